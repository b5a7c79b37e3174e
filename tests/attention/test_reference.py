"""The pure-torch references (naive_attention) against float64 math written out row by row."""
import math

import pytest
import torch

from attention_testlib import rowwise_attention
from flame.errors import ConfigError
from flame.ops.attention import log_position_scale, naive_attention, positions_from_cu_seqlens


@pytest.mark.parametrize("mode", ["softmax", "softpick", "rectified"])
def test_matches_rowwise(mode):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 9, 4, 8), torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    o, w = naive_attention(q.double(), k.double(), v.double(), mode)
    torch.testing.assert_close(o, rowwise_attention(q, k, v, mode), rtol=1e-10, atol=1e-12)
    assert w.shape == (2, 4, 9, 9)
    assert torch.all(w.triu(1) == 0)  # causal
    if mode == "softmax":
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9, dtype=torch.float64))
    if mode == "softpick":
        assert torch.all(w.sum(-1) <= 1 + 1e-12) and torch.all(w >= 0)


@pytest.mark.parametrize("mode", ["softmax", "softpick", "rectified"])
def test_decode_rows_equal_full(mode):
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 12, 2, 16, dtype=torch.float64) for _ in range(3))
    full, _ = naive_attention(q, k, v, mode)
    last, _ = naive_attention(q[:, -3:], k, v, mode)
    torch.testing.assert_close(last, full[:, -3:])
    torch.testing.assert_close(last, rowwise_attention(q[:, -3:], k, v, mode))


@pytest.mark.parametrize("mode", ["softmax", "softpick", "rectified"])
def test_varlen_equals_separate_documents(mode):
    torch.manual_seed(2)
    lens = [5, 1, 11, 7]
    T = sum(lens)
    q, k, v = torch.randn(1, T, 4, 8, dtype=torch.float64), torch.randn(1, T, 2, 8, dtype=torch.float64), \
        torch.randn(1, T, 2, 8, dtype=torch.float64)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)))
    o, _ = naive_attention(q, k, v, mode, cu_seqlens=cu)
    for a, b in zip(cu[:-1], cu[1:]):
        ref, _ = naive_attention(q[:, a:b], k[:, a:b], v[:, a:b], mode)
        torch.testing.assert_close(o[:, a:b], ref)
    # batch 2 with cu_seqlens over the flattened tokens
    o2, _ = naive_attention(q.view(2, T // 2, 4, 8), k.view(2, T // 2, 2, 8), v.view(2, T // 2, 2, 8), mode,
                            cu_seqlens=cu)
    torch.testing.assert_close(o2.reshape(1, T, 4, 8), o)


def test_softpick_is_stable_for_large_logits():
    # exp(400) overflows even float64; the running-max form must still give the exact limit
    q = torch.zeros(1, 3, 1, 4, dtype=torch.float64)
    k = torch.zeros(1, 3, 1, 4, dtype=torch.float64)
    q[0, 2, 0, 0] = 20.0
    k[0, :, 0, 0] = torch.tensor([40.0, 0.0, -40.0])    # logits of the last row: 400, 0, -400 (scale 1/2)
    v = torch.eye(3, 4, dtype=torch.float64)[None, :, None, :]
    o, w = naive_attention(q, k, v, "softpick")
    assert torch.isfinite(o).all() and torch.isfinite(w).all()
    # last row: weights -> (1, 0, 0) since |e^-200 - 1| is negligible against e^200
    torch.testing.assert_close(w[0, 0, 2], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64))


def test_rectified_row_without_positive_logit_is_zero():
    q = torch.tensor([1.0, 0, 0, 0], dtype=torch.float64).view(1, 1, 1, 4)
    k = torch.tensor([-1.0, 0, 0, 0], dtype=torch.float64).view(1, 1, 1, 4)
    v = torch.ones(1, 1, 1, 4, dtype=torch.float64)
    o, w = naive_attention(q, k, v, "rectified")
    assert torch.all(o == 0) and torch.all(w == 0)


@pytest.mark.parametrize("mode", ["softpick", "rectified", "softmax"])
def test_gradcheck(mode):
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert torch.autograd.gradcheck(lambda a, b, c: naive_attention(a, b, c, mode)[0], (q, k, v))


def test_key_padding_mask():
    torch.manual_seed(4)
    q, k, v = (torch.randn(2, 6, 2, 8, dtype=torch.float64) for _ in range(3))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    o, _ = naive_attention(q, k, v, "softpick", key_padding_mask=mask)
    ref, _ = naive_attention(q[:1, 2:], k[:1, 2:], v[:1, 2:], "softpick")
    torch.testing.assert_close(o[:1, 2:], ref)
    assert torch.all(o[0, :2] == 0)


def test_positions_and_log_scale():
    cu = torch.tensor([0, 3, 4, 8])
    assert positions_from_cu_seqlens(cu, 8).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]
    s = log_position_scale(torch.tensor([[0, 1]]), torch.tensor([0.3, 1.0]))
    torch.testing.assert_close(s[0, :, :, 0], torch.tensor([[0.3 * math.log(2), math.log(2)],
                                                            [0.3 * math.log(3), math.log(3)]]))


def test_unknown_mode_and_head_dim():
    x = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ConfigError, match="'sparsemax'"):
        naive_attention(x, x, x, "sparsemax")
    from flame.ops.attention import parallel_attention

    y = torch.zeros(1, 2, 1, 512)
    with pytest.raises(ConfigError, match="512"):
        parallel_attention(y, y, y, "softpick")
