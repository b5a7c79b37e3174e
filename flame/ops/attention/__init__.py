"""Causal attention kernels: softmax, softpick and rectified softmax (+ scalable-softmax helper).

* ``parallel_attention``: Triton forward/backward (GQA, varlen, head dim 16..256).
* ``naive_attention``: pure-torch reference that also returns the weights (CPU, float64, decode).
* ``log_position_scale``: query multiplier ``s_h * log(pos + 2)`` of scalable softmax.
"""
from flame.ops.attention.naive import attention_weights, build_valid_mask, naive_attention
from flame.ops.attention.parallel import parallel_attention
from flame.ops.attention.utils import (
    MODES,
    check_head_dim,
    check_mode,
    log_position_scale,
    positions_from_cu_seqlens,
    triton_interpreting,
)

__all__ = [
    "MODES",
    "attention_weights",
    "build_valid_mask",
    "check_head_dim",
    "check_mode",
    "log_position_scale",
    "naive_attention",
    "parallel_attention",
    "positions_from_cu_seqlens",
    "triton_interpreting",
]
