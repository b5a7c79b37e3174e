"""flame's clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on one process (the 2-rank
FSDP2/DDP/TP/HSDP cases, with DTensor and mixed layouts, run in scripts/grad_parity.py)."""

import math

import pytest
import torch

from flame.components.optimizer import clip_grad_norm_


def _params(seed):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.nn.Parameter(torch.randn(*s, generator=g)) for s in ((7, 5), (5,), (3, 4, 2), (11,))]
    for p in ps[:-1]:
        p.grad = torch.randn(p.shape, generator=g)
    return ps  # the last one has no grad: skipped by both


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 3.0])  # measure only, clip, max_norm above the norm
def test_clip_matches_torch(norm_type, fraction):
    ours, ref = _params(0), _params(0)
    full = float(torch.nn.utils.get_total_norm([p.grad for p in ref[:-1]], norm_type))
    max_norm = fraction * full
    want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type) if max_norm > 0 else torch.tensor(full)
    got = clip_grad_norm_(ours, max_norm, norm_type)
    torch.testing.assert_close(got, want)
    for p, q in zip(ours, ref):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    after = float(torch.nn.utils.get_total_norm([p.grad for p in ours[:-1]], norm_type))
    assert after == pytest.approx(min(full, max_norm) if max_norm > 0 else full, rel=1e-5)
