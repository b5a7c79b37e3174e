"""SwiGLU's output projection, ``linear(silu(gate) * up, weight)``, saving only gate and up.

Eager autograd keeps four intermediate-sized tensors per MLP for the backward (gate, up,
silu(gate) and the product that the down projection reads); this function keeps gate and up and
recomputes the product in the backward, which halves the MLP's saved activations in uncompiled
training. Under ``torch.compile`` the plain expression is used: inductor chooses what to recompute.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _SwigluLinear(torch.autograd.Function):

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up, weight)
        h = F.silu(gate) * up
        return F.linear(h, weight.to(h.dtype))  # as autocast runs the linear: in the activations' dtype

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up, weight = ctx.saved_tensors
        acc = torch.promote_types(gate.dtype, torch.float32)  # at least float32 for the elementwise math
        g = gate.to(acc)
        sig = torch.sigmoid(g)
        silu = g * sig
        h = (silu.to(gate.dtype) * up)
        dy = grad.to(h.dtype)
        d_weight = (dy.flatten(0, -2).t() @ h.flatten(0, -2)).to(weight.dtype)
        dh = (dy @ weight.to(h.dtype)).to(acc)
        d_up = (dh * silu).to(up.dtype)
        d_gate = (dh * up.to(acc) * sig * (1 + g * (1 - sig))).to(gate.dtype)  # silu'(g) = s (1 + g (1 - s))
        return d_gate, d_up, d_weight


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(F.silu(gate) * up, weight)``; in eager autograd it saves only gate, up and weight."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or type(weight) not in (torch.Tensor, torch.nn.Parameter):
        # compiled, inference, or a tensor subclass (DTensor under tensor parallelism): the plain ops
        h = F.silu(gate) * up
        return F.linear(h, weight.to(h.dtype))
    return _SwigluLinear.apply(gate, up, weight)
