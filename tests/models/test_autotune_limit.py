import pytest
import triton
import triton.language as tl

from flame.errors import ConfigError
from flame.utils import autotune


def test_spread_pick_keeps_ends_and_order():
    xs = list(range(10))
    assert autotune.spread_pick(xs, 1) == [0]
    assert autotune.spread_pick(xs, 2) == [0, 9]
    assert autotune.spread_pick(xs, 4) == [0, 3, 6, 9]
    assert autotune.spread_pick(xs, 20) == xs


@triton.jit
def _copy(x, y, B: tl.constexpr):
    pass


def test_limit_autotune_caps_real_autotuner(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    monkeypatch.setattr(Autotuner, "prune_configs", Autotuner.prune_configs)  # restored after the test
    tuned = triton.autotune(configs=[triton.Config({"B": b}) for b in (16, 32, 64, 128, 256)], key=[])(_copy)
    assert len(tuned.prune_configs({})) == 5
    autotune.limit_autotune(2)
    assert [c.kwargs["B"] for c in tuned.prune_configs({})] == [16, 256]
    autotune.limit_autotune(3)  # re-capping wraps the original, not the capped one
    assert [c.kwargs["B"] for c in tuned.prune_configs({})] == [16, 64, 256]


@pytest.mark.parametrize("raw", ["x", "-1"])
def test_bad_env_value_is_named(monkeypatch, raw):
    monkeypatch.setenv(autotune.ENV, raw)
    with pytest.raises(ConfigError, match=raw):
        autotune.limit_autotune_from_env()
