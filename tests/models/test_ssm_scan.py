"""flame's chunked Mamba/Mamba2 scans (flame/models/ssm_scan.py, installed by flame/models/fla_mamba.py).

References: the recurrences stepped token by token in float64 (the scans' definitions), and FLA's own
torch paths (its methods from before the install) for the layers and tiny models.
"""
import contextlib
import logging

import pytest
import torch
import torch.nn.functional as F

from models_testlib import debug_config

from flame.models.ssm_scan import selective_scan, ssd_scan

f64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def stepwise_selective_scan(x, dt, A, B, C):
    """h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = C_t . h_t, one token at a time."""
    batch, channels, seq_len = x.shape
    h = x.new_zeros(batch, channels, A.shape[-1])
    ys = []
    for t in range(seq_len):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * x[:, :, t])[..., None] * B[:, None, t]
        ys.append((h * C[:, None, t]).sum(-1))
    return torch.stack(ys, dim=-1), h


def stepwise_ssd(x, dt, A, B, C):
    """Per head h: state_t = exp(dt_t A_h) state_{t-1} + dt_t x_t B_t^T (B of group h // (heads / groups)),
    y_t = state_t C_t, one token at a time."""
    batch, seq_len, heads, head_dim = x.shape
    group = torch.arange(heads) // (heads // B.shape[2])
    Bh, Ch = B[:, :, group], C[:, :, group]  # (batch, T, heads, state)
    state = x.new_zeros(batch, heads, head_dim, B.shape[-1])
    ys = []
    for t in range(seq_len):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None, :]
        ys.append(torch.einsum('bhpn,bhn->bhp', state, Ch[:, t]))
    return torch.stack(ys, dim=1), state


def _mamba_inputs(seed, batch, channels, state, seq_len, dtype=f64):
    g = _gen(seed)
    x = torch.randn(batch, channels, seq_len, generator=g, dtype=dtype)
    dt = F.softplus(torch.randn(batch, channels, seq_len, generator=g, dtype=dtype) - 1)
    A = -torch.exp(torch.randn(channels, state, generator=g, dtype=dtype))
    B, C = (torch.randn(batch, seq_len, state, generator=g, dtype=dtype) for _ in range(2))
    return _leaves(x, dt, A, B, C)


def _ssd_inputs(seed, batch, heads, head_dim, groups, state, seq_len, dtype=f64):
    g = _gen(seed)
    x = torch.randn(batch, seq_len, heads, head_dim, generator=g, dtype=dtype)
    dt = F.softplus(torch.randn(batch, seq_len, heads, generator=g, dtype=dtype) - 1)
    A = -torch.exp(torch.randn(heads, generator=g, dtype=dtype))
    B, C = (torch.randn(batch, seq_len, groups, state, generator=g, dtype=dtype) for _ in range(2))
    return _leaves(x, dt, A, B, C)


def _outputs_and_grads(fn, inputs, seed):
    """fn's (y, final state) and the gradients of every input under random cotangents."""
    y, state = fn(*inputs)
    g = _gen(seed)
    dy, ds = torch.randn(y.shape, generator=g, dtype=y.dtype), torch.randn(state.shape, generator=g, dtype=y.dtype)
    grads = torch.autograd.grad((y * dy).sum() + (state * ds).sum(), inputs)
    return [y, state, *grads]


def _assert_all_close(got, want, **tol):
    names = ['y', 'final state', 'd x', 'd dt', 'd A', 'd B', 'd C']
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f'{name}: {m}', **tol)


@pytest.mark.parametrize('seq_len,chunk_len', [(1, None), (7, None), (16, 4), (16, None), (50, 6), (50, 64)])
def test_selective_scan_equals_the_stepwise_recurrence(seq_len, chunk_len):
    inputs = _mamba_inputs(seq_len, batch=2, channels=6, state=5, seq_len=seq_len)
    got = _outputs_and_grads(lambda *a: selective_scan(*a, chunk_len=chunk_len), inputs, seed=1)
    _assert_all_close(got, _outputs_and_grads(stepwise_selective_scan, inputs, seed=1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize('seq_len,chunk_size,groups', [(1, 8, 1), (7, 8, 2), (16, 8, 1), (37, 8, 2), (37, 16, 4)])
def test_ssd_scan_equals_the_stepwise_recurrence(seq_len, chunk_size, groups):
    inputs = _ssd_inputs(seq_len, batch=2, heads=4, head_dim=3, groups=groups, state=5, seq_len=seq_len)
    got = _outputs_and_grads(lambda *a: ssd_scan(*a, chunk_size), inputs, seed=1)
    _assert_all_close(got, _outputs_and_grads(stepwise_ssd, inputs, seed=1), rtol=1e-10, atol=1e-10)


def test_scans_compute_in_float32_for_bfloat16_inputs_under_autocast():
    """bf16 inputs under bf16 autocast: the scans still run in float32 (their einsums included)."""
    inputs = [t.detach().to(torch.bfloat16) for t in _mamba_inputs(0, 2, 6, 5, 20)]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y, state = selective_scan(*inputs)
    want = stepwise_selective_scan(*[t.double() for t in inputs])
    assert y.dtype == state.dtype == torch.float32
    torch.testing.assert_close(y.double(), want[0], rtol=1e-5, atol=1e-5)
    inputs = [t.detach().to(torch.bfloat16) for t in _ssd_inputs(0, 2, 4, 3, 2, 5, 20)]
    with torch.autocast('cpu', dtype=torch.bfloat16):
        y, state = ssd_scan(*inputs, 8)
    assert y.dtype == state.dtype == torch.float32
    torch.testing.assert_close(y.double(), stepwise_ssd(*[t.double() for t in inputs])[0], rtol=1e-5, atol=1e-5)


def test_scans_run_on_the_meta_device():
    """The offload planner runs models on meta (no autocast there): shapes and dtypes only."""
    inputs = [t.detach().to('meta', torch.bfloat16) for t in _mamba_inputs(0, 2, 6, 5, 20)]
    y, state = selective_scan(*inputs)
    assert (y.shape, state.shape, y.dtype, y.device.type) == ((2, 6, 20), (2, 6, 5), torch.float32, 'meta')
    inputs = [t.detach().to('meta', torch.bfloat16) for t in _ssd_inputs(0, 2, 4, 3, 2, 5, 20)]
    y, state = ssd_scan(*inputs, 8)
    assert (y.shape, state.shape, y.dtype, y.device.type) == ((2, 20, 4, 3), (2, 4, 3, 5), torch.float32, 'meta')


@pytest.mark.parametrize('backend', ['aot_eager', pytest.param('inductor', marks=pytest.mark.slow)])
def test_scans_compile_to_one_graph_with_the_same_values(backend):
    torch._dynamo.reset()
    inputs = _mamba_inputs(3, 2, 6, 5, 20, dtype=torch.float32)
    fn = torch.compile(selective_scan, backend=backend, fullgraph=True)
    _assert_all_close(_outputs_and_grads(fn, inputs, 2), _outputs_and_grads(selective_scan, inputs, 2),
                      rtol=1e-5, atol=1e-5)
    inputs = _ssd_inputs(3, 2, 4, 3, 2, 5, 20, dtype=torch.float32)
    fn = torch.compile(lambda *a: ssd_scan(*a, 8), backend=backend, fullgraph=True)
    _assert_all_close(_outputs_and_grads(fn, inputs, 2), _outputs_and_grads(lambda *a: ssd_scan(*a, 8), inputs, 2),
                      rtol=1e-5, atol=1e-5)


# --- the layers and models: flame's install against FLA's own torch paths ---


@contextlib.contextmanager
def fla_torch_paths():
    """FLA's own Mamba/Mamba2 methods for the block (flame's chunked ones back afterwards)."""
    from flame.models.fla_mamba import install_chunked_scans, uninstall_chunked_scans
    uninstall_chunked_scans()
    try:
        yield
    finally:
        install_chunked_scans()


def _layer_outputs_and_grads(layer, x, mask):
    x = x.detach().clone().requires_grad_()
    out = layer(x, attention_mask=mask)[0]
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()
    params = [p for p in layer.parameters() if p.requires_grad]
    return [out, *torch.autograd.grad(loss, [x, *params])], ['out', 'd input'] + [n for n, _ in layer.named_parameters()]


def _layer(kind, seed):
    from fla.layers.mamba import Mamba
    from fla.layers.mamba2 import Mamba2
    torch.manual_seed(seed)
    if kind == 'mamba':
        return Mamba(hidden_size=16, state_size=4, intermediate_size=32).double()
    # FLA's torch prefill gives head i the group i % n_groups (mamba_ssm and FLA's decode step:
    # i // (heads / n_groups)): compared with one group, the ssd test covers several
    return Mamba2(hidden_size=16, head_dim=8, state_size=4, chunk_size=8, n_groups=1).double()


@pytest.mark.parametrize('kind', ['mamba', 'mamba2'])
@pytest.mark.parametrize('seq_len', [5, 16, 21])
@pytest.mark.parametrize('masked', [False, True])
def test_layer_equals_flas_torch_path(cpu_fallbacks, kind, seq_len, masked):
    """Output, input gradient and every parameter's gradient (A_log, D, dt bias, projections, conv,
    norm) of a float64 layer, batch 2, with a left-padding attention mask or none."""
    layer = _layer(kind, seed=seq_len)
    x = torch.randn(2, seq_len, 16, generator=_gen(seq_len), dtype=f64)
    mask = None
    if masked:
        mask = torch.ones(2, seq_len, dtype=torch.long)
        mask[1, :3] = 0
    got, names = _layer_outputs_and_grads(layer, x, mask)
    with fla_torch_paths():
        want, _ = _layer_outputs_and_grads(layer, x, mask)
    # FLA's paths cast some inputs to float32 even in a float64 layer; flame's do not
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f'{name}: {m}')


def _model_loss_and_grads(model, ids):
    loss = model(input_ids=ids, labels=ids).loss
    return loss, torch.autograd.grad(loss, [p for p in model.parameters()])


@pytest.mark.parametrize('family', ['mamba', 'mamba2', 'samba'])
def test_tiny_model_loss_and_grads_equal_flas(cpu_fallbacks, family):
    """The debug config's loss and every gradient (float32, T = 72: mamba2's chunk 16 does not
    divide it) with flame's scans and with FLA's torch paths."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(debug_config(family))
    ids = torch.randint(0, 256, (2, 72), generator=_gen(0))
    loss, grads = _model_loss_and_grads(model, ids)
    with fla_torch_paths():
        want_loss, want_grads = _model_loss_and_grads(model, ids)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for (name, _), a, b in zip(model.named_parameters(), grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m, name=name: f'{name}: {m}')


@pytest.mark.parametrize('kind', ['mamba', 'mamba2'])
def test_layer_prefill_then_decoding_equals_the_full_forward(cpu_fallbacks, kind):
    """A float64 layer's chunked prefill (use_cache: conv and recurrent states) followed by FLA's own
    single-token steps gives the full forward. Mamba2 with n_groups = 2: the chunked prefill gives
    head i the group FLA's decoding step gives it (FLA's own torch prefill does not)."""
    from fla.layers.mamba import Mamba
    from fla.layers.mamba2 import Mamba2
    torch.manual_seed(0)
    if kind == 'mamba':
        layer = Mamba(hidden_size=16, state_size=4, intermediate_size=32).double()
        step = layer.slow_forward
    else:
        layer = Mamba2(hidden_size=16, head_dim=8, state_size=4, chunk_size=8, n_groups=2).double()
        step = layer.torch_forward
    x = torch.randn(2, 21, 16, generator=_gen(0), dtype=f64)
    with torch.no_grad():
        full = step(x)[0]
        out, conv_state, ssm_state = step(x[:, :13], use_cache=True)
        outs = [out]
        for t in range(13, x.shape[1]):
            out, conv_state, ssm_state = step(x[:, t:t + 1], {'conv_state': conv_state, 'recurrent_state': ssm_state})
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-9, atol=1e-9)


def test_install_is_idempotent_logs_once_and_leaves_the_fast_path_alone(cpu_fallbacks, caplog, monkeypatch):
    import fla.layers.mamba as mamba
    import fla.layers.mamba2 as mamba2
    from flame.models.fla_mamba import MARK, install_chunked_scans, uninstall_chunked_scans
    assert hasattr(mamba.Mamba.slow_forward, MARK) and hasattr(mamba2.Mamba2.torch_forward, MARK)
    try:
        uninstall_chunked_scans()
        assert not hasattr(mamba.Mamba.slow_forward, MARK)
        with caplog.at_level(logging.DEBUG, logger='flame.models.fla_mamba'):
            assert install_chunked_scans() == ['Mamba', 'Mamba2']
            assert install_chunked_scans() == []
        assert [r.getMessage() for r in caplog.records] == [
            "Mamba/Mamba2: mamba_ssm absent; flame's chunked torch scans (flame/models/ssm_scan.py)"]
        uninstall_chunked_scans()
        monkeypatch.setattr(mamba, 'is_fast_path_available', True)  # as with mamba_ssm installed
        assert install_chunked_scans() == ['Mamba2']
        assert not hasattr(mamba.Mamba.slow_forward, MARK)
    finally:
        monkeypatch.undo()
        install_chunked_scans()
