"""CPU versions of FLA 0.6.0's sequence-mixing ops, with FLA's signatures.

Each function accepts the arguments FLA's layers pass (``[B, T, H, D]`` layout, ``cu_seqlens`` for
packed sequences, ``state_v_first`` state layout, in-kernel l2norm/gate/beta options) and returns
what FLA returns: ``(o, final_state_or_None)`` with ``o`` in the dtype of ``v``/``q``.
The math lives in ``flame.models.cpu.recurrences``.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from flame.models.cpu.recurrences import chunked_gated_linear_attention, delta_rule_recurrence


def l2norm_torch(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (FLA's l2norm definition), in float32."""
    x = x.float()
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def _head_major(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.transpose(1, 2)


def _run_varlen(fn: Callable, tensors: dict, cu_seqlens, initial_state, **kw):
    """Run ``fn`` per packed sequence: FLA's varlen ops take ``[1, total, ...]`` plus ``cu_seqlens``.

    ``fn(tensors_of_one_sequence, initial_state_of_it, **kw) -> (o, state)``; states are stacked on
    dim 0 (tuples of states element-wise), outputs concatenated on the time dim.
    """
    if cu_seqlens is None:
        return fn(tensors, initial_state, **kw)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for n in range(len(bounds) - 1):
        s, e = bounds[n], bounds[n + 1]
        part = {name: (t[:, s:e] if t is not None else None) for name, t in tensors.items()}
        h0 = None
        if initial_state is not None:
            h0 = (tuple(x[n:n + 1] for x in initial_state) if isinstance(initial_state, tuple)
                  else initial_state[n:n + 1])
        o, st = fn(part, h0, **kw)
        outs.append(o)
        states.append(st)
    if isinstance(states[0], tuple):
        state = tuple(torch.cat(xs, 0) for xs in zip(*states))
    else:
        state = torch.cat(states, 0)
    return torch.cat(outs, 1), state


def _to_kv(state: torch.Tensor | None, v_first: bool) -> torch.Tensor | None:
    return state.transpose(-1, -2) if (state is not None and v_first) else state


# ---------------------------------------------------------------- GLA family (gla, hgrn2)

def _gla_one(t: dict, h0, scale: float):
    o, s = chunked_gated_linear_attention(
        _head_major(t['q']), _head_major(t['k']), _head_major(t['v']),
        gk=_head_major(t['gk']), gv=_head_major(t['gv']), scale=scale, initial_state=h0,
    )
    return o.transpose(1, 2), s


def gla_cpu(q, k, v, gk=None, gv=None, g=None, scale=None, initial_state=None, output_final_state=False,
            state_v_first=False, cu_seqlens=None, reverse=False, **_unused):
    """Shared body of chunk_gla / fused_recurrent_gla / fused_chunk_gla on CPU.

    ``g`` is a per-head scalar log gate ``[B, T, H]`` (simple GLA) and is broadcast to the key dim.
    """
    if reverse:
        raise NotImplementedError("flame CPU fallback: reverse=True recurrences are not implemented")
    if g is not None and gk is None:
        gk = g.unsqueeze(-1).expand_as(k) if g.dim() == 3 else g
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    h0 = _to_kv(initial_state, state_v_first)
    o, state = _run_varlen(_gla_one, {'q': q, 'k': k, 'v': v, 'gk': gk, 'gv': gv}, cu_seqlens, h0, scale=scale)
    return o.to(v.dtype), (_to_kv(state, state_v_first) if output_final_state else None)


def chunk_gla_cpu(q, k, v, g, scale=None, initial_state=None, output_final_state=False,
                  state_v_first=False, cu_seqlens=None, **kw):
    return gla_cpu(q, k, v, gk=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                   state_v_first=state_v_first, cu_seqlens=cu_seqlens)


def fused_recurrent_gla_cpu(q, k, v, gk=None, gv=None, scale=None, initial_state=None, output_final_state=False,
                            reverse=False, state_v_first=False, cu_seqlens=None, **kw):
    return gla_cpu(q, k, v, gk=gk, gv=gv, scale=scale, initial_state=initial_state,
                   output_final_state=output_final_state, state_v_first=state_v_first,
                   cu_seqlens=cu_seqlens, reverse=reverse)


def fused_chunk_gla_cpu(q, k, v, g, scale=None, initial_state=None, output_final_state=False, **kw):
    return gla_cpu(q, k, v, gk=g, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                   state_v_first=kw.get('state_v_first', False), cu_seqlens=kw.get('cu_seqlens'))


# ---------------------------------------------------------------- GSA

def _gsa_one(t: dict, h0, scale: float):
    q, k, v, s, g = (_head_major(t[n]) for n in ('q', 'k', 'v', 's', 'g'))
    s, g = s.float(), (g.float() if g is not None else None)
    if g is None:
        # without an explicit forget gate GSA normalizes the slot writes by their running logsumexp
        z = s.logcumsumexp(2)
        g = torch.cat((z[:, :, :1], z[:, :, :-1]), 2) - z
        s = torch.exp(s - z)
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v, s, g = (x.repeat_interleave(groups, dim=1) for x in (k, v, s, g))
    hk0, hv0 = (None, None) if h0 is None else (x.repeat_interleave(groups, dim=1) for x in h0)
    # pass 1: slot scores; the slot decay acts on the value (slot) dim of the [K, M] state
    ok, hk = chunked_gated_linear_attention(q, k, s, gv=g, scale=scale, initial_state=hk0)
    # pass 2: read values through the softmax over slots; the decay acts on the key (slot) dim
    ov, hv = chunked_gated_linear_attention(ok.softmax(-1), s, v, gk=g, scale=1.0, initial_state=hv0)
    B, HQ = hk.shape[:2]
    state = (hk.view(B, HQ // groups, groups, *hk.shape[2:])[:, :, 0],
             hv.view(B, HQ // groups, groups, *hv.shape[2:])[:, :, 0])
    return ov.transpose(1, 2), state


def gsa_cpu(q, k, v, s, g=None, scale=None, initial_state=None, output_final_state=False,
            cu_seqlens=None, reverse=False, **kw):
    """chunk_gsa / fused_recurrent_gsa on CPU (two gated linear-attention passes around a slot softmax)."""
    if reverse:
        raise NotImplementedError("flame CPU fallback: reverse=True recurrences are not implemented")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o, state = _run_varlen(_gsa_one, {'q': q, 'k': k, 'v': v, 's': s, 'g': g}, cu_seqlens,
                           initial_state, scale=scale)
    return o.to(v.dtype), (state if output_final_state else None)


# ---------------------------------------------------------------- delta rules

def _delta_one(t: dict, h0, scale: float):
    q, k, v, beta, g, gk = (_head_major(t[n]) for n in ('q', 'k', 'v', 'beta', 'g', 'gk'))
    o, s = delta_rule_recurrence(q, k, v, beta, g=g, gk=gk, scale=scale, initial_state=h0)
    return o.transpose(1, 2), s


def delta_rule_cpu(q, k, v, beta=None, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, g=None, gk=None, gv=None,
                   use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, state_v_first=False, **kw):
    """chunk/fused_recurrent (gated) delta rule on CPU, with FLA's in-kernel options applied in torch."""
    if gv is not None:
        raise NotImplementedError("flame CPU fallback: value-dim gates (gv) in the delta rule are not implemented")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm_torch(q), l2norm_torch(k)
    if beta is None:
        beta = torch.ones(v.shape[:3], dtype=torch.float32, device=v.device)
    if use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
        if allow_neg_eigval:
            beta = beta * 2.0
    if use_gate_in_kernel and g is not None:
        # GatedDeltaNet's decay: g = -exp(A_log) * softplus(a + dt_bias)
        a = g.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        g = -A_log.float().exp() * F.softplus(a)
    H, HV = q.shape[2], v.shape[2]
    if HV != H:  # grouped value attention: value head j reads q/k head j // (HV // H)
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
        if gk is not None and gk.shape[2] != HV:
            gk = gk.repeat_interleave(HV // H, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    h0 = _to_kv(initial_state, state_v_first)
    o, state = _run_varlen(_delta_one, {'q': q, 'k': k, 'v': v, 'beta': beta, 'g': g, 'gk': gk},
                           cu_seqlens, h0, scale=scale)
    return o.to(v.dtype), (_to_kv(state, state_v_first) if output_final_state else None)
