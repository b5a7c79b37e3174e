"""Multi-head (GQA) causal self-attention layer with a selectable backend."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flame.errors import ConfigError
from flame.models.attention.dispatch import attention
from flame.models.attention.registry import get_backend
from flame.models.attention.rotary import apply_rotary
from flame.ops.attention import check_head_dim, log_position_scale


class HeadRMSNorm(nn.Module):
    """RMSNorm over the head dim, computed in float32 (FLA's q_norm/k_norm)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class FlameAttention(nn.Module):
    """q/k/v/o projections (FLA's parameter names), optional qk-norm, rotary, scalable softmax.

    ``backend`` is a registry name (see ``flame.models.attention.BACKENDS``). Scaled backends own a
    per-head parameter ``ssmax_scale`` (init ``scale_init``) multiplying queries by
    ``ssmax_scale[h] * log(position + 2)``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        backend: str = "sdpa",
        qkv_bias: bool = False,
        qk_norm: bool = False,
        window_size: int | None = None,
        softpick_eps: float = 1e-6,
        scale_init: float = 0.3,
        layer_idx: int | None = None,
    ):
        super().__init__()
        self.backend = get_backend(backend)
        num_kv_heads = num_kv_heads or num_heads
        if hidden_size % num_heads:
            raise ConfigError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = hidden_size // num_heads
        if self.backend.needs_kernel_head_dim:
            check_head_dim(self.head_dim)
        if window_size is not None and self.backend.impl in ("triton", "flex"):
            raise ConfigError(f"window_size is not supported by attn_impl {self.backend.name!r}")
        self.window_size = window_size
        self.softpick_eps = softpick_eps
        self.scale_init = scale_init
        self.layer_idx = layer_idx
        kv_dim = num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = HeadRMSNorm(self.head_dim)
            self.k_norm = HeadRMSNorm(self.head_dim)
        if self.backend.scaled:
            self.ssmax_scale = nn.Parameter(torch.full((num_heads,), float(scale_init)))

    def reset_extra_parameters(self) -> None:
        if self.backend.scaled:
            nn.init.constant_(self.ssmax_scale, self.scale_init)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        output_attentions: bool = False,
        block_mask=None,
    ):
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        if self.backend.scaled:
            if positions is None:
                raise ValueError("scaled attention needs token positions")
            q = (q.float() * log_position_scale(positions, self.ssmax_scale)).to(q.dtype)
        if past_key_values is not None and use_cache:
            k_all, v_all = past_key_values.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
            k, v = k_all.transpose(1, 2), v_all.transpose(1, 2)
        o, weights = attention(
            q, k, v, self.backend, eps=self.softpick_eps, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            key_padding_mask=attention_mask, window_size=self.window_size, need_weights=output_attentions,
            block_mask=block_mask,
        )
        o = self.o_proj(o.reshape(B, T, -1))
        return o, weights, past_key_values
