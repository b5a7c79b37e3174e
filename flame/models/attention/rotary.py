"""Rotary position embedding (rotate-half layout, as FLA's default), computed from explicit positions."""
from __future__ import annotations

import torch


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, 1, head_dim // 2] (float32) for integer positions [B, T]."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, device=positions.device, dtype=torch.float32) * 2 / head_dim))
    ang = positions.float()[..., None] * inv_freq
    return ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., i], x[..., i + D/2]) of x [B, T, H, D] by the given angles."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:2 * half]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., 2 * half:]], dim=-1)
    return out.to(x.dtype)
