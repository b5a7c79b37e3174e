"""Helpers shared by tests/attention (a uniquely named module: several test folders have conftests)."""
import math

import torch


def rowwise_attention(q, k, v, mode, window=None, q_offset=None, starts=None, eps=1e-6):
    """Float64 attention written out one query row at a time (no max shift: only for moderate logits).

    Query i (at position i + q_offset) sees keys max(pos - window + 1, document start) .. pos; window None
    means no window, starts (the first position of each packed document) None means one document.
    """
    B, tq, hq, d = q.shape
    tk, hk = k.shape[1], k.shape[2]
    q_offset = tk - tq if q_offset is None else q_offset
    o = torch.zeros(B, tq, hq, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for h in range(hq):
            kh = h // (hq // hk)
            for i in range(tq):
                pos = i + q_offset
                lo = 0 if window is None else max(0, pos - window + 1)
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
