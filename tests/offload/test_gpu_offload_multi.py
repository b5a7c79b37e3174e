"""The engine sharded over 2 GPUs (NCCL, spawned processes; skipped without 2 CUDA devices):
the numbers of one process on the global batch, per-rank host shards in pinned memory, NCCL
all-gathered checkpoints under plain names.

    python -m pytest -q tests/offload/test_gpu_offload_multi.py
"""

import os

import pytest
import torch
import torch.distributed as dist

from flame.offload.runtime.engine import OffloadEngine
from test_engine_cpu import F32, MIXED, batches, plan
from test_engine_dp import ACTS, LR, MODES, STEPS, WORLD, _ref, _train, spawn_ranks, tiny_odd

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
CASES = [("r1", 1, (), False, F32), ("r2_gpu_acc", 2, (True,) * 4, True, F32), ("r2_host_acc", 2, (), False, F32),
         ("r1_bf16", 1, (), False, MIXED)]


def _engine(model, p, dev):
    return OffloadEngine(model, p, dev, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                         no_decay={"model.norm.weight"})


def _worker(rank, init, out):
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=WORLD, device_id=dev)
    res = {}
    for name, rounds, accs, outer_acc, dts in CASES:
        model = tiny_odd(seed=3)
        eng = _engine(model, plan(MODES, ACTS, "host_opt", rounds, accs=accs, outer_acc=outer_acc, dtypes=dts), dev)
        losses, norms = _train(model, eng, batches(STEPS, rounds, seed=4), rounds, rank, WORLD, dev)
        sd = eng.state_dict()
        host = [(u.numel, u.shard_numel, u.weights.host.numel(), u.optimizer.master.numel(), len(eng.pinned.ptrs) > 0)
                for u in eng.units if u.mode != "gpu"]
        res[name] = {"losses": losses, "norms": norms, "host": host, "report": eng.memory_report()}
        if rank == 0:
            res[name]["sd"] = {k: {n: v.cpu() for n, v in d.items() if torch.is_tensor(v)} for k, d in sd.items()}
        eng.close()
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gpu_runs(tmp_path_factory):
    return spawn_ranks(_worker, tmp_path_factory.mktemp("dpgpu"))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_two_gpus_match_one_process(gpu_runs, case):
    name, rounds, accs, outer_acc, dts = case
    b = batches(STEPS, rounds, seed=4)
    if dts is F32:
        torch.backends.cuda.matmul.allow_tf32 = False
        want, want_norms, _, _ = _ref(tiny_odd(seed=3).cuda(), [[x.cuda() for x in s] for s in b], rounds)
        for r in range(WORLD):
            assert gpu_runs[r][name]["losses"] == pytest.approx(want, rel=1e-4, abs=1e-5)
            assert gpu_runs[r][name]["norms"] == pytest.approx(want_norms, rel=1e-3)
        sd = gpu_runs[0][name]["sd"]["model"]
        ref = tiny_odd(seed=3)
        _ref(ref, b, rounds)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v, rtol=1e-3, atol=1e-4)
    else:  # bf16: one-GPU engine, same dtypes (bf16 partial grads summed: drift, see test_engine_dp)
        m = tiny_odd(seed=3)
        dev = torch.device("cuda", 0)
        eng = _engine(m, plan(MODES, ACTS, "host_opt", rounds, dtypes=dts), dev)
        want, want_norms = _train(m, eng, b, rounds, 0, 1, dev)
        eng.close()
        for r in range(WORLD):
            assert gpu_runs[r][name]["losses"] == pytest.approx(want, abs=0.035)
            assert gpu_runs[r][name]["norms"][0] == pytest.approx(want_norms[0], rel=1e-2)


def test_each_gpu_rank_holds_a_pinned_shard(gpu_runs):
    for r in range(WORLD):
        for numel, sn, w_host, master, pinned in gpu_runs[r]["r1"]["host"]:
            assert sn == -(-numel // WORLD) and w_host == master == sn and pinned
        rep = gpu_runs[r]["r1"]["report"]
        assert rep["shards"] > 0
