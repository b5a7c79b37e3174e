"""flame.models.flops against torch.utils.flop_counter.FlopCounterMode on CPU.

Tolerances (documented in flame/models/README_SECTION.md):
* softmax models (eager attention, whose dense masked T x T matmuls FlopCounterMode sees): 2 %;
  compared with ``causal=False`` because the eager kernel computes all T x T scores.
* FLA linear/SSM models on flame's CPU paths: 12 % for the whole model. The CPU paths are not FLA's
  chunked kernels (token-by-token delta rule, C x C intra-chunk blocks of 16 instead of causal 64,
  elementwise work that FlopCounterMode does not count), so only the order of the mixer term is
  checked at model level; the GLA state term is checked at op level (15 %). Mamba's torch scan is
  elementwise, invisible to FlopCounterMode: only its dense part is compared (3 %); Mamba2's
  chunked SSD (flame/models/ssm_scan.py) is matmuls, compared like the other FLA models.
"""
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from models_testlib import DEBUG_DIR, FLA_FAMILIES, debug_config

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
    if family == 'mamba':
        # the selective scan is elementwise products and cumsums, which FlopCounterMode does not
        # count: only the dense (parameter) part is measurable
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


def test_sliding_window_mean_keys_counted_row_by_row():
    """Softmax attention with a window: the mean number of keys a query sees, counted query by query
    (query i sees keys max(0, i - w + 1) .. i); a window at least as long as the sequence is no window."""
    from flame.models.flops import mixer_forward_flops
    from flame.models.registry import Mixer
    H, dh = 3, 8
    for seq, w in ((10, 4), (128, 16), (7, 1), (12, 11)):
        keys = sum(i - max(0, i - w + 1) + 1 for i in range(seq)) / seq
        got = mixer_forward_flops(Mixer('softmax', H, dh, dh, window=w), seq)
        assert got == pytest.approx(2 * H * 2 * dh * keys, rel=1e-12), (seq, w)
    assert mixer_forward_flops(Mixer('softmax', H, dh, dh, window=10), 10) == pytest.approx(2 * H * 2 * dh * 5.5)
    assert mixer_forward_flops(Mixer('softmax', H, dh, dh, window=40), 10) == pytest.approx(2 * H * 2 * dh * 5.5)


def test_windowed_transformer_config_flops():
    """flame's transformer with ``window_size``: every layer counts the windowed mean (H=4, d_h=32, w=16)."""
    from transformers import AutoConfig
    from flame.models.flops import flops_per_token
    import flame  # noqa: F401  (registers the transformer family)
    cfg = AutoConfig.from_pretrained(os.path.join(DEBUG_DIR, 'transformer_tiny.json'), window_size=16)
    keys = (16 * 17 / 2 + (128 - 16) * 16) / 128  # 120 queries see 16 keys, the first 16 see 1..16
    L, H, dh = 2, 4, 32
    assert flops_per_token(cfg, 128)['attention'] == pytest.approx(3 * L * 2 * H * 2 * dh * keys)


def test_delta_rule_and_mamba_terms_by_hand():
    from flame.models.flops import flops_per_token, mixer_forward_flops
    from flame.models.registry import Mixer, layer_mixers
    # delta rule, H=1, d_k=d_v=4, C=64: 6*4*4 (state, read, W S) + 64*(3*4 + 2*4) (intra-chunk) + 64^2/3 (solve)
    assert mixer_forward_flops(Mixer('delta', 1, 4, 4), 100, chunk=64) == pytest.approx(96 + 1280 + 4096 / 3)
    # two heads, d_k=4, d_v=8, C=6: 2 * (192 + 6 * 28 + 12)
    assert mixer_forward_flops(Mixer('delta', 2, 4, 8), 100, chunk=6) == pytest.approx(744)
    # Mamba: 6 FLOPs per state entry per inner channel; debug mamba: d_inner = 2 * 64, N = 8, 2 layers
    cfg = debug_config('mamba')
    assert layer_mixers(cfg)[0] == Mixer('mamba', 128, 8, 1)
    assert mixer_forward_flops(Mixer('mamba', 128, 8, 1), 100) == 6 * 8 * 128
    assert flops_per_token(cfg, 128)['attention'] == pytest.approx(3 * 2 * 6 * 8 * 128)


def test_context_len_longer_than_the_sequence_is_capped():
    from flame.models.flops import flops_per_token
    cfg = debug_config('llama')
    assert flops_per_token(cfg, 128, context_len=4096) == flops_per_token(cfg, 128)
    assert flops_per_token(cfg, 128, context_len=128) == flops_per_token(cfg, 128)


def test_tied_lm_head_is_counted_as_a_matmul():
    """Debug llama (hidden 64, 2 layers, q 4x16, kv 2x16, MLP 172, vocab 256), parameters counted by hand:
    tying the head removes it from the unique parameters but not from the per-token matmul work."""
    from transformers import AutoConfig
    from flame.models.flops import flops_per_token, param_counts
    d, ffn, vocab = 64, 172, 256
    layer = d * 64 + 2 * d * 32 + 64 * d + 3 * d * ffn + 2 * d  # q, k, v, o, gate/up/down, two norms
    body = 2 * layer + d  # + the final norm
    untied = param_counts(debug_config('llama'))
    assert untied == {'total': vocab * d * 2 + body, 'embedding': vocab * d, 'matmul': body + vocab * d}
    tied_cfg = AutoConfig.from_pretrained(os.path.join(DEBUG_DIR, 'llama.json'), tie_word_embeddings=True)
    tied = param_counts(tied_cfg)
    assert tied == {'total': vocab * d + body, 'embedding': vocab * d, 'matmul': body + vocab * d}
    assert flops_per_token(tied_cfg, 64)['dense'] == 6 * (body + vocab * d)


def test_lora_training_flops_match_flop_counter():
    """A LoRA step (frozen base, trained adapters): the base's weight gradients are never computed,
    which FlopCounterMode sees over a forward and backward."""
    from transformers import AutoModelForCausalLM

    from flame.lora import Lora, apply_lora, is_adapter_key
    from flame.models.flops import flops_per_token

    cfg = debug_config('llama')
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation='eager')
    apply_lora(model, Lora(rank=4, alpha=8.0))
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))
    assert adapters > 0 and all(not p.requires_grad for n, p in model.named_parameters() if not is_adapter_key(n))
    x = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=x).logits.float().sum().backward()
    measured = counter.get_total_flops() / (B * T)
    lora = flops_per_token(cfg, T, frozen_base=True, adapter_params=adapters)
    full = flops_per_token(cfg, T)
    # eager attention computes all T x T scores: compare with the non-causal count, as above
    from flame.models.flops import forward_flops_per_token
    fwd = forward_flops_per_token(cfg, T, causal=False)
    expected = 2 * fwd['dense'] + 6 * adapters + 3 * fwd['attention']
    assert lora['total'] < full['total']
    assert lora['dense'] == pytest.approx(2 * full['dense'] / 3 + 6 * adapters)
    assert measured == pytest.approx(expected, rel=0.03)
