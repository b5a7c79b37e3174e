"""The planner with frozen parameters (a LoRA base): no gradient, master copy, moments, weight-gradient
matmul, grad traffic or optimizer work for them; arithmetic by hand, and the costs of a LoRA model."""

import pytest

from flame.offload.planner.block_costs import ModelCosts, UnitCosts
from flame.offload.planner.cost_model import Dtypes, predict, unit_gpu_bytes, unit_host_bytes
from tests.offload.test_planner import prof


def test_frozen_parameters_take_their_compute_copy_only():
    u = UnitCosts("b", "layer", 1000, {}, 0, 0, 0, 0, 0, frozen_numel=900)
    dt = Dtypes()  # bf16 compute, float32 grads, master and moments
    # gpu: compute copy of all; grad (compute dtype), master, grad accumulator, moments of the 100 trainable
    assert unit_gpu_bytes(u, "gpu", dt) == 1000 * 2 + 100 * (2 + 4 + 4 + 8)
    assert unit_gpu_bytes(u, "host_opt", dt) == 1000 * 2 + 100 * 2
    assert unit_host_bytes(u, "stream", dt) == (1000 * 2 + 100 * (2 + 4 + 8), 1000 * 2 + 100 * 2)
    assert unit_host_bytes(u, "stream", dt, rounds=2) == (1000 * 2 + 100 * (2 + 4 + 4 + 8), 1000 * 2 + 100 * 2)
    # sharded over 4 ranks: the grad shard and its accumulator are the trainable shard's
    gpu_acc = unit_gpu_bytes(u, "stream", dt, gpu_acc=True, world=4)
    assert gpu_acc == 25 * 4 + 25 * 2
    frozen = UnitCosts("b", "layer", 1000, {}, 0, 0, 0, 0, 0, frozen_numel=1000)
    assert unit_host_bytes(frozen, "stream", dt) == (1000 * 2, 1000 * 2)
    assert unit_gpu_bytes(frozen, "gpu", dt) == 1000 * 2


def test_a_frozen_streamed_layer_by_hand():
    # one frozen layer streamed: forward = h2d + compute; backward = dX only, no grads sent, no CPU step
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 0, 0, 0, frozen_numel=10**9)
    out = UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)
    pr = predict(ModelCosts(1, 1, [lay, out], "L"), prof(), Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15)
    h2d, fwd = 2e9 / 50e9, 1e12 / 500e12
    assert pr.phase_s == pytest.approx([h2d + fwd, fwd, 0.0])
    assert (pr.h2d_bytes, pr.d2h_bytes, pr.cpu_s) == (2e9, 0, 0.0)
    assert pr.host_bytes == 2e9 and pr.pinned_bytes == 2e9


def test_costs_of_a_lora_model_count_its_frozen_base():
    from flame.lora import Lora, apply_lora
    from flame.models import build
    from flame.offload.measure.tracing import measure_costs
    from tests.trainer.helpers import TINY_LLAMA

    model = build.build_meta_model(build.load_model_config(TINY_LLAMA))
    apply_lora(model, Lora(rank=4))
    costs = measure_costs(model, 1, 32)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert sum(u.trainable_numel for u in costs.units) == adapters > 0
    assert costs.outer.frozen_numel == costs.outer.numel  # embeddings, norm and head stay frozen
    for u in costs.layers:
        assert 0 < u.trainable_numel < u.numel
        assert u.bwd_gemm_flops < 2 * u.fwd_gemm_flops


def test_the_calculator_plans_lora_on_an_8b_base_at_16_gib(capsys):
    """Llama-3-8B's shape with rank-16 adapters at offload.gpu_memory_gib 16 (the bundled H100
    profile): a plan within the budget, every block a frozen base, the adapters with the outer unit."""
    import os

    from flame.config.manager import FlameConfigManager
    from flame.offload.calculator import plan_for
    from tests.trainer.helpers import ROOT

    job = FlameConfigManager().parse_args([
        "--job.config_file", os.path.join(ROOT, "flame/models/fla.toml"),
        "--model.config", os.path.join(ROOT, "benchmarks/configs/llama3_8B.json"), "--training.batch_size", "1",
        "--training.seq_len", "8192", "--lora.rank", "16", "--offload.gpu_memory_gib", "16",
        "--offload.host_memory_gib", "64"])
    plan, costs, _ = plan_for(job)
    assert plan.predicted["peak_gpu_bytes"] <= plan.gpu_budget_bytes <= 16 * 2**30
    assert plan.offloads and all(u.trainable_numel == 0 and u.numel > 200e6 for u in costs.layers)
    # rank 16 on q, k, v, o, gate, up, down of 32 blocks: 16 x (in + out) each
    per_block = 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert costs.outer.trainable_numel == 32 * per_block
