"""Training metrics: console line, TensorBoard, W&B (through torchtitan's loggers).

Everything that needs a host sync (``.item()``) happens here, on log steps only.
"""

import json
import os
import resource
import time
from dataclasses import dataclass, field

import torch
from torchtitan.components.metrics import _build_metric_logger
from torchtitan.tools.logging import logger

from flame.utils.startup import seconds_since_launch


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux: ``VmHWM``, the process's own; ``ru_maxrss``
    (the fallback elsewhere) keeps the parent's peak across the exec that started the process."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if os.uname().sysname == "Darwin" else rss * 1024  # bytes on macOS, KiB on Linux


def _gib(x: float) -> float:
    return x / 2**30


def _fmt_eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"


def _record_step(line: str) -> int:
    """A metrics.jsonl line's step (a torn last line from a killed run counts as after every step)."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 2**62


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
    trained_tokens_since: object = 0
    """Targets that count in the loss (labels != -100) on all data-parallel ranks since the last log
    (an int or a device tensor)."""
    data_time_since: float = 0.0
    skipped_steps: int = 0
    last_time: float = field(default_factory=time.perf_counter)
    last_step: int = 0
    run_start: float = field(default_factory=time.perf_counter)
    history: list = field(default_factory=list)
    allocated_peak_seen: int = 0
    """The allocator's allocated-bytes peak over the intervals this logger reset (see allocated_peak)."""
    launch_tokens: int = 0
    """Tokens this rank processed since the loop started in this launch (for the end-of-run summary)."""
    memory_peak_gib: float = 0.0
    """Largest reserved GPU memory of any log interval."""
    last_validation: dict = field(default_factory=dict)
    """The latest ``validation/...`` values and their step."""
    created: float = field(default_factory=time.perf_counter)

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
        """Time this launch from `step` (where it starts or resumed); metrics.jsonl keeps only the
        records up to it, so a relaunch from an earlier checkpoint does not list steps twice."""
        self._drop_records_after(step)
        self.launch_tokens = 0
        self.last_time = time.perf_counter()
        self.last_step = step
        self.run_start = self.last_time
        self.start_step = step

    def _drop_records_after(self, step: int) -> None:
        if not self.jsonl or not os.path.isfile(self.jsonl):
            return
        with open(self.jsonl) as f:
            lines = f.readlines()
        kept = [line for line in lines if _record_step(line) <= step]
        if len(kept) == len(lines):
            return
        with open(self.jsonl + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(self.jsonl + ".tmp", self.jsonl)
        logger.info("metrics.jsonl: %d records of steps after %d (a later run's, replaced by this one) removed",
                    len(lines) - len(kept), step)

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
        # SFT: tokens/s on the trained (assistant) tokens too, next to all tokens
        sft = getattr(self.job_config.training, "sft", False)
        trained_tps = float(self.trained_tokens_since) / elapsed if sft else None
        if trained_tps is not None:
            record["trained_tokens_per_second"] = trained_tps
        if self.peak_flops:
            record["mfu_pct"] = 100.0 * tflops * 1e12 / self.peak_flops
        if self.device.type == "cuda":
            record["memory_peak_gib"] = _gib(torch.cuda.max_memory_reserved(self.device))
            self.memory_peak_gib = max(self.memory_peak_gib, record["memory_peak_gib"])
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
            *([f"trained tok/s {trained_tps:,.0f}"] if trained_tps is not None else []),
            f"tflops {tflops:.1f}" if tflops >= 1 else f"tflops {tflops:.2g}",  # a CPU run's small rates
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
        self.launch_tokens += self.tokens_since
        self.tokens_since = 0
        self.trained_tokens_since = 0
        self.data_time_since = 0.0
        self.last_time = now
        self.last_step = step
        return record

    def log_scalars(self, values: dict, step: int) -> None:
        """Extra metrics with full names (e.g. ``validation/loss``) to every backend."""
        if any(k.startswith("validation/") for k in values):
            self.last_validation = {"step": step, **{k: v for k, v in values.items() if k.startswith("validation/")}}
        self.backend.log(values, step)
        if self.jsonl:
            with open(self.jsonl, "a") as f:
                f.write(json.dumps({"step": step, **values}) + "\n")
        logger.info(f"step {step}: " + "  ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def close(self) -> None:
        self.backend.close()


def run_summary(trainer) -> dict:
    """What a finished launch did and where its outputs are (the same on every rank's view)."""
    cfg, m = trainer.cfg, trainer.metrics
    dump = os.path.abspath(cfg.job.dump_folder)
    now = time.perf_counter()
    train_time = now - m.run_start
    tokens = (m.launch_tokens + m.tokens_since) * m.dp  # every data-parallel rank's share
    losses = [r["loss"] for _, r in m.history if "loss" in r]
    ckpt_root = os.path.join(dump, cfg.checkpoint.folder)
    steps = sorted((int(d[5:]) for d in os.listdir(ckpt_root) if d.startswith("step-") and d[5:].isdigit())
                   if os.path.isdir(ckpt_root) else [])
    hf = os.path.join(dump, "hf")
    jsonl = os.path.join(dump, "metrics.jsonl")
    return {
        "steps": trainer.step,
        "steps_this_launch": trainer.step - m.start_step,
        "final_train_loss": losses[-1] if losses else None,
        "validation_loss": m.last_validation.get("validation/loss"),
        "validation_step": m.last_validation.get("step"),
        "tokens_seen": trainer.ntokens_seen * trainer.dp_degree,
        "tokens_this_launch": tokens,
        # from train.sh's start when it launched this run (imports, data workers and compilation
        # included), else from the metrics' creation
        "wall_time_s": seconds_since_launch() or now - m.created,
        "train_time_s": train_time,
        "tokens_per_second": tokens / train_time if train_time > 0 else None,
        "gpu_memory_peak_gib": m.memory_peak_gib if m.device.type == "cuda" else None,
        "host_memory_peak_gib": _gib(peak_rss_bytes()),
        "dump_folder": dump,
        "checkpoint": os.path.join(ckpt_root, f"step-{steps[-1]}") if steps else None,
        "hf_export": hf if cfg.checkpoint.export_hf and os.path.isdir(hf) else None,
        "metrics_jsonl": jsonl if os.path.isfile(jsonl) else None,
    }


def format_summary(summary: dict) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    val = ("-" if summary["validation_loss"] is None
           else f"{summary['validation_loss']:.4f} (step {summary['validation_step']})")
    memory = f"host {summary['host_memory_peak_gib']:.2f} GiB RSS"
    if summary["gpu_memory_peak_gib"] is not None:
        memory = f"GPU {summary['gpu_memory_peak_gib']:.2f} GiB reserved, " + memory
    rows = [
        ("steps", f"{summary['steps']} ({summary['steps_this_launch']} in this launch)"),
        ("final train loss", num(summary["final_train_loss"], ".4f")),
        ("validation loss", val),
        ("tokens seen", f"{summary['tokens_seen']:,}"),
        ("wall time", f"{_fmt_eta(summary['wall_time_s'])} (training {summary['train_time_s']:.1f} s)"),
        ("tokens/s", num(summary["tokens_per_second"], ",.0f")),
        ("peak memory", memory),
        ("dump folder", summary["dump_folder"]),
        ("checkpoint", summary["checkpoint"] or "-"),
        ("HF export", summary["hf_export"] or "-"),
        ("metrics", summary["metrics_jsonl"] or "-"),
        ("summary", os.path.join(summary["dump_folder"], "summary.json")),
    ]
    return "\n".join(["run summary:"] + [f"  {name:<17}{value}" for name, value in rows])


def write_run_summary(trainer) -> dict | None:
    """Rank 0: print the summary block and write it as ``DUMP/summary.json``."""
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return None
    summary = run_summary(trainer)
    path = os.path.join(summary["dump_folder"], "summary.json")
    with open(path + ".tmp", "w") as f:
        json.dump(summary, f, indent=2)
    os.replace(path + ".tmp", path)
    logger.info(format_summary(summary))
    return summary
