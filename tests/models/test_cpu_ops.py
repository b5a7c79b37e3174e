"""flame's torch ops against FLA's own naive references (or an independent definition) on random inputs."""
import pytest
import torch
import torch.nn.functional as F

from flame.models.cpu import modules as M
from flame.models.cpu import ops as O

ATOL = 1e-4  # float32; the chunked and the token-by-token forms sum in different orders


def _rand(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


@pytest.fixture(scope='module')
def qkv():
    B, T, H, K, V = 2, 37, 3, 8, 6  # T not a multiple of the chunk size on purpose
    q, k, v = _rand(B, T, H, K, seed=1), _rand(B, T, H, K, seed=2), _rand(B, T, H, V, seed=3)
    gk = F.logsigmoid(_rand(B, T, H, K, seed=4)) / 4
    h0 = _rand(B, H, K, V, seed=5)
    return q, k, v, gk, h0


def test_gla_matches_fla_naive(qkv):
    from fla.ops.gla.naive import naive_recurrent_gla
    q, k, v, gk, h0 = qkv
    ref_o, ref_h = naive_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True)
    o, h = O.chunk_gla_cpu(q, k, v, gk, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(h, ref_h, atol=ATOL, rtol=1e-4)
    # the V-first state layout used by FLA's GLA layer is the transpose
    o2, h2 = O.fused_recurrent_gla_cpu(q, k, v, gk=gk, initial_state=h0.transpose(-1, -2),
                                       output_final_state=True, state_v_first=True)
    torch.testing.assert_close(o2, ref_o, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(h2.transpose(-1, -2), ref_h, atol=ATOL, rtol=1e-4)


def test_gla_strong_decay_long_sequence_is_finite():
    # exp(-cumsum) formulations overflow here; the masked pairwise form must not
    B, T, H, K = 1, 300, 1, 4
    q, k, v = _rand(B, T, H, K, seed=6), _rand(B, T, H, K, seed=7), _rand(B, T, H, K, seed=8)
    gk = torch.full((B, T, H, K), -20.0)
    o, _ = O.chunk_gla_cpu(q, k, v, gk)
    assert torch.isfinite(o).all()
    # with a decay of exp(-20) per step only the current token matters
    expected = (q * k).sum(-1, keepdim=True) * K ** -0.5 * v
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=1e-4)


def test_delta_rule_matches_fla_naive(qkv):
    from fla.ops.delta_rule.naive import delta_rule_recurrence
    q, k, v, _, h0 = qkv
    k = F.normalize(k, dim=-1)
    beta = torch.sigmoid(_rand(*q.shape[:3], seed=9))
    tr = lambda x: x.transpose(1, 2)  # noqa: E731  (that naive op is head-major)
    ref_o, ref_h = delta_rule_recurrence(tr(q), tr(k), tr(v), tr(beta),
                                         initial_state=h0, output_final_state=True)
    o, h = O.delta_rule_cpu(q, k, v, beta, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, tr(ref_o), atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(h, ref_h, atol=ATOL, rtol=1e-4)


def test_gated_delta_rule_in_kernel_options_match_fla_naive(qkv):
    from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
    q, k, v, _, h0 = qkv
    B, T, H = q.shape[:3]
    a, b = _rand(B, T, H, seed=10), _rand(B, T, H, seed=11)
    A_log, dt_bias = _rand(H, seed=12) * 0.5, _rand(H, seed=13) * 0.5
    # what FLA's kernels do internally with use_gate_in_kernel / use_beta_sigmoid / qk l2norm
    g = -A_log.exp() * F.softplus(a + dt_bias)
    beta = torch.sigmoid(b) * 2  # allow_neg_eigval
    ref_o, ref_h = naive_recurrent_gated_delta_rule(
        O.l2norm_torch(q), O.l2norm_torch(k), v, beta, g, initial_state=h0, output_final_state=True)
    o, h = O.delta_rule_cpu(q, k, v, beta=b, g=a, initial_state=h0.transpose(-1, -2), output_final_state=True,
                            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                            use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(h.transpose(-1, -2), ref_h, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize('with_gate', [True, False])
def test_gsa_matches_fla_naive(with_gate):
    from fla.ops.gsa.naive import naive_recurrent_gsa
    B, T, HQ, H, K, V, M = 2, 21, 4, 2, 8, 6, 5  # grouped queries: 2 query heads per kv head
    q, k, v = _rand(B, T, HQ, K, seed=20), _rand(B, T, H, K, seed=21), _rand(B, T, H, V, seed=22)
    s = _rand(B, T, H, M, seed=23)
    g = F.logsigmoid(_rand(B, T, H, M, seed=24)) if with_gate else None
    h0 = (_rand(B, H, K, M, seed=25), _rand(B, H, M, V, seed=26))
    ref_o, ref_h = naive_recurrent_gsa(q, k, v, s, g, initial_state=h0, output_final_state=True)
    o, h = O.gsa_cpu(q, k, v, s, g, initial_state=h0, output_final_state=True)
    torch.testing.assert_close(o, ref_o, atol=ATOL, rtol=1e-4)
    for a, b in zip(h, ref_h):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)


def test_varlen_equals_per_sequence(qkv):
    q, k, v, gk, _ = qkv
    lens = [5, 20, 12]
    cu = torch.tensor([0, 5, 25, 37])
    packed = [x[:1] for x in (q, k, v, gk)]
    o, h = O.chunk_gla_cpu(*packed, cu_seqlens=cu, output_final_state=True)
    assert h.shape[0] == len(lens)
    for n in range(len(lens)):
        s, e = cu[n].item(), cu[n + 1].item()
        on, hn = O.chunk_gla_cpu(*(x[:, s:e] for x in packed), output_final_state=True)
        torch.testing.assert_close(o[:, s:e], on)
        torch.testing.assert_close(h[n:n + 1], hn)


def test_causal_conv_matches_padded_conv1d_and_decoding():
    B, T, D, W = 2, 11, 6, 4
    x, w, b = _rand(B, T, D, seed=30), _rand(D, W, seed=31), _rand(D, seed=32)
    ref = F.silu(F.conv1d(x.transpose(1, 2), w.unsqueeze(1), b, padding=W - 1, groups=D)[..., :T]).transpose(1, 2)
    y, state = M.causal_conv1d_cpu(x, w, b, activation='silu', output_final_state=True)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, x[:, -W:].transpose(1, 2))
    # prefill the first 7 tokens, then decode the rest one by one with the in-place cache update
    y1, cache = M.causal_conv1d_cpu(x[:, :7], w, b, activation='silu', output_final_state=True)
    steps = [M.causal_conv1d_update_cpu(x[:, t], cache, weight=w, bias=b, activation='silu')[0]
             for t in range(7, T)]
    torch.testing.assert_close(torch.cat([y1, torch.stack(steps, 1)], 1), ref, atol=1e-5, rtol=1e-5)


def test_rotary_and_norms_match_fla_refs():
    from fla.modules.layernorm import layer_norm_ref, rms_norm_ref
    from fla.modules.rotary.ops import rotary_embedding_ref
    B, T, H, D = 2, 9, 3, 16
    x = _rand(B, T, H, D, seed=40)
    ang = torch.arange(T + 3)[:, None] * torch.rand(6)[None]  # rotary dim 12 < D
    cos, sin = ang.cos(), ang.sin()
    for inter in (False, True):
        ref = rotary_embedding_ref(x, cos[3:3 + T], sin[3:3 + T], interleaved=inter)
        got = M.rotary_embedding_cpu(x, cos, sin, interleaved=inter, seqlen_offsets=3)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    h, r = _rand(4, 32, seed=41), _rand(4, 32, seed=42)
    w, bias = _rand(32, seed=43), _rand(32, seed=44)
    torch.testing.assert_close(M.rms_norm_cpu(h, w, None, r, 1e-5, True)[0],
                               rms_norm_ref(h, w, None, r, 1e-5, True)[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(M.layer_norm_cpu(h, w, bias, eps=1e-5), layer_norm_ref(h, w, bias, eps=1e-5),
                               atol=1e-5, rtol=1e-5)


def test_fused_cross_entropy_matches_torch(cpu_fallbacks):
    from fla.modules import FusedCrossEntropyLoss, FusedLinearCrossEntropyLoss
    logits, target = _rand(10, 17, seed=50), torch.randint(0, 17, (10,))
    target[3] = -100
    ref = F.cross_entropy(logits, target)
    torch.testing.assert_close(FusedCrossEntropyLoss()(logits, target), ref)
    x, w = _rand(10, 8, seed=51), _rand(17, 8, seed=52)
    torch.testing.assert_close(FusedLinearCrossEntropyLoss()(x, target, w), F.cross_entropy(x @ w.T, target))


def test_sdpa_window_matches_explicit_softmax():
    B, T, H, D, win = 1, 12, 2, 8, 4
    q, k, v = _rand(B, T, H, D, seed=60), _rand(B, T, 1, D, seed=61), _rand(B, T, 1, D, seed=62)
    o = M.flash_attn_func_cpu(q, k, v, causal=True, window_size=(win - 1, 0))
    s = torch.einsum('bihd,bjd->bhij', q, k[:, :, 0]) / D ** 0.5
    i, j = torch.arange(T)[:, None], torch.arange(T)[None]
    s = s.masked_fill(~((j <= i) & (j > i - win)), float('-inf'))
    ref = torch.einsum('bhij,bjd->bihd', s.softmax(-1), v[:, :, 0])
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)
