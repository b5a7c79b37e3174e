"""Attention backends (registry), layer-level dispatch and the attention layer of flame's transformer."""
from flame.models.attention.dispatch import attention
from flame.models.attention.layer import FlameAttention, HeadRMSNorm
from flame.models.attention.registry import BACKENDS, AttentionBackend, get_backend, resolve_layer_backends
from flame.models.attention.rotary import apply_rotary, rotary_cos_sin

__all__ = [
    "BACKENDS",
    "AttentionBackend",
    "FlameAttention",
    "HeadRMSNorm",
    "apply_rotary",
    "attention",
    "get_backend",
    "resolve_layer_backends",
    "rotary_cos_sin",
]
