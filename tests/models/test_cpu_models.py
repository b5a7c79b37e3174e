"""Tiny FLA models (configs/debug) train, run in bf16 and decode with a cache on CPU."""
import pytest
import torch

from models_testlib import FLA_FAMILIES, debug_config


def _model(name, dtype=torch.float32, seed=0):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(debug_config(name), dtype=dtype)


@pytest.fixture(scope='module')
def batch():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (2, 72), generator=g)  # T > 64: FLA layers take their chunk mode


@pytest.mark.parametrize('family', FLA_FAMILIES)
def test_family_trains_five_steps(cpu_fallbacks, batch, family):
    model = _model(family)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.parametrize('family', FLA_FAMILIES)
def test_family_bf16_forward_backward(cpu_fallbacks, batch, family):
    if family in ('mamba', 'mamba2'):
        # FLA builds these models' norms with dtype=float32 and casts the residual stream to the
        # norm's dtype, so an all-bf16 model feeds fp32 into a bf16 lm_head on any device; run them
        # the way mixed-precision training does instead: fp32 weights, bf16 autocast.
        model = _model(family)
        with torch.autocast('cpu', dtype=torch.bfloat16):
            out = model(input_ids=batch[:, :40], labels=batch[:, :40])
    else:
        model = _model(family, dtype=torch.bfloat16)
        out = model(input_ids=batch[:, :40], labels=batch[:, :40])
    out.loss.backward()
    assert torch.isfinite(out.loss)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g.float()).all() for g in grads)


@pytest.mark.parametrize('family', FLA_FAMILIES)
def test_cached_decoding_matches_full_forward(cpu_fallbacks, batch, family):
    """Prefill + token-by-token decoding (conv caches, recurrent states, KV cache) gives the logits
    of the full-sequence forward: checks the state layouts the CPU ops return."""
    model = _model(family).eval()
    ids = batch[:1, :12]
    with torch.no_grad():
        full = model(input_ids=ids).logits
        out = model(input_ids=ids[:, :8], use_cache=True)
        cache, steps = out.past_key_values, [out.logits]
        for t in range(8, 12):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-4, rtol=1e-3)


def test_enable_is_idempotent_and_dispatches_by_device(cpu_fallbacks):
    import fla.layers.gla as gla_layer
    from flame.models.cpu.patch import MARK, make_dispatcher
    from flame.models.cpu import enable_cpu_fallbacks
    before = gla_layer.chunk_gla
    assert enable_cpu_fallbacks() == {}
    assert gla_layer.chunk_gla is before
    original = getattr(before, MARK)
    assert original.__module__ == 'fla.ops.gla.chunk' and not hasattr(original, MARK)
    # the dispatcher itself: CPU and meta (the offload planner's measurement) -> torch
    # implementation, any other device -> the original (a fake CUDA tensor stands for one here)
    from torch._subclasses.fake_tensor import FakeTensorMode
    d = make_dispatcher(lambda *a, **k: 'original', lambda *a, **k: 'torch')
    assert d(torch.zeros(1)) == 'torch'
    assert d(q=torch.zeros(1, device='meta')) == 'torch'
    with FakeTensorMode():
        cuda = torch.empty(1, device='cuda')
    assert d(cuda) == 'original' and d(q=cuda) == 'original'
