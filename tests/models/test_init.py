"""Weight init on the meta-device path (build on meta, to_empty, the model's own init): every
parameter initialized, deterministic per seed, constructor-only values restored."""

import glob
import math
import os

import pytest
import torch
import torch.nn as nn

from flame.errors import ConfigError
from flame.models import build as mb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs/debug/*.json")))


def _init(path, seed=0):
    m = mb.build_meta_model(mb.load_model_config(path))
    m.to_empty(device="cpu")
    mb.init_weights(m, seed)
    return m


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-5])
def test_every_family_initializes_fully_and_deterministically(cpu_fallbacks, path):
    a, b = _init(path), _init(path)  # check_initialized inside: nothing left at NaN
    for (name, x), (_, y) in zip(list(a.named_parameters()) + list(a.named_buffers()),
                                 list(b.named_parameters()) + list(b.named_buffers())):
        assert torch.equal(x, y), name  # garbage from to_empty would differ between the two


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: os.path.basename(p)[:-5])
def test_meta_init_has_the_eager_constructions_statistics(cpu_fallbacks, path):
    """The meta-device path against an independent expectation: the same model built eagerly by
    transformers (its own post_init on real tensors). Constant parameters (norm scales, A_log,
    D, ...) must be equal; random ones (64+ elements) must have the same mean and std, and the
    input embedding the config's initializer_range."""
    from transformers import AutoModelForCausalLM
    ours = _init(path)
    torch.manual_seed(1)
    eager = dict(AutoModelForCausalLM.from_config(mb.load_model_config(path)).named_parameters())
    for name, p in ours.named_parameters():
        x, y = p.detach().double(), eager[name].detach().double()
        if x.numel() < 2 or float(y.std()) == 0:
            assert torch.equal(x, y), name
        elif x.numel() >= 64:
            assert float(x.std()) == pytest.approx(float(y.std()), rel=0.25), name
            assert abs(float(x.mean() - y.mean())) <= 0.25 * float(y.std()), name
    emb = ours.get_input_embeddings().weight.detach().double()
    assert float(emb.std()) == pytest.approx(ours.config.initializer_range, rel=0.1)


def test_samba_mamba_mixers_and_hgrn2_bounds_get_their_constructor_values(cpu_fallbacks):
    mix = [m for m in _init(os.path.join(ROOT, "configs/debug/samba.json")).modules() if type(m).__name__ == "Mamba"]
    assert mix
    for m in mix:
        n = m.ssm_state_size
        assert torch.allclose(m.A_log, torch.log(torch.arange(1, n + 1.0)).expand_as(m.A_log))
        assert torch.equal(m.D, torch.ones_like(m.D))
        dt = torch.nn.functional.softplus(m.dt_proj.bias.double())
        assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6 and dt.std() > 0
    h = _init(os.path.join(ROOT, "configs/debug/hgrn2.json"))
    bounds = [m.lower_bounds for m in h.modules() if type(m).__name__ == "HGRN2Model"]
    assert bounds and all(torch.count_nonzero(b) == 0 for b in bounds)


def test_a_parameter_nothing_initializes_is_refused():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.full((3,), math.pi))  # set only here

    with torch.device("meta"):
        m = Model()
    m.to_empty(device="cpu")
    with pytest.raises(ConfigError, match="'scale' is not initialized"):
        mb.init_weights(m, 0)
