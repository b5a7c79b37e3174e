"""Research probes: hand-computed values, and the softpick family's exact zeros."""

import copy
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


_MODELS = {}


def _tiny_transformer(impl):
    """A fresh copy of one random tiny transformer per backend (built once per module)."""
    key = str(impl)
    if key not in _MODELS:
        cfg = AutoConfig.from_pretrained(os.path.join(ROOT, "configs/debug/transformer_tiny.json"), attn_impl=impl)
        torch.manual_seed(0)
        _MODELS[key] = cfg, AutoModelForCausalLM.from_config(cfg)
    cfg, model = _MODELS[key]
    return cfg, copy.deepcopy(model)


@pytest.mark.parametrize("impl, sparse", [("sdpa", False), ("softpick", True)])
def test_run_probes_on_flame_transformer(impl, sparse):
    """Per-layer values equal those computed here from the model's own hidden states and attention
    weights (layer i is the output of block i, not the embeddings)."""
    cfg, model = _tiny_transformer(impl)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    values = run_probes(model, ids)
    layers = cfg.num_hidden_layers
    final_norm_input = []
    handle = model.model.norm.register_forward_hook(lambda m, i, o: final_norm_input.append(i[0]))
    with torch.no_grad():
        out = model.eval()(input_ids=ids, output_hidden_states=True, output_attentions=True, use_cache=False)
    handle.remove()
    assert len(out.hidden_states) == layers + 1 and len(out.attentions) == layers
    # the model's last hidden state is the final norm's output; the last block's own is its input
    block_outputs = list(out.hidden_states[1:-1]) + final_norm_input
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    sinks, zeros = [], []
    for i in range(layers):
        h = block_outputs[i].double().flatten().numpy()
        c = h - h.mean()
        assert values[f"probes/kurtosis/layer_{i}"] == pytest.approx((c ** 4).mean() / (c ** 2).mean() ** 2, rel=1e-9)
        assert values[f"probes/max_abs_hidden/layer_{i}"] == pytest.approx(abs(h).max(), rel=1e-6)
        a = out.attentions[i][0].double()  # [H, T, T]
        sinks.append(sum(float(a[hd, :, 0].mean()) > 0.3 for hd in range(a.shape[0])) / a.shape[0])
        zeros.append(int(((a == 0) & causal).sum()) / (int(causal.sum()) * a.shape[0]))
        assert values[f"probes/sink_rate/layer_{i}"] == pytest.approx(sinks[-1])
        assert values[f"probes/attention_sparsity/layer_{i}"] == pytest.approx(zeros[-1])
    assert values["probes/sink_rate"] == pytest.approx(sum(sinks) / layers)
    assert values["probes/attention_sparsity"] == pytest.approx(sum(zeros) / layers)
    assert values["probes/max_abs_hidden"] == pytest.approx(max(values[f"probes/max_abs_hidden/layer_{i}"]
                                                                for i in range(layers)))
    assert (values["probes/attention_sparsity"] > 0.05) == sparse


def test_run_probes_on_a_known_attention_pattern():
    """Zero query projections make every score 0. Layer 0 (softmax) attends uniformly: query i gives
    1/(i+1) to token 0, a mean of H_T / T over T queries, and no weight is zero; layer 1 (softpick)
    gives exactly zero weights everywhere. The model-wide values are the means over the layers."""
    cfg, model = _tiny_transformer(["sdpa", "softpick"])
    with torch.no_grad():
        for block in model.model.layers:
            block.attn.q_proj.weight.zero_()
    T = 24
    ids = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(2))
    first = sum(1 / (i + 1) for i in range(T)) / T  # 0.157
    below, above = run_probes(model, ids, sink_threshold=first - 0.01), run_probes(model, ids, first + 0.01)
    assert below["probes/sink_rate/layer_0"] == 1.0 and above["probes/sink_rate/layer_0"] == 0.0
    assert below["probes/sink_rate/layer_1"] == 0.0
    assert below["probes/sink_rate"] == 0.5 and above["probes/sink_rate"] == 0.0
    assert below["probes/attention_sparsity/layer_0"] == 0.0
    assert below["probes/attention_sparsity/layer_1"] == 1.0
    assert below["probes/attention_sparsity"] == 0.5
