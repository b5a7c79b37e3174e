"""Autograd wrapper and launch logic for the Triton attention kernels in ``kernels.py``."""
from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

from flame.errors import ConfigError
from flame.ops.attention.utils import check_head_dim, check_mode, next_pow2, triton_interpreting

LOG2E = 1.4426950408889634


class TileConfig(NamedTuple):
    outer: int        # rows owned by one program (queries for fwd/dq, keys for dk/dv)
    inner: int        # tile length of the loop dimension (must divide ``outer``)
    num_warps: int
    num_stages: int


# Candidate tiles per kernel ("fwd", "dkdv", "dq") and padded head dim; the first entry is the
# untuned default (used when FLAME_ATTN_AUTOTUNE=0). _MODE_TILES overrides a (kernel, mode, head
# dim) where one mode prefers other tiles (softpick's backward holds more live values per element).
# Head dim 128 ordered by an H100 sweep (benchmarks/attention_tiles.py, B=4 T=4096 H=16 bf16:
# benchmarks/results/attention_tiles_nvidia_h100_80gb_hbm3.json).
_FWD = {
    64: [TileConfig(128, 64, 4, 3), TileConfig(128, 128, 8, 3), TileConfig(64, 64, 4, 3)],
    128: [TileConfig(64, 64, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(128, 128, 8, 3)],
    256: [TileConfig(64, 32, 4, 2), TileConfig(64, 64, 8, 2), TileConfig(128, 32, 8, 2)],
}
_DKDV = {
    64: [TileConfig(128, 64, 8, 3), TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 3)],
    128: [TileConfig(128, 64, 8, 2), TileConfig(64, 32, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 2)],
    256: [TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2), TileConfig(64, 16, 4, 2)],
}
_DQ = {
    64: [TileConfig(128, 64, 8, 3), TileConfig(128, 32, 8, 3), TileConfig(64, 32, 4, 3)],
    128: [TileConfig(128, 64, 8, 3), TileConfig(64, 32, 4, 3), TileConfig(128, 128, 8, 2)],
    256: [TileConfig(64, 32, 8, 2), TileConfig(32, 32, 4, 2), TileConfig(64, 16, 4, 2)],
}
_TILES = {"fwd": _FWD, "dkdv": _DKDV, "dq": _DQ}
_MODE_TILES: dict[tuple[str, int, int], list[TileConfig]] = {
    ("fwd", 1, 128): [TileConfig(128, 64, 8, 3), TileConfig(64, 64, 4, 3), TileConfig(128, 128, 8, 3)],
    ("dkdv", 1, 128): [TileConfig(64, 32, 4, 3), TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 2),
                       TileConfig(64, 64, 4, 2)],
    ("dkdv", 2, 128): [TileConfig(128, 64, 8, 3), TileConfig(128, 64, 8, 2), TileConfig(64, 64, 4, 2),
                       TileConfig(64, 32, 4, 3)],
}
_INTERPRET_TILE = TileConfig(16, 16, 1, 1)
_TUNED: dict[tuple, TileConfig] = {}


def tuned_configs() -> dict[str, str]:
    """The tiles picked so far in this process (for benchmark reports)."""
    return {"/".join(map(str, k)): str(tuple(v)) for k, v in _TUNED.items()}


def _candidates(kernel: str, mode_id: int, bd: int) -> list[TileConfig]:
    cls = 64 if bd <= 64 else (128 if bd <= 128 else 256)
    return _MODE_TILES.get((kernel, mode_id, cls)) or _TILES[kernel][cls]


def _run_tuned(key: tuple, configs: list[TileConfig], launch) -> None:
    """Launch with the fastest of ``configs`` for ``key`` (timed once per process)."""
    if triton_interpreting():
        launch(_INTERPRET_TILE)
        return
    cfg = _TUNED.get(key)
    if cfg is None:
        cfg = configs[0]
        if os.environ.get("FLAME_ATTN_AUTOTUNE", "1") != "0" and len(configs) > 1:
            from triton.testing import do_bench

            best = math.inf
            for c in configs:
                try:
                    t = do_bench(lambda c=c: launch(c), warmup=3, rep=10)
                except Exception:  # e.g. out of shared memory for this tile
                    continue
                if t < best:
                    best, cfg = t, c
        _TUNED[key] = cfg
    launch(cfg)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _prec(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class ParallelAttentionFunction(torch.autograd.Function):

    @staticmethod
    def forward(ctx, q, k, v, mode_id, scale, eps, cu_seqlens, max_seqlen):
        from flame.ops.attention.kernels import attn_fwd_kernel

        B, T, HQ, D = q.shape
        HK = k.shape[2]
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        o = torch.empty_like(q)
        lse = torch.empty(B * T, HQ, device=q.device, dtype=torch.float32)
        n_docs = B if cu_seqlens is None else cu_seqlens.numel() - 1
        bd = max(16, next_pow2(D))
        cu = cu_seqlens if cu_seqlens is not None else q.new_empty(1, dtype=torch.int32)

        def launch(c: TileConfig):
            attn_fwd_kernel[(_cdiv(max_seqlen, c.outer), HQ, n_docs)](
                q, k, v, o, lse, cu, scale * LOG2E, eps, T, HQ, HK,
                D=D, BD=bd, MODE=mode_id, IS_VARLEN=cu_seqlens is not None,
                PREC=_prec(q.dtype), BM=c.outer, BN=c.inner, num_warps=c.num_warps, num_stages=c.num_stages,
            )

        _run_tuned(("fwd", bd, mode_id, q.dtype, HQ // HK), _candidates("fwd", mode_id, bd), launch)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.meta = (mode_id, scale, max_seqlen, bd)
        return o

    @staticmethod
    def backward(ctx, do):
        from flame.ops.attention.kernels import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel, bwd_delta_kernel

        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        mode_id, scale, max_seqlen, bd = ctx.meta
        B, T, HQ, D = q.shape
        HK = k.shape[2]
        do = do.contiguous()
        # D_i = dO_i . O_i in float32, one fused pass (no float32 copies of O and dO)
        delta = torch.empty(B * T, HQ, device=q.device, dtype=torch.float32)
        n_rows = B * T * HQ
        br = 16 if triton_interpreting() else max(16, 8192 // bd)
        bwd_delta_kernel[(_cdiv(n_rows, br),)](o, do, delta, n_rows, D=D, BD=bd, BR=br, num_warps=4)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        n_docs = B if cu_seqlens is None else cu_seqlens.numel() - 1
        cu = cu_seqlens if cu_seqlens is not None else q.new_empty(1, dtype=torch.int32)
        common = dict(D=D, BD=bd, MODE=mode_id, IS_VARLEN=cu_seqlens is not None, PREC=_prec(q.dtype),
                      RAW_SIGN=scale > 0)

        def launch_dkdv(c: TileConfig):
            attn_bwd_dkdv_kernel[(_cdiv(max_seqlen, c.outer), HK, n_docs)](
                q, k, v, do, lse, delta, dk, dv, cu, scale * LOG2E, scale, T, HQ, HK,
                BN=c.outer, BM=c.inner, num_warps=c.num_warps, num_stages=c.num_stages, **common,
            )

        def launch_dq(c: TileConfig):
            attn_bwd_dq_kernel[(_cdiv(max_seqlen, c.outer), HQ, n_docs)](
                q, k, v, do, lse, delta, dq, cu, scale * LOG2E, scale, T, HQ, HK,
                BM=c.outer, BN=c.inner, num_warps=c.num_warps, num_stages=c.num_stages, **common,
            )

        key = (bd, mode_id, q.dtype, HQ // HK)
        _run_tuned(("dkdv",) + key, _candidates("dkdv", mode_id, bd), launch_dkdv)
        _run_tuned(("dq",) + key, _candidates("dq", mode_id, bd), launch_dq)
        return dq, dk, dv, None, None, None, None, None


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
    ``max_seqlen`` (longest document) avoids a device sync when given.
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
    return ParallelAttentionFunction.apply(q, k, v, mode_id, float(scale), float(eps), cu_seqlens, int(max_seqlen))
