"""naive_attention with a sliding window against a row-by-row float64 definition in which query i
sees only keys i - w + 1 .. i (decode offsets, GQA and packed documents included)."""
import math

import pytest
import torch

from flame.ops.attention import naive_attention


def windowed_rows(q, k, v, mode, window, q_offset=None, starts=None, eps=1e-6):
    """Float64, one query row at a time: keys max(i - window + 1, document start) .. i."""
    B, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    q_offset = tk - tq if q_offset is None else q_offset
    o = torch.zeros(B, tq, hq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(tq):
                pos = i + q_offset
                lo = max(0, pos - window + 1)
                if starts is not None:
                    lo = max(lo, max(s for s in starts if s <= pos))
                s = (k[b, lo:pos + 1, kh].double() @ q[b, i, h].double()) / math.sqrt(d)
                if mode == "softmax":
                    w = torch.softmax(s, 0)
                elif mode == "rectified":
                    keep = s >= 0
                    w = torch.zeros_like(s)
                    if keep.any():
                        w[keep] = torch.softmax(s[keep], 0)
                else:
                    e = torch.expm1(s)
                    w = torch.relu(e) / (e.abs().sum() + eps)
                o[b, i, h] = w @ v[b, lo:pos + 1, kh].double()
    return o


@pytest.mark.parametrize("mode", ["softmax", "softpick", "rectified"])
@pytest.mark.parametrize("window", [1, 3, 8])
def test_window_matches_row_by_row(mode, window):
    g = torch.Generator().manual_seed(window)
    q = torch.randn(2, 11, 4, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 11, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    o, w = naive_attention(q, k, v, mode, window_size=window)
    torch.testing.assert_close(o, windowed_rows(q, k, v, mode, window), rtol=1e-10, atol=1e-12)
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
    torch.testing.assert_close(o, windowed_rows(q[:, -4:], k, v, mode, 5), rtol=1e-10, atol=1e-12)
    # packed documents [0, 6), [6, 9), [9, 14): the window stops at the document start
    cu = torch.tensor([0, 6, 9, 14])
    o, _ = naive_attention(q, k, v, mode, window_size=4, cu_seqlens=cu)
    torch.testing.assert_close(o, windowed_rows(q, k, v, mode, 4, starts=[0, 6, 9]), rtol=1e-10, atol=1e-12)
