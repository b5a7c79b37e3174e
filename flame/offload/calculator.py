"""The resource calculator, run as `python -m flame.offload.plan --job.config_file X.toml [--section.key value ...]`: measures the model's per-block costs on the meta device (no memory),
loads the hardware profile, solves, prints the plan with predicted step time, tokens/s, MFU,
peak GPU/host/pinned bytes and the binding constraint. Needs no GPU. Exits 2 with one line
("offload: needs 31.2 GiB host, budget 24.0 GiB ...") when nothing fits, before allocating anything.

Takes the trainer's command line (the same parser: TOML + CLI, flame's aliases such as
``training.batch_size``, unknown keys rejected) and plans as the trainer would
(`flame.offload.build_plan`), for the machine of the stored ``offload.profile``. The
data-parallel ranks the host state is sharded over, and the plan is made per rank for, are
``parallelism.data_parallel_shard_degree`` x ``data_parallel_replicate_degree`` (-1 counts as 1:
give the degrees explicitly). Micro-batches per step: ``training.gradient_accumulation_steps`` (or
``training.global_batch_size`` / (batch x ranks)) x the loaded batch / the planner's micro-batch.
"""

from __future__ import annotations

import glob
import os
import sys
from types import SimpleNamespace

import torch

from flame.config.manager import FlameConfigManager, accumulation_steps
from flame.errors import ConfigError
from flame.offload import build_plan, check_parallel_dims
from flame.offload.config import Offload
from flame.offload.planner.block_costs import ModelCosts
from flame.offload.planner.plan import Plan
from flame.offload.planner.solver import describe

# measured profiles shipped with flame: the calculator's machine when none is given and no GPU is here
BUNDLED_PROFILES = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles", "*.json")))

# the options the calculator reads, shown by --help (every trainer option is accepted)
HELP_OPTIONS = (
    "job.config_file", "model.config", "training.batch_size", "training.seq_len", "training.varlen",
    "training.context_len", "training.gradient_accumulation_steps", "training.global_batch_size",
    "training.loss_chunk_tokens", "training.data_parallel_shard_degree",
    "training.data_parallel_replicate_degree", "training.tensor_parallel_degree", "training.compile",
    "job.dump_folder", "model.module", "lora.rank", "lora.targets",
)


def help_text(args: list[str]) -> str:
    from flame.config.help import format_entries, help_entries

    # the values this command line gives, its options over its job file (as train.sh --help shows them)
    config = FlameConfigManager().help_config(args)
    entries = [e for e in help_entries(config) if e[0] == "offload" or e[1].split()[0][2:] in HELP_OPTIONS]
    profiles = ", ".join(os.path.relpath(p) for p in BUNDLED_PROFILES) or "none"
    intro = f"""usage: python -m flame.offload.plan [--job.config_file X.toml] [--section.key VALUE ...]

The offload resource calculator: plans a training job without running it. It measures the
model's per-block costs on the meta device (no memory, no GPU), loads a hardware profile and
prints the fastest plan that fits the GPU and host budgets: where each block's weights,
gradients, optimizer state and activations live, the predicted step time, tokens/s, MFU, and
peak GPU/host/pinned bytes with the binding constraint. When nothing fits it exits 2 with one
line naming the shortfall. It reads the trainer's command line (same job file, options and
aliases; those below are the ones it uses), so it plans what `bash train.sh` with the same
options would.

Hardware profile: --offload.profile, else DUMP/offload_profile.json when a run cached one, else
this machine's GPU is measured (~30 s), else the bundled measured profile ({profiles}).
Measure another machine's with `python -m flame.offload.profile OUT.json` on it."""
    return intro + "\n" + format_entries(entries)


def _profile_for(job) -> str | None:
    """The profile to plan with when ``offload.profile`` is not given (None: measure this GPU)."""
    cached = os.path.join(job.job.dump_folder, "offload_profile.json")
    if os.path.isfile(cached):
        return cached
    if torch.cuda.is_available():
        return None
    if not BUNDLED_PROFILES:
        raise ConfigError("offload.profile: required without a GPU (path of a stored hardware profile JSON)")
    print(f"offload: no GPU here and no --offload.profile: planning with the bundled measured profile "
          f"{BUNDLED_PROFILES[0]} (its GPU and its host's CPU cores; the host memory budget is this machine's "
          f"unless --offload.host_memory_gib gives one)")
    return BUNDLED_PROFILES[0]


def plan_for(job) -> tuple[Plan, ModelCosts | None, Offload]:
    """(plan, costs or None when a plan file is replayed, the offload section) of a parsed job."""
    from flame.models.build import load_model_config

    off = job.offload
    par = job.parallelism
    world = max(1, par.data_parallel_shard_degree) * max(1, par.data_parallel_replicate_degree)
    job.training.gradient_accumulation_steps = accumulation_steps(job.training, world)
    device = "cpu"
    if off.plan == "auto" and not off.profile:
        off.profile = _profile_for(job) or ""
        device = "cpu" if off.profile else "cuda"  # measured here and cached in the dump folder
    config = load_model_config(job.model.config, job.model.module)  # as the trainer loads it (HF models default to SDPA)
    plan, costs, _ = build_plan(SimpleNamespace(config=config), job, device, world, threads_from_profile=True)
    return plan, costs, off


def main(argv: list[str] | None = None) -> int:
    from flame.launch import job_args

    # train.sh's job: without --job.config_file, the options go on top of the default tiny job
    argv = job_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if "-h" in argv or "--help" in argv:
            from flame.config.help import print_help

            print_help(help_text(argv))
            return 0
        job = FlameConfigManager().parse_args(argv)
        plan, costs, off = plan_for(job)
        if plan.offloads:  # the trainer refuses Muon in this run (maybe_offload)
            from flame.components.muon import refuse_offloaded_muon

            refuse_offloaded_muon(job)
        if plan.offloads or off.enable == "on":  # the trainer's engine refuses these (apply_offload)
            par = job.parallelism
            check_parallel_dims(SimpleNamespace(tp=par.tensor_parallel_degree, pp=par.pipeline_parallel_degree,
                                                cp=par.context_parallel_degree))
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    if costs is None:
        print(f"replaying plan file {off.plan}: {plan.summary()}")
    else:
        print(describe(plan, costs))
        if off.enable == "auto" and not plan.offloads:
            print("  -> everything fits: plain FSDP2, no offload engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
