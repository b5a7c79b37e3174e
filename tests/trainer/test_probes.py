"""Research probes: hand-computed values, and the softpick family's exact zeros."""

import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import flame  # noqa: F401
from flame.components.probes import attention_probes, kurtosis, run_probes
from tests.trainer.helpers import ROOT


def test_attention_probes_hand_computed():
    # 1 batch, 2 heads, 3 tokens; head 0 puts 0.5 on token 0 everywhere it can, head 1 does not
    w = torch.zeros(1, 2, 3, 3)
    w[0, 0] = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.5, 0.25, 0.25]])
    w[0, 1] = torch.tensor([[1.0, 0, 0], [0.0, 1.0, 0], [0.1, 0.0, 0.9]])
    p = attention_probes(w, sink_threshold=0.3)
    # head 0: mean over queries of w[:, 0] = (1 + .5 + .5)/3 > .3 ; head 1: (1 + 0 + .1)/3 = .367 > .3
    assert p["sink_rate"] == pytest.approx(1.0)
    assert attention_probes(w, sink_threshold=0.5)["sink_rate"] == pytest.approx(0.5)
    # causal entries: 6 per head, 12 total; zeros among them: head0 none... head1 two (w[1,0], w[2,1])
    assert p["attention_sparsity"] == pytest.approx(2 / 12)


def test_kurtosis_of_known_distributions():
    g = torch.Generator().manual_seed(0)
    assert kurtosis(torch.randn(200000, generator=g)) == pytest.approx(3.0, abs=0.1)
    assert kurtosis(torch.tensor([-1.0, 1.0] * 1000)) == pytest.approx(1.0)


@pytest.mark.parametrize("impl, sparse", [("sdpa", False), ("softpick", True)])
def test_run_probes_on_flame_transformer(impl, sparse):
    cfg = AutoConfig.from_pretrained(os.path.join(ROOT, "configs/debug/transformer_tiny.json"), attn_impl=impl)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    values = run_probes(model, torch.randint(0, cfg.vocab_size, (1, 24)))
    layers = cfg.num_hidden_layers
    assert all(f"probes/kurtosis/layer_{i}" in values for i in range(layers))
    assert (values["probes/attention_sparsity"] > 0.05) == sparse
    assert 0.0 <= values["probes/sink_rate"] <= 1.0
