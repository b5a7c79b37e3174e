"""GPU checks of flame's Triton attention kernels and the layer dispatch against float64 references.

Fresh random inputs each run; bf16 relative error (||x - ref|| / ||ref||) <= 1e-2 for the output
and every gradient; lengths that are not multiples of any tile; varlen; GQA; head dims 64..256.
"""
import os

import pytest
import torch

os.environ.setdefault("FLAME_ATTN_AUTOTUNE", "0")  # default tiles: keeps compile time down

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

TOL = 1e-2


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def make(B, T, HQ, HK, D, dtype=torch.bfloat16, logit_scale=1.0):
    q = (torch.randn(B, T, HQ, D, device="cuda") * logit_scale).to(dtype)
    k = (torch.randn(B, T, HK, D, device="cuda") * logit_scale).to(dtype)
    v = torch.randn(B, T, HK, D, device="cuda").to(dtype)
    do = torch.randn(B, T, HQ, D, device="cuda").to(dtype)
    return q, k, v, do


def reference(q, k, v, do, mode, cu=None):
    from flame.ops.attention import naive_attention

    xs = [x.double().requires_grad_() for x in (q, k, v)]
    o, _ = naive_attention(*xs, mode, cu_seqlens=cu, return_weights=False)
    o.backward(do.double())
    return [o] + [x.grad for x in xs]


def kernel(q, k, v, do, mode, cu=None):
    from flame.ops.attention import parallel_attention

    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o = parallel_attention(*xs, mode, cu_seqlens=cu)
    o.backward(do)
    return [o] + [x.grad for x in xs]


def check(got, ref, label):
    errs = [rel(a, b) for a, b in zip(got, ref)]
    for name, e in zip(("o", "dq", "dk", "dv"), errs):
        assert e <= TOL, f"{label}: {name} relative error {e:.2e}"
    assert all(torch.isfinite(x).all() for x in got), label


MODES = ("softmax", "softpick", "rectified")
SHAPES = [
    # B, T, HQ, HK, D   (T never a multiple of 16)
    (2, 1000, 8, 2, 128),
    (1, 333, 4, 4, 64),
    (2, 257, 2, 1, 256),
    (1, 190, 2, 2, 100),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_dense(mode, shape):
    torch.manual_seed(hash((mode, shape)) % 2**31)
    q, k, v, do = make(*shape)
    check(kernel(q, k, v, do, mode), reference(q, k, v, do, mode), f"{mode} {shape}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [1, 2])
def test_varlen(mode, B):
    torch.manual_seed(7 + B)
    T = 1100 // B
    total = B * T
    cuts = sorted(set([0, 1, 130, 517, 518, total - 83, total]))
    cu = torch.tensor(cuts, device="cuda", dtype=torch.int32)
    q, k, v, do = make(B, T, 8, 2, 128)
    check(kernel(q, k, v, do, mode, cu), reference(q, k, v, do, mode, cu), f"varlen {mode} B={B}")


@pytest.mark.parametrize("mode", ["softpick", "rectified"])
def test_large_logits(mode):
    # logits of +-60: softpick's running max keeps exp() finite; rectified has many empty rows
    torch.manual_seed(11)
    q, k, v, do = make(1, 300, 4, 2, 64, logit_scale=3.0)
    check(kernel(q, k, v, do, mode), reference(q, k, v, do, mode), f"large {mode}")


@pytest.mark.parametrize("impl", ["sdpa", "sdpa_flex", "flex", "fla", "triton", "softpick", "scaled_softpick",
                                  "rectified"])
@pytest.mark.parametrize("varlen", [False, True])
def test_dispatch_backends(impl, varlen, monkeypatch):
    """Layer-level dispatch on GPU (SDPA, torch varlen / FlexAttention, FLA, Triton) vs naive float64."""
    from flame.models.attention import attention, get_backend

    torch.manual_seed(3)
    if impl == "sdpa_flex":
        monkeypatch.setenv("FLAME_VARLEN_SOFTMAX", "flex")
        impl = "sdpa"
    b = get_backend(impl)
    q, k, v, do = make(1, 700, 8, 2, 128)
    cu = torch.tensor([0, 200, 201, 650, 700], device="cuda", dtype=torch.int32) if varlen else None
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    o, _ = attention(*xs, b, cu_seqlens=cu)
    o.backward(do)
    got = [o] + [x.grad for x in xs]
    check(got, reference(q, k, v, do, b.rows, cu), f"dispatch {impl} varlen={varlen}")


def test_transformer_gpu_matches_naive():
    """The model on GPU with kernels (bf16) vs the same weights with naive backends (float32)."""
    from flame.models.transformer import TransformerConfig, TransformerForCausalLM

    for fast, slow in (("sdpa", "naive"), ("parallel_softpick_attn", "naive_softpick_attn"),
                       ("parallel_scaled_softpick_attn", "naive_scaled_softpick_attn")):
        torch.manual_seed(0)
        # FLA's fused norm/swiglu are left out to keep this test short (with them on it did not finish
        # within 62 s on the H100; the cause was not isolated)
        kw = dict(hidden_size=256, num_hidden_layers=2, num_heads=2, num_kv_heads=1, vocab_size=512,
                  fuse_norm=False, fuse_swiglu=False)
        m_fast = TransformerForCausalLM(TransformerConfig(attn_impl=fast, **kw)).cuda()
        m_slow = TransformerForCausalLM(TransformerConfig(attn_impl=slow, **kw)).cuda()
        m_slow.load_state_dict(m_fast.state_dict())
        x = torch.randint(0, 512, (1, 300), device="cuda")
        cu = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            a = m_fast(input_ids=x, cu_seqlens=cu).logits.float()
        b = m_slow(input_ids=x, cu_seqlens=cu).logits.float()
        assert rel(a, b) < 2e-2, (fast, rel(a, b))
        out = m_fast.generate(x[:, :20], max_new_tokens=5, do_sample=False)
        assert out.shape == (1, 25)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("varlen", [False, True])
def test_compiled_matches_eager_and_float64(mode, varlen):
    """torch.compile(fullgraph=True) with inductor around the kernels: forward and every gradient
    against float64, as uncompiled (the custom ops stay opaque calls)."""
    from flame.ops.attention import parallel_attention

    torch.manual_seed(17 + MODES.index(mode))
    B, T = 2, 777
    q, k, v, do = make(B, T, 8, 2, 64)
    cu = torch.tensor([0, 300, 301, 900, 1400, B * T], device="cuda", dtype=torch.int32) if varlen else None
    max_seqlen = 600 if varlen else None

    def fn(q, k, v):
        # a scale by a Python float around the op, as in a model block (inductor emits a kernel for it)
        return parallel_attention(q * 1.0, k, v, mode, cu_seqlens=cu, max_seqlen=max_seqlen) * 0.5

    def run(f):
        xs = [x.clone().requires_grad_() for x in (q, k, v)]
        o = f(*xs)
        o.backward(do)
        return [o * 2] + [x.grad * 2 for x in xs]

    ref = reference(q, k, v, do, mode, cu)
    eager = run(fn)
    compiled = run(torch.compile(fn, fullgraph=True))
    check(eager, ref, f"eager {mode} varlen={varlen}")
    check(compiled, ref, f"compiled {mode} varlen={varlen}")
    for name, a, b in zip(("o", "dq", "dk", "dv"), compiled, eager):
        assert rel(a, b) <= 1e-3, f"compiled vs eager {mode} varlen={varlen}: {name} {rel(a, b):.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("attn_impl", ["parallel_attn", "parallel_softpick_attn", "parallel_rectified_attn",
                                       "parallel_scaled_softpick_attn"])
def test_transformer_blocks_compiled(attn_impl):
    """Every block compiled on its own (as --training.compile does), varlen, bf16 autocast: logits
    and weight gradients as accurate as uncompiled, both measured against the float32 run."""
    from flame.models.transformer import TransformerConfig, TransformerForCausalLM

    torch.manual_seed(5)
    kw = dict(hidden_size=256, num_hidden_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
              fuse_norm=False, fuse_swiglu=False, attn_impl=attn_impl)
    ref_model = TransformerForCausalLM(TransformerConfig(**kw)).cuda()
    model = TransformerForCausalLM(TransformerConfig(**kw)).cuda()
    model.load_state_dict(ref_model.state_dict())
    for i, block in enumerate(model.model.layers):
        model.model.layers[i] = torch.compile(block)
    x = torch.randint(0, 512, (1, 600), device="cuda")
    cu = torch.tensor([0, 250, 251, 600], device="cuda", dtype=torch.int32)

    def run(m, autocast):
        m.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = m(input_ids=x, cu_seqlens=cu, max_seqlen=349).logits.float()
        logits.square().mean().backward()
        return [logits.detach()] + [p.grad.clone() for p in m.parameters()]

    fp32, eager, compiled = run(ref_model, False), run(ref_model, True), run(model, True)
    for i, (r, e, c) in enumerate(zip(fp32, eager, compiled)):
        assert rel(c, r) <= 1.5 * rel(e, r) + 2e-3, (attn_impl, i, rel(c, r), rel(e, r))
