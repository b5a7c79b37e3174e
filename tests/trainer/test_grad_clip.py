"""flame's clip_grad_norm_ against torch.nn.utils.clip_grad_norm_ on one process (the 2-rank
FSDP2/DDP/TP/HSDP cases, with DTensor and mixed layouts, run in scripts/grad_parity.py)."""

import math

import pytest
import torch

from torch.distributed.tensor import DTensor

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


def test_clip_over_dtensor_and_plain_layouts_on_one_rank(tmp_path):
    """Tensor parallelism without FSDP leaves some parameters plain: the total norm combines the
    DTensor group and the plain group (a 1-rank gloo mesh in this process; 2 ranks in grad_parity)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        ref = _params(1)
        ours = []
        for i, q in enumerate(ref):
            if i % 2 == 0:  # every other one a DTensor
                p = torch.nn.Parameter(distribute_tensor(q.detach().clone(), mesh, [Shard(0)]))
                p.grad = distribute_tensor(q.grad.clone(), mesh, [Shard(0)]) if q.grad is not None else None
            else:
                p = torch.nn.Parameter(q.detach().clone())
                p.grad = q.grad.clone() if q.grad is not None else None
            ours.append(p)
        for norm_type in (2.0, math.inf):
            for p, q in zip(ours, ref):
                if q.grad is not None:
                    q.grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(len(q.shape)))
                    p.grad = (distribute_tensor(q.grad.clone(), mesh, [Shard(0)]) if isinstance(p.grad, DTensor)
                              else q.grad.clone())
            max_norm = 0.3 * float(torch.nn.utils.get_total_norm([q.grad for q in ref[:-1]], norm_type))
            want = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type)
            got = clip_grad_norm_(ours, max_norm, norm_type)
            torch.testing.assert_close(got, want)
            for p, q in zip(ours[:-1], ref[:-1]):
                g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                torch.testing.assert_close(g, q.grad, rtol=1e-6, atol=0)
    finally:
        dist.destroy_process_group()
