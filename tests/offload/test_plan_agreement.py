"""2 gloo ranks: every rank runs rank 0's plan, and the collective bandwidths are measured alike."""

import math

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flame.offload import agree_on_plan
from flame.offload.measure.hardware import measure_collectives
from flame.offload.planner.plan import Plan

WORLD = 2


def _plan(rank: int) -> Plan:
    # the ranks' own plans differ (as per-rank measurements can make them)
    modes = ["stream", "gpu"] if rank == 0 else ["gpu", "gpu"]
    return Plan(modes, ["recompute", "keep"], "gpu", 1 + rank, 1, 64, 2, 1,
                {"compute": "float32", "master": "float32", "grad": "float32", "moment": "float32"},
                1 << 30, 1 << 30, {"step_s": 1.0 + rank})


def _worker(rank, init, out):
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        plan = agree_on_plan(_plan(rank))
        ag, rs = measure_collectives("cpu", nbytes=1 << 20, iters=2)
        torch.save({"plan": (plan.layer_modes, plan.prefetch_depth, plan.predicted), "bw": (ag, rs)},
                   f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_ranks_agree_on_rank0_plan_and_bandwidths(tmp_path):
    out = str(tmp_path / "res")
    mp.spawn(_worker, args=(str(tmp_path / "init"), out), nprocs=WORLD, join=True)
    res = [torch.load(f"{out}.{r}") for r in range(WORLD)]
    want = (["stream", "gpu"], 1, {"step_s": 1.0})
    assert all(r["plan"] == want for r in res)
    assert res[0]["bw"] == res[1]["bw"]
    assert all(math.isfinite(b) and b > 0 for b in res[0]["bw"])


def test_single_process_keeps_its_plan():
    p = _plan(1)
    assert not dist.is_initialized() and agree_on_plan(p) is p
