"""flame.ops.swiglu.swiglu_linear against the plain expression: values, gradients, what it saves."""
import os

import pytest
import torch
import torch.nn.functional as F

from flame.ops.swiglu import swiglu_linear

SEED = int(os.environ.get("FLAME_TEST_SEED") or int.from_bytes(os.urandom(3), "little"))


def _inputs(dtype, t=37, d=24, f=40):
    g = torch.Generator().manual_seed(SEED)
    gate, up = (torch.randn(2, t, f, generator=g, dtype=torch.float64) * 3 for _ in range(2))
    w = torch.randn(d, f, generator=g, dtype=torch.float64) / f**0.5
    dy = torch.randn(2, t, d, generator=g, dtype=torch.float64)
    return [x.to(dtype) for x in (gate, up, w, dy)]


def _run(fn, gate, up, w, dy):
    xs = [x.clone().requires_grad_() for x in (gate, up, w)]
    y = fn(*xs)
    y.backward(dy)
    return [y] + [x.grad for x in xs]


def plain(gate, up, w):
    return F.linear(F.silu(gate) * up, w)


def test_float64_matches_plain_autograd():
    got, want = _run(swiglu_linear, *_inputs(torch.float64)), _run(plain, *_inputs(torch.float64))
    for name, a, b in zip(("y", "d_gate", "d_up", "d_weight"), got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12), (SEED, name, (a - b).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_rounding_of_float64(dtype):
    ref = _run(plain, *_inputs(torch.float64))
    got, base = _run(swiglu_linear, *_inputs(dtype)), _run(plain, *_inputs(dtype))
    for name, a, b, r in zip(("y", "d_gate", "d_up", "d_weight"), got, base, ref):
        err = ((a.double() - r).norm() / r.norm()).item()
        err_plain = ((b.double() - r).norm() / r.norm()).item()
        assert err <= 2 * err_plain + 1e-7, (SEED, dtype, name, err, err_plain)


def _saved_numel(fn, gate, up, w):
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    xs = [x.clone().requires_grad_() for x in (gate, up, w)]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*xs)
    return sum(saved)


def test_saves_gate_and_up_only():
    gate, up, w, _ = _inputs(torch.float32)
    inter = gate.numel()
    assert _saved_numel(swiglu_linear, gate, up, w) == 2 * inter + w.numel()
    assert _saved_numel(plain, gate, up, w) >= 4 * inter  # gate, up, silu(gate), the product


def test_compiled_uses_plain_expression_and_matches():
    args = _inputs(torch.float32)
    compiled = torch.compile(swiglu_linear, backend="aot_eager", fullgraph=True)
    for a, b in zip(_run(compiled, *args), _run(plain, *args)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), SEED
