"""Default memory budgets: device total minus a margin; host from cgroup / Slurm / meminfo."""

from __future__ import annotations

import os

GiB = 1024**3


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


def gpu_budget_bytes(gpu_memory_gib: float, margin_gib: float, device_total: int) -> int:
    if gpu_memory_gib > 0:
        return int(gpu_memory_gib * GiB)
    return max(0, int(device_total - margin_gib * GiB))
