"""Where mixed precision comes from: FSDP2's ``MixedPrecisionPolicy`` or ``torch.autocast``."""

import contextlib

import torch
from torchtitan.config import TORCH_DTYPE_MAP


def autocast_context(parallel_dims, param_dtype: str, device_type: str, offloaded: bool):
    """``torch.autocast`` to ``param_dtype`` wherever nothing else casts the compute.

    FSDP2 casts parameters itself and the offload engine streams compute-dtype weights, so
    those get no autocast. Everything else does: one device, DDP, and tensor parallelism without
    FSDP. torchtitan's ``maybe_enable_amp`` leaves TP without FSDP in float32, which runs the
    sharded matmuls in float32 (several times slower than one GPU in bf16); autocast dispatches
    below DTensor and casts the sharded matmuls like plain ones.
    """
    dtype = TORCH_DTYPE_MAP[param_dtype]
    if offloaded or parallel_dims.fsdp_enabled or dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=dtype)
