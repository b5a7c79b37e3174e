"""Memory budgets: the GPU cap split into what torch's allocator may reserve and what a plan may
allocate; the host budget from cgroup / Slurm / meminfo.

`offload.gpu_memory_gib` is the whole process on the device, as `nvidia-smi` counts it: the
CUDA context and other driver memory outside torch's caching allocator, plus the allocator's
reserved bytes, of which the plan's allocated peak is a part. The allocator cap (applied with
`torch.cuda.set_per_process_memory_fraction`, `flame.offload.gpu_cap`) bounds reserved bytes;
the plan keeps `FRAGMENTATION_HEADROOM` of it free for cached blocks of the wrong size.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flame.errors import ConfigError

GiB = 1024**3

OUTSIDE_ALLOCATOR_GROWTH_BYTES = GiB // 2
"""Device memory the driver takes outside torch's allocator after the start-up measurement:
kernel modules loaded at their first launch (CUDA's lazy loading: torch, Triton and inductor
kernels), NCCL communicators' buffers (made at the first collective), cuBLAS and cuDNN handles."""

DEFAULT_CUDA_CONTEXT_BYTES = GiB // 2
"""Driver memory of one process at start-up when neither the process nor the hardware profile
measured it (planning without a GPU from a profile that lacks `cuda_context_bytes`)."""

FRAGMENTATION_HEADROOM = 0.05
"""Share of the allocator's cap a plan leaves unallocated: reserved bytes cached in blocks the
next request does not fit (the trainer turns on expandable segments, which keep this small)."""


def reserved_peak_bytes(allocated_peak_bytes: float) -> int:
    """The allocator's reserved bytes predicted at a plan's allocated peak: the plan's bytes plus
    the cached blocks `FRAGMENTATION_HEADROOM` leaves room for (at most the allocator cap when the
    plan fits its budget: nvidia-smi's number is this plus the memory outside the allocator)."""
    return int(allocated_peak_bytes / (1 - FRAGMENTATION_HEADROOM))


@dataclass(frozen=True)
class GpuBudget:
    """One GPU's memory split, in bytes."""

    cap_bytes: int
    """The process's whole use of the device (nvidia-smi's number)."""
    outside_allocator_bytes: int
    """Counted for the CUDA context and driver memory outside torch's allocator (0: not counted)."""
    allocator_bytes: int
    """Cap on the allocator's reserved bytes (0: no cap is applied)."""
    plan_bytes: int
    """What a plan's allocated peak may reach."""


def gpu_budget(gpu_memory_gib: float, margin_gib: float, device_total: int,
               context_bytes: int | None) -> GpuBudget:
    """The split of `offload.gpu_memory_gib` (0: the device total less the driver memory measured
    outside the allocator and `margin_gib`, the headroom then; no allocator cap). `context_bytes`:
    driver memory outside the allocator measured at start-up (the CUDA context, NCCL's
    communicator); None when the plan runs on no GPU (CPU tests of the engine: nothing but the
    plan is counted)."""
    if gpu_memory_gib <= 0:
        cap = max(0, int(device_total - margin_gib * GiB))
        outside = min(cap, context_bytes or 0)
        return GpuBudget(cap_bytes=cap, outside_allocator_bytes=outside, allocator_bytes=0, plan_bytes=cap - outside)
    cap = int(gpu_memory_gib * GiB)
    if context_bytes is None:
        return GpuBudget(cap_bytes=cap, outside_allocator_bytes=0, allocator_bytes=0, plan_bytes=cap)
    outside = context_bytes + OUTSIDE_ALLOCATOR_GROWTH_BYTES
    allocator = min(cap, device_total) - outside
    if allocator <= 0:
        raise ConfigError(f"offload.gpu_memory_gib={gpu_memory_gib}: must be more than {outside / GiB:.2f} GiB (the "
                          "budget also holds the CUDA context, driver memory outside torch's allocator and other "
                          "processes' memory on this GPU)")
    return GpuBudget(cap_bytes=cap, outside_allocator_bytes=outside, allocator_bytes=allocator,
                     plan_bytes=int(allocator * (1 - FRAGMENTATION_HEADROOM)))


def _cgroup_limit() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = open(path).read().strip()
        except OSError:
            continue
        if v.isdigit() and int(v) < (1 << 60):
            return int(v)
    return None


def _slurm_limit() -> int | None:
    # SLURM_MEM_PER_NODE is in MiB
    v = os.environ.get("SLURM_MEM_PER_NODE")
    return int(v) * 2**20 if v and v.isdigit() else None


def _mem_available() -> int | None:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_budget_bytes(host_memory_gib: float, margin_gib: float) -> int:
    """The configured host budget, or the smallest known limit minus the margin."""
    if host_memory_gib > 0:
        return int(host_memory_gib * GiB)
    limits = [x for x in (_cgroup_limit(), _slurm_limit(), _mem_available()) if x]
    return max(0, int(min(limits) - margin_gib * GiB)) if limits else 0


