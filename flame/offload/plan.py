"""`python -m flame.offload.plan --job.config_file X.toml [--section.key value ...]`

The resource calculator: measures the model's per-block costs on the meta device (no memory),
loads the hardware profile, solves, prints the plan with predicted step time, tokens/s, MFU,
peak GPU/host/pinned bytes and the binding constraint. Needs no GPU. Exits 2 with one line
("offload: needs 31.2 GiB host, budget 24.0") when nothing fits, before allocating anything.

Reads from the TOML: [model] config (HF/FLA config JSON path or directory), [training]
local_batch_size, seq_len, global_batch_size (rounds = global / (local * ranks) when set),
[parallelism] data_parallel_shard_degree and data_parallel_replicate_degree (their product is
the number of data-parallel ranks the host state is sharded over and the plan is made per rank
for; -1 or unset counts as 1: give the degrees explicitly), and [offload].
"""

from __future__ import annotations

import os
import sys
import tomllib
from dataclasses import fields

from flame.errors import ConfigError
from flame.offload.budgets import gpu_budget_bytes, host_budget_bytes
from flame.offload.config import Offload
from flame.offload.cost_model import Dtypes
from flame.offload.costs import ModelCosts, measure_costs, meta_model
from flame.offload.profile import load as load_profile
from flame.offload.solver import Plan, describe, solve


def _parse(argv: list[str]) -> dict:
    cfg: dict = {}
    it = iter(argv)
    for a in it:
        if not a.startswith("--") or "." not in a:
            raise ConfigError(f"argument {a!r}: expected --section.key value")
        key, _, val = a[2:].partition("=")
        if not _:
            val = next(it, None)
            if val is None:
                raise ConfigError(f"argument {a!r}: missing value")
        sec, k = key.replace("-", "_").split(".", 1)
        cfg.setdefault(sec, {})[k] = val
    path = cfg.get("job", {}).get("config_file")
    toml = {}
    if path:
        try:
            with open(path, "rb") as f:
                toml = tomllib.load(f)
        except OSError:
            raise ConfigError(f"job.config_file={path!r}: cannot read") from None
    for sec, kv in cfg.items():
        toml.setdefault(sec, {}).update(kv)
    return toml


def offload_from(d: dict) -> Offload:
    o = Offload()
    for f in fields(Offload):
        if f.name in d:
            v = d[f.name]
            cur = getattr(o, f.name)
            try:
                if isinstance(cur, bool):
                    v = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes")
                elif isinstance(cur, int):
                    v = int(v)
                elif isinstance(cur, float):
                    v = float(v)
                elif isinstance(cur, list):
                    v = v if isinstance(v, list) else [x for x in str(v).split(",") if x]
            except ValueError:
                raise ConfigError(f"offload.{f.name}={v!r}: not a {type(cur).__name__}") from None
            setattr(o, f.name, v)
    o.validate()
    return o


def load_model_config(path: str):
    import transformers

    try:
        import fla  # noqa: F401  (registers FLA model types with AutoConfig)
    except ImportError:
        pass
    if not os.path.exists(path):
        raise ConfigError(f"model.config={path!r}: not found")
    cfg = transformers.AutoConfig.from_pretrained(path)
    if getattr(cfg, "_attn_implementation", None) in (None, "eager"):
        cfg._attn_implementation = "sdpa"
    return cfg


def plan_for(cfg: dict) -> tuple[Plan, ModelCosts, Offload]:
    off = offload_from(cfg.get("offload", {}))
    tr = cfg.get("training", {})
    mb = int(tr.get("local_batch_size", 1))
    seq = int(tr.get("seq_len", 2048))
    gb = int(tr.get("global_batch_size", -1) or -1)
    par = cfg.get("parallelism", {})
    world = 1
    for k in ("data_parallel_shard_degree", "data_parallel_replicate_degree"):
        world *= max(1, int(par.get(k, 1)))
    rounds = max(1, gb // (mb * world)) if gb > 0 else 1
    if off.plan != "auto":
        plan = Plan.load(off.plan)
        return plan, None, off
    mpath = cfg.get("model", {}).get("config")
    if not mpath:
        raise ConfigError("model.config: missing (path of the HF/FLA model config)")
    model = meta_model(load_model_config(mpath), dtype=getattr(__import__("torch"), off.compute_dtype))
    costs = measure_costs(model, mb, seq, loss_chunk_tokens=int(tr.get("loss_chunk_tokens", 0) or 0))
    if not off.profile:
        raise ConfigError("offload.profile: required without a GPU (path of a stored hardware profile JSON)")
    prof = load_profile(off.profile)
    gpu = gpu_budget_bytes(off.gpu_memory_gib, off.gpu_margin_gib, prof.gpu_total_bytes)
    host = host_budget_bytes(off.host_memory_gib, off.host_margin_gib)
    threads = off.cpu_threads or max(1, prof.cpu_cores - 1)
    dt = Dtypes(off.compute_dtype, off.master_dtype, off.grad_dtype, off.moment_dtype)
    depths = (off.prefetch_depth,) if off.prefetch_depth else (1, 2, 3)
    plan = solve(costs, prof, dt, gpu, host, mb, rounds, threads, depths, off.overrides, allow_offload=off.enable != "off",
                 world=world)
    if off.save_plan:
        plan.save(off.save_plan)
    return plan, costs, off


def main(argv: list[str] | None = None) -> int:
    try:
        plan, costs, off = plan_for(_parse(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        print(str(e), file=sys.stderr)
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
