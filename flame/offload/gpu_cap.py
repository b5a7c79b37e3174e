"""The GPU cap of an offload run: `offload.gpu_memory_gib` bounds the whole process on the device.

Applied once at the trainer's setup, before the model touches the GPU: torch's caching allocator
gets expandable segments (unless `PYTORCH_CUDA_ALLOC_CONF`/`PYTORCH_ALLOC_CONF` says otherwise)
and a reserved-bytes cap, `torch.cuda.set_per_process_memory_fraction`, of the cap minus the
driver memory outside the allocator (measured now, plus `planner.budgets`' allowance for what
comes later). The planner then packs its allocated peak into the part the fragmentation headroom
leaves (`planner.budgets.gpu_budget`).
"""

from __future__ import annotations

import logging
import os

import torch

from flame.offload.config import Offload
from flame.offload.planner.budgets import GiB, GpuBudget, gpu_budget

logger = logging.getLogger(__name__)

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

_applied: dict[int, GpuBudget] = {}


def _set_allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch before the accelerator-generic name
        setter = torch.cuda.memory._set_allocator_settings
    setter(settings)


def _cuda_index(device: torch.device) -> int:
    """The CUDA device's index (the current device when `device` names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def apply_gpu_cap(off: Offload, device: torch.device) -> GpuBudget | None:
    """Cap this process's use of `device` at `off.gpu_memory_gib` (offload on or auto, a cap
    given, a CUDA device); returns the split, or None when nothing was capped. Idempotent per
    device."""
    if device.type != "cuda" or off.enable == "off" or off.gpu_memory_gib <= 0:
        return None
    index = _cuda_index(device)
    if index in _applied:
        return _applied[index]
    from flame.offload.measure.hardware import outside_allocator_bytes

    if not any(os.environ.get(v) for v in ALLOC_CONF_VARS):
        _set_allocator_settings("expandable_segments:True")
    total = torch.cuda.get_device_properties(index).total_memory
    budget = gpu_budget(off.gpu_memory_gib, off.gpu_margin_gib, total, outside_allocator_bytes(index))
    torch.cuda.set_per_process_memory_fraction(budget.allocator_bytes / total, index)
    _applied[index] = budget
    logger.info("offload: GPU cap %.2f GiB = %.2f GiB allocator cap (reserved) + %.2f GiB for the CUDA context and "
                "driver memory; plans may allocate %.2f GiB", budget.cap_bytes / GiB, budget.allocator_bytes / GiB,
                budget.outside_allocator_bytes / GiB, budget.plan_bytes / GiB)
    return budget


def applied_gpu_cap(device) -> GpuBudget | None:
    """The split `apply_gpu_cap` applied to `device` in this process, if any."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _applied.get(_cuda_index(device))
