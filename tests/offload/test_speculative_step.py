"""Speculative CPU steps (plan.speculative_step): host units step as their grads land in the
backward, and keep, redo or undo that update at step(). Every outcome must equal the
non-speculative engine's bit for bit: unclipped steps (kept), clipped steps and a changed lr
(redone), skipped steps (undone), over the three ways grads reach the host. With one round a step
the outer unit's untied head is an early piece (stepped alone as soon as its grad arrives, the
rest of the outer when the embedding's grad completes it): the same bit for bit."""

import math

import pytest
import torch

from flame.offload.runtime.engine import OffloadEngine
from tests.offload.test_engine_cpu import F32, batches, loss_of, plan, tiny

MODES = (["stream", "host_opt", "stream", "gpu"], ["keep", "recompute", "keep", "keep"], "host_opt")


# bf16 compute copy and fp32 grads: grads converted on the 'GPU' before D2H, a separate compute copy
BF16_COMPUTE = dict(F32, compute="bfloat16")


def run(speculative, rounds, accs, max_norms, lrs, nan_step=None, tell_lr=True, dtypes=F32, redo=True):
    model = tiny(seed=7)
    p = plan(*MODES, rounds, accs=accs, outer_acc=bool(accs), dtypes=dtypes)
    p.speculative_step, p.speculative_redo = speculative, redo
    eng = OffloadEngine(model, p, torch.device("cpu"), lr=lrs[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                        no_decay={"model.norm.weight", "model.embed_tokens.weight"})
    head = next(k for k, (n, _) in enumerate(eng.units[0].params) if n == "lm_head.weight")
    assert (head in eng.units[0].early) == (rounds == 1)  # the head is an early piece with one round
    losses, skipped = [], []
    for i, step in enumerate(batches(len(max_norms), rounds, seed=3)):
        if tell_lr:  # as OffloadOptimizers does: the schedule's lr of this step
            eng.optimizer.next_lr = lambda i=i: lrs[i]
        for ids in step:
            loss = loss_of(model, ids) / rounds
            (loss * (float("nan") if i == nan_step else 1.0)).backward()
            losses.append(loss.item())
        norm = eng.clip_grad_norm_(max_norms[i])
        if not math.isfinite(norm.item()):  # the trainer's skip: no step, then zero_grad
            skipped.append(i)
        else:
            eng.step(lr=lrs[i])
        eng.zero_grad()
    eng.synchronize()
    seconds = eng.reset_host_seconds()
    assert all((u.optimizer.spare is not None) == (speculative and redo) for u in eng.units
               if u.optimizer is not None and u.mode != "gpu")
    return losses, skipped, eng.model_state_dict(), eng.optimizer_state_dict(), seconds


def assert_same(a, b):
    assert a[0] == b[0] and a[1] == b[1]  # losses and skipped steps
    for sd_a, sd_b in ((a[2], b[2]), (a[3], b[3])):
        assert sd_a.keys() == sd_b.keys()
        for k, v in sd_a.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(v, sd_b[k]), k
            else:
                assert v == sd_b[k], k


@pytest.mark.parametrize("rounds,accs,kernel,dtypes", [(1, (), True, F32), (2, (), True, F32),
                                                      (2, (True,) * 4, True, F32), (1, (), False, F32),
                                                      (1, (), True, BF16_COMPUTE), (1, (), False, BF16_COMPUTE)],
                         ids=["one_round", "host_accumulation", "gpu_accumulation", "torch_fused_adamw",
                              "bf16_compute", "bf16_compute_torch_fused_adamw"])
def test_speculative_steps_equal_the_plain_engine(rounds, accs, kernel, dtypes, monkeypatch):
    if not kernel:  # torch's fused AdamW, as where flame's C kernel does not build
        monkeypatch.setattr("flame.offload.runtime.host_optimizer.cpu_adamw.available", lambda: False)
    # unclipped (0: no clipping; 100: above the norm), clipped (1e-3), at a changing lr
    max_norms = [0.0, 1e-3, 100.0, 1e-3, 0.0]
    lrs = [1e-2, 1e-2, 5e-3, 5e-3, 2e-3]
    plain = run(False, rounds, accs, max_norms, lrs, dtypes=dtypes)
    spec = run(True, rounds, accs, max_norms, lrs, dtypes=dtypes)
    assert_same(spec, plain)
    assert spec[4].get("speculative_commit", 0) > 0  # speculative updates were kept
    assert spec[4].get("speculative_discarded", 0) > 0  # and redone where the steps clipped
    assert "speculative_commit" not in plain[4]


@pytest.mark.parametrize("rounds,accs,kernel,dtypes", [(1, (), True, F32), (2, (), True, F32),
                                                      (2, (True,) * 4, True, F32), (1, (), False, F32),
                                                      (1, (), True, BF16_COMPUTE)],
                         ids=["one_round", "host_accumulation", "gpu_accumulation", "torch_fused_adamw",
                              "bf16_compute"])
def test_in_place_speculation_without_clipping_equals_the_plain_engine(rounds, accs, kernel, dtypes, monkeypatch):
    """A run that neither clips nor skips (plan.speculative_redo False): no spare buffers, the
    update goes into the state, pieces and all, with the step counted once; the same bits."""
    if not kernel:
        monkeypatch.setattr("flame.offload.runtime.host_optimizer.cpu_adamw.available", lambda: False)
    max_norms, lrs = [0.0] * 4, [1e-2, 5e-3, 5e-3, 2e-3]
    spec = run(True, rounds, accs, max_norms, lrs, dtypes=dtypes, redo=False)
    assert_same(spec, run(False, rounds, accs, max_norms, lrs, dtypes=dtypes))
    assert spec[4].get("speculative_commit", 0) > 0 and "speculative_discarded" not in spec[4]


def test_in_place_speculation_refuses_a_step_it_cannot_redo():
    """Clipping, a skipped step or an lr other than the speculated one would need the state the
    in-place update overwrote: an error, never a silently different step."""
    with pytest.raises(RuntimeError, match="cannot be redone"):
        run(True, 1, (), [1e-3, 1e-3], [1e-2, 1e-2], redo=False)
    with pytest.raises(RuntimeError, match="cannot be undone"):
        run(True, 1, (), [0.0, 0.0], [1e-2, 1e-2], nan_step=1, redo=False)


def test_unclipped_steps_keep_the_speculative_update():
    max_norms, lrs = [0.0, 100.0, 0.0], [1e-2, 5e-3, 5e-3]
    spec = run(True, 1, (), max_norms, lrs)
    assert_same(spec, run(False, 1, (), max_norms, lrs))
    assert "speculative_discarded" not in spec[4]


def test_skipped_step_and_unknown_lr_undo_or_redo_it():
    """A NaN step is skipped (its speculative update undone, compute copies included); without the
    schedule's lr the speculation uses the last one, and a changed lr redoes the step."""
    max_norms, lrs = [1.0, 1.0, 1.0, 1.0], [1e-2, 1e-2, 3e-3, 3e-3]
    for tell_lr, dtypes in ((True, F32), (False, F32), (True, BF16_COMPUTE)):
        plain = run(False, 1, (), max_norms, lrs, nan_step=1, tell_lr=tell_lr, dtypes=dtypes)
        spec = run(True, 1, (), max_norms, lrs, nan_step=1, tell_lr=tell_lr, dtypes=dtypes)
        assert spec[1] == [1]
        assert_same(spec, plain)
        assert spec[4].get("speculative_discarded", 0) > 0


def test_the_head_steps_before_the_outer_unit_completes():
    """The untied head's grad arrives first in the backward: its speculative CPU step runs while the
    blocks' backward does, before the embedding's grad completes the outer unit; the rest of the
    outer steps after. A block (no parameter a third of it) stays one piece."""
    model = tiny(seed=7)
    p = plan(*MODES)
    p.speculative_step = True
    eng = OffloadEngine(model, p, torch.device("cpu"), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    outer = eng.units[0]
    head = next(k for k, (n, _) in enumerate(outer.params) if n == "lm_head.weight")
    assert outer.pieces[outer.early[head]] == (outer.offsets[head], outer.numel)
    assert all(u.pieces == [(0, u.numel)] for u in eng.units[1:])
    eng.worker.trace = []

    def outer_steps():
        return sum(1 for kind, unit, *_ in list(eng.worker.trace) if (kind, unit) == ("cpu_step", 0))

    before_embedding = []

    def at_embedding_grad(grad):  # every block's backward has run, the embedding's grad not yet
        eng.worker.wait()
        before_embedding.append(outer_steps())

    def on_embedding(mod, args, out):
        out.register_hook(at_embedding_grad)

    model.model.embed_tokens.register_forward_hook(on_embedding)
    for i, step in enumerate(batches(3, 1, seed=3)):
        loss_of(model, step[0]).backward()
        eng.step()  # unclipped: every speculative update is kept
        eng.zero_grad()
        eng.synchronize()
        assert before_embedding[i] == 2 * i + 1  # this step's head piece (and the earlier steps' two pieces)
        assert outer_steps() == 2 * i + 2
    assert eng.optimizer.speculations == {"kept": 3 * sum(u.mode != "gpu" for u in eng.units)}


def test_the_trainer_waits_for_checkpoint_staging_before_an_in_place_backward(tmp_path):
    """An async checkpoint's staging copies the optimizer state in the background while the next
    step runs; in-place speculative updates write that state during the backward, so the trainer
    waits for the staging before the backward too, not only before step()."""
    import os

    import flame
    from tests.trainer.helpers import tiny_job, train_in_process

    profile = os.path.join(os.path.dirname(flame.__file__), "offload/profiles/h100_80gb_measured.json")
    calls = []

    def count_waits(trainer):
        wait = trainer.checkpointer.maybe_wait_for_staging

        def counted():
            calls.append(1)
            return wait()

        trainer.checkpointer.maybe_wait_for_staging = counted

    offload = ["--offload.enable", "on", "--offload.profile", profile, "--offload.overrides", "weights[*]=host",
               "--offload.speculative_step", "--checkpoint.no-enable", "--training.steps", "3"]
    # per step: before the backward (in place only) and before step()
    for no_redo, waits in ((["--training.max_norm", "0", "--training.no-skip_nan_inf"], 6), ([], 3)):
        calls.clear()
        train_in_process(tiny_job(str(tmp_path / f"run{len(no_redo)}"), *offload, *no_redo), before_train=count_waits)
        assert len(calls) == waits
