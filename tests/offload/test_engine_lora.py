"""LoRA on the offload engine (CPU: 'GPU' and host both CPU): frozen base units hold their compute
copy only, the adapters train in one resident unit; the numbers are the plain LoRA run's."""

import copy
import os

import pytest
import torch

from flame.lora import Lora, apply_lora, is_adapter_key
from flame.lora.layer import init_adapters
from tests.offload.test_engine_cpu import F32, batches, loss_of, plan, run_engine, run_ref, tiny


def lora_tiny(seed=0, tie=False, build=tiny):
    """The tiny Llama (`build`) with rank-4 adapters on every projection, B moved off zero (a zero
    B would hide a wrong grad of A in the first step)."""
    model = build(seed, tie)
    apply_lora(model, Lora(rank=4, alpha=8.0))
    init_adapters(model, seed)
    gen = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


PLANS = {
    "stream": (["stream"] * 4, ["keep", "recompute", "keep", "recompute"], "gpu"),
    "host_opt": (["host_opt"] * 4, ["recompute", "keep", "selective", "keep"], "host_opt"),
    "gpu": (["gpu"] * 4, ["keep"] * 4, "gpu"),
    "mixed": (["gpu", "host_opt", "stream", "stream"], ["keep", "recompute", "offload", "recompute"], "stream"),
}


@pytest.mark.parametrize("rounds", [1, 2])
@pytest.mark.parametrize("name", list(PLANS))
def test_lora_engine_matches_plain_lora_run(name, rounds):
    """Losses and every weight after 4 steps equal the plain run's (the tolerance of the engine's
    other CPU tests: its fused AdamW against torch's default one); the base is bit-identical, only the adapters have optimizer state, and the frozen units hold no
    grads, master or moments."""
    ref = lora_tiny(tie=rounds == 2)
    mod = copy.deepcopy(ref)
    base = {k: v.clone() for k, v in ref.state_dict().items() if not is_adapter_key(k)}
    b = batches(4, rounds)
    want = run_ref(ref, b, rounds, max_norm=0.5)
    modes, acts, outer = PLANS[name]
    got, eng = run_engine(mod, plan(modes, acts, outer, rounds, accs=[rounds > 1] * 4, outer_acc=rounds > 1), b,
                          rounds, max_norm=0.5)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    sd = eng.model_state_dict()
    assert set(sd) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for k, v in base.items():
        assert torch.equal(sd[k], v), k
    adapters = {n for n, p in ref.named_parameters() if p.requires_grad}
    opt = eng.optimizer_state_dict()
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in opt if k.startswith("state.")} == adapters
    frozen = [u for u in eng.units if u.frozen]
    assert len(frozen) == 5 and all(u.optimizer is None and u.grads.buffer is None and u.grads.accumulator is None
                                    for u in frozen)
    assert [u.name for u in eng.units if not u.frozen] == ["trainable"]
    assert all(not p.requires_grad for u in frozen for _, p in u.params)
    eng.close()


@pytest.mark.parametrize("dtypes", [F32, {"compute": "bfloat16", "master": "float32", "grad": "float32", "moment": "float32"}])
def test_lora_memory_report_is_what_the_planner_counts(dtypes):
    """The engine's device memory with a frozen base, category by category, is the cost model's
    for the costs the planner solves with (adapters counted with the outer unit)."""
    from flame.offload.measure.tracing import measure_costs
    from flame.offload.planner.block_costs import adapters_with_outer
    from flame.offload.planner.cost_model import Dtypes, static_gpu_bytes

    mod = lora_tiny()
    costs = adapters_with_outer(measure_costs(copy.deepcopy(mod), 2, 16))
    assert all(u.trainable_numel == 0 for u in costs.layers)
    assert costs.outer.trainable_numel == sum(p.numel() for p in mod.parameters() if p.requires_grad)
    p = plan(["gpu", "host_opt", "stream", "stream"], ["keep"] * 4, "gpu", depth=2, dtypes=dtypes)
    _, eng = run_engine(mod, p, batches(1, 1), 1, max_norm=1.0)
    rep = eng.memory_report()
    want = static_gpu_bytes([costs.outer] + costs.layers, [p.outer_mode] + p.layer_modes, Dtypes(**dtypes),
                            p.prefetch_depth, 1)
    assert {k: rep[k] for k in want} == want
    assert rep["grad_slots"] == 0  # frozen streamed blocks get no grad slots
    eng.close()


def _dp_worker(rank, init, out):
    import torch.distributed as dist

    from tests.offload.test_engine_dp import ACTS, MODES, WORLD, _engine, _train, tiny_odd

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = lora_tiny(3, build=tiny_odd)
    eng = _engine(model, plan(MODES, ACTS, "host_opt", 2, accs=(False, True, False, True)))
    losses, norms = _train(model, eng, batches(3, 2, seed=4), 2, rank, WORLD)
    sd = eng.state_dict()  # a collective: every rank
    sharded = [u.weights.host.numel() == u.shard_numel < u.numel for u in eng.units if u.frozen and u.mode != "gpu"]
    torch.save({"losses": losses, "norms": norms, "sd": sd, "sharded": sharded}, os.path.join(out, f"rank{rank}.pt"))
    eng.close()
    dist.destroy_process_group()


def test_lora_on_two_ranks_matches_one_process_on_the_global_batch(tmp_path):
    """The frozen base sharded over 2 data-parallel ranks (odd sizes: padded shards), the adapters
    replicated: the plain LoRA run's losses, norms and weights on the global batch."""
    from tests.offload.test_engine_dp import _ref, spawn_ranks, tiny_odd

    ranks = spawn_ranks(_dp_worker, tmp_path)
    ref = lora_tiny(3, build=tiny_odd)
    want, want_norms, _, _ = _ref(ref, batches(3, 2, seed=4), 2)
    for r in ranks:
        assert r["sharded"] and all(r["sharded"])
        assert r["losses"] == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert r["norms"] == pytest.approx(want_norms, rel=1e-5, abs=1e-6)
        assert set(r["sd"]["model"]) == set(ref.state_dict())
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(r["sd"]["model"][k], v, rtol=1e-4, atol=1e-5, msg=k)
        assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in r["sd"]["optimizer"] if k.startswith("state.")} == \
            {n for n, p in ref.named_parameters() if p.requires_grad}


def test_block_calibration_times_the_block_with_its_adapters():
    """The GPU block calibration builds its one block with the run's adapters (a frozen base: no
    weight grads in the timed backward, as in the LoRA costs); a target it cannot place is the
    apply_lora error, so the adapters are really put on."""
    from flame.errors import ConfigError
    from flame.offload.measure.calibration import measure_block_fudges
    from flame.offload.measure.tracing import measure_costs
    from tests.offload.test_planner import prof

    m = lora_tiny()
    costs = measure_costs(m, 2, 16)
    cal = measure_block_fudges(m.config, {2: costs}, prof(), 16, torch.float32, "cpu", lora=Lora(rank=4))[2]
    assert cal["fudge"] > 0 and cal["measured_fwd_bwd_s"] > 0
    with pytest.raises(ConfigError, match="no_such_proj"):
        measure_block_fudges(m.config, {2: costs}, prof(), 16, torch.float32, "cpu", lora=Lora(rank=4, targets=["no_such_proj"]))


def _engine(model, modes):
    from flame.offload.runtime.engine import OffloadEngine

    return OffloadEngine(model, plan(modes, ["keep", "recompute", "keep", "keep"], "host_opt"), torch.device("cpu"),
                         lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_lora_engine_checkpoint_resumes_exactly_in_another_plan():
    """The engine's state dict after 2 steps (every key, adapter-only optimizer state) loaded into
    another model (other init) under another plan continues as the uninterrupted run."""
    from tests.offload.test_engine_cpu import run_engine_continue

    b = batches(4, 1, seed=5)
    first = ["stream", "host_opt", "stream", "gpu"]
    model = lora_tiny()
    whole, eng = run_engine_continue(_engine(model, first), model, b)
    eng.close()
    model = lora_tiny()
    half, eng = run_engine_continue(_engine(model, first), model, b[:2])
    sd = eng.state_dict()
    eng.close()
    assert not any(k.startswith("state.") and not k.split(".", 1)[1].rsplit(".", 1)[0].endswith(("lora_A", "lora_B"))
                   for k in sd["optimizer"])
    other = lora_tiny(seed=9)
    eng = _engine(other, ["gpu", "stream", "host_opt", "stream"])
    eng.load_state_dict(sd)
    rest, _ = run_engine_continue(eng, other, b[2:])
    eng.close()
    assert half + rest == whole
