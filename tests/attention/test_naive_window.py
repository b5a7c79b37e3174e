"""naive_attention with a sliding window against a row-by-row float64 definition in which query i
sees only keys i - w + 1 .. i (decode offsets, GQA and packed documents included)."""
import pytest
import torch

from attention_testlib import rowwise_attention
from flame.ops.attention import naive_attention


@pytest.mark.parametrize("mode", ["softmax", "softpick", "rectified"])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_matches_row_by_row(mode, window):
    g = torch.Generator().manual_seed(window)
    q = torch.randn(2, 11, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 11, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    o, w = naive_attention(q, k, v, mode, window_size=window)
    torch.testing.assert_close(o, rowwise_attention(q, k, v, mode, window=window), rtol=1e-10, atol=1e-12)
    i, j = torch.arange(11)[:, None], torch.arange(11)[None, :]
    outside = (j > i) | (j <= i - window)
    assert torch.all(w[..., outside] == 0)
    if mode == "softmax":
        assert torch.all(w[..., ~outside] > 0)


@pytest.mark.parametrize("mode", ["softmax", "softpick"])
def test_window_with_decode_offset_and_documents(mode):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 14, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    # the last 4 queries against all 14 keys (decode), window 5
    o, _ = naive_attention(q[:, -4:], k, v, mode, window_size=5)
    torch.testing.assert_close(o, rowwise_attention(q[:, -4:], k, v, mode, window=5), rtol=1e-10, atol=1e-12)
    # packed documents [0, 6), [6, 9), [9, 14): the window stops at the document start
    cu = torch.tensor([0, 6, 9, 14])
    o, _ = naive_attention(q, k, v, mode, window_size=4, cu_seqlens=cu)
    torch.testing.assert_close(o, rowwise_attention(q, k, v, mode, window=4, starts=[0, 6, 9]), rtol=1e-10, atol=1e-12)
