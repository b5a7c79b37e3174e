"""CPU versions of FLA 0.6.0's Triton modules: norms, short convolution, rotary, activations,
fused cross entropy and (for hybrid models without flash-attn) softmax attention.

Functions mirror the FLA function they replace argument for argument, so that a dispatcher can
call either with the same arguments. Computation is done in float32 and cast back, as FLA's kernels do.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from flame.models.cpu.patch import TORCH_PATH_DEVICES, caller_autocast_dtype

# ---------------------------------------------------------------- norms


def _residual_in(x, residual, residual_in_fp32):
    """FLA's fused pre-norm: returns the normalized input and the updated residual stream."""
    if residual is not None:
        x = x.float() + residual.float() if residual_in_fp32 else x + residual
    residual_out = x.float() if residual_in_fp32 else x
    return x, residual_out


def _norm(x, weight, bias, eps, is_rms_norm, num_groups=1):
    xf = x.float()
    if num_groups > 1:
        xf = rearrange(xf, '... (g d) -> ... g d', g=num_groups)
    if is_rms_norm:
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(xf, xf.shape[-1:], eps=eps)
    if num_groups > 1:
        y = rearrange(y, '... g d -> ... (g d)')
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y


def layer_norm_cpu(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False,
                   is_rms_norm=False, num_groups=1, **kw):
    """fla's layer_norm / group_norm: optional fused residual add, float32 math, output in x's dtype."""
    dtype = x.dtype
    x, residual_out = _residual_in(x, residual, residual_in_fp32)
    y = _norm(x, weight, bias, eps, is_rms_norm, num_groups).to(dtype)
    return (y, residual_out) if prenorm else y


def rms_norm_cpu(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False, **kw):
    return layer_norm_cpu(x, weight, bias, residual, eps, prenorm, residual_in_fp32, is_rms_norm=True)


group_norm_cpu = layer_norm_cpu


def _linear(x, weight, bias):
    """The matmul of FLA's fused ops: in the caller's autocast dtype when it had autocast on, else in
    x's dtype (FLA casts the weight to it; under the trainer's autocast x is often already bf16
    while the master weight is float32)."""
    dtype = caller_autocast_dtype() or x.dtype
    return F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))


def layer_norm_linear_cpu(x, norm_weight, norm_bias, linear_weight, linear_bias, residual=None, eps=1e-5,
                          prenorm=False, residual_in_fp32=False, is_rms_norm=False, num_groups=1, **kw):
    dtype = x.dtype
    x, residual_out = _residual_in(x, residual, residual_in_fp32)
    y = _norm(x, norm_weight, norm_bias, eps, is_rms_norm, num_groups).to(dtype)
    out = _linear(y, linear_weight, linear_bias)
    return (out, residual_out) if prenorm else out


def rms_norm_linear_cpu(*args, **kw):
    kw['is_rms_norm'] = True
    return layer_norm_linear_cpu(*args, **kw)


def _gate(g, activation):
    g = g.float()
    if activation in ('swish', 'silu'):
        return F.silu(g)
    if activation == 'sigmoid':
        return torch.sigmoid(g)
    raise ValueError(f"Unsupported activation: {activation}")


def _norm_gated_entry(is_rms_norm, with_linear):
    def fn(x, g, *args, **kw):
        names = (['norm_weight', 'norm_bias', 'linear_weight', 'linear_bias'] if with_linear
                 else ['weight', 'bias', 'activation'])
        names += ['residual', 'prenorm', 'residual_in_fp32', 'eps']
        p = dict(zip(names, args))
        p.update(kw)
        dtype = x.dtype
        x, residual_out = _residual_in(x, p.get('residual'), p.get('residual_in_fp32', False))
        w = p.get('norm_weight' if with_linear else 'weight')
        b = p.get('norm_bias' if with_linear else 'bias')
        y = _norm(x, w, b, p.get('eps', 1e-6), is_rms_norm) * _gate(g, p.get('activation', 'swish'))
        y = y.to(dtype)
        if with_linear:
            y = _linear(y, p['linear_weight'], p.get('linear_bias'))
        return (y, residual_out) if p.get('prenorm', False) else y
    return fn


layer_norm_gated_cpu = _norm_gated_entry(False, False)
rms_norm_gated_cpu = _norm_gated_entry(True, False)
layer_norm_swish_gate_linear_cpu = _norm_gated_entry(False, True)
rms_norm_swish_gate_linear_cpu = _norm_gated_entry(True, True)


def _norm_before_after_gate(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm):
    """fla.modules.layernorm_gated semantics (Mamba2's gated RMSNorm)."""
    dtype = x.dtype
    xf = x.float()
    if z is not None and not norm_before_gate:
        xf = xf * F.silu(z.float())
    groups = 1 if group_size is None else xf.shape[-1] // group_size
    y = _norm(xf, weight, bias, eps, is_rms_norm, groups)
    if z is not None and norm_before_gate:
        y = y * F.silu(z.float())
    return y.to(dtype)


def layernorm_fn_cpu(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    return _norm_before_after_gate(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm)


def rmsnorm_fn_cpu(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    return _norm_before_after_gate(x, weight, bias, z, eps, group_size, norm_before_gate, True)


def l2norm_cpu(x, eps=1e-6, output_dtype=None):
    y = x.float() * torch.rsqrt(x.float().square().sum(-1, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


# ---------------------------------------------------------------- short convolution


def _conv_one(x, weight, bias, residual, initial_state, activation):
    """Depthwise causal conv of one batch ``x [B, T, D]``; ``initial_state [B, D, W]`` holds the W
    inputs before position 0 (oldest first). Returns y and the last W inputs (the next state)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    xt = x.transpose(1, 2)
    prev = xt.new_zeros(B, D, W) if initial_state is None else initial_state.to(xt.dtype)
    xp = torch.cat([prev, xt], dim=-1)  # [B, D, W + T]
    y = F.conv1d(xp.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=D)
    y = y[..., 1:]  # output j uses xp[j : j + W]; position t needs xp[t + 1 : t + 1 + W]
    if activation in ('silu', 'swish'):
        y = F.silu(y)
    y = y.transpose(1, 2)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype), xp[..., -W:]


def causal_conv1d_cpu(x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False,
                      activation=None, backend=None, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None,
                      cp_context=None, **kw):
    """fla.modules.convolution.causal_conv1d on CPU (weight ``[D, W]``, x ``[B, T, D]`` or ``[B, T, H, P]``)."""
    if cp_context is not None:
        raise NotImplementedError("flame CPU fallback: context-parallel causal_conv1d is not supported")
    shape = x.shape
    if x.shape[-1] != weight.shape[0]:
        x = rearrange(x, 'b t ... -> b t (...)')
    if residual is not None:
        residual = residual.reshape(x.shape)
    if cu_seqlens is None:
        y, state = _conv_one(x, weight, bias, residual, initial_state, activation)
    else:
        bounds = cu_seqlens.tolist()
        ys, states = [], []
        for n in range(len(bounds) - 1):
            s, e = bounds[n], bounds[n + 1]
            yn, st = _conv_one(x[:, s:e], weight, bias, None if residual is None else residual[:, s:e],
                               None if initial_state is None else initial_state[n:n + 1], activation)
            ys.append(yn)
            states.append(st)
        y, state = torch.cat(ys, 1), torch.cat(states, 0)
    return y.view(shape), (state if output_final_state else None)


def causal_conv1d_update_cpu(x, cache, residual=None, weight=None, bias=None, activation=None):
    """One decoding step per sequence; updates ``cache [N, D, W]`` in place, as FLA's kernel does."""
    shape = x.shape
    if weight is not None and x.shape[-1] != weight.shape[0]:
        x = rearrange(x, 'b t ... -> b t (...)')
    D = x.shape[-1]
    xt = x.reshape(-1, D)
    new_cache = torch.cat([cache[..., 1:], xt.unsqueeze(-1).to(cache.dtype)], dim=-1)
    cache.copy_(new_cache)
    y = (new_cache.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation in ('silu', 'swish'):
        y = F.silu(y)
    if residual is not None:
        y = y + residual.reshape(y.shape).float()
    return y.to(x.dtype).view(shape), cache


# ---------------------------------------------------------------- rotary


def rotary_embedding_cpu(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
                         chunk_indices=None):
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x [B, T, H, D]``; positions start at
    ``seqlen_offsets`` (int or per-sequence tensor) and restart per packed sequence."""
    B, T = x.shape[:2]
    R = cos.shape[-1] * 2
    if cu_seqlens is not None:
        starts = cu_seqlens[:-1]
        idx = torch.arange(T, device=x.device)
        seq = torch.searchsorted(cu_seqlens[1:], idx, right=True)
        pos = idx - starts[seq]
        if isinstance(seqlen_offsets, torch.Tensor):
            pos = pos + seqlen_offsets[seq]
        else:
            pos = pos + seqlen_offsets
        pos = pos.unsqueeze(0)
    elif isinstance(seqlen_offsets, torch.Tensor):
        pos = torch.arange(T, device=x.device)[None] + seqlen_offsets.view(-1, 1)
    else:
        pos = (torch.arange(T, device=x.device) + seqlen_offsets)[None]
    c = cos[pos].float().unsqueeze(2)  # [B|1, T, 1, R/2]
    s = sin[pos].float().unsqueeze(2)
    xr, rest = x[..., :R].float(), x[..., R:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out.to(x.dtype), rest), dim=-1)


# ---------------------------------------------------------------- activations


def _gelu_tanh(x):
    return F.gelu(x, approximate='tanh')


ACTIVATIONS_CPU = {
    'swish': lambda x: F.silu(x.float()).to(x.dtype),
    'sigmoid': lambda x: torch.sigmoid(x.float()).to(x.dtype),
    'logsigmoid': lambda x, temperature=1.0: (F.logsigmoid(x.float()) / temperature).to(x.dtype),
    'sqrelu': lambda x: F.relu(x).square(),
    'fast_gelu_impl': _gelu_tanh,
    'bias_gelu_impl': lambda y, bias: _gelu_tanh(y + bias),
    'elu_p1': lambda x: (F.elu(x.float()) + 1.0).to(x.dtype),
    'swiglu': lambda x, y: (F.silu(x.float()) * y.float()).to(x.dtype),
    'sigmoidglu': lambda x, y: (torch.sigmoid(x.float()) * y.float()).to(x.dtype),
    'swiglu_linear': lambda x, y, weight, bias: _linear((F.silu(x.float()) * y.float()).to(x.dtype), weight, bias),
    'sigmoidglu_linear': lambda x, y, weight, bias: _linear(
        (torch.sigmoid(x.float()) * y.float()).to(x.dtype), weight, bias),
}


# ---------------------------------------------------------------- losses


def _ce(logits, target, ignore_index, label_smoothing, logit_scale, softcap, lse_square_scale, reduction):
    z = logits.float() * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    loss = F.cross_entropy(z, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction='none')
    if lse_square_scale:
        lse = torch.logsumexp(z, dim=-1)
        loss = loss + lse_square_scale * lse.square() * (target != ignore_index)
    if reduction == 'none':
        return loss
    total = loss.sum()
    if reduction == 'mean':
        total = total / (target != ignore_index).sum()
    return total


def fused_cross_entropy_forward_cpu(self, input, target):
    """FusedCrossEntropyLoss.forward on CPU (FLA asserts CUDA/NPU/XPU)."""
    if self.process_group is not None:
        raise NotImplementedError("flame CPU fallback: vocab-parallel cross entropy is not supported")
    loss = _ce(input, target, self.ignore_index, self.label_smoothing, self.logit_scale, self.logit_softcapping,
               self.lse_square_scale, self.reduction)
    if self.return_z_loss:
        lse = torch.logsumexp(input.float() * self.logit_scale, dim=-1)
        z = (lse.square() * self.lse_square_scale * (target != self.ignore_index)).detach()
        z = z if self.reduction == 'none' else z.sum() / ((target != self.ignore_index).sum()
                                                          if self.reduction == 'mean' else 1)
        return loss, z
    return loss


def fused_linear_cross_entropy_forward_cpu(self, x, target, weight, bias=None):
    """FusedLinearCrossEntropyLoss.forward on CPU: materializes the logits (fine for tiny vocabularies)."""
    if self.process_group is not None:
        raise NotImplementedError("flame CPU fallback: vocab-parallel cross entropy is not supported")
    x2 = x.reshape(-1, x.shape[-1])
    logits = _linear(x2, weight, bias)
    t = target.reshape(-1)
    loss = _ce(logits, t, self.ignore_index, self.label_smoothing, self.logit_scale, self.logit_softcapping,
               0.0, self.reduction)
    if self.use_l2warp:
        from fla.modules.l2warp import l2_warp
        loss = l2_warp(loss, logits, self.l2_penalty_factor)
    return loss


# ---------------------------------------------------------------- softmax attention (flash-attn shims)


def _sdpa(q, k, v, causal, window_size, softmax_scale=None):
    """q ``[B, Tq, H, D]``, k/v ``[B, Tk, Hkv, D]``. Queries are aligned to the end of the keys (as
    flash-attn does with a KV cache); ``window_size=(left, right)`` with -1 meaning unbounded."""
    Tq, Tk = q.shape[1], k.shape[1]
    H, Hkv = q.shape[2], k.shape[2]
    if H != Hkv:
        k, v = k.repeat_interleave(H // Hkv, dim=2), v.repeat_interleave(H // Hkv, dim=2)
    qi = torch.arange(Tq, device=q.device)[:, None] + (Tk - Tq)
    kj = torch.arange(Tk, device=q.device)[None, :]
    allowed = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device)
    left, right = window_size if window_size is not None else (-1, -1)
    if causal:
        allowed &= kj <= qi
    elif right >= 0:
        allowed &= kj <= qi + right
    if left >= 0:
        allowed &= kj >= qi - left
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed,
        scale=softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
    )
    return o.transpose(1, 2)


def _flex_left(causal, window_size):
    """flash-attn's (left, right) window as FlexAttention's look-back; None = unbounded."""
    left, right = window_size if window_size is not None else (-1, -1)
    if not causal or right not in (-1, 0):
        raise NotImplementedError(f"flash-attn stand-in on GPU: causal=True only (got causal={causal}, "
                                  f"window_size={window_size})")
    return None if left < 0 else int(left)


def flash_attn_func_cpu(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kw):
    """Stand-in for flash_attn_func when flash-attn is absent: SDPA with an explicit mask on CPU,
    FlexAttention (causal, sliding window) on GPU."""
    if q.device.type not in TORCH_PATH_DEVICES and q.shape[1] == k.shape[1]:
        from flame.models.attention.dispatch import _flex

        return _flex(q, k, v, softmax_scale, None, _flex_left(causal, window_size))
    return _sdpa(q, k, v, causal, window_size, softmax_scale)


def flash_attn_varlen_func_cpu(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kw):
    """Stand-in for flash_attn_varlen_func (packed ``[total, H, D]`` tensors): per-document SDPA on
    CPU, one document-masked FlexAttention call on GPU when q and k share one cu_seqlens tensor (FLA's
    training path; comparing values would sync the host on every call)."""
    if q.device.type not in TORCH_PATH_DEVICES and cu_seqlens_q is cu_seqlens_k:
        from flame.models.attention.dispatch import _flex

        return _flex(q[None], k[None], v[None], softmax_scale, cu_seqlens_q, _flex_left(causal, window_size))[0]
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs = []
    for n in range(len(bq) - 1):
        o = _sdpa(q[None, bq[n]:bq[n + 1]], k[None, bk[n]:bk[n + 1]], v[None, bk[n]:bk[n + 1]],
                  causal, window_size, softmax_scale)
        outs.append(o[0])
    return torch.cat(outs, 0)
