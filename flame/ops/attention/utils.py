"""Small helpers shared by the attention kernels and references."""
from __future__ import annotations

import math
import os

import torch

from flame.errors import ConfigError

MODES = ("softmax", "softpick", "rectified")
MAX_HEAD_DIM = 256
MIN_HEAD_DIM = 16


def check_mode(mode: str) -> int:
    if mode not in MODES:
        raise ConfigError(f"unknown attention mode {mode!r}; expected one of {', '.join(MODES)}")
    return MODES.index(mode)


def check_head_dim(d: int) -> None:
    if not (MIN_HEAD_DIM <= d <= MAX_HEAD_DIM):
        raise ConfigError(
            f"head dim {d} is not supported by flame's attention kernels (need {MIN_HEAD_DIM}..{MAX_HEAD_DIM})"
        )


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Position of each of the ``total`` flattened tokens inside its document (int64)."""
    idx = torch.arange(total, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens, idx, right=True) - 1
    return idx - cu_seqlens.long()[doc]


def log_position_scale(positions: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Query multiplier of scalable softmax: ``scale[h] * log(pos + 2)``.

    positions: [B, T] (int), scale: [H] -> returns [B, T, H, 1] in float32.
    """
    logpos = torch.log(positions.float() + 2.0)
    return (logpos[..., None] * scale.float()[None, None, :])[..., None]


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b (grid sizes)."""
    return (a + b - 1) // b


def next_pow2(x: int) -> int:
    return 1 << max(0, math.ceil(math.log2(x)))
