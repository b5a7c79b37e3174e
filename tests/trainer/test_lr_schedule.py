"""LR schedule values: warmup, cosine/linear/sqrt decay to lr_min, WSD via decay_ratio."""

import math

import pytest
import torch
from torchtitan.components.lr_scheduler import build_lr_schedulers

from flame.components.optimizer import build_optimizers
from flame.config.manager import FlameConfigManager
from tests.trainer.helpers import TINY_LLAMA


def lrs(*args, steps=10):
    cfg = FlameConfigManager().parse_args(["--model.config", TINY_LLAMA, "--optimizer.lr", "1.0", *args])
    model = torch.nn.Linear(4, 4)
    opt = build_optimizers([model], cfg.optimizer, torch.device("cpu"))
    sched = build_lr_schedulers(opt, cfg.lr_scheduler, steps)
    out = []
    for _ in range(steps):
        out.append(sched.schedulers[0].get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_to_lr_min():
    got = lrs("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_type", "cosine", "--lr_scheduler.lr_min", "0.1")
    assert got[:2] == pytest.approx([0.5, 1.0])
    # torchtitan adds one stable step (a virtual last step keeps the final lr above lr_min),
    # then decays over 8 steps: progress k/8 at step 2 + k
    expect = [1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 8)) for k in range(1, 8)]
    assert got[2:] == pytest.approx(expect)
    assert min(got) >= 0.1 - 1e-9


@pytest.mark.parametrize("kind, f", [("linear", lambda p: 1 - p), ("sqrt", lambda p: 1 - math.sqrt(p))])
def test_linear_and_sqrt(kind, f):
    got = lrs("--lr_scheduler.warmup_steps", "0", "--lr_scheduler.decay_type", kind, "--lr_scheduler.lr_min", "0")
    assert got == pytest.approx([1.0] + [f(k / 10) for k in range(1, 10)])


def test_wsd_keeps_peak_then_decays_last_fraction():
    got = lrs("--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.3",
              "--lr_scheduler.decay_type", "linear", "--lr_scheduler.lr_min", "0")
    # 3 decay steps (30% of 10); warmup 2, then stable until the decay phase
    assert got[2:8] == pytest.approx([1.0] * 6)
    assert got[8:] == pytest.approx([2 / 3, 1 / 3])


def test_no_weight_decay_groups():
    from flame.components.optimizer import param_groups

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model, 0.1, ["embed"])
    decayed = {id(p) for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    assert decayed == {id(model[1].weight)}
