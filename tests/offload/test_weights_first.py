"""Weights-first CPU steps (runtime.host_optimizer): a host unit whose grads reach the host once a
step writes its new compute copy first and steps master and moments in a later job. Every value
must be the one-pass step's, bit for bit, with clipping, a changing lr and a skipped step, also
when the state step runs late (the next backward's D2H must wait before it overwrites the grads
the state step still reads)."""

import time

import pytest
import torch

from flame.offload.planner.cost_model import Dtypes, weights_first_fractions, weights_first_units
from flame.offload.runtime.host_optimizer import HostOptimizer
from flame.ops import cpu_adamw
from tests.offload.test_speculative_step import BF16_COMPUTE, assert_same, run

pytestmark = pytest.mark.skipif(not cpu_adamw.available(), reason="no C compiler: the engine uses torch's fused AdamW")

MAX_NORMS = [0.0, 1e-3, 100.0, 0.0, 1e-3]  # unclipped, clipped, above the norm (step 3 is skipped: nan loss)
LRS = [1e-2, 1e-2, 5e-3, 5e-3, 2e-3]


def one_pass(monkeypatch):
    monkeypatch.setattr(HostOptimizer, "weights_first", lambda self, u: False)


@pytest.mark.parametrize("rounds,accs", [(1, ()), (2, (True,) * 4)], ids=["one_round", "gpu_accumulation"])
def test_weights_first_equals_the_one_pass_step(rounds, accs, monkeypatch):
    split = run(False, rounds, accs, MAX_NORMS, LRS, nan_step=3, dtypes=BF16_COMPUTE)
    assert split[1] == [3]
    assert split[4].get("cpu_adam_state", 0) > 0  # the state steps ran as jobs of their own
    with monkeypatch.context() as m:
        one_pass(m)
        plain = run(False, rounds, accs, MAX_NORMS, LRS, nan_step=3, dtypes=BF16_COMPUTE)
    assert "cpu_adam_state" not in plain[4]
    assert_same(split, plain)


def test_a_late_state_step_holds_back_the_next_grads(monkeypatch):
    """The state step delayed until the next step's first D2H is waiting: that copy must not write
    the grads before the state step has read them."""
    slow = HostOptimizer._state_step

    def late(self, u, coef, lr):
        time.sleep(0.05)
        slow(self, u, coef, lr)

    monkeypatch.setattr(HostOptimizer, "_state_step", late)
    split = run(False, 1, (), MAX_NORMS[:3], LRS[:3], dtypes=BF16_COMPUTE)
    assert split[4].get("backward_waits_for_cpu_adam", 0) > 0
    monkeypatch.undo()
    with monkeypatch.context() as m:
        one_pass(m)
        assert_same(split, run(False, 1, (), MAX_NORMS[:3], LRS[:3], dtypes=BF16_COMPUTE))


def test_the_planner_splits_the_same_units_as_the_engine():
    bf16 = Dtypes(compute="bfloat16", master="float32", grad="float32", moment="float32")
    modes, accs = ["host_opt", "stream", "gpu"], [False, True, False]
    assert weights_first_units(bf16, True, False, modes, [False] * 3, 1) == [True, True, False]
    assert weights_first_units(bf16, True, False, modes, accs, 2) == [False, True, False]  # host adds: one pass
    assert not any(weights_first_units(bf16, True, True, modes, [False] * 3, 1))  # speculative
    assert not any(weights_first_units(bf16, False, False, modes, [False] * 3, 1))  # torch's fused AdamW
    assert not any(weights_first_units(Dtypes(compute="bfloat16", master="bfloat16", grad="bfloat16",
                                              moment="bfloat16"), True, False, modes, [False] * 3, 1))
    first, rest = weights_first_fractions(bf16)
    assert first == (4 + 12 + 2) / (4 + 12 + 12 + 2) and rest == (4 + 12 + 12) / (4 + 12 + 12 + 2)
