"""Pure-torch reference attention for the softmax / softpick / rectified family.

Used as the float64-checkable ground truth for the Triton kernels, by probes that want the
attention weights, by CPU training and by generation when no kernel applies. Memory is
O(B * H * Tq * Tk): meant for short sequences only.
"""
from __future__ import annotations

import math

import torch

from flame.ops.attention.utils import MODES, check_mode


def build_valid_mask(
    tq: int,
    tk: int,
    *,
    device: torch.device,
    cu_seqlens: torch.Tensor | None = None,
    q_offset: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window_size: int | None = None,
) -> torch.Tensor:
    """Boolean mask [B or 1, 1, Tq, Tk]: True where query i may attend key j.

    Causal with the last query aligned to the last key (``q_offset = Tk - Tq`` by default),
    block-diagonal per document when ``cu_seqlens`` is given (then Tq == Tk, flattened tokens),
    restricted to keys where ``key_padding_mask`` [B, Tk] is true, and to the last
    ``window_size`` keys when a window is given.
    """
    if q_offset is None:
        q_offset = tk - tq
    qi = torch.arange(tq, device=device)[:, None] + q_offset
    kj = torch.arange(tk, device=device)[None, :]
    valid = kj <= qi
    if window_size is not None:
        valid = valid & (kj > qi - window_size)
    if cu_seqlens is not None:
        if tq != tk:
            raise ValueError("cu_seqlens needs as many queries as keys")
        doc = torch.searchsorted(cu_seqlens.to(device), torch.arange(tk, device=device), right=True)
        valid = valid & (doc[:, None] == doc[None, :])
    valid = valid[None, None]
    if key_padding_mask is not None:
        valid = valid & key_padding_mask.bool()[:, None, None, -tk:]
    return valid


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str = "softmax",
    *,
    scale: float | None = None,
    eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
    q_offset: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    window_size: int | None = None,
    return_weights: bool = True,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with explicit weights.

    q: [B, Tq, HQ, D]; k, v: [B, Tk, HK, D] with HQ % HK == 0 (GQA). With ``cu_seqlens``
    the B * T tokens are one flattened stream of documents (any batch size).
    mode: 'softmax' | 'softpick' | 'rectified'.
    Returns (o [B, Tq, HQ, D] in q's dtype, weights [B, HQ, Tq, Tk] in the compute dtype).
    Rows without any admissible key give zero output.
    """
    check_mode(mode)
    B, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"query heads {hq} not divisible by key heads {hk}")
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    cdtype = torch.promote_types(q.dtype, torch.float32) if upcast else q.dtype
    if cu_seqlens is not None and B > 1:
        out, w = naive_attention(
            q.reshape(1, B * tq, hq, d), k.reshape(1, B * tk, hk, d), v.reshape(1, B * tk, hk, -1),
            mode, scale=scale, eps=eps, cu_seqlens=cu_seqlens, window_size=window_size,
            return_weights=return_weights, upcast=upcast,
        )
        return out.reshape(B, tq, hq, -1), w
    g = hq // hk
    qh = q.to(cdtype).transpose(1, 2)                                   # B HQ Tq D
    kh = k.to(cdtype).transpose(1, 2).repeat_interleave(g, dim=1)       # B HQ Tk D
    vh = v.to(cdtype).transpose(1, 2).repeat_interleave(g, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    valid = build_valid_mask(
        tq, tk, device=q.device, cu_seqlens=cu_seqlens, q_offset=q_offset,
        key_padding_mask=key_padding_mask, window_size=window_size,
    )
    w = attention_weights(s, valid, mode, eps)
    o = torch.matmul(w, vh).transpose(1, 2).to(q.dtype)
    return o, (w if return_weights else None)


def attention_weights(s: torch.Tensor, valid: torch.Tensor, mode: str, eps: float = 1e-6) -> torch.Tensor:
    """Row-normalised weights from logits ``s`` over the admissible set ``valid`` (broadcastable)."""
    valid = valid.expand_as(s)
    if mode == "rectified":
        valid = valid & (s >= 0)
    neg_inf = torch.full((), float("-inf"), dtype=s.dtype, device=s.device)
    m = torch.where(valid, s, neg_inf).amax(-1, keepdim=True).detach()
    if mode == "softpick":
        # shift by the (non-negative) running max: exp(s-m) - exp(-m) = exp(-m) * (exp(s) - 1)
        m = m.clamp_min(0.0)
        e = torch.exp(s - m) - torch.exp(-m)
        num = torch.where(valid, torch.relu(e), 0.0)
        # |e| whose derivative at e = 0 (a logit of exactly 0) is the left one, -1, as in the
        # Triton kernels' backward (torch's abs takes 0 there); both are subgradients of the kink
        den = torch.where(valid, torch.where(e > 0, e, -e), 0.0).sum(-1, keepdim=True) + eps * torch.exp(-m)
        return num / den
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.where(valid, torch.exp(s - m), 0.0)
    l = p.sum(-1, keepdim=True)
    return p / torch.where(l > 0, l, torch.ones_like(l))


__all__ = ["MODES", "attention_weights", "build_valid_mask", "naive_attention"]
