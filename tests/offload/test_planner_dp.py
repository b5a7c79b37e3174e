"""The planner per data-parallel rank: shard bytes, gathered GPU buffers, collective times."""

from types import SimpleNamespace

import pytest

from flame.errors import ConfigError
from flame.offload import check_parallel_dims
from flame.offload.planner.block_costs import ModelCosts, UnitCosts
from flame.offload.planner.cost_model import (DEFAULT_COLLECTIVE_GBPS, Dtypes, collective_s, predict,
                                              static_gpu_bytes, unit_gpu_bytes, unit_host_bytes)
from flame.offload.planner.solver import solve
from test_planner import GiB, costs, prof  # noqa: F401 (costs: the module fixture)


def test_shard_bytes_by_hand():
    u = UnitCosts("b", "layer", 1001, {}, 0, 0, 0, 0, 0)  # odd: padded to 1002, shards of 501
    dt = Dtypes()  # bf16 compute, fp32 master/grads/moments (one micro-batch a step: bf16 host grads)
    assert unit_host_bytes(u, "stream", dt, world=2) == (501 * (2 + 2 + 4 + 8), 501 * (2 + 2))
    assert unit_host_bytes(u, "host_opt", dt, rounds=2, world=2) == (501 * (4 + 4 + 4 + 8), 501 * 4)
    # host_opt: the full gathered copy and full grad (padded) + the bf16 grad shard
    assert unit_gpu_bytes(u, "host_opt", dt, world=2) == 1002 * 2 * 2 + 501 * 2
    # + the fp32 accumulator of the shard when it accumulates on the GPU
    assert unit_gpu_bytes(u, "host_opt", dt, gpu_acc=True, world=2) == 1002 * 2 * 2 + 501 * 2 + 501 * 4
    assert unit_gpu_bytes(u, "stream", dt, world=2) == 501 * 2
    # "gpu" units stay replicated: as with one rank
    assert unit_gpu_bytes(u, "gpu", dt, world=2) == unit_gpu_bytes(u, "gpu", dt) == 1001 * (2 + 2 + 4 + 4 + 8)
    s = static_gpu_bytes([u, u], ["stream", "host_opt"], dt, depth=1, rounds=1, world=2)
    assert s["slots"] == 4 * 1002 * 2 and s["grad_slots"] == 2 * 1002 * 2
    assert s["shards"] == 2 * 501 * 2 and s["conversion"] == 0  # bf16 grads go to the host as they are
    two = static_gpu_bytes([u, u], ["stream", "host_opt"], Dtypes("float32", "float32", "bfloat16", "float32"),
                           depth=1, rounds=1, world=2)
    assert two["conversion"] == 2 * 501 * 2  # fp32 compute, bf16 grads: converted on the GPU in chunks
    assert s["compute"] == s["grads"] == 1002 * 2


def test_collective_time_by_hand():
    assert collective_s(2e9, 1, 100.0) == 0.0
    assert collective_s(2e9, 2, 100.0) == pytest.approx(0.5 * 2e9 / 100e9)
    assert collective_s(2e9, 4, 0.0) == pytest.approx(0.75 * 2e9 / (DEFAULT_COLLECTIVE_GBPS * 1e9))


def _one_layer(numel, mode):
    lay = UnitCosts("l", "layer", numel, {}, 1e12, 0.0, 0, 0, 0)
    out = UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)
    return ModelCosts(1, 1, [lay, out], "L")


def test_predict_two_ranks_by_hand():
    """One streamed layer of 1e9 params on 2 ranks: half the H2D, D2H and CPU work per rank, an
    all-gather after the H2D and a reduce-scatter with the backward's compute."""
    p = prof(allgather_gbps=200.0, reducescatter_gbps=100.0)
    pr = predict(_one_layer(10**9, "stream"), p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15, world=2)
    n = 5e8
    cpu = n / 4e9 + n * 12 / 20e9  # torch's AdamW + the compute copy and grad conversions
    h2d = n * 2 / 50e9
    ag = 0.5 * 2e9 / 200e9  # the full bf16 layer gathered
    fwd, bwd = 1e12 / 500e12, 2e12 / 500e12
    rs = 0.5 * 2e9 / 100e9
    d2h = n * 2 / (70e9 * 0.5)  # bf16 grads
    assert pr.step_s == pytest.approx(cpu + h2d + ag + fwd + bwd + rs + d2h)
    assert pr.h2d_bytes == n * 2 and pr.d2h_bytes == n * 2
    # + the torch AdamW's fp32 grad scratch (the largest unit's shard)
    assert (pr.host_bytes, pr.pinned_bytes) == (n * 16 + n * 4, n * 4)
    assert pr.static_gpu["slots"] == 4 * 10**9 * 2 and pr.static_gpu["shards"] == n * 2
    assert pr.static_gpu["conversion"] == 0
    # without measured bandwidths: the documented default for both collectives
    pd = predict(_one_layer(10**9, "stream"), prof(), Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15, world=2)
    assert pd.step_s == pytest.approx(cpu + h2d + fwd + bwd + d2h + 2 * 0.5 * 2e9 / (DEFAULT_COLLECTIVE_GBPS * 1e9))


def test_replicated_gpu_layer_pays_one_all_reduce_and_world1_unchanged():
    p = prof(allgather_gbps=200.0, reducescatter_gbps=100.0)
    c = _one_layer(10**9, "gpu")
    one = predict(c, p, Dtypes(), ["gpu"], ["keep"], "gpu", 1, 1, 1, 15)
    assert predict(c, p, Dtypes(), ["gpu"], ["keep"], "gpu", 1, 1, 1, 15, world=1) == one
    two = predict(c, p, Dtypes(), ["gpu"], ["keep"], "gpu", 1, 1, 1, 15, world=2)
    assert two.step_s - one.step_s == pytest.approx(0.5 * 4e9 / 100e9 + 0.5 * 4e9 / 200e9)  # fp32 grads
    assert two.gpu_bytes == one.gpu_bytes and two.host_bytes == one.host_bytes == 0


def test_solver_plans_per_rank(costs):  # noqa: F811
    """A host budget below one rank's full state but above half of it: infeasible alone,
    feasible on 2 ranks, the plan records its world and fits the per-rank budget."""
    p, dt = prof(), Dtypes()
    over = ["weights[*]=host", "outer=host_opt"]
    alone = solve(costs, p, dt, 48 * GiB, 64 * GiB, 2, 1, 15, overrides=over)
    host = int(0.6 * alone.predicted["peak_host_bytes"])
    with pytest.raises(ConfigError, match="host"):
        solve(costs, p, dt, 48 * GiB, host, 2, 1, 15, overrides=over)
    two = solve(costs, p, dt, 48 * GiB, host, 2, 1, 15, overrides=over, world=2)
    assert two.world == 2 and two.predicted["peak_host_bytes"] <= host
    assert two.predicted["peak_host_bytes"] == pytest.approx(alone.predicted["peak_host_bytes"] / 2, rel=1e-3)
    assert alone.world == 1


@pytest.mark.parametrize("attr,option", [("tp", "tensor_parallel_degree"), ("pp", "pipeline_parallel_degree"),
                                         ("cp", "context_parallel_degree")])
def test_only_data_parallelism_composes(attr, option):
    dims = dict(tp=1, pp=1, cp=1, world_size=4)
    check_parallel_dims(SimpleNamespace(**dims))
    dims[attr] = 2
    with pytest.raises(ConfigError, match=f"parallelism.{option} 2"):
        check_parallel_dims(SimpleNamespace(**dims))


def test_cli_plans_per_rank(tmp_path, capsys):
    from transformers import LlamaConfig

    from flame.config.manager import FlameConfigManager
    from flame.offload import calculator as cli
    from flame.offload.planner.hardware import save

    save(prof(), str(tmp_path / "prof.json"))
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, vocab_size=1000)
    cfg.save_pretrained(tmp_path / "m")
    args = ["--model.config", str(tmp_path / "m"), "--training.seq_len", "512", "--training.global_batch_size", "8",
            "--training.batch_size", "1", "--offload.profile", str(tmp_path / "prof.json"),
            "--offload.overrides", "weights[*]=host"]
    one, _, _ = cli.plan_for(FlameConfigManager().parse_args(args))
    two, _, _ = cli.plan_for(FlameConfigManager().parse_args(args + ["--parallelism.data_parallel_shard_degree", "2"]))
    assert (one.world, one.rounds, two.world, two.rounds) == (1, 8, 2, 4)
    assert two.predicted["peak_host_bytes"] < one.predicted["peak_host_bytes"]
    assert cli.main(args + ["--parallelism.data_parallel_shard_degree", "2"]) == 0
    assert "sharded over 2 ranks" in capsys.readouterr().out
