"""Launch logic for the Triton attention kernels in ``kernels.py``, as torch custom ops.

``flame::attn_fwd`` and ``flame::attn_bwd`` are ``torch.library`` custom ops with shape-only fake
implementations and a registered autograd formula: ``torch.compile`` keeps them as opaque calls
(inductor never re-emits the Triton launches, so it cannot retype their scalar arguments), and
the tile choice in ``tiles.choose`` runs on real tensors at run time. ``max_seqlen`` is a SymInt
argument: a compiled caller may pass a dynamic value without recompiling.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from flame.errors import ConfigError
from flame.ops.attention import tiles
from flame.ops.attention.tiles import TileConfig, TileKey
from flame.ops.attention.utils import MODES, cdiv, check_head_dim, check_mode, next_pow2, triton_interpreting

LOG2E = 1.4426950408889634
_INTERPRET_TILE = TileConfig(16, 16, 1, 1)

tuned_configs = tiles.tuned_configs


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _run_tuned(kernel: str, q: torch.Tensor, mode_id: int, group: int, varlen: bool, max_seqlen: int,
               launch) -> None:
    """Launch with the tile chosen for this shape class (``tiles.choose``)."""
    if triton_interpreting():
        launch(_INTERPRET_TILE)
        return
    bd = max(16, next_pow2(q.shape[-1]))
    key = TileKey(kernel, MODES[mode_id], bd, str(q.dtype).removeprefix("torch."), group, varlen,
                  tiles.seqlen_bucket(max_seqlen))
    launch(tiles.choose(key, tiles.candidates(kernel, MODES[mode_id], bd), launch, tiles.device_name(q.device)))


def _n_docs(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    return q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1


@torch.library.custom_op("flame::attn_fwd", mutates_args=())
def attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
    mode_id: int, scale: float, eps: float, max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output [B, T, HQ, D] and the base-2 log denominators [HQ, B * T] (float32) of contiguous
    q [B, T, HQ, D], k / v [B, T, HK, D]."""
    from flame.ops.attention.kernels import attn_fwd_kernel

    B, T, HQ, D = q.shape
    HK = k.shape[2]
    o = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(HQ, B * T, device=q.device, dtype=torch.float32)
    bd = max(16, next_pow2(D))
    cu = cu_seqlens if cu_seqlens is not None else q.new_empty(1, dtype=torch.int32)
    n_docs = _n_docs(q, cu_seqlens)

    def launch(c: TileConfig):
        attn_fwd_kernel[(cdiv(max_seqlen, c.outer), HQ, n_docs)](
            q, k, v, o, lse, cu, scale * LOG2E, eps, T, B * T, HQ, HK,
            D=D, BD=bd, MODE=mode_id, IS_VARLEN=cu_seqlens is not None, PREC=_prec(q.dtype), RAW_SIGN=scale > 0,
            BM=c.outer, BN=c.inner, num_warps=c.num_warps, num_stages=c.num_stages,
        )

    _run_tuned("fwd", q, mode_id, HQ // HK, cu_seqlens is not None, max_seqlen, launch)
    return o, lse


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, cu_seqlens, mode_id, scale, eps, max_seqlen):
    B, T, HQ, _ = q.shape
    return q.new_empty(q.shape), q.new_empty(HQ, B * T, dtype=torch.float32)


@torch.library.custom_op("flame::attn_bwd", mutates_args=())
def attn_bwd(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: Optional[torch.Tensor], mode_id: int, scale: float, max_seqlen: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv for the output gradient ``do`` of ``attn_fwd`` (q, k, v, o contiguous)."""
    from flame.ops.attention.kernels import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_delta_kernel

    B, T, HQ, D = q.shape
    HK = k.shape[2]
    bd = max(16, next_pow2(D))
    do = do.contiguous()
    # D_i = dO_i . O_i in float32, one fused pass (no float32 copies of O and dO)
    delta = torch.empty(HQ, B * T, device=q.device, dtype=torch.float32)
    n_rows = B * T * HQ
    br = 16 if triton_interpreting() else max(16, 8192 // bd)
    bwd_delta_kernel[(cdiv(n_rows, br),)](o, do, delta, n_rows, B * T, HQ, D=D, BD=bd, BR=br, num_warps=4)
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    n_docs = _n_docs(q, cu_seqlens)
    cu = cu_seqlens if cu_seqlens is not None else q.new_empty(1, dtype=torch.int32)
    common = dict(D=D, BD=bd, MODE=mode_id, IS_VARLEN=cu_seqlens is not None, PREC=_prec(q.dtype),
                  RAW_SIGN=scale > 0)

    def launch_dkdv(c: TileConfig):
        attn_bwd_dkdv_kernel[(cdiv(max_seqlen, c.outer), HK, n_docs)](
            q, k, v, do, lse, delta, dk, dv, cu, scale * LOG2E, scale, T, B * T, HQ, HK,
            BN=c.outer, BM=c.inner, num_warps=c.num_warps, num_stages=c.num_stages, **common,
        )

    def launch_dq(c: TileConfig):
        attn_bwd_dq_kernel[(cdiv(max_seqlen, c.outer), HQ, n_docs)](
            q, k, v, do, lse, delta, dq, cu, scale * LOG2E, scale, T, B * T, HQ, HK,
            BM=c.outer, BN=c.inner, num_warps=c.num_warps, num_stages=c.num_stages, **common,
        )

    varlen = cu_seqlens is not None
    _run_tuned("dkdv", q, mode_id, HQ // HK, varlen, max_seqlen, launch_dkdv)
    _run_tuned("dq", q, mode_id, HQ // HK, varlen, max_seqlen, launch_dq)
    return dq, dk, dv


@attn_bwd.register_fake
def _attn_bwd_fake(do, q, k, v, o, lse, cu_seqlens, mode_id, scale, max_seqlen):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, mode_id, scale, eps, max_seqlen = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.meta = (mode_id, scale, max_seqlen)


def _backward(ctx, do, dlse):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    mode_id, scale, max_seqlen = ctx.meta
    dq, dk, dv = attn_bwd(do, q, k, v, o, lse, cu_seqlens, mode_id, scale, max_seqlen)
    return dq, dk, dv, None, None, None, None, None


attn_fwd.register_autograd(_backward, setup_context=_setup_context)


def parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str = "softmax",
    *,
    scale: float | None = None,
    eps: float = 1e-6,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
) -> torch.Tensor:
    """Causal attention with softmax / softpick / rectified rows (Triton, forward + backward).

    q: [B, T, HQ, D], k and v: [B, T, HK, D] (HQ % HK == 0), 16 <= D <= 256.
    cu_seqlens: int32 [N + 1] offsets of documents in the flattened B * T tokens (any B);
    ``max_seqlen`` (longest document) avoids a device sync when given; under ``torch.compile``
    pass it from outside the compiled region (computing it here is a graph break).
    Needs CUDA tensors, or CPU tensors with ``TRITON_INTERPRET=1`` (tiny shapes, float32).
    """
    mode_id = check_mode(mode)
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"bad shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    B, T, HQ, D = q.shape
    if HQ % k.shape[2]:
        raise ValueError(f"query heads {HQ} not divisible by key heads {k.shape[2]}")
    check_head_dim(D)
    if not (q.is_cuda or triton_interpreting()):
        raise ConfigError("parallel_attention needs CUDA tensors (or TRITON_INTERPRET=1)")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ConfigError(f"dtype {q.dtype} is not supported by flame's attention kernels")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32).contiguous()
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    else:
        max_seqlen = T
    o, _ = attn_fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens, mode_id, float(scale), float(eps),
                    max_seqlen)
    return o
