"""custom_models: registration from any directory and the RetNet-like example end to end on CPU."""
import os
import subprocess
import sys

import pytest
import torch

from models_testlib import ROOT, debug_config


@pytest.fixture(scope='module')
def config():
    import custom_models  # noqa: F401
    return debug_config('retention_lm')


def _model(config, seed=0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def test_registers_on_import_from_any_directory(tmp_path):
    code = ("import sys; sys.path.insert(0, %r); import custom_models, custom_models; "
            "from transformers import AutoConfig, AutoModelForCausalLM; "
            "m = AutoModelForCausalLM.from_config(AutoConfig.for_model('retention_lm', hidden_size=32, "
            "num_hidden_layers=1, num_heads=2, vocab_size=64)); print(type(m).__name__)") % ROOT
    r = subprocess.run([sys.executable, '-c', code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().endswith('RetentionLMForCausalLM')


def test_retention_matches_token_by_token_recurrence():
    from custom_models.retention.modeling import retention
    B, T, H, D = 2, 29, 3, 8
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, D, generator=g) for _ in range(3))
    log_gamma = torch.log1p(-torch.tensor([0.5, 0.1, 0.01]))
    S = torch.zeros(B, H, D, D)
    ref = []
    for t in range(T):
        S = S * log_gamma.exp()[None, :, None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        ref.append(torch.einsum('bhk,bhkv->bhv', q[:, t] * D ** -0.5, S))
    torch.testing.assert_close(retention(q, k, v, log_gamma), torch.stack(ref, 1), atol=1e-5, rtol=1e-5)


def test_trains_on_cpu(config):
    model = _model(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    assert model.model.layers[0].attn.log_gamma.grad is None  # decays are fixed buffers


def test_flops_counted(config):
    from torch.utils.flop_counter import FlopCounterMode
    from flame.models.flops import flops_per_token, forward_flops_per_token
    model = _model(config)
    T = 128
    ids = torch.randint(0, 256, (2, T))
    with FlopCounterMode(display=False) as c, torch.no_grad():
        model(input_ids=ids)
    fwd = forward_flops_per_token(config, T, chunk=16, causal=False)
    assert fwd['attention'] > 0
    assert c.get_total_flops() / (2 * T) == pytest.approx(fwd['total'], rel=0.12)
    assert flops_per_token(config, T)['total'] == pytest.approx(3 * forward_flops_per_token(config, T)['total'])


def test_exports_to_hf_and_reloads(config, tmp_path):
    from transformers import AutoModelForCausalLM
    from flame.utils.hf_export import export_hf
    model = _model(config).eval()
    out = export_hf(model.state_dict(), config, None, str(tmp_path / 'ret'), dtype='float32')
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)
    gen = reloaded.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
    assert gen.shape == (1, 7)
