"""The `[offload]` config section (host-offload engine).

The lead's JobConfig includes it as section ``offload``:
``from flame.offload.config import Offload``. Field docstrings are shown by ``--help``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Literal

from flame.errors import ConfigError

DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class Offload:
    enable: Literal["auto", "on", "off"] = "auto"
    """auto: offload only when the plain (all-resident FSDP2) plan does not fit the GPU budget;
    on: always run the offload engine (even if everything fits); off: never offload."""

    gpu_memory_gib: float = 0.0
    """GPU memory budget per GPU in GiB: the whole process on the device (CUDA context and driver
    memory plus torch's reserved bytes); the trainer caps torch's allocator to fit it (see
    `flame.offload.gpu_cap`). 0 = device total minus the driver memory outside torch's allocator
    (CUDA context, NCCL) and `gpu_margin_gib`, no allocator cap."""

    gpu_margin_gib: float = 2.0
    """Margin kept free on the GPU when `gpu_memory_gib` is 0, beyond the driver memory measured at
    start-up (CUDA context, NCCL's communicator): allocator fragmentation and what libraries load
    later."""

    host_memory_gib: float = 0.0
    """Host RAM budget per node in GiB. 0 = cgroup limit / Slurm allocation / MemAvailable,
    whichever is smallest, minus `host_margin_gib`."""

    host_margin_gib: float = 8.0
    """Margin kept free on the host (data loader workers, page cache, Python) when
    `host_memory_gib` is 0."""

    compute_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the weights the GPU computes with (the streamed copy)."""

    master_dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    """dtype of the master weights the optimizer updates."""

    grad_dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    """dtype gradients are accumulated and stored in (on GPU or on host). With one micro-batch a step
    nothing is accumulated: host-offloaded blocks' grads then stay in the compute dtype when it is
    narrower (the same values, half the bytes to copy and keep)."""

    moment_dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    """dtype of the AdamW moments (exp_avg, exp_avg_sq)."""

    plan: str = "auto"
    """'auto' to solve for the fastest plan under the budgets, or the path of a plan JSON file
    (written by `python -m flame.offload.plan --offload.save_plan ...`) to replay exactly."""

    save_plan: str = ""
    """If set, write the chosen plan to this JSON path."""

    profile: str = ""
    """Path of the cached hardware profile JSON. Empty: `<dump_folder>/offload_profile.json`;
    measured (~30 s) on the first GPU run when missing."""

    activation_offload: bool = False
    """Let the planner offload blocks' activations to pinned host memory (copied out after each
    block's forward, back ahead of its backward) where that beats recomputing them. Off by default:
    it pays only when the PCIe link has room beside the weight traffic and no CPU optimizer shares
    host memory bandwidth with the copies (the copies and the AdamW slow each other down), and it
    doubles the planner's
    search. `overrides = ["activations[i-j]=offload"]` forces it per block either way."""

    selective_recompute: bool = True
    """Let the planner recompute blocks selectively: keep the outputs of their matmuls and attention,
    recompute the rest (norms, rotary, activation functions) in the backward. Between keeping a
    block's activations and recomputing its whole forward in memory; nearly free in time."""

    checkpoint_offload: bool = False
    """Let the planner keep the inputs of recomputed blocks in pinned host memory between their
    forward and backward (copied out after the block's forward, back ahead of its recompute): the
    GPU then holds no activations of those blocks: larger micro-batches, or more weights kept on
    the GPU, where the memory freed buys more than the copies cost. Off by default (docs/offload.md
    has its measurements); `overrides = ["activations[i-j]=recompute_host"]` forces it per block."""

    speculative_step: bool = False
    """Start each host block's CPU AdamW as soon as its gradients reach the host, during the rest of
    the backward, instead of after the step's gradient norm; it is kept when the step turns out
    unclipped at that learning rate, and redone (or undone, for a skipped step) otherwise, so the
    result equals the usual step's bit for bit. With clipping (training.max_norm > 0) or
    training.skip_nan_inf it costs a spare set of master weights and moments in host memory (the
    planner counts it) and a redo on every clipped step; without either, the update goes into the
    state itself (no step can need a redo)."""

    prefetch_depth: int = 0
    """Blocks whose weights are in flight ahead of the block computing. 0 = chosen by the planner."""

    micro_batch_tokens: int = 0
    """Tokens per forward/backward pass. 0: the planner picks the fastest micro-batch among the
    divisors of `training.batch_size` (whole sequences; the trainer splits every loaded batch
    accordingly; varlen batches are never split); N: fixed, a multiple of `training.seq_len` whose
    sequences divide the batch."""

    cpu_threads: int = 0
    """Threads of each rank's CPU optimizer. 0 = the cores the process may use, split evenly over the
    ranks on this machine (torchrun's LOCAL_WORLD_SIZE), minus one."""

    calibrate: bool = True
    """Time steps 3-5 of every launch once; log predicted vs measured step time and peak GPU
    memory; when the step is off by more than 10%, refit the compute scale and re-plan once. A
    changed plan is written to `<dump_folder>/offload_plan_calibrated.json` and used from the
    next launch (resume) of the job with the same settings."""

    overrides: list[str] = field(default_factory=list)
    """Per-decision overrides for experts, comma-separated `key=value`, block index ranges allowed:
    `weights[i-j]=gpu|host|resident` (host = streamed with grads/optimizer on the host,
    resident = weights on GPU with the optimizer on the CPU), `optimizer[*]=gpu|cpu`,
    `activations[*]=keep|selective|recompute|offload|recompute_host`, `prefetch=2`, `outer=gpu|host_opt`."""

    def depths(self) -> tuple[int, ...]:
        """The prefetch depths the solver may choose: the fixed one, or 1-3."""
        return (self.prefetch_depth,) if self.prefetch_depth else (1, 2, 3)

    def changed_options(self) -> list[str]:
        """The options set to other than their defaults, `enable` aside (`offload.<name>`)."""
        default = Offload()
        return [f"offload.{f.name}" for f in fields(self) if f.name != "enable"
                and getattr(self, f.name) != getattr(default, f.name)]

    def validate(self) -> None:
        """Raise ConfigError (one line naming the value) on bad input."""
        if self.enable not in ("auto", "on", "off"):
            raise ConfigError(f"offload.enable={self.enable!r}: expected auto, on or off")
        for name in ("gpu_memory_gib", "host_memory_gib", "gpu_margin_gib", "host_margin_gib"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"offload.{name}={v!r}: expected a number >= 0")
        for name in ("compute_dtype", "master_dtype", "grad_dtype", "moment_dtype"):
            v = getattr(self, name)
            if v not in DTYPES:
                raise ConfigError(f"offload.{name}={v!r}: expected one of {', '.join(DTYPES)}")
        if self.moment_dtype != self.master_dtype:  # the engine's AdamW (as torch's) keeps them in one dtype
            raise ConfigError(f"offload.moment_dtype={self.moment_dtype!r}: must equal offload.master_dtype "
                              f"({self.master_dtype!r})")
        for name in ("prefetch_depth", "micro_batch_tokens", "cpu_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ConfigError(f"offload.{name}={v!r}: expected an integer >= 0")
