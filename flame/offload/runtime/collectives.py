"""The two collectives the sharded offload engine needs, over flat 1-D buffers.

NCCL (and the other device backends) get the native `all_gather_into_tensor` /
`reduce_scatter_tensor`. Any other backend (gloo in the CPU tests) gets a fallback built from
`all_gather` (list) and `all_reduce`, which every backend has: older torch releases' gloo lacks
the tensor forms (reduce_scatter in particular), and on CPU their cost does not matter. The
fallback never aliases its input with its output and leaves the input unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

NATIVE_BACKENDS = ("nccl", "xccl")


def multi_rank() -> bool:
    """torch.distributed is running with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def native(group=None) -> bool:
    return dist.get_backend(group) in NATIVE_BACKENDS


def comm_device(group, device: torch.device) -> torch.device:
    """Where tensors handed to `group` must live: the compute device for NCCL, else the CPU."""
    return torch.device(device) if native(group) else torch.device("cpu")


def all_gather_flat(out: torch.Tensor, shard: torch.Tensor, group=None, use_native: bool | None = None) -> None:
    """out[r * S:(r + 1) * S] = shard of rank r (S = shard.numel(), out.numel() = world * S).
    `shard` may be out's own slice of this rank (in place, as FSDP2 does with NCCL)."""
    if use_native if use_native is not None else native(group):
        dist.all_gather_into_tensor(out, shard, group=group)
        return
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    src = shard.clone()  # out's chunk of this rank may be `shard` itself
    parts = list(out.chunk(world))
    dist.all_gather(parts, src, group=group)
    parts[rank].copy_(src)  # a no-op unless the backend wrote around the alias


def reduce_scatter_flat(out: torch.Tensor, full: torch.Tensor, group=None, use_native: bool | None = None) -> None:
    """out = sum over ranks of full[r * S:(r + 1) * S] for this rank r (S = out.numel())."""
    if use_native if use_native is not None else native(group):
        dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.SUM, group=group)
        return
    rank, n = dist.get_rank(group), out.numel()
    tmp = full.clone()
    dist.all_reduce(tmp, op=dist.ReduceOp.SUM, group=group)
    out.copy_(tmp[rank * n:(rank + 1) * n])
