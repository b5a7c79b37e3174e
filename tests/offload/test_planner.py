"""Planner properties on CPU: budgets, monotonicity, infeasibility, plan files, cost arithmetic."""

import dataclasses
import math
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flame.errors import ConfigError
from flame.offload.config import Offload
from flame.offload.measure.tracing import measure_costs, meta_model
from flame.offload.planner.budgets import FRAGMENTATION_HEADROOM
from flame.offload.planner.block_costs import ModelCosts, UnitCosts
from flame.offload.planner.cost_model import Dtypes, _flow, predict, unit_gpu_bytes, unit_host_bytes
from flame.offload.planner.hardware import HardwareProfile, load, save
from flame.offload.planner.plan import Plan
from flame.offload.planner.solver import describe, solve, spread

GiB = 1024**3


def prof(**kw):
    # a synthetic profile for arithmetic tests (not a measurement of any machine)
    d = dict(source="synthetic test profile", device_name="test", gpu_total_bytes=80 * GiB, host_total_bytes=128 * GiB,
             cpu_cores=16, gemm_tflops={"default": 500.0}, attn_tflops=250.0, hbm_gbps=2000.0, h2d_gbps=50.0,
             d2h_gbps=50.0, duplex_gbps=70.0, pageable_h2d_gbps=5.0, host_memcpy_gbps=10.0,
             cpu_adam_gparams={"1": 0.5, "15": 4.0}, gpu_adam_gparams=80.0, pin_s_per_gib=0.8)
    d.update(kw)
    return HardwareProfile(**d)


def small_llama() -> LlamaConfig:
    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=32000, use_cache=False)  # as in training
    cfg._attn_implementation = "sdpa"
    return cfg


@pytest.fixture(scope="module")
def costs():
    return measure_costs(meta_model(small_llama()), 2, 2048)


def test_costs_measured_from_model(costs):
    l0 = costs.layers[0]
    d, f, t = 1024, 2816, 2 * 2048
    numel = 2 * d * d + 2 * d * (d // 2) + 3 * d * f + 2 * d
    assert l0.numel == numel
    assert l0.fwd_gemm_flops == pytest.approx(2 * t * (numel - 2 * d))
    assert l0.fwd_attn_flops == pytest.approx(4 * 2 * 8 * 2048 * 2048 * 128 * 0.5)
    assert l0.act_recompute_bytes == t * d * 2  # bf16 block input
    assert l0.act_keep_bytes > 10 * l0.act_recompute_bytes
    assert costs.outer.numel == 2 * 32000 * d + d
    assert ModelCosts.from_dict(costs.to_dict()) == costs


def test_flow_shop_arithmetic():
    # two jobs: h2d 1, compute 2 each; unlimited depth: 1 + 2 + 2 = 5
    assert _flow([(0, 1, 2, 0), (0, 1, 2, 0)], 4) == 5
    # copy-bound: h2d 3, compute 1: 3 + 3 + 1 = 7
    assert _flow([(0, 3, 1, 0), (0, 3, 1, 0)], 4) == 7
    # d2h tail: compute 1 then d2h 2 for each: 1, 2 -> d2h ends 3 then 5
    assert _flow([(0, 0, 1, 2), (0, 0, 1, 2)], 1) == 5
    # depth 0: the copy of job 1 waits for compute of job 0: 1 + 2 + 1 + 2 = 6
    assert _flow([(0, 1, 2, 0), (0, 1, 2, 0)], 0) == 6
    # a CPU stage in front: 2 + max(...)
    assert _flow([(2, 1, 1, 0)], 1) == 4
    # host adds after each D2H, on one CPU worker: compute 1, d2h 1, add 3 each -> adds end 5, 8
    assert _flow([(0, 0, 1, 1, 3), (0, 0, 1, 1, 3)], 1) == 8
    # adds shorter than the copies hide behind them: d2h ends 3, the last add 3.5
    assert _flow([(0, 0, 1, 1, 0.5), (0, 0, 1, 1, 0.5)], 1) == 3.5


def test_host_accumulation_charged_per_micro_batch(costs):
    """Host accumulation costs a CPU pass per micro-batch (copy, then read-add-write): a step of R
    rounds costs at least R x the accumulate time of the largest host unit's adds in the backward."""
    p, dt, n = prof(), Dtypes(), len(costs.layers)
    modes, acts = ["stream"] * n, ["recompute"] * n
    slow = dataclasses.replace(p, host_memcpy_gbps=p.host_memcpy_gbps / 100)
    for rounds in (2, 4):
        fast_t = predict(costs, p, dt, modes, acts, "gpu", 1, 2, rounds, 15).step_s
        slow_t = predict(costs, slow, dt, modes, acts, "gpu", 1, 2, rounds, 15).step_s
        # bf16 staged, fp32 accumulator: convert into scratch (2 + 4) then add (4 + 4 + 4) bytes/param
        adds = sum(u.numel for u in costs.layers) * (2 + 4 + 4 + 4 + 4) / (slow.host_memcpy_gbps * 1e9)
        assert slow_t > fast_t and slow_t >= (rounds - 1) * adds


def test_unit_bytes_by_hand():
    u = UnitCosts("b", "layer", 1000, {}, 0, 0, 0, 0, 0)
    dt = Dtypes()
    assert unit_gpu_bytes(u, "gpu", dt) == 1000 * (2 + 2 + 4 + 4 + 8)
    assert unit_gpu_bytes(u, "host_opt", dt) == 1000 * 4
    assert unit_gpu_bytes(u, "stream", dt) == 0
    # one micro-batch a step: the grads stay in bf16 (host_grad_dtype); two: summed in fp32
    assert unit_host_bytes(u, "stream", dt) == (1000 * (2 + 2 + 4 + 8), 1000 * (2 + 2))
    assert unit_host_bytes(u, "stream", dt, rounds=2) == (1000 * (4 + 4 + 4 + 8), 1000 * 4)
    assert unit_host_bytes(u, "stream", dt, rounds=2, gpu_acc=True) == (1000 * (2 + 4 + 4 + 8), 1000 * (2 + 4))
    bf = Dtypes("bfloat16", "bfloat16", "bfloat16", "bfloat16")
    assert unit_gpu_bytes(u, "gpu", bf) == 1000 * (2 + 2 + 0 + 0 + 4)


def test_predict_by_hand():
    # one layer streamed, no attention: forward = cpu + h2d + compute, backward = compute + d2h
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 0, 0, 0)
    out = UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)
    c = ModelCosts(1, 1, [lay, out], "L")
    p = prof()
    pr = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15)
    # torch's AdamW + the fp32 -> bf16 compute copy and the bf16 grads -> fp32 (6 bytes each at 2x memcpy)
    cpu = 1e9 / 4e9 + 1e9 * (6 + 6) / 20e9
    h2d = 2e9 / 50e9
    fwd = 1e12 / 500e12
    bwd = 2e12 / 500e12
    d2h = 2e9 / (70e9 * 0.5)  # bf16 grads (one micro-batch a step: host_grad_dtype)
    # the only layer stays in its slot for the backward: no refetch
    assert pr.step_s == pytest.approx(cpu + h2d + fwd + bwd + d2h)
    # the phases: forward, backward (one round), GPU optimizer (no GPU units here)
    assert pr.phase_s == pytest.approx([cpu + h2d + fwd, bwd + d2h, 0.0])
    assert pr.h2d_bytes == 2e9 and pr.d2h_bytes == 2e9
    # the outer's forward (head + loss) runs after the last block, not under the layer's CPU step
    # and copy: it adds to the forward phase in full
    c.units[1] = UnitCosts("outer", "outer", 0, {}, 1e11, 0.0, 0, 0, 0)
    pr = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15)
    assert pr.phase_s[0] == pytest.approx(cpu + h2d + fwd + 1e11 / 500e12)


def test_peak_by_phase_by_hand():
    """The GPU peak above static memory is the larger of: the end of the forward (every activation +
    the loss's transient) and each block's backward (the inputs of it and the blocks before it +
    its transient; the outer's and later blocks' activations are freed by then)."""
    from flame.offload.planner.cost_model import RUNTIME_OVERHEAD_BYTES, predict_memory

    mb = 2**20
    # (numel, act_keep, act_recompute, max_saved): a recomputed block's transient is its saved
    # bytes + twice its largest saved tensor
    lay = [UnitCosts(f"l{i}", "layer", 0, {}, 0.0, 0.0, 100 * mb, 10 * mb, 20 * mb) for i in range(3)]
    out = UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 50 * mb, 50 * mb, 30 * mb)
    c = ModelCosts(1, 1, lay + [out], "L", {"loss_chunk_transient_bytes": 70 * mb})

    def peak(acts, chunk=70 * mb):
        c.extra["loss_chunk_transient_bytes"] = chunk
        m = predict_memory(c, Dtypes(), ["stream"] * 3, acts, "gpu", 1, 1, 1)
        return (m.gpu_bytes - sum(m.static_gpu.values()) - RUNTIME_OVERHEAD_BYTES) / mb

    # all recomputed: forward end 3*10 + 50 + max(70, 2*30) = 150; last block's backward
    # 3*10 + (100 + 2*20) = 170
    assert peak(["recompute"] * 3) == pytest.approx(170)
    # a loss transient of 200: the forward end binds, 30 + 50 + 200
    assert peak(["recompute"] * 3, 200 * mb) == pytest.approx(280)
    # all kept: forward end 300 + 50 + 70 = 420; last backward 300 + 40 = 340
    assert peak(["keep"] * 3) == pytest.approx(420)
    # the first block kept, the others recomputed: forward end 100 + 20 + 50 + 70 = 240; last
    # block's backward 120 + 140 = 260
    assert peak(["keep", "recompute", "recompute"]) == pytest.approx(260)
    # a measured backward peak replaces the estimate
    for u in lay:
        u.bwd_peak_bytes = 60 * mb
    assert peak(["recompute"] * 3) == pytest.approx(150)  # 30 + 60 < forward end 150


def test_cpu_adam_rate_between_measured_thread_counts_and_shared_by_ranks():
    p = prof(cpu_adam_gparams={"1": 0.5, "16": 3.5, "32": 5.0})
    rate = p.cpu_adam_rate
    assert rate(16) == pytest.approx(3.5e9)  # a measured count: its rate
    assert rate(15) == pytest.approx(0.5e9 + 3.0e9 * 14 / 15)  # between 1 and 16, not the 1-thread rate
    assert rate(24) == pytest.approx(3.5e9 + 1.5e9 * 8 / 16)
    assert rate(64) == pytest.approx(5.0e9)  # beyond the measurements: no gain assumed
    assert prof(cpu_adam_gparams={"4": 2.0}).cpu_adam_rate(2) == pytest.approx(1.0e9)
    # two ranks of 15 threads each share the memory bandwidth of 30 threads
    assert rate(15, node_ranks=2) == pytest.approx(rate(30) / 2)
    assert rate(15, node_ranks=1) == rate(15)
    per_rank = [rate(7, node_ranks=n) for n in (1, 2, 4)]
    assert per_rank == sorted(per_rank, reverse=True)  # more ranks sharing: never faster per rank


def test_cpu_adam_rate_of_the_states_dtype():
    p = prof(cpu_adam_gparams={"1": 0.5, "16": 4.0}, cpu_adam_bf16_gparams={"1": 0.8, "16": 6.0})
    assert p.cpu_adam_rate(16) == pytest.approx(4.0e9)
    assert p.cpu_adam_rate(16, dtype="bfloat16") == pytest.approx(6.0e9)
    assert p.cpu_adam_rate(8, node_ranks=2, dtype="bfloat16") == pytest.approx(6.0e9 / 2)
    # a profile stored before the bf16 rate was measured: the fp32 rate
    assert prof(cpu_adam_gparams={"16": 4.0}).cpu_adam_rate(16, dtype="bfloat16") == pytest.approx(4.0e9)
    # the cost model takes the master dtype's rate: bf16 states make the CPU part 1.5x faster here
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 0, 0, 0)
    c = ModelCosts(1, 1, [lay, UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)], "L")
    bf = Dtypes("bfloat16", "bfloat16", "bfloat16", "bfloat16")
    f32_cpu = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 16).cpu_s
    bf_cpu = predict(c, p, bf, ["stream"], ["keep"], "gpu", 1, 1, 1, 16).cpu_s
    # AdamW + the new bf16 compute copy of the fp32 master (read 4, write 2 bytes/param, at twice
    # the memcpy rate: it counts bytes copied, each read and written) and the bf16 grads converted
    # to fp32 for torch's AdamW (read 2, write 4)
    assert f32_cpu == pytest.approx(10**9 / 4.0e9 + 10**9 * (4 + 2 + 2 + 4) / 20e9)
    assert bf_cpu == pytest.approx(10**9 / 6.0e9)


def test_stored_profiles_of_other_versions_load(tmp_path):
    """Without the bf16 rate (before 2026-11-23): the fp32 rate for bf16 states. With the retired
    H2D load factor: dropped. Any other unknown field: the one-line profile error."""
    import json

    d = dataclasses.asdict(prof())
    d.pop("cpu_adam_bf16_gparams")
    path = tmp_path / "old.json"
    path.write_text(json.dumps(d))
    p = load(str(path))
    assert p.cpu_adam_bf16_gparams == {} and p.cpu_adam_rate(15, dtype="bfloat16") == pytest.approx(4.0e9)
    path.write_text(json.dumps(dict(d, cpu_adam_under_h2d={"float32": 1.2})))
    assert load(str(path)).cpu_adam_rate(15) == pytest.approx(4.0e9)
    path.write_text(json.dumps(dict(d, gemm_flops_typo=1.0)))
    with pytest.raises(ConfigError, match="not a hardware profile"):
        load(str(path))


@pytest.mark.parametrize("content, why", [
    ([1, 2], "a JSON object expected, got list"),
    (dict(h2d_gbps="fast"), "h2d_gbps='fast': expected float"),
    (dict(cpu_cores=None), "cpu_cores=None: expected int"),
    (dict(gemm_tflops=700), "gemm_tflops=700: expected dict"),
    (dict(gemm_tflops={"8x8x8": 1.0}), "gemm_tflops: no 'default' rate"),
    (dict(cpu_adam_gparams={}), "cpu_adam_gparams={}: expected rates by thread count"),
])
def test_a_damaged_profile_is_one_error_naming_the_field(tmp_path, content, why):
    """A hand-edited or truncated profile: the one-line profile error, not a traceback in the planner."""
    import json

    path = tmp_path / "p.json"
    path.write_text(json.dumps(content if isinstance(content, list) else dict(dataclasses.asdict(prof()), **content)))
    with pytest.raises(ConfigError, match=re.escape(f"not a hardware profile ({why}")):
        load(str(path))


def test_cpu_adam_measured_per_dtype_on_this_machine():
    from flame.offload.measure.hardware import measure_cpu_adam

    from flame.offload.measure.hardware import measure_out_of_place_slowdown

    for dt in (torch.float32, torch.bfloat16):
        r = measure_cpu_adam([1, 2], numel=1 << 18, dtype=dt, steps=2)
        assert set(r) == {"1", "2"} and all(v > 0 for v in r.values())
    slowdown = measure_out_of_place_slowdown(numel=1 << 18, steps=2)
    assert math.isfinite(slowdown) and slowdown >= 1.0


def test_ranks_sharing_the_cpu_predict_a_slower_optimizer():
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 0, 0, 0)
    c = ModelCosts(1, 1, [lay, UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)], "L")
    p = prof(cpu_adam_gparams={"1": 0.5, "8": 3.0, "16": 4.0})
    args = (c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 7)
    alone, shared = predict(*args, world=2).cpu_s, predict(*args, world=2, node_ranks=2).cpu_s
    assert shared > alone
    shard = 10**9 // 2  # each of the 2 ranks updates half of the block
    assert shared - alone == pytest.approx(shard / p.cpu_adam_rate(7, 2) - shard / p.cpu_adam_rate(7))


@pytest.mark.parametrize("rounds", [1, 4])
def test_budgets_respected_and_monotone(costs, rounds):
    p = prof()
    host = 64 * GiB
    last = None
    for gib in (2, 3, 4, 6, 8, 12, 16, 24, 48):
        try:
            plan = solve(costs, p, Dtypes(), gib * GiB, host, 2, rounds, 15, depths=(1, 2))
        except ConfigError:
            assert last is None  # only the smallest budgets may be infeasible
            continue
        assert plan.predicted["peak_gpu_bytes"] <= gib * GiB
        assert plan.predicted["peak_host_bytes"] <= host
        if last is not None:
            assert plan.predicted["step_s"] <= last + 1e-12
        last = plan.predicted["step_s"]
    assert last is not None
    assert not plan.offloads  # 48 GiB holds this 0.2B model entirely


def test_infeasible_says_what_is_missing(costs):
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB GPU, budget 0\.5"):
        solve(costs, prof(), Dtypes(), GiB // 2, 64 * GiB, 2, 1, 15)
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB host, budget 0\.1"):
        solve(costs, prof(), Dtypes(), 3 * GiB, int(0.1 * GiB), 2, 1, 15)
    # offload.enable off streams nothing: the line said "every block streamed and recomputed"
    with pytest.raises(ConfigError, match=r"needs [\d.]+ GiB GPU, budget 0\.5 GiB \(offload.enable off: every block "
                                          r"on the GPU, recomputed; --offload.gpu_memory_gib\)"):
        solve(costs, prof(), Dtypes(), GiB // 2, 64 * GiB, 2, 1, 15, allow_offload=False)


def test_a_host_too_small_for_fp32_states_names_the_bf16_options_that_fit(costs):
    """Nothing fits the host with float32 master, moments and grads, a plan with bf16 ones does:
    the error says so, with the options and the host bytes of the plan they give."""
    from flame.offload.planner.solver import solve_micro_batches

    bf16 = Dtypes(master="bfloat16", moment="bfloat16", grad="bfloat16")

    def plan(dt, host):
        return solve_micro_batches({2: costs}, 2, prof(), dt, 3 * GiB, host, 15, overrides=["weights[*]=host"])[0]

    fp32_need = plan(Dtypes(), 64 * GiB).predicted["peak_host_bytes"]
    bf16_need = plan(bf16, 64 * GiB).predicted["peak_host_bytes"]
    budget = (fp32_need + bf16_need) // 2
    assert bf16_need < budget < fp32_need
    with pytest.raises(ConfigError) as e:
        plan(Dtypes(), budget)
    msg = str(e.value)
    assert "--offload.master_dtype bfloat16 --offload.moment_dtype bfloat16 --offload.grad_dtype bfloat16" in msg
    assert msg.endswith(f"it plans {plan(bf16, budget).predicted['peak_host_bytes'] / GiB:.1f} GiB")
    with pytest.raises(ConfigError, match=r"host_margin_gib\)$"):  # bf16 already: nothing to suggest
        plan(bf16, bf16_need // 2)


def test_a_host_too_small_for_the_speculative_spare_names_the_option_that_fits(costs):
    """The speculative step keeps a spare master and moments per host block: when only that is
    what does not fit, the error names --offload.speculative_step first, with the host bytes of
    the plan without it (and the bf16 options after, where they fit too)."""
    from flame.offload.planner.solver import solve_micro_batches

    def plan(host, speculative):
        return solve_micro_batches({2: costs}, 2, prof(), Dtypes(), 3 * GiB, host, 15, overrides=["weights[*]=host"],
                                   speculative_step=speculative)[0]

    plain_need = plan(64 * GiB, False).predicted["peak_host_bytes"]
    spare_need = plan(64 * GiB, True).predicted["peak_host_bytes"]
    budget = (plain_need + spare_need) // 2
    assert plain_need < budget < spare_need
    with pytest.raises(ConfigError) as e:
        plan(budget, True)
    msg = str(e.value)
    without = f"without --offload.speculative_step (its spare master and moments) it plans {plain_need / GiB:.1f} GiB"
    assert without in msg
    in_place = (f"with --training.max_norm 0 --training.no-skip_nan_inf (no step to redo: the speculative step "
                f"needs no spare) it plans {plain_need / GiB:.1f} GiB")
    assert in_place in msg
    assert msg.index(without) < msg.index(in_place) < msg.index("with bf16 optimizer state")

def test_plan_file_and_profile_roundtrip(costs, tmp_path):
    plan = solve(costs, prof(), Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 15)
    # the reserved peak it predicts: its allocated peak plus the fragmentation headroom's cached
    # blocks, within the allocator cap the budget was cut from
    pr = plan.predicted
    assert pr["peak_gpu_reserved_bytes"] == int(pr["peak_gpu_bytes"] / (1 - FRAGMENTATION_HEADROOM))
    assert pr["peak_gpu_bytes"] < pr["peak_gpu_reserved_bytes"] <= 3 * GiB / (1 - FRAGMENTATION_HEADROOM)
    assert "allocated, " in describe(plan, costs)
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    assert "binding constraint" in describe(plan, costs)
    save(prof(), str(tmp_path / "prof.json"))
    assert load(str(tmp_path / "prof.json")) == prof()
    with pytest.raises(ConfigError, match="nope.json"):
        Plan.load(str(tmp_path / "nope.json"))
    # a directory given for the plan file was a traceback (IsADirectoryError)
    with pytest.raises(ConfigError, match=re.escape(f"offload.plan={str(tmp_path)!r}: cannot read it (Is a directory)")):
        Plan.load(str(tmp_path))
    with pytest.raises(ConfigError, match=r"offload.save_plan='/nonexistent_dir/p.json': cannot write it"):
        plan.save("/nonexistent_dir/p.json")


def test_a_replayed_plan_must_be_for_the_run_s_shape(costs):
    """A plan file holds the micro-batch, rounds and sequence length its memory and time are for:
    replayed on another shape it is an error naming both, and it prints as one readable line.
    Its dtypes and speculative step are the run's: options asking otherwise (ignored before) are
    an error naming both."""
    plan = solve(costs, prof(), Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 15)   # micro-batch 2, one round
    plan.check_shape("p.json", 2, plan.seq_len)
    with pytest.raises(ConfigError, match=f"made for sequences of {plan.seq_len} tokens, the run has training.seq_len 7"):
        plan.check_shape("p.json", 2, 7)
    with pytest.raises(ConfigError, match=r"made for 2 x 1 sequences a step .* the run has 4 "):
        plan.check_shape("p.json", 4, plan.seq_len)
    plan.check_options("p.json", Offload(), redo=True)
    plan.check_options("p.json", Offload(), redo=False)  # no speculative step: redo does not matter
    with pytest.raises(ConfigError, match="made for offload.master_dtype float32, the run has bfloat16"):
        plan.check_options("p.json", Offload(master_dtype="bfloat16", moment_dtype="bfloat16"), redo=True)
    with pytest.raises(ConfigError, match="made without offload.speculative_step, the run has it on"):
        plan.check_options("p.json", Offload(speculative_step=True), redo=True)
    spec = solve(costs, prof(), Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 15, speculative_step=True)
    spec.check_options("p.json", Offload(speculative_step=True), redo=True)
    with pytest.raises(ConfigError, match="made for a run that may redo a speculative step; this run can never"):
        spec.check_options("p.json", Offload(speculative_step=True), redo=False)
    line = plan.summary()
    assert line.startswith(f"{len(plan.layer_modes)} blocks, micro-batch 2x{plan.seq_len}, 1 round(s)/step, "
                           "predicted step ") and "{" not in line


def test_a_replayed_plan_refuses_the_planner_options_it_would_ignore(costs):
    """`--offload.plan p.json` with `--offload.overrides`, `prefetch_depth`, `cpu_threads`,
    `micro_batch_tokens` or the planner's choices (`checkpoint_offload`, ...) ran the plan as it was
    and ignored them in silence. Options the plan already follows (the command that saved it) pass."""
    plan = solve(costs, prof(), Dtypes(), 40 * GiB, 64 * GiB, 2, 1, 15, overrides=["weights[0-1]=host", "prefetch=2"])
    same = Offload(overrides=["weights[0-1]=host", "prefetch=2"], prefetch_depth=2, cpu_threads=15,
                   micro_batch_tokens=2 * plan.seq_len)
    plan.check_options("p.json", same, redo=True)
    for off, why in [
            (Offload(overrides=["weights[0-1]=host", "weights[2]=host"]),
             "does not follow offload.overrides entry 'weights[2]=host'"),
            (Offload(overrides=["prefetch=3"]), "does not follow offload.overrides entry 'prefetch=3'"),
            (Offload(prefetch_depth=3), "made for offload.prefetch_depth 2, the run has 3"),
            (Offload(cpu_threads=4), "made for offload.cpu_threads 15, the run has 4"),
            (Offload(micro_batch_tokens=plan.seq_len), f"made for offload.micro_batch_tokens {2 * plan.seq_len}, "
                                                       f"the run has {plan.seq_len}"),
            (Offload(checkpoint_offload=True), "made without offload.checkpoint_offload, the run has it on"),
            (Offload(selective_recompute=False), "made with offload.selective_recompute, the run has it off")]:
        with pytest.raises(ConfigError, match=re.escape("offload.plan='p.json': " + why)):
            plan.check_options("p.json", off, redo=True)


def test_overrides_and_spread(costs):
    plan = solve(costs, prof(), Dtypes(), 40 * GiB, 64 * GiB, 2, 1, 15, overrides=["weights[0-1]=host", "prefetch=2"])
    assert plan.layer_modes[:2] == ["stream", "stream"] and plan.prefetch_depth == 2
    with pytest.raises(ConfigError, match="weights\\[9\\]"):
        solve(costs, prof(), Dtypes(), 40 * GiB, 64 * GiB, 2, 1, 15, overrides=["weights[9]=host"])
    s = spread(8, {"a": 2, "b": 6})
    assert s.count("a") == 2 and s.index("a") > 0


@pytest.mark.parametrize("entry, why", [
    ("weights[a-b]=host", "block index"), ("weights[1-]=host", "block index"), ("weights[3-1]=host", "empty block range"),
    ("weights[*=host", "unknown key or value"), ("prefetch=abc", "prefetch=N"), ("prefetch=-1", "prefetch=N"),
    ("outer=foo", "outer=gpu or outer=host_opt"),
    ("weights[*]=host;activations[*]=keep", "separate entries with commas")])
def test_a_malformed_override_is_a_config_error_naming_it(costs, entry, why):
    """Index ranges, prefetch depths and outer modes that the planner cannot use: one ConfigError
    naming the entry (a traceback, or a plan with an outer mode that does not exist, before)."""
    with pytest.raises(ConfigError, match=re.escape(repr(entry)) + ".*" + re.escape(why)):
        solve(costs, prof(), Dtypes(), 40 * GiB, 64 * GiB, 2, 1, 15, overrides=[entry])


def test_config_validation():
    with pytest.raises(ConfigError, match="offload.enable='maybe'"):
        Offload(enable="maybe").validate()
    with pytest.raises(ConfigError, match="offload.master_dtype='fp8'"):
        Offload(master_dtype="fp8").validate()
    with pytest.raises(ConfigError, match="offload.gpu_memory_gib=-1"):
        Offload(gpu_memory_gib=-1).validate()


@pytest.mark.parametrize("name", ["gpu_memory_gib", "host_memory_gib", "gpu_margin_gib", "host_margin_gib"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_budget_that_is_not_a_finite_number_is_one_error(name, value):
    """`--offload.host_memory_gib nan` planned with this machine's memory (nan compared false with
    0), and `--offload.gpu_memory_gib nan|inf` crashed converting it to bytes."""
    with pytest.raises(ConfigError, match=f"offload.{name}={value!r}: expected a number >= 0"):
        Offload(**{name: value}).validate()


def test_moments_in_another_dtype_than_the_masters_is_one_error():
    """The docs' `moment_dtype must equal master_dtype`: the calculator planned such a run, which
    the trainer's engine then refused after building the model."""
    with pytest.raises(ConfigError, match="offload.moment_dtype='float32': must equal offload.master_dtype"):
        Offload(master_dtype="bfloat16").validate()
    Offload(master_dtype="bfloat16", moment_dtype="bfloat16").validate()


def test_cli_infeasible_exits_nonzero(tmp_path, capsys):
    from flame.offload import calculator as cli

    save(prof(), str(tmp_path / "prof.json"))
    cfgdir = tmp_path / "m"
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, vocab_size=1000)
    cfg.save_pretrained(cfgdir)
    args = ["--model.config", str(cfgdir), "--training.seq_len", "512", "--offload.profile", str(tmp_path / "prof.json"),
            "--offload.host_memory_gib", "0.01"]
    assert cli.main(args + ["--offload.gpu_memory_gib", "0.001"]) == 2
    assert "must be more than" in capsys.readouterr().err
    # the trainer's parser: unknown keys are errors naming the closest valid one; aliases work
    assert cli.main(args + ["--training.batchsize", "2"]) == 2
    assert "did you mean 'training.batch_size'" in capsys.readouterr().err
    assert cli.main(args[:-2] + ["--offload.host_memory_gib", "8", "--training.batch_size", "3"]) == 0
    assert "micro-batch 3x512" in capsys.readouterr().out
    assert cli.main(args[:-2] + ["--offload.host_memory_gib", "8", "--offload.gpu_memory_gib", "2"]) == 0
    assert "predicted step" in capsys.readouterr().out


def test_cli_refuses_offload_with_tensor_pipeline_or_context_parallelism(tmp_path, capsys):
    """The trainer's engine refuses them with one line (check_parallel_dims); the calculator printed
    a plan for such a run and exited 0."""
    from flame.offload import calculator as cli

    save(prof(), str(tmp_path / "prof.json"))
    args = ["--offload.profile", str(tmp_path / "prof.json"), "--offload.host_memory_gib", "8", "--offload.enable", "on"]
    for option in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        assert cli.main(args + [f"--parallelism.{option}", "2"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"flame: error: offload: parallelism.{option} 2: the offload engine composes with data parallelism "
            "only (set it to 1 or offload.enable=off)"]
    assert cli.main(args[:-1] + ["auto", "--parallelism.tensor_parallel_degree", "2"]) == 0  # fits: no engine
    assert "everything fits" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the errors of a machine without a GPU")
def test_without_gpu_or_profile_one_error_line(tmp_path, capsys, monkeypatch):
    """The trainer without a profile on CPU, and `python -m flame.offload.profile` on CPU: one
    `flame: error:` line each (the trainer's names the bundled profile to pass), no traceback."""
    from types import SimpleNamespace

    from flame.config.manager import FlameConfigManager
    from flame.offload import build_plan
    from flame.offload.measure import hardware

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    cfg.save_pretrained(tmp_path / "m")
    job = FlameConfigManager().parse_args(["--model.config", str(tmp_path / "m"), "--training.seq_len", "64",
                                           "--job.dump_folder", str(tmp_path / "dump"), "--offload.enable", "on"])
    with pytest.raises(ConfigError, match="offload.profile not given.*no GPU.*--offload.profile .*h100_80gb_measured.json"):
        build_plan(SimpleNamespace(config=cfg), job, "cpu")
    monkeypatch.setattr("sys.argv", ["profile", str(tmp_path / "p.json")])
    assert hardware.main() == 2
    assert capsys.readouterr().err.splitlines() == [
        "flame: error: offload.profile: measuring a profile needs a CUDA device; pass a stored one"]
    assert not (tmp_path / "p.json").exists()


def test_gpu_grad_accumulation_in_model_and_solver(costs):
    """With rounds > 1 a host unit's GPU accumulator costs numel * grad bytes of GPU memory (none
    for a host_opt unit whose grads are already in grad dtype), removes its per-round D2H and CPU
    adds, and the solver takes it when the budget allows."""
    p, dt, n = prof(), Dtypes(), len(costs.layers)
    modes, acts = ["stream"] * (n - 1) + ["host_opt"], ["recompute"] * n
    off = predict(costs, p, dt, modes, acts, "host_opt", 1, 2, 4, 15)
    on = predict(costs, p, dt, modes, acts, "host_opt", 1, 2, 4, 15, layer_accs=[True] * n, outer_acc=True)
    numel = sum(u.numel for u in costs.units)
    assert on.gpu_bytes - off.gpu_bytes == 4 * numel
    assert on.static_gpu["grad_acc"] == 4 * numel
    assert on.d2h_bytes == 4 * numel and off.d2h_bytes == 4 * 2 * numel  # fp32 once vs bf16 every round
    assert on.step_s < off.step_s and on.host_bytes < off.host_bytes
    bf = Dtypes("bfloat16", "float32", "bfloat16", "float32")
    one = UnitCosts("b", "layer", 1000, {}, 0, 0, 0, 0, 0)
    assert unit_gpu_bytes(one, "host_opt", bf, gpu_acc=True) == unit_gpu_bytes(one, "host_opt", bf)
    assert unit_gpu_bytes(one, "stream", bf, gpu_acc=True) == 2000
    # one round: nothing to accumulate, the flag changes nothing
    assert predict(costs, p, dt, modes, acts, "host_opt", 1, 2, 1, 15, layer_accs=[True] * n) == \
        predict(costs, p, dt, modes, acts, "host_opt", 1, 2, 1, 15)
    plan = solve(costs, p, dt, 40 * GiB, 64 * GiB, 2, 4, 15, overrides=["weights[*]=host", "outer=host_opt"])
    assert all(plan.layer_gpu_acc) and plan.outer_gpu_acc and "grads accumulated on GPU" in describe(plan, costs)
    tight = solve(costs, p, dt, 3 * GiB, 64 * GiB, 2, 4, 15, overrides=["weights[*]=host", "outer=host_opt"])
    assert tight.predicted["step_s"] >= plan.predicted["step_s"]


def test_plan_file_with_accumulators_and_old_files(costs, tmp_path):
    import json

    plan = solve(costs, prof(), Dtypes(), 40 * GiB, 64 * GiB, 2, 4, 15, overrides=["weights[*]=host"])
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan and any(plan.layer_gpu_acc)
    # a plan file written before the accumulator fields existed: every host unit accumulates on the host
    d = json.loads((tmp_path / "p.json").read_text())
    del d["layer_gpu_acc"], d["outer_gpu_acc"]
    (tmp_path / "old.json").write_text(json.dumps(d))
    old = Plan.load(tmp_path / "old.json")
    assert old.unit_accs() == [False] * (len(costs.layers) + 1)


def test_chunked_loss_costs_by_hand(costs):
    """training.loss_chunk_tokens: the outer unit no longer saves the [tokens, vocab] float32 logits
    but the head's gradients (hidden [tokens, d] + weight [vocab, d], bf16); the chunk's forward
    transient is charged by the cost model, and the same plan's predicted peak falls."""
    chunked = measure_costs(meta_model(small_llama()), 2, 2048, loss_chunk_tokens=512)
    t, d, v = 2 * 2048, 1024, 32000
    assert costs.outer.max_saved_bytes >= t * v * 4  # plain: the float32 logits
    assert chunked.outer.max_saved_bytes == v * d * 2  # the head's weight gradient, bf16
    assert chunked.outer.act_keep_bytes <= costs.outer.act_keep_bytes - t * v * 4 + t * d * 2 + v * d * 2
    assert chunked.extra["loss_chunk_transient_bytes"] == v * d * 4 + 512 * v * (4 + 2)
    assert [u.fwd_gemm_flops for u in chunked.units] == pytest.approx([u.fwd_gemm_flops for u in costs.units])
    # the head's dX and dW run inside the chunked forward: timed there, the same total and useful FLOPs
    from flame.offload.planner.cost_model import unit_times

    assert chunked.outer.bwd_in_fwd_gemm_flops == pytest.approx(2 * 2.0 * t * v * d)
    assert costs.outer.bwd_in_fwd_gemm_flops == 0.0
    (fc, bc), (fp, bp) = unit_times(chunked.outer, prof(), 1.0), unit_times(costs.outer, prof(), 1.0)
    assert fc - fp == pytest.approx(2 * 2.0 * t * v * d / prof().gemm_rate()) and fc + bc == pytest.approx(fp + bp)
    n = len(costs.layers)
    args = (prof(), Dtypes(), ["stream"] * n, ["recompute"] * n, "host_opt", 2, 2, 1, 15)
    assert predict(chunked, *args).gpu_bytes < predict(costs, *args).gpu_bytes - 2 * t * v * 4 + chunked.extra["loss_chunk_transient_bytes"]
    assert predict(chunked, *args).useful_flops == pytest.approx(predict(costs, *args).useful_flops)


def test_timed_unit_uses_its_seconds_not_flops(costs):
    """A unit timed before the run (the outer, by the block calibration) costs its seconds, scaled
    with the micro-batch, whatever the blocks' compute scale; its useful FLOPs stay FLOP-based."""
    from flame.offload.planner.cost_model import unit_times

    timed = ModelCosts.from_dict(costs.to_dict())
    timed.outer.timed_s = [0.25, 0.125]
    assert unit_times(timed.outer, prof(), 2.0, fudge=3.0) == (0.5, 0.25)
    assert unit_times(timed.layers[0], prof(), 2.0, fudge=3.0) == unit_times(costs.layers[0], prof(), 2.0, fudge=3.0)
    n = len(costs.layers)
    args = (prof(), Dtypes(), ["gpu"] * n, ["keep"] * n, "gpu", 1, 2, 1, 15)
    base, slow = predict(costs, *args), predict(timed, *args)
    f, b = unit_times(costs.outer, prof(), 1.0)
    assert slow.step_s - base.step_s == pytest.approx(0.375 - f - b)
    assert slow.useful_flops == base.useful_flops


def test_step_calibration_refits_writes_and_reuses_the_plan(tmp_path, monkeypatch, costs):
    """A step measured 30x slower than predicted: the compute scale is refit, the plan re-solved
    (compute-bound now: stream weights rather than recompute activations), written, and accepted
    by the next launch only when it was made for the same settings."""
    import types

    from flame.offload.measure import calibration as step_timing
    from flame.offload.measure.calibration import StepCalibrator
    from flame.offload.planner import refit as cal

    p = prof()
    plan = solve(costs, p, Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 15)
    assert cal.refit(plan, costs, p, plan.predicted["step_s"] * 1.05)[1] is None  # within 10%
    clock = iter([100.0, 100.0 + 30 * plan.predicted["step_s"]])
    monkeypatch.setattr(step_timing.time, "perf_counter", lambda: next(clock))
    engine = types.SimpleNamespace(synchronize=lambda: None, reset_host_seconds=dict)  # no host units timed
    calib = StepCalibrator(engine, plan, costs, p, [], str(tmp_path), window=1)
    for _ in range(StepCalibrator.FIRST - 1):
        assert calib.before_step() is False
        assert calib.after_step() is None
    assert calib.before_step() is True  # the window starts: the trainer restarts its peak window
    # the window's GPU peak as the trainer's metrics logger saw it (it resets the allocator's counter)
    rep = calib.after_step(peak_bytes=2 * GiB)
    assert rep["measured_peak_gpu_bytes"] == 2 * GiB
    assert rep["peak_error"] == pytest.approx(2 * GiB / plan.predicted["peak_gpu_bytes"] - 1)
    assert rep["step_error"] == pytest.approx(29.0) and rep["refit_compute_scale"] == pytest.approx(30.0)
    assert rep["replanned"] and (tmp_path / cal.CALIBRATED_PLAN).exists()
    new = cal.calibrated_plan_for(str(tmp_path), plan, [])
    assert new is not None and not cal.same_decisions(new, plan)
    assert new.layer_modes.count("stream") > plan.layer_modes.count("stream")
    assert new.layer_acts.count("recompute") < plan.layer_acts.count("recompute")
    assert new.predicted["peak_gpu_bytes"] <= 3 * GiB
    # made for other settings: not used
    assert cal.calibrated_plan_for(str(tmp_path), plan, ["prefetch=2"]) is None
    assert cal.calibrated_plan_for(str(tmp_path), solve(costs, p, Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 7), []) is None
    tight = dataclasses.replace(plan, gpu_budget_bytes=new.predicted["peak_gpu_bytes"] - 1)
    assert cal.calibrated_plan_for(str(tmp_path), tight, []) is None
    # a launch with other offload options, or that may now have to redo a speculative step
    for change in (dict(speculative_step=True), dict(checkpoint_offload=True), dict(selective_recompute=False),
                   dict(activation_offload=True)):
        assert cal.calibrated_plan_for(str(tmp_path), dataclasses.replace(plan, **change), []) is None, change
    # a launch of another model with as many blocks (the same dump folder): its plan was used before
    other = dataclasses.replace(plan, layer_numel=[n + 1 for n in plan.layer_numel])
    assert cal.calibrated_plan_for(str(tmp_path), other, []) is None
    assert cal.calibrated_plan_for(str(tmp_path), dataclasses.replace(plan, speculative_redo=False), []) is not None


def test_calibration_says_when_a_speculative_plan_runs_slower_than_it_would_without(tmp_path, monkeypatch, costs,
                                                                                     caplog):
    """A speculative plan whose CPU AdamW the engine timed at a third of the profiled rate (beside
    the backward), with a step slower than the same plan predicted without speculation: the
    report has that prediction and one log line says the flag likely costs time. A step as
    predicted: the prediction is reported, nothing is said."""
    import logging
    import types

    from flame.offload.measure import calibration as step_timing
    from flame.offload.measure.calibration import StepCalibrator
    from flame.offload.planner import refit as cal

    p = prof(cpu_adam_one_pass=True)  # no copy aside: at the profiled rate speculation pays
    plan = solve(costs, p, Dtypes(), 40 * GiB, 64 * GiB, 2, 1, 15, overrides=["weights[*]=host"],
                 speculative_step=True)
    assert plan.speculative_step and any(m != "gpu" for m in plan.layer_modes)
    plain_s = cal.without_speculation(plan, costs, p)
    assert plain_s > plan.predicted["step_s"]
    assert plain_s == pytest.approx(cal.predict_again(dataclasses.replace(plan, speculative_step=False), costs, p,
                                                      plan.predicted["compute_fudge"]).step_s)
    profiled_s = sum(u.numel for u, m in zip([costs.outer] + list(costs.layers),
                                             [plan.outer_mode] + plan.layer_modes) if m != "gpu") / p.cpu_adam_rate(15)

    def calibrate(step_s: float, cpu_adam_s: float) -> dict:
        clock = iter([100.0, 100.0 + step_s])
        monkeypatch.setattr(step_timing.time, "perf_counter", lambda: next(clock))
        engine = types.SimpleNamespace(synchronize=lambda: None, reset_host_seconds=lambda: {"cpu_adam": cpu_adam_s})
        calib = StepCalibrator(engine, plan, costs, p, [], str(tmp_path), window=1, write=False)
        for _ in range(StepCalibrator.FIRST):
            calib.before_step()
            rep = calib.after_step(peak_bytes=GiB)
        return rep

    hint = "likely faster without the flag"
    with caplog.at_level(logging.INFO, logger=step_timing.logger.name):
        rep = calibrate(plan.predicted["step_s"], profiled_s)
    assert rep["predicted_step_without_speculation_s"] == pytest.approx(plain_s)
    assert not [r for r in caplog.records if hint in r.getMessage()]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=step_timing.logger.name):
        rep = calibrate(1.5 * plain_s, 3 * profiled_s)
    lines = [r.getMessage() for r in caplog.records if hint in r.getMessage()]
    assert rep["refit_cpu_adam_scale"] == pytest.approx(1 / 3)
    assert len(lines) == 1 and "--offload.speculative_step" in lines[0] and "0.33x" in lines[0], lines


def test_micro_batch_candidates_and_accumulation_steps():
    import types

    from flame.config.manager import accumulation_steps
    from flame.offload import micro_batch_candidates

    assert micro_batch_candidates(12, 64, 0, False) == [12, 6, 4, 3, 2, 1]
    assert micro_batch_candidates(12, 64, 0, True) == [12]  # a packed varlen batch is one stream
    assert micro_batch_candidates(12, 64, 256, False) == [4]
    for tokens, varlen in ((100, False), (64 * 5, False), (128, True)):
        with pytest.raises(ConfigError, match=f"offload.micro_batch_tokens {tokens}"):
            micro_batch_candidates(12, 64, tokens, varlen)

    def t(gb, local, acc):
        return types.SimpleNamespace(global_batch_size=gb, local_batch_size=local, gradient_accumulation_steps=acc)

    assert accumulation_steps(t(-1, 4, 3), 2) == 3
    assert accumulation_steps(t(32, 4, 1), 2) == 4  # torchtitan's global batch over 2 ranks
    assert accumulation_steps(t(32, 4, 4), 2) == 4
    with pytest.raises(ConfigError, match="disagree"):
        accumulation_steps(t(32, 4, 2), 2)
    with pytest.raises(ConfigError, match="not a multiple"):
        accumulation_steps(t(30, 4, 1), 2)


def test_micro_batch_search_takes_each_candidates_compute_scale():
    """Per-micro-batch compute scales: a candidate is predicted with its own scale (the chosen
    plan records it), a candidate without one (its block did not fit when timed) is never chosen,
    and none at all is a one-line error."""
    from flame.offload.planner.solver import solve, solve_micro_batches

    meta = meta_model(small_llama())
    costs_of = {mb: measure_costs(meta, mb, 2048) for mb in (4, 2, 1)}
    args = (4, prof(), Dtypes(), 24 * GiB, 64 * GiB, 15)
    plan, _ = solve_micro_batches(costs_of, *args, fudges={1: 1.0, 2: 1.0, 4: 1.0}, depths=(1,))
    slow = {1: 1.0, 2: 1.0, 4: 1.0, plan.micro_batch: 3.0}
    other, _ = solve_micro_batches(costs_of, *args, fudges=slow, depths=(1,))
    assert other.micro_batch != plan.micro_batch and other.predicted["compute_fudge"] == 1.0
    alone = solve(costs_of[plan.micro_batch], prof(), Dtypes(), 24 * GiB, 64 * GiB, plan.micro_batch,
                  4 // plan.micro_batch, 15, depths=(1,), fudge=3.0)
    assert other.predicted["step_s"] <= alone.predicted["step_s"]
    only_one, _ = solve_micro_batches(costs_of, *args, fudges={1: 1.2}, depths=(1,))
    assert only_one.micro_batch == 1 and only_one.predicted["compute_fudge"] == 1.2
    with pytest.raises(ConfigError, match="micro-batch 1 does not fit"):
        solve_micro_batches(costs_of, *args, fudges={}, depths=(1,))


def test_micro_batch_search_respects_budgets_and_is_monotone():
    """The planner's micro-batch choice (fastest over the divisors of 4 sequences per step): every
    plan within both budgets, never slower with more GPU memory, smaller micro-batches where the
    budget is tight."""
    from flame.offload.planner.solver import solve_micro_batches

    meta = meta_model(small_llama())
    costs_of = {mb: measure_costs(meta, mb, 2048, loss_chunk_tokens=1024) for mb in (4, 2, 1)}
    last, chosen = None, []
    for gib in (1.1, 1.2, 1.5, 2, 3, 4, 6, 8, 12, 24):
        try:
            plan, c = solve_micro_batches(costs_of, 4, prof(), Dtypes(), int(gib * GiB), 64 * GiB, 15, depths=(1, 2))
        except ConfigError as e:
            assert last is None and "needs" in str(e)
            continue
        assert c is costs_of[plan.micro_batch] and plan.rounds * plan.micro_batch == 4
        assert plan.predicted["peak_gpu_bytes"] <= gib * GiB and plan.predicted["peak_host_bytes"] <= 64 * GiB
        if last is not None:
            assert plan.predicted["step_s"] <= last + 1e-12
        last = plan.predicted["step_s"]
        chosen.append(plan.micro_batch)
    assert last is not None and chosen[0] < chosen[-1], chosen


def test_host_shortfall_names_a_larger_micro_batch_that_lacks_only_gpu_memory():
    """Micro-batch 4 (one round: bf16 host grads) needs more GPU than the budget, 2 and 1 (fp32
    grads summed on the host) more host: the one error line says both, and how much GPU the
    one-round plan needs."""
    from flame.offload.planner.solver import HostShortfall, solve, solve_micro_batches

    meta = meta_model(small_llama())
    costs_of = {mb: measure_costs(meta, mb, 2048, loss_chunk_tokens=1024) for mb in (4, 2, 1)}
    gpu, host = int(1.1 * GiB), int(2.8 * GiB)
    with pytest.raises(HostShortfall) as e:
        solve_micro_batches(costs_of, 4, prof(), Dtypes(), gpu, host, 15, depths=(1, 2))
    one_round = solve(costs_of[4], prof(), Dtypes(), 64 * GiB, 64 * GiB, 4, 1, 15, depths=(1, 2),
                      overrides=["weights[*]=host", "activations[*]=recompute"])
    assert one_round.predicted["peak_host_bytes"] < host < 3.0 * GiB
    msg = str(e.value)
    assert msg.startswith("offload: needs 3.") and "GiB host, budget 2.8 GiB" in msg
    assert "micro-batch 4 (1 round(s) a step) needs 1.2 GiB GPU (--offload.gpu_memory_gib)" in msg
    # every micro-batch fits the GPU, none the host: the line names the least host any needs
    # (one round's bf16 grads: micro-batch 4's), not the smallest micro-batch's
    needs = {}
    for mb in (4, 2, 1):
        with pytest.raises(HostShortfall) as one:
            solve(costs_of[mb], prof(), Dtypes(), int(1.5 * GiB), int(2.3 * GiB), mb, 4 // mb, 15, depths=(1, 2))
        needs[mb] = one.value.need
    assert min(needs, key=needs.get) == 4
    with pytest.raises(HostShortfall) as e:
        solve_micro_batches(costs_of, 4, prof(), Dtypes(), int(1.5 * GiB), int(2.3 * GiB), 15, depths=(1, 2))
    assert e.value.need == needs[4] and str(e.value).startswith(f"offload: needs {needs[4] / GiB:.1f} GiB host")


@pytest.mark.parametrize("family", ["gated_deltanet", "gla", "samba"])
def test_fla_costs_measured_on_meta(family):
    """FLA models on the meta device: flame's torch implementations stand in for the Triton ops
    (the delta rule as a shape-only op saving its inputs, not a token loop)."""
    import os
    import time

    from flame.models.build import load_model_config
    from flame.offload.measure.tracing import model_costs

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_model_config(os.path.join(root, "configs/debug", f"{family}.json"))
    t = time.perf_counter()
    costs = model_costs(cfg, torch.bfloat16, [1, 2], 1024)
    assert time.perf_counter() - t < 60
    for mb, c in costs.items():
        assert c.micro_batch == mb and len(c.layers) == 2
        assert all(u.act_keep_bytes > 0 and u.fwd_gemm_flops > 0 for u in c.layers)
    # activations scale with the micro-batch
    assert costs[2].layers[0].act_keep_bytes == pytest.approx(2 * costs[1].layers[0].act_keep_bytes, rel=0.05)


def test_mamba2_costs_need_float32_and_the_error_says_so():
    """Mamba2 cannot be measured on meta in bf16 (FLA's torch path mixes dtypes): the one-line
    error names the option that measures it, and that option does."""
    import os

    from flame.models.build import load_model_config
    from flame.offload.measure.tracing import model_costs

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_model_config(os.path.join(root, "configs/debug/mamba2.json"))
    with pytest.raises(ConfigError, match="'mamba2' cannot be measured.*try --offload.compute_dtype float32"):
        model_costs(cfg, torch.bfloat16, [1], 64)
    costs = model_costs(cfg, torch.float32, [1], 64)
    assert len(costs[1].layers) == 2 and all(u.act_keep_bytes > 0 for u in costs[1].layers)


def test_grad_conversion_to_master_dtype_is_costed(costs):
    """bf16 grads, fp32 master (two micro-batches a step, summed on the host): each host unit's
    grads are converted (read 2 + write 4 bytes/param at twice the host memcpy rate) before
    torch's CPU AdamW, into one buffer as large as the largest unit. With one micro-batch a step
    host grads are bf16 whatever the grad dtype (host_grad_dtype): the same plan either way."""
    p, n = prof(), len(costs.layers)
    modes, acts = ["stream"] * (n - 1) + ["gpu"], ["recompute"] * n
    f32_dt, bf_dt = Dtypes("bfloat16", "float32", "float32", "float32"), Dtypes("bfloat16", "float32", "bfloat16", "float32")
    one = [predict(costs, p, dt, modes, acts, "host_opt", 1, 2, 1, 15) for dt in (f32_dt, bf_dt)]
    # (the "gpu" unit keeps its accumulator in the grad dtype)
    assert [(x.host_bytes, x.d2h_bytes, x.cpu_s) for x in one] == [(one[0].host_bytes, one[0].d2h_bytes, one[0].cpu_s)] * 2
    f32 = predict(costs, p, f32_dt, modes, acts, "host_opt", 1, 1, 2, 15)
    bf = predict(costs, p, bf_dt, modes, acts, "host_opt", 1, 1, 2, 15)
    host_units = costs.layers[:-1] + [costs.outer]
    moved = sum(u.numel for u in host_units) * 6
    assert bf.cpu_s - f32.cpu_s == pytest.approx(moved / (2 * p.host_memcpy_gbps * 1e9))
    biggest = max(u.numel for u in host_units)
    # fp32 -> bf16 grads: the pinned grad buffers shrink by 2 bytes/param, the scratch adds 4 bytes/param
    assert f32.host_bytes - bf.host_bytes == sum(u.numel for u in host_units) * 2 - biggest * 4


def test_calibration_refits_the_cpu_adam_rate_before_compute(costs):
    """The engine measured its CPU AdamW at half the profiled rate: the refit halves the rate,
    and a step that is exactly what the plan predicts at that rate leaves the compute scale at 1."""
    from flame.offload.planner import refit as cal

    p = prof()
    plan = solve(costs, p, Dtypes(), 40 * GiB, 64 * GiB, 2, 1, 15, overrides=["weights[*]=host"])
    host = sum(u.numel for u, m in zip([costs.outer] + list(costs.layers), [plan.outer_mode] + plan.layer_modes)
               if m != "gpu")
    assert host > 0
    profiled_s = host / p.cpu_adam_rate(15)
    assert cal.cpu_adam_scale(plan, costs, p, 2 * profiled_s) == pytest.approx(0.5)
    slow = cal.with_cpu_adam_scale(p, 0.5)
    assert slow.cpu_adam_rate(15) == pytest.approx(p.cpu_adam_rate(15) / 2)
    both = cal.with_cpu_adam_scale(prof(cpu_adam_bf16_gparams={"15": 6.0}), 0.5)
    assert both.cpu_adam_rate(15, dtype="bfloat16") == pytest.approx(3.0e9)
    step = cal.predict_again(plan, costs, slow, 1.0).step_s
    assert step > plan.predicted["step_s"] * 1.1  # the slower optimizer shows in the step
    fudge, new = cal.refit(plan, costs, p, step, cpu_rate_scale=cal.cpu_adam_scale(plan, costs, p, 2 * profiled_s))
    assert fudge == pytest.approx(1.0) and new is not None
    assert new.predicted["step_s"] <= step * (1 + 1e-9)  # re-solved at the measured rate: no slower


def test_measured_block_backward_peak_replaces_the_estimate(costs):
    """A block whose backward peak the calibration measured on the GPU is charged that (scaled with
    the micro-batch) when it is recomputed, on top of the blocks' inputs only; a block that keeps
    its activations is not."""
    from flame.offload.planner.cost_model import predict_memory

    n = len(costs.layers)
    est = costs.layers[0].act_keep_bytes + 2 * costs.layers[0].max_saved_bytes
    measured = ModelCosts.from_dict(costs.to_dict())
    for u in measured.layers:
        u.bwd_peak_bytes = 50 * est  # large enough to be the step's largest transient
    for acts in (["recompute"] * n, ["keep"] * n):
        args = (Dtypes(), ["stream"] * n, acts, "host_opt", 2, 4, 1)
        base, got = predict_memory(costs, *args), predict_memory(measured, *args)
        if acts[0] == "keep":
            assert got == base
            continue
        # in the last block's backward: every block's input (the outer's activations are freed)
        scale = 4 / costs.micro_batch
        inputs = sum(scale * u.act_recompute_bytes for u in costs.layers)
        assert got.activation_bytes + got.transient_bytes == pytest.approx(inputs + scale * 50 * est, abs=2)
        assert got.gpu_bytes - base.gpu_bytes == got.transient_bytes - base.transient_bytes


def test_offloaded_activations_by_hand():
    """Two GPU-resident blocks (no weight copies), both offloading 10 GB of activations: the
    forward's D2H and the backward's H2D share the duplex rate; block 1's compute waits for nothing
    (one offloaded block before it), the outer's compute after block 1 waits for block 0's D2H."""
    gb = 10**9
    lay = [UnitCosts(f"l{i}", "layer", 0, {}, 1e12, 0.0, 5 * gb, gb, gb, act_offload_bytes=10 * gb) for i in range(2)]
    out = UnitCosts("outer", "outer", 0, {}, 1e12, 0.0, 0, 0, 0)
    c = ModelCosts(1, 1, lay + [out], "L")
    p = prof()  # 500 TFLOP/s, duplex 70 GB/s split 35/35
    pr = predict(c, p, Dtypes(), ["gpu"] * 2, ["offload"] * 2, "gpu", 1, 1, 1, 15)
    fwd, d2h = 1e12 / 500e12, 10e9 / 35e9
    # forward: block 0 computes [0, f], its D2H [f, f + d]; block 1 computes [f, 2f], its D2H
    # [f + d, f + 2d]; the outer's compute waits for block 0's D2H: starts at max(2f, f + d)
    assert pr.phase_s[0] == pytest.approx(max(max(2 * fwd, fwd + d2h) + fwd, fwd + 2 * d2h))
    # backward: block 1's activations come back before its backward (2f), then block 0's (the
    # slot rule: prefetched one block ahead), the outer's backward last
    h = 10e9 / 35e9
    bwd = 2 * fwd
    b1_end = h + bwd
    b0_end = max(b1_end, 2 * h) + bwd
    assert pr.phase_s[1] == pytest.approx(b0_end + bwd)
    assert pr.h2d_bytes == 20 * gb and pr.d2h_bytes == 20 * gb
    # host: the two arenas, pinned; GPU: nothing kept, peaks of the copies in flight
    m = pr
    kept = predict(c, p, Dtypes(), ["gpu"] * 2, ["keep"] * 2, "gpu", 1, 1, 1, 15)
    assert m.host_bytes - kept.host_bytes == 20 * gb and m.pinned_bytes - kept.pinned_bytes == 20 * gb
    assert m.activation_bytes == 0 and kept.activation_bytes == 10 * gb
    # forward: both blocks' copies in flight (20 GB); block 0's backward: both restored (depth 1)
    # + 2 x its largest saved tensor
    assert m.activation_bytes + m.transient_bytes == pytest.approx(20 * gb + 2 * gb)


def test_solver_offloads_activations_only_when_the_link_pays(costs):
    """At a budget that forces recomputing, a link far faster than compute makes the solver offload
    activations instead (no recompute of those blocks); at the profile's link it recomputes."""
    n = len(costs.layers)
    # (and host memory fast enough that the copies do not slow the CPU optimizer)
    fast_link = prof(h2d_gbps=5e4, d2h_gbps=5e4, duplex_gbps=1e5, host_memcpy_gbps=1e5)
    slow = solve(costs, prof(gemm_tflops={"default": 5000.0}), Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 15, depths=(1,),
                 offload_activations=True)
    assert "recompute" in slow.layer_acts and "offload" not in slow.layer_acts
    fast = solve(costs, fast_link, Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 15, depths=(1,), offload_activations=True)
    assert fast.activation_offload
    # off by default (offload.activation_offload): the same case recomputes
    assert "offload" not in solve(costs, fast_link, Dtypes(), 3 * GiB, 64 * GiB, 2, 1, 15, depths=(1,)).layer_acts
    assert fast.layer_acts.count("offload") > 0
    assert fast.layer_acts.count("recompute") < slow.layer_acts.count("recompute")
    assert fast.predicted["peak_gpu_bytes"] <= 3 * GiB and fast.predicted["peak_host_bytes"] <= 64 * GiB
    assert "activations offloaded" in describe(fast, costs)
    forced = solve(costs, prof(), Dtypes(), 40 * GiB, 64 * GiB, 2, 1, 15, overrides=["activations[*]=offload"])
    assert forced.layer_acts == ["offload"] * n


def test_cpu_optimizer_slowed_by_activations_sharing_host_memory():
    """The AdamW (fp32, two micro-batches a step: 4 + 2*4 + 4*4 = 28 bytes a parameter) at 4e9
    params/s moves 112 GB/s, above 2 x memcpy (20 GB/s): the capacity is 112 GB/s; 56 GB/s of
    copies leave half of it, so it runs 2x slower; copies that leave less than a quarter count as
    leaving a quarter. With one micro-batch a step it reads bf16 grads (26 bytes). In predict: a
    streamed block offloading 10 GB of activations stretches the first forward's CPU step."""
    from flame.offload.planner.cost_model import adam_traffic_bytes, cpu_contention

    p = prof()  # host_memcpy 10 GB/s
    assert adam_traffic_bytes(Dtypes(), 2) == 28
    assert adam_traffic_bytes(Dtypes(), 1) == 26
    assert adam_traffic_bytes(Dtypes("bfloat16", "bfloat16", "bfloat16", "bfloat16"), 2) == 14
    assert cpu_contention(p, Dtypes(), 2, 4e9, 56e9, 1.0) == pytest.approx(2.0)
    assert cpu_contention(p, Dtypes(), 2, 4e9, 0, 1.0) == 1.0
    assert cpu_contention(p, Dtypes(), 2, 4e9, 1e12, 1.0) == pytest.approx(4.0)
    # a slow AdamW (0.5e9/s: 14 GB/s) under 2 x memcpy = 20 GB/s: 5 GB/s of copies still fit
    assert cpu_contention(p, Dtypes(), 2, 0.5e9, 5e9, 1.0) == 1.0
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 10**10, 0, 0, act_offload_bytes=10**10)
    c = ModelCosts(1, 1, [lay, UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)], "L")
    kept = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15)
    off = predict(c, p, Dtypes(), ["stream"], ["offload"], "gpu", 1, 1, 1, 15)
    alone = 10**9 / 4e9 + 10**9 * 12 / 20e9  # AdamW + the bf16 compute copy and grads, as in test_predict_by_hand
    assert kept.cpu_s == pytest.approx(alone)
    # first pass: CPU step, H2D 2 GB at the shared 35 GB/s, compute; the D2H 10 GB at 35 GB/s after
    first = max(alone + 2e9 / 35e9 + 1e12 / 500e12, alone + 2e9 / 35e9 + 1e12 / 500e12 + 1e10 / 35e9)
    assert off.cpu_s == pytest.approx(alone * 104e9 / (104e9 - 1e10 / first))


def test_selective_recompute_by_hand_and_in_the_solver(costs):
    """A selective block keeps its inputs and matmul/attention outputs (measured on meta, between
    recompute and keep) and its backward redoes the rest at HBM speed: 2 x (keep - select) bytes.
    The solver steps blocks down keep -> selective -> recompute: at a budget between, it uses
    selective blocks and predicts a faster step than recomputing only."""
    from flame.offload.planner.cost_model import predict_memory, selective_recompute_s

    l0 = costs.layers[0]
    assert l0.act_recompute_bytes < l0.act_select_bytes < l0.act_keep_bytes
    p, n = prof(), len(costs.layers)
    assert selective_recompute_s(l0, p, 1.0) == pytest.approx(2 * (l0.act_keep_bytes - l0.act_select_bytes) / 2000e9)
    args = (["stream"] * n,)
    sel = predict(costs, p, Dtypes(), *args, ["selective"] * n, "gpu", 1, 2, 1, 15)
    rec = predict(costs, p, Dtypes(), *args, ["recompute"] * n, "gpu", 1, 2, 1, 15)
    keep = predict(costs, p, Dtypes(), *args, ["keep"] * n, "gpu", 1, 2, 1, 15)
    assert sel.activation_bytes - rec.activation_bytes == n * (l0.act_select_bytes - l0.act_recompute_bytes)
    assert keep.step_s < sel.step_s < rec.step_s
    assert sel.compute_s - keep.compute_s == pytest.approx(n * selective_recompute_s(l0, p, 1.0))
    # a budget that holds every block selective but not every block kept
    budget = (predict_memory(costs, Dtypes(), *args, ["selective"] * n, "gpu", 1, 2, 1).gpu_bytes
              + predict_memory(costs, Dtypes(), *args, ["keep"] * n, "gpu", 1, 2, 1).gpu_bytes) // 2
    plan = solve(costs, p, Dtypes(), budget, 64 * GiB, 2, 1, 15, depths=(1,), overrides=["weights[*]=host"])
    assert "selective" in plan.layer_acts and plan.predicted["peak_gpu_bytes"] <= budget
    only_rec = solve(costs, p, Dtypes(), budget, 64 * GiB, 2, 1, 15, depths=(1,),
                     overrides=["weights[*]=host"] + [f"activations[{i}]={a}" for i, a in enumerate(
                         ["keep" if a == "keep" else "recompute" for a in plan.layer_acts])])
    assert plan.predicted["step_s"] < only_rec.predicted["step_s"]


def test_speculative_step_by_hand(costs):
    """The speculative CPU step (offload.speculative_step): its work (plus the copy aside of master
    and moments) moves from the next forward's start to the end of the backward, and the copy's
    host bytes are counted."""
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 0, 0, 0)
    out = UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)
    c = ModelCosts(1, 1, [lay, out], "L")
    p = prof()
    cpu = 1e9 / 4e9 + 1e9 * 12 / 20e9  # AdamW + the compute copy and grad conversions, as in test_predict_by_hand
    backup = 1e9 * (4 + 8) / 10e9  # master and moments copied at the memcpy rate
    h2d, fwd, bwd, d2h = 2e9 / 50e9, 1e12 / 500e12, 2e12 / 500e12, 2e9 / (70e9 * 0.5)
    pr = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15, speculative=True)
    # the forward no longer waits; the backward ends when the CPU step after the D2H has run
    assert pr.phase_s == pytest.approx([h2d + fwd, bwd + d2h + cpu + backup, 0.0])
    assert pr.cpu_s == pytest.approx(cpu + backup)
    plain = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15)
    assert pr.host_bytes - plain.host_bytes == 1e9 * (4 + 8)
    assert unit_host_bytes(lay, "stream", Dtypes(), spare=True)[0] == 1e9 * (2 + 2 + 4 + 8 + 12)
    # a run that can never redo the step (no clipping, no skipping) updates the state in place:
    # no spare bytes and nothing copied aside, the same overlap
    in_place = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15, speculative=True, spare=False)
    assert in_place.host_bytes == plain.host_bytes
    assert in_place.phase_s == pytest.approx([h2d + fwd, bwd + d2h + cpu, 0.0])
    # the solver carries the choice into the plan, within the host budget that now holds the copy
    budget = dict(gpu_budget=4 * GiB, host_budget=64 * GiB, micro_batch=2, rounds=1, cpu_threads=15)
    spec = solve(costs, prof(), Dtypes(), **budget, speculative_step=True)
    assert spec.speculative_step and spec.predicted["peak_host_bytes"] <= 64 * GiB and spec.speculative_redo
    no_redo = solve(costs, prof(), Dtypes(), **budget, speculative_step=True, speculative_redo=False,
                    overrides=["weights[*]=host"])
    assert not no_redo.speculative_redo
    assert no_redo.predicted["peak_host_bytes"] < solve(costs, prof(), Dtypes(), **budget, speculative_step=True,
                                                         overrides=["weights[*]=host"]).predicted["peak_host_bytes"]
    assert "in place" in describe(no_redo, costs)
    assert not solve(costs, prof(), Dtypes(), **budget).speculative_step
    # the printed plan says whether there is a CPU step to speculate
    host = solve(costs, prof(), Dtypes(), **budget, speculative_step=True, overrides=["weights[*]=host"])
    resident = solve(costs, prof(), Dtypes(), **dict(budget, gpu_budget=64 * GiB), speculative_step=True)
    assert resident.layer_modes == ["gpu"] * len(resident.layer_modes) and resident.outer_mode == "gpu"
    assert "CPU AdamW: speculative (" in describe(host, costs)
    assert "speculative_step has no effect" in describe(resident, costs)


def test_speculative_early_head_by_hand(costs):
    """speculative_step, one round: the outer's untied head (a third of it or more) is an early
    piece: its D2H and its share of the outer's CPU step run from the backward's start, ahead of
    the blocks', not after the outer's backward (the same work and bytes); not when tied (measured
    head_numel 0), with several rounds, or with the outer on the GPU."""
    assert costs.outer.head_numel == 32000 * 1024  # small_llama: untied
    tied = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
    assert measure_costs(meta_model(tied), 1, 16).outer.head_numel == 0
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 0, 0, 0)
    p = prof(cpu_adam_one_pass=True)
    bwd, d2h, cpu = 2e12 / 500e12, 2e9 / (70e9 * 0.5), 1e9 / 4e9  # per 1e9 params: bf16 grads, one-pass AdamW

    def run(head_numel, outer="host_opt", rounds=1, speculative=True):
        out = UnitCosts("outer", "outer", 10**9, {}, 0.0, 0.0, 0, 0, 0, head_numel=head_numel)
        return predict(ModelCosts(1, 1, [lay, out], "L"), p, Dtypes(), ["stream"], ["keep"], outer, 1, 1, rounds,
                       15, speculative=speculative)

    early, whole = run(5 * 10**8), run(0)
    # the head's half of the outer: D2H, then its CPU step, from the start; the block's D2H queues
    # behind the head's, its CPU step behind the head's; then the rest of the outer
    d_block = max(bwd, d2h / 2) + d2h
    cpu_block = max(d_block, d2h / 2 + cpu / 2) + cpu
    assert early.phase_s[1] == pytest.approx(max(d_block + d2h / 2, cpu_block) + cpu / 2)
    # without an early head: the outer's whole D2H and CPU step after the block's
    assert whole.phase_s[1] == pytest.approx(max(bwd + 2 * d2h, bwd + d2h + cpu) + cpu)
    assert early.phase_s[1] < whole.phase_s[1]
    assert (early.cpu_s, early.d2h_bytes) == (whole.cpu_s, whole.d2h_bytes)
    for kw in (dict(rounds=2), dict(speculative=False), dict(outer="gpu")):
        assert run(5 * 10**8, **kw).phase_s == run(0, **kw).phase_s
    assert run(3 * 10**8).phase_s == whole.phase_s  # below a third of the outer: not an early piece


def test_one_pass_cpu_adamw_by_hand():
    """A profile measured with flame's one-pass CPU AdamW: the measured rate is the whole host
    step (no separate compute copy), and a speculative step copies nothing aside; its spare
    master is pinned when it takes turns as the compute copy (bf16 master)."""
    lay = UnitCosts("l", "layer", 10**9, {}, 1e12, 0.0, 0, 0, 0)
    out = UnitCosts("outer", "outer", 0, {}, 0.0, 0.0, 0, 0, 0)
    c = ModelCosts(1, 1, [lay, out], "L")
    p = prof(cpu_adam_one_pass=True)
    cpu = 1e9 / 4e9
    h2d, fwd, bwd, d2h = 2e9 / 50e9, 1e12 / 500e12, 2e12 / 500e12, 2e9 / (70e9 * 0.5)
    pr = predict(c, p, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15, speculative=True)
    assert pr.phase_s == pytest.approx([h2d + fwd, bwd + d2h + cpu, 0.0])
    assert pr.cpu_s == pytest.approx(cpu)
    # the kernel writing into the spare buffers runs at the profile's out-of-place rate; in place
    # (no spare: a run that can never redo the step) at the in-place one
    slow = prof(cpu_adam_one_pass=True, cpu_adam_out_of_place_slowdown=1.5)
    spare = predict(c, slow, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15, speculative=True)
    assert spare.phase_s == pytest.approx([h2d + fwd, bwd + d2h + 1.5 * cpu, 0.0]) and spare.cpu_s == pytest.approx(1.5 * cpu)
    in_place = predict(c, slow, Dtypes(), ["stream"], ["keep"], "gpu", 1, 1, 1, 15, speculative=True, spare=False)
    assert in_place.phase_s == pr.phase_s
    bf16 = Dtypes(master="bfloat16", moment="bfloat16", grad="bfloat16")
    plain_host, plain_pinned = unit_host_bytes(lay, "stream", bf16)
    host, pinned = unit_host_bytes(lay, "stream", bf16, spare=True)
    assert host - plain_host == 1e9 * (2 + 4) and pinned - plain_pinned == 1e9 * 2


def test_recompute_host_by_hand():
    """recompute_host: the block runs its forward again in the backward like recompute, keeps
    nothing on the GPU between its forward and backward, and its input (act_recompute_bytes)
    crosses D2H in the forward and H2D in the backward into a pinned arena."""
    gb = 10**9
    lay = [UnitCosts(f"l{i}", "layer", 0, {}, 1e12, 0.0, 5 * gb, gb, gb) for i in range(2)]
    out = UnitCosts("outer", "outer", 0, {}, 1e12, 0.0, 0, 0, 0)
    c = ModelCosts(1, 1, lay + [out], "L")
    p = prof()
    rec = predict(c, p, Dtypes(), ["gpu"] * 2, ["recompute"] * 2, "gpu", 1, 1, 1, 15)
    host = predict(c, p, Dtypes(), ["gpu"] * 2, ["recompute_host"] * 2, "gpu", 1, 1, 1, 15)
    assert rec.activation_bytes == 2 * gb and host.activation_bytes == 0
    assert host.h2d_bytes - rec.h2d_bytes == 2 * gb and host.d2h_bytes - rec.d2h_bytes == 2 * gb
    assert host.pinned_bytes - rec.pinned_bytes == 2 * gb
    assert host.compute_s == pytest.approx(rec.compute_s)  # the same recompute
    assert host.step_s >= rec.step_s


def test_solver_keeps_recomputed_inputs_on_the_host_only_where_recompute_does_not_fit(costs):
    """offload.checkpoint_offload: a budget below every block recomputed fits with some blocks'
    inputs on the host (and fails without the option)."""
    n = len(costs.layers)
    all_rec = solve(costs, prof(), Dtypes(), 64 * GiB, 64 * GiB, 2, 1, 15, depths=(1,),
                    overrides=["weights[*]=host", "outer=host_opt"] + [f"activations[{i}]=recompute" for i in range(n)])
    need = all_rec.predicted["peak_gpu_bytes"]
    budget = need - costs.layers[0].act_recompute_bytes * n // 2
    with pytest.raises(ConfigError):
        solve(costs, prof(), Dtypes(), budget, 64 * GiB, 2, 1, 15, depths=(1,))
    plan = solve(costs, prof(), Dtypes(), budget, 64 * GiB, 2, 1, 15, depths=(1,), checkpoint_offload=True)
    k = plan.layer_acts.count("recompute_host")
    assert 0 < k and plan.predicted["peak_gpu_bytes"] <= budget and plan.checkpoint_offload
    assert "recomputed with inputs on the host" in describe(plan, costs)
    # where recomputing fits, the option only adds choices: never a slower predicted plan
    roomy = dict(gpu_budget=need + GiB, host_budget=64 * GiB, micro_batch=2, rounds=1, cpu_threads=15, depths=(1,))
    off = solve(costs, prof(), Dtypes(), **roomy)
    assert "recompute_host" not in off.layer_acts
    assert solve(costs, prof(), Dtypes(), **roomy, checkpoint_offload=True).predicted["step_s"] <= off.predicted["step_s"]


def test_auto_on_cpu_says_which_offload_options_have_no_effect(caplog):
    """offload.enable auto never offloads on CPU: options the user set for the engine are named in
    one log line, not dropped in silence; with none set nothing is logged."""
    import logging
    from types import SimpleNamespace

    from flame.offload import _offload_decision

    def job(**kw):
        return SimpleNamespace(offload=Offload(**kw))

    with caplog.at_level(logging.INFO, logger="flame.offload"):
        assert _offload_decision(None, None, job(speculative_step=True, overrides=["prefetch=2"]),
                                 torch.device("cpu")) == (False, None)
        assert _offload_decision(None, None, job(), torch.device("cpu")) == (False, None)
    lines = [r.getMessage() for r in caplog.records if r.name == "flame.offload"]
    assert len(lines) == 1 and "offload.speculative_step, offload.overrides" in lines[0]
    assert Offload(enable="on").changed_options() == []
    # offload.enable off dropped them without a word
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flame.offload"):
        assert _offload_decision(None, None, job(enable="off", gpu_memory_gib=16.0), torch.device("cpu")) == \
            (False, None)
        assert _offload_decision(None, None, job(enable="off"), torch.device("cpu")) == (False, None)
    lines = [r.getMessage() for r in caplog.records if r.name == "flame.offload"]
    assert lines == ["offload: enable=off; these have no effect: offload.gpu_memory_gib"]


def test_auto_offload_plans_once_and_the_engine_runs_that_plan(monkeypatch, tmp_path):
    """offload.enable auto plans (block timing, a compilation) to decide; the engine is built from
    that plan, not from a second planner run."""
    import os
    from types import SimpleNamespace

    import flame.offload as fo
    from flame.config.manager import FlameConfigManager

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    cfg.save_pretrained(tmp_path / "m")
    profile = os.path.join(os.path.dirname(fo.__file__), "profiles", "h100_80gb_measured.json")
    job = FlameConfigManager().parse_args(["--model.config", str(tmp_path / "m"), "--training.seq_len", "64",
                                           "--job.dump_folder", str(tmp_path / "dump"), "--offload.enable", "auto",
                                           "--offload.overrides", "weights[*]=host", "--offload.profile", profile])
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    calls = []
    real_build = fo.build_plan

    def counted(model, job_config, device, world=1):
        calls.append(device)
        return real_build(model, job_config, "cpu", world)  # the stored profile, CPU block costs

    monkeypatch.setattr(fo, "build_plan", counted)
    pd = SimpleNamespace(dp_shard=1, tp=1, world_size=1)
    # auto plans on a GPU only: the decision is asked for "cuda", the planner runs on the CPU
    monkeypatch.setattr(fo, "_clearly_fits", lambda *a: False)
    wanted, planned = fo._offload_decision(meta, pd, job, torch.device("cuda"))
    assert wanted and planned is not None and planned[0].offloads and len(calls) == 1

    def refuse(*a, **k):
        raise AssertionError("planned twice")

    monkeypatch.setattr(fo, "build_plan", refuse)
    model = LlamaForCausalLM(cfg)
    engine, _ = fo.apply_offload(model, job, pd, "cpu", planned)
    assert engine.plan is planned[0]
    engine.close()


def test_cpu_run_refuses_a_model_beyond_host_memory(monkeypatch):
    """Training on CPU without offload: a model whose weights, grads and one moment exceed the
    host's available memory is one ConfigError naming both, per this machine's ranks; one that
    fits passes."""
    from types import SimpleNamespace

    from flame.offload import refuse_cpu_model_beyond_host

    model = meta_model(small_llama())
    n = sum(p.numel() for p in model.parameters())
    dims = SimpleNamespace(dp_shard=1, tp=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr("flame.offload.planner.budgets.host_budget_bytes", lambda *a: 2 * 12 * n + 1)
    refuse_cpu_model_beyond_host(model, dims)
    monkeypatch.setattr("flame.offload.planner.budgets.host_budget_bytes", lambda *a: 2 * 12 * n - 1)
    with pytest.raises(ConfigError, match=f"{n:,} parameters.*2 rank"):
        refuse_cpu_model_beyond_host(model, dims)
    # sharded over the two ranks: half each
    refuse_cpu_model_beyond_host(model, SimpleNamespace(dp_shard=2, tp=1))


def _saved_storages(fn, logits, labels) -> dict[int, int]:
    """Bytes of each distinct storage `fn` keeps for its backward."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(logits, labels).backward()
    return seen


def test_the_traced_loss_keeps_what_the_trainer_s_loss_keeps():
    """Eager cross-entropy keeps a float32 log-softmax of the logits for its backward; the loss the
    trainer compiles (compile on, a GPU) keeps the logits as they are. The outer's traced bytes
    differ between the two by what the real losses keep (run here, inductor on the CPU)."""
    from flame.components.loss import compiled_cross_entropy_sum, cross_entropy_sum

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, use_cache=False)
    cfg._attn_implementation = "sdpa"
    mb, seq = 2, 64
    eager = measure_costs(meta_model(cfg), mb, seq).outer
    compiled = measure_costs(meta_model(cfg), mb, seq, compiled_loss=True).outer
    logits = torch.randn(mb * seq, 512, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 512, (mb * seq,))
    real_eager = _saved_storages(cross_entropy_sum, logits, labels)
    real_compiled = _saved_storages(compiled_cross_entropy_sum, logits, labels)
    assert max(real_compiled.values()) == logits.numel() * 2  # the bf16 logits, no float32 copy
    assert eager.act_keep_bytes - compiled.act_keep_bytes == sum(real_eager.values()) - sum(real_compiled.values())
    assert compiled.max_saved_bytes == max(real_compiled.values())
    assert eager.max_saved_bytes == max(real_eager.values())


def test_the_binding_constraint_of_a_plan_that_offloads_with_room_to_spare():
    """A plan that offloads while both budgets leave room is not said to be bound by the GPU budget."""
    from types import SimpleNamespace

    from flame.offload.planner.solver import _binding

    pred = dict(peak_gpu_bytes=22 * GiB, peak_host_bytes=4 * GiB, compute_s=1.0, h2d_bytes=0, d2h_bytes=0, cpu_opt_s=0.1)
    roomy = SimpleNamespace(offloads=True, predicted=pred, gpu_budget_bytes=76 * GiB, host_budget_bytes=64 * GiB,
                            layer_acts=["keep"] * 4)
    assert _binding(roomy, prof()).startswith("no budget")
    full = SimpleNamespace(**{**vars(roomy), "gpu_budget_bytes": 22 * GiB})
    assert _binding(full, prof()).startswith("GPU memory budget")


@pytest.mark.parametrize("offloaded", [True, False])
def test_maybe_offload_calls_before_host_state_once_offloading_is_decided(offloaded, monkeypatch, tmp_path):
    """The trainer's data workers' fork server starts once offloading is decided, before the model
    state is allocated in host memory; a run that does not offload never calls it."""
    from types import SimpleNamespace

    import flame.offload as fo
    from flame.config.manager import FlameConfigManager

    class Stop(Exception):
        pass

    job = FlameConfigManager().parse_args(["--job.dump_folder", str(tmp_path), "--offload.enable", "auto"])
    events = []
    monkeypatch.setattr(fo, "_offload_decision", lambda *a: (offloaded, None))

    def after_init(*a, **k):
        raise Stop

    monkeypatch.setattr(fo, "apply_offload", after_init)
    monkeypatch.setattr("flame.distributed.parallelize.apply_data_parallel", after_init)
    pd = SimpleNamespace(tp_enabled=False, dp_shard=1, tp=1, world_size=1)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    with pytest.raises(Stop):
        fo.maybe_offload(meta, pd, job, torch.device("cpu"), lambda m: events.append("init"),
                         before_host_state=lambda: events.append("fork server"))
    assert events == (["fork server", "init"] if offloaded else [])
