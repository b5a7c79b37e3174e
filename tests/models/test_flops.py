"""flame.models.flops against torch.utils.flop_counter.FlopCounterMode on CPU.

Tolerances (documented in flame/models/README_SECTION.md):
* softmax models (eager attention, whose dense masked T x T matmuls FlopCounterMode sees): 2 %;
  compared with ``causal=False`` because the eager kernel computes all T x T scores.
* FLA linear/SSM models on flame's CPU paths: 12 % for the whole model. The CPU paths are not FLA's
  chunked kernels (token-by-token delta rule, C x C intra-chunk blocks of 16 instead of causal 64,
  elementwise work that FlopCounterMode does not count), so only the order of the mixer term is
  checked at model level; the GLA state term is checked at op level (15 %). Mamba/Mamba2's torch
  scans are elementwise, invisible to FlopCounterMode: only their dense part is compared (3 %).
"""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models_testlib import FLA_FAMILIES, debug_config

B, T = 2, 128


def _measured_per_token(model):
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=x)
    return counter.get_total_flops() / (B * T)


@pytest.mark.parametrize('name', ['llama', 'qwen3'])
def test_softmax_models_match_flop_counter(name):
    from transformers import AutoModelForCausalLM
    from flame.models.flops import forward_flops_per_token
    cfg = debug_config(name)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation='eager')
    expected = forward_flops_per_token(cfg, T, causal=False)
    measured = _measured_per_token(model)
    assert expected['attention'] > 0.1 * expected['total']  # the attention term matters at this size
    assert measured == pytest.approx(expected['total'], rel=0.02)


@pytest.mark.parametrize('family', FLA_FAMILIES)
def test_fla_models_on_cpu_paths_match_flop_counter(cpu_fallbacks, family):
    from transformers import AutoModelForCausalLM
    from flame.models.flops import forward_flops_per_token
    cfg = debug_config(family)
    model = AutoModelForCausalLM.from_config(cfg)
    expected = forward_flops_per_token(cfg, T, causal=False, chunk=16)
    measured = _measured_per_token(model)
    if family in ('mamba', 'mamba2'):
        # FLA's torch scans are elementwise products and cumsums, which FlopCounterMode does not
        # count: only the dense (parameter) part is measurable for them
        assert measured == pytest.approx(expected['dense'], rel=0.03)
    else:
        assert measured == pytest.approx(expected['total'], rel=0.12)


def test_gla_state_term_at_op_level():
    from flame.models.cpu.ops import chunk_gla_cpu
    from flame.models.flops import mixer_forward_flops
    from flame.models.registry import Mixer
    H, K, V = 2, 64, 64  # large head dims: the 4 * dk * dv state term dominates
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, d, generator=g) for d in (K, K, V))
    gk = torch.nn.functional.logsigmoid(torch.randn(1, T, H, K, generator=g))
    with FlopCounterMode(display=False) as counter:
        chunk_gla_cpu(q, k, v, gk)
    assert counter.get_total_flops() / T == pytest.approx(mixer_forward_flops(Mixer('gla', H, K, V), T, chunk=16),
                                                          rel=0.15)


def test_training_flops_formula_values():
    """Hand-computed numbers for a llama-like config: 6N + 6 * L * H * d_h * (S + 1) (causal)."""
    from flame.models.flops import flops_per_token, param_counts
    cfg = debug_config('llama')
    n = param_counts(cfg)
    assert n['matmul'] == n['total'] - n['embedding']  # untied head counts as a parameter
    f = flops_per_token(cfg, 128)
    L, H, dh = 2, 4, 16
    assert f['dense'] == 6 * n['matmul']
    assert f['attention'] == pytest.approx(3 * L * 2 * H * 2 * dh * (128 + 1) / 2)
    # packed documents of mean length 32 attend 4x less; a window of 16 is capped
    assert flops_per_token(cfg, 128, context_len=32)['attention'] == pytest.approx(3 * L * 4 * H * dh * 33 / 2)
