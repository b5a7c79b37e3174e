"""The engine on CPU ('GPU' and host both CPU, streams no-ops): same numbers as a plain run."""

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from flame.offload.planner.plan import Plan
from flame.offload.runtime.engine import OffloadEngine
from flame.offload.runtime.host_math import HostMath
from flame.offload.runtime.streams import piece_ranges

F32 = {"compute": "float32", "master": "float32", "grad": "float32", "moment": "float32"}
# weights after the engine's steps against torch's AdamW: flame's CPU AdamW kernel rounds its
# expressions differently (the compiler may fuse a multiply-add on one CPU and not another); a few
# ulp in a step's update grow, through the next steps' grads, to ~1e-6 on single weights, while a
# lost or doubled micro-batch moves many by ~lr (1e-2)
KERNEL_ATOL = 1e-5


def tiny(seed=0, tie=False):
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96, tie_word_embeddings=tie)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).float()


def plan(modes, acts, outer, rounds=1, depth=1, dtypes=F32, accs=(), outer_acc=False):
    return Plan(modes, acts, outer, depth, 2, 16, rounds, 1, dict(dtypes), 0, 0, layer_gpu_acc=list(accs), outer_gpu_acc=outer_acc)


def loss_of(model, ids):
    logits = model(ids).logits
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(0, 1))


def accumulate(model, step, rounds) -> float:
    """Forward/backward every micro-batch of one step (loss / rounds); the step's loss."""
    tot = 0.0
    for ids in step:
        l = loss_of(model, ids) / rounds
        l.backward()
        tot += l.item()
    return tot


def run_ref(model, batches, rounds, max_norm, lr=1e-2):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    out = []
    for step in batches:
        tot = accumulate(model, step, rounds)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        out.append(tot)
    return out


def run_engine(model, p, batches, rounds, max_norm, lr=1e-2, **kw):
    eng = OffloadEngine(model, p, torch.device("cpu"), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    out = []
    for step in batches:
        tot = accumulate(model, step, rounds)
        eng.optimizer_step(max_norm, True)
        eng.zero_grad()  # as the trainer does after every step
        out.append(tot)
    eng.synchronize()
    return out, eng


def batches(n, rounds, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, 96, (2, 16), generator=g) for _ in range(rounds)] for _ in range(n)]


@pytest.mark.parametrize("rounds,tie,accs,outer_acc", [(1, False, (), False), (2, True, (), False),
                                                      (2, False, (True, True, True, True), True),
                                                      (3, True, (False, True, False, True), False),
                                                      (3, False, (False, False, True, False), True)])
def test_engine_matches_plain_run(rounds, tie, accs, outer_acc):
    """Host units accumulating their grads on the host or on the GPU over the rounds of a step:
    the numbers of a plain run (clipping by the global norm included)."""
    ref = tiny(tie=tie)
    mod = copy.deepcopy(ref)
    b = batches(5, rounds)
    want = run_ref(ref, b, rounds, max_norm=0.5)
    p = plan(["gpu", "host_opt", "stream", "stream"], ["keep", "recompute", "keep", "recompute"], "host_opt", rounds,
             accs=accs, outer_acc=outer_acc)
    got, eng = run_engine(mod, p, b, rounds, max_norm=0.5)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    sd = eng.model_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=KERNEL_ATOL)


def test_all_streamed_depth2_and_state_dict_roundtrip():
    ref = tiny(seed=3)
    mod = copy.deepcopy(ref)
    b = batches(4, 1, seed=2)
    want = run_ref(ref, b[:2], 1, max_norm=1.0)
    p = plan(["stream"] * 4, ["keep"] * 4, "gpu", depth=2)
    got, eng = run_engine(mod, p, b[:2], 1, max_norm=1.0)
    assert got == pytest.approx(want, rel=1e-5)
    # checkpoint of the offloaded run resumes in a plain run (same names) and vice versa
    sd = eng.state_dict()
    assert set(sd["model"]) == set(ref.state_dict())
    plain = tiny(seed=9)
    plain.load_state_dict(sd["model"])
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    names = {p: n for n, p in plain.named_parameters()}
    opt.state_dict()  # build the layout
    st = {}
    for p_, n in names.items():
        st[p_] = {k: sd["optimizer"][f"state.{n}.{k}"].clone() for k in ("exp_avg", "exp_avg_sq")}
        st[p_]["step"] = sd["optimizer"][f"state.{n}.step"].clone()
    opt.state.update(st)
    ref_opt_losses = []
    for step in b[2:]:
        l = loss_of(plain, step[0])
        l.backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        ref_opt_losses.append(l.item())
    cont, _ = run_engine_continue(eng, mod, b[2:])
    assert cont == pytest.approx(ref_opt_losses, rel=1e-5)
    # and a fresh engine loads the offloaded checkpoint
    other = tiny(seed=5)
    eng2 = OffloadEngine(other, plan(["gpu", "stream", "host_opt", "gpu"], ["keep"] * 4, "host_opt"), torch.device("cpu"))
    eng2.load_state_dict(sd)
    torch.testing.assert_close(loss_of(other, b[0][0]), loss_of(mod.__class__(mod.config).float().eval(), b[0][0]) * 0 + loss_with(sd, b[0][0]))


def loss_with(sd, ids):
    m = tiny(seed=11)
    m.load_state_dict(sd["model"])
    return loss_of(m, ids)


def run_engine_continue(eng, model, b):
    out = []
    for step in b:
        l = loss_of(model, step[0])
        l.backward()
        eng.optimizer_step(1.0, True)
        out.append(l.item())
    eng.synchronize()
    return out, eng


def test_nan_grad_skips_step():
    mod = tiny()
    eng = OffloadEngine(mod, plan(["stream", "gpu", "host_opt", "gpu"], ["keep"] * 4, "host_opt"), torch.device("cpu"))
    before = {k: v.clone() for k, v in eng.model_state_dict().items()}
    ids = batches(1, 1)[0][0]
    (loss_of(mod, ids) * float("nan")).backward()
    norm, skipped = eng.optimizer_step(1.0, True)
    assert skipped and not torch.isfinite(norm)
    for k, v in eng.model_state_dict().items():
        torch.testing.assert_close(v, before[k], equal_nan=True)


def test_block_calibration_runs_repeatedly_on_cpu():
    from flame.offload.measure.calibration import measure_block_fudges
    from flame.offload.measure.tracing import measure_costs
    from test_planner import prof

    m = tiny()
    costs = measure_costs(m, 2, 16)
    cal = measure_block_fudges(m.config, {2: costs}, prof(), 16, torch.float32, device="cpu")[2]
    assert cal["fudge"] > 0 and cal["measured_fwd_bwd_s"] > 0
    # every candidate micro-batch timed with the one block; the prediction scales with the tokens
    cals = measure_block_fudges(m.config, {1: measure_costs(m, 1, 16), 2: costs}, prof(), 16, torch.float32, "cpu")
    assert set(cals) == {1, 2}
    assert cals[2]["predicted_fwd_bwd_s"] == pytest.approx(2 * cals[1]["predicted_fwd_bwd_s"], rel=0.05)
    # the outer (head + chunked loss) is timed without blocks and its times go into the costs
    from flame.offload.planner.refit import use_block_calibration

    chunked = {2: measure_costs(tiny(), 2, 16, loss_chunk_tokens=8)}
    cals = measure_block_fudges(m.config, chunked, prof(), 16, torch.float32, "cpu")
    assert cals[2]["outer_fwd_s"] > 0 and cals[2]["outer_bwd_s"] >= 0
    assert use_block_calibration(chunked, cals) == {2: cals[2]["fudge"]}
    assert chunked[2].outer.timed_s == [cals[2]["outer_fwd_s"], cals[2]["outer_bwd_s"]]


def test_block_calibration_of_a_compiled_run_times_the_block_compiled(monkeypatch):
    """With compile on, the block is timed compiled once (the largest micro-batch) and every
    micro-batch's block times are scaled by compiled / eager."""
    from flame.offload.measure import calibration
    from flame.offload.measure.tracing import measure_costs
    from test_planner import prof

    m = tiny()
    costs = {1: measure_costs(m, 1, 16), 2: measure_costs(m, 2, 16)}
    compiled_at = []
    real = calibration._compile_scale
    monkeypatch.setattr(calibration, "_compile_scale",
                        lambda m_, blk, mb, *a: compiled_at.append(mb) or real(m_, blk, mb, *a))
    torch._dynamo.reset()
    cals = calibration.measure_block_fudges(m.config, costs, prof(), 16, torch.float32, "cpu",
                                            compile_backend="aot_eager")
    assert compiled_at == [2]
    scale = cals[2]["compile_scale"]
    assert scale > 0 and cals[1]["compile_scale"] == scale
    assert not any("bwd_peak_bytes" in c for c in cals.values())  # a GPU measurement only
    for c in cals.values():
        assert c["fudge"] == pytest.approx(c["measured_fwd_bwd_s"] / c["predicted_fwd_bwd_s"])


def test_bf16_compute_policy_same_across_modes():
    """bf16 compute / fp32 master: streaming and CPU AdamW give the all-GPU-mode numbers."""
    mixed = {"compute": "bfloat16", "master": "float32", "grad": "float32", "moment": "float32"}
    b = batches(3, 1, seed=4)
    a_mod, s_mod = tiny(seed=6), tiny(seed=6)
    a, _ = run_engine(a_mod, plan(["gpu"] * 4, ["keep"] * 4, "gpu", dtypes=mixed), b, 1, max_norm=0.5)
    s, eng = run_engine(s_mod, plan(["stream", "host_opt", "stream", "gpu"], ["recompute", "keep", "keep", "keep"], "host_opt",
                                    dtypes=mixed), b, 1, max_norm=0.5)
    assert s == pytest.approx(a, rel=1e-3)
    assert all(v.dtype == torch.float32 for v in eng.model_state_dict().values())


def test_piece_ranges_never_cross_a_piece():
    assert piece_ranges(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert piece_ranges(3, 9, 4) == [(3, 4), (4, 8), (8, 9)]
    assert piece_ranges(5, 7, 8) == [(5, 7)]
    assert piece_ranges(8, 8, 4) == []
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lo, n, piece = (int(x) for x in torch.randint(0, 50, (3,), generator=g))
        got = piece_ranges(lo, lo + n, piece + 1)
        assert [a for a, _ in got[1:]] == [b for _, b in got[:-1]]  # contiguous
        assert (got[0][0], got[-1][1]) == (lo, lo + n) if n else got == []
        assert all(a // (piece + 1) == (b - 1) // (piece + 1) for a, b in got)  # inside one piece


def test_copies_split_at_tiny_pin_pieces_same_numbers(monkeypatch):
    """Every host<->device copy split at 40-byte pieces (and 7-element grad conversion chunks)
    gives bit-identical results: no copy site skips or misplaces a range. (float32 compute with
    bf16 grads: the one case of one micro-batch a step whose grads are converted on the GPU.)"""
    import flame.offload.runtime.gradients as gradients

    mixed = {"compute": "float32", "master": "float32", "grad": "bfloat16", "moment": "float32"}
    b = batches(3, 1, seed=4)
    p = plan(["stream", "host_opt", "stream", "gpu"], ["recompute", "keep", "keep", "keep"], "host_opt", dtypes=mixed)
    want, _ = run_engine(tiny(seed=6), p, b, 1, max_norm=0.5)
    monkeypatch.setattr(gradients, "CONV_CHUNK", 7)
    got, eng = run_engine(tiny(seed=6), p, b, 1, max_norm=0.5, pin_piece_bytes=40)
    assert eng.gradients.conversion and eng.gradients.conversion[0].numel() == 7
    assert got == want


@pytest.mark.parametrize("speculative", [False, True])
def test_bf16_host_grads_give_the_fp32_grads_numbers(monkeypatch, speculative):
    """bf16 compute, fp32 grad dtype, one micro-batch a step: host grads stay bf16 on the host
    (cost_model.host_grad_dtype: nothing sums them), and every weight and loss is bit for bit what
    fp32 host grads (converted on the GPU, as before) give, with clipping."""
    import flame.offload.runtime.engine as engine

    mixed = {"compute": "bfloat16", "master": "float32", "grad": "float32", "moment": "float32"}
    b = batches(4, 1, seed=9)
    p = plan(["stream", "host_opt", "stream", "gpu"], ["recompute", "keep", "keep", "keep"], "host_opt", dtypes=mixed)
    p.speculative_step = speculative
    got, eng = run_engine(tiny(seed=3), p, b, 1, max_norm=0.5)
    host = [u for u in eng.units if u.mode != "gpu"]
    assert {u.grads.accumulator.dtype for u in host} == {torch.bfloat16} and not eng.gradients.conversion
    assert {u.grads.accumulator.dtype for u in eng.units if u.mode == "gpu"} == {torch.float32}
    weights = [u.optimizer.master.detach().clone() for u in eng.units]
    monkeypatch.setattr(engine, "host_grad_dtype", lambda dt, rounds: dt.grad)
    want, old = run_engine(tiny(seed=3), p, b, 1, max_norm=0.5)
    assert {u.grads.accumulator.dtype for u in old.units if u.mode != "gpu"} == {torch.float32}
    assert got == want
    assert all(torch.equal(a, u.optimizer.master) for a, u in zip(weights, old.units))


@pytest.mark.parametrize("dtypes", [F32, {"compute": "bfloat16", "master": "float32", "grad": "float32", "moment": "float32"}])
def test_memory_report_is_what_the_cost_model_counts(dtypes):
    """The engine's own device memory, category by category, is cost_model.static_gpu_bytes of
    the same plan (with equal dtypes the master is the compute copy and the grad buffer the
    accumulator: counted once)."""
    from flame.offload.measure.tracing import measure_costs
    from flame.offload.planner.cost_model import Dtypes, static_gpu_bytes

    mod = tiny()
    costs = measure_costs(copy.deepcopy(mod), 2, 16)
    p = plan(["gpu", "host_opt", "stream", "stream"], ["keep"] * 4, "gpu", depth=2, dtypes=dtypes)
    _, eng = run_engine(mod, p, batches(1, 1), 1, max_norm=1.0)
    rep = eng.memory_report()
    want = static_gpu_bytes([costs.outer] + costs.layers, [p.outer_mode] + p.layer_modes, Dtypes(**dtypes), p.prefetch_depth, 1)
    assert {k: rep[k] for k in want} == want
    assert rep["total"] == sum(want.values()) + rep["other"]
    assert 0 < rep["other"] < 4096  # rotary table, step counters, the norm scalar
    # what a run out of GPU memory logs: each category's bytes next to the plan's
    eng.plan.predicted["static_gpu_bytes"] = {k: v + (i + 1) * 2**30 for i, (k, v) in enumerate(want.items())}
    line = eng.memory_explanation()
    for i, (k, v) in enumerate(want.items()):
        assert f"{k} {rep[k] / 2**30:.2f} (planned {(v + (i + 1) * 2**30) / 2**30:.2f})" in line


def test_dropped_engine_frees_model_and_buffers():
    """Nothing autograd owns (parameter hooks, saved-tensor hooks) keeps the engine alive: after
    close(), or when simply dropped, the engine, the model and their buffers are freed."""
    import gc
    import weakref

    for close in (True, False):
        mod = tiny()
        _, eng = run_engine(mod, plan(["stream", "host_opt", "gpu", "stream"], ["recompute", "keep", "keep", "keep"], "gpu"),
                            batches(1, 1), 1, max_norm=1.0)
        refs = [weakref.ref(eng), weakref.ref(mod), weakref.ref(eng.schedule.slots[0].buffer)]
        if close:
            eng.close()
            assert not mod._forward_pre_hooks and "forward" not in mod.model.layers[0].__dict__
        del eng, mod
        gc.collect()
        assert all(r() is None for r in refs)


MIXED = {"compute": "bfloat16", "master": "float32", "grad": "float32", "moment": "float32"}


@pytest.mark.parametrize("grad", ["float32", "bfloat16"])
def test_gpu_grad_accumulation_same_as_host_accumulation(grad):
    """bf16 compute: accumulating on the GPU (a separate fp32 accumulator, or with bf16 grads the
    host_opt unit's own grad buffer) gives the host accumulation's numbers."""
    dt = dict(MIXED, grad=grad)
    b = batches(3, 3, seed=7)
    modes, acts = ["stream", "host_opt", "gpu", "stream"], ["recompute", "keep", "keep", "keep"]
    host, _ = run_engine(tiny(seed=8), plan(modes, acts, "host_opt", 3, dtypes=dt), b, 3, max_norm=0.5)
    gpu, eng = run_engine(tiny(seed=8), plan(modes, acts, "host_opt", 3, dtypes=dt, accs=[True] * 4, outer_acc=True), b, 3,
                          max_norm=0.5)
    assert gpu == pytest.approx(host, rel=1e-3)
    assert (eng.units[2].grads.device_accumulator is eng.units[2].grads.buffer) == (grad == "bfloat16")
    assert [u.accumulate_on_gpu for u in eng.units] == [True, True, True, False, True]  # the gpu block accumulates anyway


def test_gpu_accumulation_fewer_rounds_than_planned_and_too_many():
    """A step with fewer micro-batches than the plan sends what it has at optimizer_step; more
    than planned is an error (the sum already left)."""
    ref = tiny(seed=2)
    mod = copy.deepcopy(ref)
    b = batches(3, 2, seed=3)
    want = run_ref(ref, b, 2, max_norm=0.5)
    p = plan(["stream", "host_opt", "stream", "gpu"], ["keep"] * 4, "host_opt", 3, accs=[True] * 4, outer_acc=True)
    got, eng = run_engine(mod, p, b, 2, max_norm=0.5)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    with pytest.raises(RuntimeError, match="3 micro-batch"):
        for ids in batches(1, 4, seed=4)[0]:
            loss_of(mod, ids).backward()


@pytest.mark.parametrize("calls", ["optimizer_step", "torch_shaped"])
def test_skipped_step_with_gpu_accumulation_then_resumes(calls):
    """A NaN step is skipped (weights and moments untouched) and the next steps are those of a
    plain run that never saw it: through optimizer_step, and through the trainer's torch-shaped
    calls (clip_grad_norm_, step() unless the norm is non-finite, zero_grad()) at the lr of the
    schedule's holder optimizer (the engine's own lr is then never used)."""
    from flame.offload.adapter import OffloadOptimizers

    ref = tiny(seed=4)
    mod = copy.deepcopy(ref)
    b = batches(3, 2, seed=5)
    want = run_ref(ref, [b[0], b[2]], 2, max_norm=0.5)
    eng = OffloadEngine(mod, plan(["stream", "host_opt", "stream", "gpu"], ["keep"] * 4, "host_opt", 2, accs=[True] * 4,
                                  outer_acc=True), torch.device("cpu"), lr=1e-2 if calls == "optimizer_step" else 1.0,
                        betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = OffloadOptimizers(eng, lr=1e-2, num_groups=1)
    got = []
    for i, step in enumerate(b):
        tot = 0.0
        for ids in step:
            l = loss_of(mod, ids) / 2 * (float("nan") if i == 1 else 1.0)
            l.backward()
            tot += l.item()
        if calls == "optimizer_step":
            _, skipped = eng.optimizer_step(0.5, True)
            eng.zero_grad()
        else:
            skipped = not torch.isfinite(opt.clip_grad_norm_(0.5))
            if not skipped:
                opt.step()
            opt.zero_grad()
        assert skipped == (i == 1)
        if not skipped:
            got.append(tot)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_host_add_chunked_conversion_is_exact(chunk):
    """The CPU worker's grad add converts bf16 chunks into an fp32 scratch buffer before adding:
    the same numbers as torch's (slow, unvectorized) mixed-dtype add, at any chunk boundary."""
    hm = HostMath(chunk)
    g = torch.Generator().manual_seed(11)
    acc = torch.randn(103, generator=g)
    staged = torch.randn(103, generator=g).to(torch.bfloat16)
    want = acc.clone().add_(staged)
    hm.add_(acc, staged)
    assert torch.equal(acc, want)
    same = torch.randn(103, generator=g)
    hm.add_(acc, same)  # same dtype: a plain add
    assert torch.equal(acc, want + same)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [7, 64, 1 << 22])
def test_host_add_norm_sums_every_chunk(dtype, chunk):
    """add_(..., norm=True) (the CPU worker's last accumulation) returns the sum of squares of the
    whole result, every chunk counted, against float64; without `norm` it returns None."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    acc = torch.randn(1001, generator=g)
    staged = torch.randn(1001, generator=g).to(dtype)
    want = acc.double() + staged.double()
    hm = HostMath(chunk)
    got = hm.add_(acc, staged, norm=True)
    torch.testing.assert_close(acc.double(), want, rtol=1e-6, atol=1e-6)
    assert got == pytest.approx(float(want.square().sum()), rel=1e-6)
    assert hm.add_(acc, staged) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_host_sq_norm_matches_float64(dtype, chunk):
    """The host grad norm (chunked fp32 square + cascade sum, chunks summed in float64) against a float64 reference, on a
    buffer long enough that a float32 running sum drifts (torch's vector_norm was 1% low at 67M)."""
    n = 3_000_003 if chunk > 7 else 1001
    x = torch.randn(n, generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))).to(dtype)
    want = float(x.double().square().sum())
    assert HostMath(chunk).sq_norm(x) == pytest.approx(want, rel=1e-6)


def test_host_norm_taken_with_the_last_accumulation():
    """rounds > 1, host accumulation: the norm comes from the CPU worker after the last round's
    add (not in optimizer_step), and a step with fewer rounds than planned still gets its norm."""
    b = batches(2, 3, seed=12)
    modes, acts = ["stream", "host_opt", "gpu", "stream"], ["recompute", "keep", "keep", "keep"]
    ref = tiny(seed=13)
    mod = copy.deepcopy(ref)
    want = run_ref(ref, b, 3, max_norm=0.05)
    got, eng = run_engine(mod, plan(modes, acts, "host_opt", 3), b, 3, max_norm=0.05)
    assert got == pytest.approx(want, rel=1e-4)
    seconds = eng.reset_host_seconds()
    assert seconds["accumulate_and_norm"] > 0 and all(u.grads.host_sq_norm is None for u in eng.units)
    # two of three planned rounds: no last accumulation, the step takes the norms itself
    ids = b[0]
    for x in ids[:2]:
        (loss_of(mod, x) / 3).backward()
    norm, skipped = eng.optimizer_step(0.05, True)
    for x in ids[:2]:
        (loss_of(ref, x) / 3).backward()
    want_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    assert not skipped and float(norm) == pytest.approx(float(want_norm), rel=1e-4)
    eng.close()


@pytest.mark.parametrize("kernel,grad", [(True, "bfloat16"), (False, "bfloat16"), (True, "float16")],
                         ids=["one_pass_kernel", "torch_fused_adamw", "float16_grads"])
def test_low_precision_grads_fp32_master_match_gpu_mode(kernel, grad, monkeypatch):
    """fp32 master, bf16 grads: the one-pass kernel reads the bf16 grads itself; torch's fused
    AdamW (where the kernel does not build, or for float16 grads, which it does not take) converts
    every unit's grads into one reused buffer (no fresh unit-sized tensor a step). All give the
    all-GPU-mode numbers; the host work is timed."""
    if not kernel:
        monkeypatch.setattr("flame.offload.runtime.host_optimizer.cpu_adamw.available", lambda: False)
    dt = dict(MIXED, grad=grad)
    b = batches(3, 1, seed=9)
    ref, _ = run_engine(tiny(seed=10), plan(["gpu"] * 4, ["keep"] * 4, "gpu", dtypes=dt), b, 1, max_norm=0.5)
    got, eng = run_engine(tiny(seed=10), plan(["stream", "host_opt", "stream", "host_opt"], ["keep"] * 4, "host_opt",
                                              dtypes=dt), b, 1, max_norm=0.5)
    assert eng.optimizer.kernel == kernel
    assert got == pytest.approx(ref, rel=1e-3)
    scratch = eng.optimizer.grad_scratch
    if kernel and grad == "bfloat16":
        assert scratch is None
    else:
        assert scratch.dtype == torch.float32 and scratch.numel() == max(u.grads.accumulator.numel() for u in eng.units)
    eng.optimizer_step(0.5, True)
    eng.synchronize()
    assert eng.optimizer.grad_scratch is scratch
    seconds = eng.reset_host_seconds()
    assert "cpu_adam" in seconds and eng.worker.seconds == {}


SWITCH_INTERVAL_SCRIPT = """
import gc, sys
import pytest, torch
sys.path.insert(0, sys.argv[1])
from test_engine_cpu import plan, tiny
from flame.offload.runtime.engine import OffloadEngine
from flame.offload.runtime.switch_interval import SWITCH_INTERVAL_S, ShortSwitchInterval

def short():
    return sys.getswitchinterval() <= SWITCH_INTERVAL_S + 1e-9

sys.setswitchinterval(0.0037)  # not the default: a restore to a constant would not give it back
original = sys.getswitchinterval()
def restored():  # the interpreter stores microseconds
    return sys.getswitchinterval() == pytest.approx(original, abs=2e-6)

p = plan(["stream", "gpu", "host_opt", "gpu"], ["keep"] * 4, "host_opt")
a = OffloadEngine(tiny(), p, torch.device("cpu"))
assert short()
b = OffloadEngine(tiny(), p, torch.device("cpu"))
a.close()
assert short()  # b still runs its worker
b.close()
assert restored()
c = OffloadEngine(tiny(), p, torch.device("cpu"))
assert short()
del c  # dropped without close(): its lease ends with it
gc.collect()
assert restored()
with ShortSwitchInterval(1e-4):
    with ShortSwitchInterval(5e-5) as inner:
        inner_value = sys.getswitchinterval()
        assert inner_value < 6e-5
        inner.release()  # released twice (here and at the exit): counted once
    assert sys.getswitchinterval() == inner_value  # still leased: shortened, not restored
assert restored()
print("ok")
"""


def test_engine_shortens_the_gil_switch_interval_while_it_lives():
    """The CPU worker's chunked host ops wait for the GIL after each dispatch: while any engine
    lives the interpreter's switch interval is SWITCH_INTERVAL_S at most; the process's own value
    comes back when the last engine closes (in any order) or is collected without close(), and
    after nested leases. In a fresh interpreter: an engine another test left alive holds a lease."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", SWITCH_INTERVAL_SCRIPT, here], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_runtime_chunk_sizes_are_the_cost_models():
    """The runtime takes its chunk sizes from the planner's cost model (one definition), which
    counts their buffers."""
    from flame.offload.planner import cost_model
    from flame.offload.runtime import gradients, host_math

    assert cost_model.CONV_CHUNK == gradients.CONV_CHUNK and cost_model.HOST_MATH_CHUNK == host_math.HostMath().chunk


def test_no_decay_parameters_match_torch_param_groups():
    """Norm weights excluded from weight decay (the trainer's no_decay set) in every unit mode: the
    fused AdamW decays each flat master in its one pass and the engine divides the no_decay ranges
    by the decay factor first; the numbers of torch AdamW with a weight_decay=0 group for them."""
    ref = tiny(seed=5)
    mod = copy.deepcopy(ref)
    skip = {n for n, _ in ref.named_parameters() if "norm" in n}
    assert len(skip) == 2 * 4 + 1  # two norms per block and the final one
    groups = [{"params": [p for n, p in ref.named_parameters() if n not in skip], "weight_decay": 0.1},
              {"params": [p for n, p in ref.named_parameters() if n in skip], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    b = batches(4, 1, seed=6)
    want = []
    for step in b:
        want.append(accumulate(ref, step, 1))
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    p = plan(["gpu", "host_opt", "stream", "stream"], ["keep"] * 4, "host_opt")
    got, eng = run_engine(mod, p, b, 1, max_norm=0.5, no_decay=skip)
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    sd = eng.model_state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=KERNEL_ATOL)
    # decay really is applied elsewhere and not to the norms: a run without the no_decay set differs
    # in the norms (they start at 1.0 and decay towards 0)
    _, decayed = run_engine(tiny(seed=5), p, b, 1, max_norm=0.5)
    sd2 = decayed.model_state_dict()
    for k, v in ref.state_dict().items():
        if k in skip:
            assert not torch.allclose(sd2[k], v, rtol=1e-5, atol=1e-6), k


def engine_against_kept(modes, acts, rounds):
    """The engine with activation modes `acts` (40-byte pin pieces, so every copy is split) gives
    the losses and weights of keeping every block, bit for bit; returns that engine."""
    b = batches(3, rounds, seed=7)
    want, e1 = run_engine(tiny(seed=8), plan(modes, ["keep"] * 4, "host_opt", rounds), b, rounds, max_norm=0.5)
    got, e2 = run_engine(tiny(seed=8), plan(modes, acts, "host_opt", rounds), b, rounds, max_norm=0.5,
                         pin_piece_bytes=40)
    assert got == want
    for k, v in e1.model_state_dict().items():
        assert torch.equal(e2.model_state_dict()[k], v), k
    return e2


ROUNDS_MODES = [(1, ["gpu", "host_opt", "stream", "stream"]), (2, ["stream"] * 4)]


@pytest.mark.parametrize("rounds,modes", ROUNDS_MODES)
def test_offloaded_activations_bit_identical_to_kept(rounds, modes):
    """Blocks whose saved tensors go to the host arena and back, mixed with kept and recomputed
    blocks, over rounds that reuse each arena."""
    eng = engine_against_kept(modes, ["offload", "recompute", "offload", "offload"], rounds)
    arenas = [u.activations for u in eng.units if u.activations is not None]
    assert len(arenas) == 3 and all(a.arena is not None and a.arena.numel() >= a.nbytes > 0 for a in arenas)
    # nothing left on the 'GPU' between steps: the forward dropped its copies, the backward its restored ones
    assert all(not a.pending and not a.restored for a in arenas)


@pytest.mark.parametrize("rounds,modes", ROUNDS_MODES)
def test_recomputed_blocks_with_inputs_on_the_host_match_kept(rounds, modes):
    """recompute_host: a recomputed block's input goes to its host arena in the forward and back
    for its recompute; the arena holds exactly the block's input (batch x seq x hidden)."""
    eng = engine_against_kept(modes, ["recompute_host", "recompute", "recompute_host", "offload"], rounds)
    inputs = [eng.units[i + 1].activations for i in (0, 2)]
    hidden = 2 * 16 * 32 * 4  # 2 x 16 tokens x 32 hidden, float32
    assert [a.entries[0][1] for a in inputs] == [hidden, hidden] and all(len(a.entries) == 1 for a in inputs)
    assert all(not a.pending and not a.restored for a in inputs)


@pytest.mark.parametrize("act,alive", [("recompute_host", 0), ("recompute", 4)])
def test_recompute_host_keeps_no_block_input_beside_its_host_copy(act, alive):
    """After the forward, no recompute_host block's input is alive (its only copy is in the arena,
    a reference kept until the backward would hold it on the GPU); a plain recomputed block keeps
    its input by design."""
    import weakref

    mod = tiny()
    eng = OffloadEngine(mod, plan(["stream"] * 4, [act] * 4, "host_opt"), torch.device("cpu"), lr=1e-2)
    refs = []
    for b in mod.model.layers:
        b.register_forward_pre_hook(lambda m, a: refs.append(weakref.ref(a[0])))
    loss = loss_of(mod, batches(1, 1)[0][0])
    assert len(refs) == 4 and sum(r() is not None for r in refs) == alive
    loss.backward()
    eng.optimizer_step(1.0, True)
    eng.close()


def test_input_saving_checkpoint_gives_grads_under_a_frozen_input():
    """The block's parameters get their grads when its input takes none (a frozen embedding)."""
    from flame.offload.runtime.hooks import _input_saving_checkpoint

    lin = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4)  # no grad
    _input_saving_checkpoint(lambda t, scale: lin(t) * scale, x, 2.0).sum().backward()
    want = torch.nn.Linear(4, 4)
    want.load_state_dict(lin.state_dict())
    (want(x) * 2.0).sum().backward()
    assert torch.equal(lin.weight.grad, want.weight.grad) and torch.equal(lin.bias.grad, want.bias.grad)
    lin.zero_grad()
    _input_saving_checkpoint(lambda hidden_states: lin(hidden_states), hidden_states=x).sum().backward()
    assert torch.equal(lin.bias.grad, torch.full((4,), 3.0))


def test_offload_rejects_an_unknown_activation_mode():
    from flame.errors import ConfigError

    with pytest.raises(ConfigError, match="'swap'"):
        OffloadEngine(tiny(), plan(["gpu"] * 4, ["keep", "swap", "keep", "keep"], "gpu"), torch.device("cpu"))


def test_host_activations_restore_each_layout():
    """Dense tensors (contiguous, permuted, an offset row block) come back with their own strides,
    others (a column slice, an expanded view) contiguous; all with their values; a tensor saved
    twice is copied once."""
    from flame.offload.runtime.activations import HostActivations, dense_strides
    from flame.offload.runtime.streams import Streams

    acts = HostActivations("b", Streams(torch.device("cpu")), torch.device("cpu"), False, pin_piece_bytes=40)
    base = torch.randn(2, 5, 3, 4)
    saved = [base.transpose(1, 2), base[:, 1:3], torch.randn(4, 1).expand(4, 3), base[1:], torch.randn(()),
             torch.randn(3, 4).to(torch.bfloat16)]
    assert [dense_strides(t) is not None for t in saved] == [True, False, False, True, True, True]
    acts.begin_forward()
    handles = [acts.pack(t) for t in saved]
    assert acts.pack(saved[0]) == handles[0] and len(acts.entries) == len(saved)
    acts.copy_out()
    acts.release_forward()
    for t, h in zip(saved, handles):
        r = acts.unpack(h[2])
        assert torch.equal(r, t) and r.dtype == t.dtype
        assert r.stride() == t.stride() if dense_strides(t) is not None else r.is_contiguous()


@pytest.mark.parametrize("rounds", [1, 2])
def test_selective_recompute_bit_identical_to_kept(rounds):
    """Blocks under selective recompute (matmul outputs kept, the rest recomputed in the backward)
    mixed with kept, recomputed and offloaded ones: the losses and weights of keeping everything."""
    b = batches(3, rounds, seed=9)
    modes = ["stream", "host_opt", "gpu", "stream"]
    want, e1 = run_engine(tiny(seed=10), plan(modes, ["keep"] * 4, "host_opt", rounds), b, rounds, max_norm=0.5)
    sel = plan(modes, ["selective", "recompute", "selective", "offload"], "host_opt", rounds)
    got, e2 = run_engine(tiny(seed=10), sel, b, rounds, max_norm=0.5)
    assert got == want
    for k, v in e1.model_state_dict().items():
        assert torch.equal(e2.model_state_dict()[k], v), k


def test_selective_checkpoint_keeps_only_matmul_outputs():
    """Under the selective policy the backward recomputes the elementwise ops, not the matmuls."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flame.offload.runtime.selective import selective_checkpoint

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    lin = torch.nn.Linear(8, 8, bias=False)
    x = torch.randn(4, 8, requires_grad=True)
    def f(t):
        h = lin(t)
        return torch.nn.functional.silu(h) * h  # the product's backward needs silu's output

    y = selective_checkpoint(f, x)
    with Count() as c:
        y.sum().backward()
    names = [str(f) for f in c.ops]
    assert any("silu.default" in n for n in names)  # recomputed
    assert sum("aten.mm.default" in n for n in names) == 2  # dX and dW only, no forward matmul again



def test_selective_recompute_of_compiled_blocks_matches_kept():
    """Blocks compiled one by one (as --training.compile does) under selective recompute: the
    checkpoint goes inside each compiled graph, and the losses and weights are those of the
    uncompiled blocks kept whole."""
    from torch._dynamo.eval_frame import OptimizedModule

    b = batches(3, 1, seed=9)
    modes = ["stream", "host_opt", "gpu", "stream"]
    want, e1 = run_engine(tiny(seed=10), plan(modes, ["keep"] * 4, "host_opt"), b, 1, max_norm=0.5)
    torch._dynamo.reset()
    model = tiny(seed=10)
    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = torch.compile(layers[i], backend="aot_eager")
    got, e2 = run_engine(model, plan(modes, ["selective", "recompute", "selective", "keep"], "host_opt"), b, 1,
                         max_norm=0.5)
    assert isinstance(layers[0], OptimizedModule) and "forward" in vars(layers[0]._orig_mod)
    assert got == pytest.approx(want, rel=1e-5)
    got_state = {k.replace("._orig_mod", ""): v for k, v in e2.model_state_dict().items()}
    for k, v in e1.model_state_dict().items():
        torch.testing.assert_close(got_state[k], v, rtol=1e-4, atol=1e-6)


def test_input_saving_checkpoint_gives_grads_to_every_tensor_argument():
    """A second tensor argument that takes grads (a residual passed on) gets them through the
    recompute, positional or keyword, as without the checkpoint."""
    from flame.offload.runtime.hooks import _input_saving_checkpoint

    lin = torch.nn.Linear(4, 4)

    def block(h, residual, scale=1.0):
        return lin(h) * scale + residual * residual

    for as_kw in (False, True):
        h, r = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
        out = _input_saving_checkpoint(block, h, residual=r, scale=2.0) if as_kw else \
            _input_saving_checkpoint(block, h, r, scale=2.0)
        out.sum().backward()
        h2, r2 = h.detach().clone().requires_grad_(), r.detach().clone().requires_grad_()
        block(h2, r2, scale=2.0).sum().backward()
        assert torch.equal(h.grad, h2.grad) and torch.equal(r.grad, r2.grad), as_kw


def test_state_dict_names_are_a_plain_runs_with_blocks_checkpointed_and_compiled():
    """Blocks wrapped by activation checkpointing and torch.compile (as the trainer wraps them):
    the engine saves and loads its weights and AdamW state under the names of the unwrapped model,
    those torch's get_model_state_dict gives a plain run, so seed and resume checkpoints cross
    between plain and offloaded runs; no_decay names given with the wrappers still apply."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    ref = tiny(seed=9)
    ref.model.layers[1].register_buffer("scale", torch.arange(3.0))  # a persistent buffer inside a wrapped block
    model = copy.deepcopy(ref)
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(checkpoint_wrapper(block), backend="eager")
    wrapped_norms = {n for n, _ in model.named_parameters() if "norm" in n}
    assert any("_orig_mod._checkpoint_wrapped_module" in n for n in wrapped_norms)
    plain_names = set(get_model_state_dict(ref).keys())
    p = plan(["gpu", "host_opt", "stream", "stream"], ["keep"] * 4, "host_opt")
    eng = OffloadEngine(model, p, torch.device("cpu"), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                        no_decay=wrapped_norms)
    assert "model.layers.1.scale" in plain_names
    assert set(eng.model_state_keys()) == set(eng.model_state_dict()) == plain_names
    assert plain_names == set(get_model_state_dict(model).keys())
    opt = eng.optimizer_state_dict()
    assert {k.split(".", 1)[1].rsplit(".", 1)[0] for k in opt if k.startswith("param_groups.")} == \
        {n for n, p in ref.named_parameters() if p.requires_grad}
    decays = {k[len("param_groups."):-len(".weight_decay")]: v for k, v in opt.items() if k.endswith(".weight_decay")}
    assert {n for n, v in decays.items() if v == 0.0} == {n for n in plain_names if "norm" in n}
    # a plain model's state loads into the engine under those names
    other = tiny(seed=10)
    other.model.layers[1].register_buffer("scale", torch.arange(3.0))
    other = other.state_dict()
    eng.load_model_state_dict({k: v for k, v in other.items() if k in plain_names})
    for k, v in eng.model_state_dict().items():
        torch.testing.assert_close(v, other[k])
    eng.close()
