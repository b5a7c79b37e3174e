"""torch.profiler traces of the training loop (``[profiling]``), on every device the trainer runs on,
and CUDA memory snapshots (``profiling.enable_memory_snapshot``, torchtitan's: one every
``profile_freq`` steps and one when a step runs out of GPU memory, under
``<dump>/<save_memory_snapshot_folder>/iteration_<step>[_exit]/rank<r>_memory_snapshot.pickle``,
for https://pytorch.org/memory_viz).

torchtitan's schedule and file layout (``<dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``,
one trace every ``profile_freq`` steps after ``profiler_warmup`` steps of warmup, for
``profiler_active`` steps), with two differences from torchtitan's ``maybe_enable_profiling``: it
lists the GPU's activity only where there is a GPU (torch.profiler refuses a missing one), and it
writes no trace for the steps a run's end cuts short (torch hands over what it recorded when the
profiler stops, mid-cycle: only the code after the loop).
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def training_profiler(cfg, *, global_step: int, base_folder: str, device: torch.device, last_step: int):
    """The profiler to ``step()`` once per training step, or None when profiling is off."""
    if not cfg.enable_profiling:
        yield None
        return
    trace_dir = os.path.join(base_folder, cfg.save_traces_folder)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    freq = cfg.profile_freq
    if global_step + freq > last_step:
        logger.warning("profiling.profile_freq %d: this run ends at step %d, before its first trace (step %d)",
                       freq, last_step, global_step + freq)

    def write_trace(prof):
        if prof.step_num % freq:  # the profiler stopped mid-cycle at the run's end
            return
        folder = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace.json"))
        logger.info("Profiler trace of step %d written to %s", prof.step_num, folder)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    schedule = torch.profiler.schedule(wait=freq - cfg.profiler_warmup - cfg.profiler_active,
                                       warmup=cfg.profiler_warmup, active=cfg.profiler_active)
    logger.info("Profiling active (%s). Traces will be saved at %s", "/".join(a.name for a in activities), trace_dir)
    with torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=write_trace,
                                record_shapes=True) as prof:
        prof.step_num = global_step
        yield prof


@contextlib.contextmanager
def memory_snapshots(cfg, *, global_step: int, base_folder: str):
    """torchtitan's memory snapshot recorder to ``step()`` once per training step (it also writes a
    snapshot when the loop raises torch.OutOfMemoryError), or None when snapshots are off."""
    if not cfg.enable_memory_snapshot:
        yield None
        return
    from torchtitan.tools.profiling import maybe_enable_memory_snapshot

    with maybe_enable_memory_snapshot(cfg, global_step=global_step, base_folder=base_folder) as recorder:
        yield recorder
