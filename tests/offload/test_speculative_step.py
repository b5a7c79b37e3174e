"""Speculative CPU steps (plan.speculative_step): host units step as their grads land in the
backward, and keep, redo or undo that update at step(). Every outcome must equal the
non-speculative engine's bit for bit: unclipped steps (kept), clipped steps and a changed lr
(redone), skipped steps (undone), over the three ways grads reach the host."""

import math

import pytest
import torch

from flame.offload.runtime.engine import OffloadEngine
from tests.offload.test_engine_cpu import batches, loss_of, plan, tiny

MODES = (["stream", "host_opt", "stream", "gpu"], ["keep", "recompute", "keep", "keep"], "host_opt")


def run(speculative, rounds, accs, max_norms, lrs, nan_step=None, tell_lr=True):
    model = tiny(seed=7)
    p = plan(*MODES, rounds, accs=accs, outer_acc=bool(accs))
    p.speculative_step = speculative
    eng = OffloadEngine(model, p, torch.device("cpu"), lr=lrs[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
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


@pytest.mark.parametrize("rounds,accs,kernel", [(1, (), True), (2, (), True), (2, (True,) * 4, True), (1, (), False)],
                         ids=["one_round", "host_accumulation", "gpu_accumulation", "torch_fused_adamw"])
def test_speculative_steps_equal_the_plain_engine(rounds, accs, kernel, monkeypatch):
    if not kernel:  # torch's fused AdamW, as where flame's C kernel does not build
        monkeypatch.setattr("flame.offload.runtime.host_optimizer.cpu_adamw.available", lambda: False)
    # unclipped (0: no clipping; 100: above the norm), clipped (1e-3), at a changing lr
    max_norms = [0.0, 1e-3, 100.0, 1e-3, 0.0]
    lrs = [1e-2, 1e-2, 5e-3, 5e-3, 2e-3]
    plain = run(False, rounds, accs, max_norms, lrs)
    spec = run(True, rounds, accs, max_norms, lrs)
    assert_same(spec, plain)
    assert spec[4].get("speculative_commit", 0) > 0  # speculative updates were kept
    assert spec[4].get("speculative_discarded", 0) > 0  # and redone where the steps clipped
    assert "speculative_commit" not in plain[4]


def test_unclipped_steps_keep_the_speculative_update():
    max_norms, lrs = [0.0, 100.0, 0.0], [1e-2, 5e-3, 5e-3]
    spec = run(True, 1, (), max_norms, lrs)
    assert_same(spec, run(False, 1, (), max_norms, lrs))
    assert "speculative_discarded" not in spec[4]


def test_skipped_step_and_unknown_lr_undo_or_redo_it():
    """A NaN step is skipped (its speculative update undone, compute copies included); without the
    schedule's lr the speculation uses the last one, and a changed lr redoes the step."""
    max_norms, lrs = [1.0, 1.0, 1.0, 1.0], [1e-2, 1e-2, 3e-3, 3e-3]
    for tell_lr in (True, False):
        plain = run(False, 1, (), max_norms, lrs, nan_step=1, tell_lr=tell_lr)
        spec = run(True, 1, (), max_norms, lrs, nan_step=1, tell_lr=tell_lr)
        assert spec[1] == [1]
        assert_same(spec, plain)
        assert spec[4].get("speculative_discarded", 0) > 0
