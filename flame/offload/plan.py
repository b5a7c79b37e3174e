"""`python -m flame.offload.plan --job.config_file X.toml [--section.key value ...]`

The resource calculator: measures the model's per-block costs on the meta device (no memory),
loads the hardware profile, solves, prints the plan with predicted step time, tokens/s, MFU,
peak GPU/host/pinned bytes and the binding constraint. Needs no GPU. Exits 2 with one line
("offload: needs 31.2 GiB host, budget 24.0") when nothing fits, before allocating anything.

Takes the trainer's command line (the same parser: TOML + CLI, flame's aliases such as
``training.batch_size``, unknown keys rejected) and plans as the trainer would
(`flame.offload.build_plan`), for the machine of the stored ``offload.profile``. The
data-parallel ranks the host state is sharded over, and the plan is made per rank for, are
``parallelism.data_parallel_shard_degree`` x ``data_parallel_replicate_degree`` (-1 counts as 1:
give the degrees explicitly). Micro-batches per step: ``training.gradient_accumulation_steps`` (or
``training.global_batch_size`` / (batch x ranks)) x the loaded batch / the planner's micro-batch.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from flame.config.manager import FlameConfigManager, accumulation_steps
from flame.errors import ConfigError
from flame.offload import build_plan
from flame.offload.config import Offload
from flame.offload.costs import ModelCosts
from flame.offload.solver import Plan, describe


def plan_for(job) -> tuple[Plan, ModelCosts | None, Offload]:
    """(plan, costs or None when a plan file is replayed, the offload section) of a parsed job."""
    from flame.models.build import load_model_config

    off = job.offload
    par = job.parallelism
    world = max(1, par.data_parallel_shard_degree) * max(1, par.data_parallel_replicate_degree)
    job.training.gradient_accumulation_steps = accumulation_steps(job.training, world)
    if off.plan == "auto" and not off.profile:
        raise ConfigError("offload.profile: required without a GPU (path of a stored hardware profile JSON)")
    config = load_model_config(job.model.config, job.model.module)  # as the trainer loads it (HF models default to SDPA)
    plan, costs, _ = build_plan(SimpleNamespace(config=config), job, "cpu", world, threads_from_profile=True)
    return plan, costs, off


def main(argv: list[str] | None = None) -> int:
    try:
        plan, costs, off = plan_for(FlameConfigManager().parse_args(argv))
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    if costs is None:
        print(f"replaying plan file {off.plan}: predicted {plan.predicted}")
    else:
        print(describe(plan, costs))
        if off.enable == "auto" and not plan.offloads:
            print("  -> everything fits: plain FSDP2, no offload engine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
