"""torch.profiler traces of the training loop (``[profiling]``), on every device the trainer runs on.

On a GPU this is torchtitan's ``maybe_enable_profiling``. Its profiler lists the GPU's activity
even where there is none, which torch.profiler refuses, so on CPU the same schedule and trace
files (``<dump>/<save_traces_folder>/iteration_<step>/rank<r>_trace.json``) come from a
CPU-only profiler.
"""
from __future__ import annotations

import contextlib
import logging
import os

import torch

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def training_profiler(cfg, *, global_step: int, base_folder: str, device: torch.device):
    """The profiler to ``step()`` once per training step, or None when profiling is off."""
    if not cfg.enable_profiling or device.type != "cpu":
        from torchtitan.tools.profiling import maybe_enable_profiling

        with maybe_enable_profiling(cfg, global_step=global_step, base_folder=base_folder) as prof:
            yield prof
        return
    trace_dir = os.path.join(base_folder, cfg.save_traces_folder)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def write_trace(prof):
        folder = os.path.join(trace_dir, f"iteration_{prof.step_num}")
        os.makedirs(folder, exist_ok=True)
        prof.export_chrome_trace(os.path.join(folder, f"rank{rank}_trace.json"))
        logger.info("Profiler trace of step %d written to %s", prof.step_num, folder)

    schedule = torch.profiler.schedule(wait=cfg.profile_freq - cfg.profiler_warmup - cfg.profiler_active,
                                       warmup=cfg.profiler_warmup, active=cfg.profiler_active)
    logger.info("Profiling active (CPU). Traces will be saved at %s", trace_dir)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule,
                                on_trace_ready=write_trace, record_shapes=True) as prof:
        prof.step_num = global_step
        yield prof
