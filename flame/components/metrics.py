"""Training metrics: console line, TensorBoard, W&B (through torchtitan's loggers).

Everything that needs a host sync (``.item()``) happens here, on log steps only.
"""

import json
import os
import time
from dataclasses import dataclass, field

import torch
from torchtitan.components.metrics import _build_metric_logger
from torchtitan.tools.logging import logger


def _gib(x: float) -> float:
    return x / 2**30


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


@dataclass
class MetricsLogger:
    """Accumulates per-step counters between log steps and writes one record per log step."""

    job_config: object
    parallel_dims: object
    device: torch.device
    flops_per_token: float
    peak_flops: float | None
    total_steps: int
    start_step: int = 0
    tokens_since: int = 0
    data_time_since: float = 0.0
    skipped_steps: int = 0
    last_time: float = field(default_factory=time.perf_counter)
    last_step: int = 0
    run_start: float = field(default_factory=time.perf_counter)
    history: list = field(default_factory=list)
    allocated_peak_seen: int = 0
    """The allocator's allocated-bytes peak over the intervals this logger reset (see allocated_peak)."""

    def __post_init__(self):
        self.backend = _build_metric_logger(self.job_config, self.parallel_dims)
        self.last_step = self.start_step
        self.world = max(self.parallel_dims.world_size, 1)
        self.dp = self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard * self.parallel_dims.cp
        # one JSON record per log step, for scripts and tests (rank 0 only)
        self.jsonl = (
            os.path.join(self.job_config.job.dump_folder, "metrics.jsonl")
            if torch.distributed.get_rank() == 0
            else None
        )

    def reset_clock(self, step: int) -> None:
        self.last_time = time.perf_counter()
        self.last_step = step
        self.run_start = self.last_time
        self.start_step = step

    def start_allocated_peak(self) -> None:
        """Begin a window for allocated_peak (the caller resets the allocator's counter itself)."""
        self.allocated_peak_seen = 0

    def allocated_peak(self) -> int | None:
        """The GPU allocator's peak of allocated bytes since start_allocated_peak, across the
        resets of its one peak counter that every log does. None without a GPU."""
        if self.device.type != "cuda":
            return None
        return max(self.allocated_peak_seen, torch.cuda.max_memory_allocated(self.device))

    def should_log(self, step: int) -> bool:
        return step == 1 or step % self.job_config.metrics.log_freq == 0 or step == self.total_steps

    def log(self, step: int, loss: float, grad_norm: float, lr: float, extra: dict | None = None) -> dict:
        now = time.perf_counter()
        elapsed = max(now - self.last_time, 1e-9)
        steps = max(step - self.last_step, 1)
        tps_local = self.tokens_since / elapsed  # this rank's tokens/s
        tps_global = tps_local * self.dp
        tflops = self.flops_per_token * tps_local / 1e12
        record = {
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens_per_second_per_device": tps_local,
            "tokens_per_second": tps_global,
            "tflops": tflops,
            "data_loading_pct": 100.0 * self.data_time_since / elapsed,
            "step_time": elapsed / steps,
            "skipped_steps": self.skipped_steps,
        }
        if self.peak_flops:
            record["mfu_pct"] = 100.0 * tflops * 1e12 / self.peak_flops
        if self.device.type == "cuda":
            record["memory_peak_gib"] = _gib(torch.cuda.max_memory_reserved(self.device))
            peak = torch.cuda.max_memory_allocated(self.device)
            record["memory_active_gib"] = _gib(peak)
            self.allocated_peak_seen = max(self.allocated_peak_seen, peak)
            torch.cuda.reset_peak_memory_stats(self.device)
        if extra:
            record.update(extra)
        done = step - self.start_step
        rate = (now - self.run_start) / max(done, 1)
        eta = rate * (self.total_steps - step)
        self.history.append((step, record))
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"step": step, **record}) + "\n")
        self.backend.log({f"train/{k}": v for k, v in record.items()}, step)
        parts = [
            f"step {step:>6}/{self.total_steps}",
            f"loss {loss:8.4f}",
            f"gnorm {grad_norm:7.3f}",
            f"lr {lr:.3e}",
            f"tok/s {tps_global:,.0f} ({tps_local:,.0f}/dev)",
            f"tflops {tflops:.1f}",
        ]
        if "mfu_pct" in record:
            parts.append(f"mfu {record['mfu_pct']:.1f}%")
        if "memory_peak_gib" in record:
            parts.append(f"mem {record['memory_peak_gib']:.1f}GiB")
        parts.append(f"data {record['data_loading_pct']:.0f}%")
        if self.skipped_steps:
            parts.append(f"skipped {self.skipped_steps}")
        parts.append(f"eta {_fmt_eta(eta)}")
        logger.info("  ".join(parts))
        self.tokens_since = 0
        self.data_time_since = 0.0
        self.last_time = now
        self.last_step = step
        return record

    def log_scalars(self, values: dict, step: int) -> None:
        """Extra metrics with full names (e.g. ``validation/loss``) to every backend."""
        self.backend.log(values, step)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
        logger.info(f"step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def close(self) -> None:
        self.backend.close()
