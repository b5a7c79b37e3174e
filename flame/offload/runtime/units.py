"""The engine's units (a decoder block, or "outer": everything else) and GPU buffer slots.

A unit's parameters are views into flat buffers. With data parallelism (world > 1) a host unit's
flat range is padded to a multiple of the world size and each rank owns one shard of it; "gpu"
units stay whole on every rank. Each part of the engine keeps its own state of a unit in its own
record: `weights` (schedule.UnitWeights), `grads` (gradients.UnitGrads), `optimizer`
(host_optimizer.UnitOptimizer); each is set once by that part when the engine builds the unit.
A frozen unit (all its parameters frozen: a LoRA base) has weights only: its `optimizer` is None
and its `grads` record stays empty.
"""

from __future__ import annotations

import threading
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from flame.offload.runtime.activations import HostActivations
    from flame.offload.runtime.gradients import UnitGrads
    from flame.offload.runtime.host_optimizer import UnitOptimizer
    from flame.offload.runtime.schedule import UnitWeights


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """`a` and `b` are the same memory in the same dtype (a copy between them is a no-op)."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype


def set_event() -> threading.Event:
    """A threading.Event that starts set (nothing pending)."""
    e = threading.Event()
    e.set()
    return e


@dataclass(eq=False)
class Slot:
    """A GPU buffer lent to one unit at a time (weights of a streamed unit, or its grads)."""

    buffer: torch.Tensor
    owner: Unit | None = None
    free: object = None  # event: the last GPU work that read the buffer (the next fill waits for it)
    last_use: int = -1  # the schedule's counter when lent: the least recently used slot is lent next


@dataclass(eq=False)
class Unit:
    index: int  # 0: outer, i + 1: block i
    name: str
    params: list[tuple[str, nn.Parameter]]  # (first name, parameter), each parameter once
    mode: str  # gpu | host_opt | stream (see the engine's module docstring)
    activation_mode: str  # keep | selective | recompute | offload | recompute_host
    accumulate_on_gpu: bool  # host unit, several micro-batches: grads summed on the GPU, sent once a step
    world: InitVar[int] = 1
    rank: InitVar[int] = 0
    # every parameter frozen (a LoRA base): compute copy only, no grads, master, moments or optimizer step
    frozen: bool = False
    offsets: list[int] = field(init=False)  # of every parameter in the flat buffers
    numel: int = field(init=False)
    sharded: bool = field(init=False)  # host unit with several data-parallel ranks
    padded_numel: int = field(init=False)  # numel rounded up to a multiple of the world size
    shard_numel: int = field(init=False)  # elements this rank owns (numel when not sharded)
    shard_start: int = field(init=False)  # first owned element (0 when not sharded)
    # ranges of the (shard of the) master excluded from weight decay: (start, length)
    no_decay_ranges: list[tuple[int, int]] = field(default_factory=list)
    # the same coordinates cut into ranges in order: (start, end, decayed), covering the master
    decay_segments: list[tuple[int, int, bool]] = field(default_factory=list)
    # [start, end) ranges of the (shard of the) flat buffers, in order, covering them: cut at the
    # parameters whose grads are handed on alone as soon as they arrive (gradients.py: early
    # pieces); one range otherwise. The CPU AdamW runs piece by piece either way.
    pieces: list[tuple[int, int]] = field(init=False)
    early: dict[int, int] = field(default_factory=dict)  # parameter index -> its piece, for those parameters
    activations: HostActivations | None = None  # offload, recompute_host: the block's host arena
    weights: UnitWeights | None = None
    grads: UnitGrads | None = None
    optimizer: UnitOptimizer | None = None

    def __post_init__(self, world: int, rank: int) -> None:
        self.offsets, off = [], 0
        for _, p in self.params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.sharded = world > 1 and self.mode != "gpu"
        self.padded_numel = -(-off // world) * world if self.sharded else off
        self.shard_numel = self.padded_numel // world if self.sharded else off
        self.shard_start = rank * self.shard_numel if self.sharded else 0
        self.pieces = [(0, self.shard_numel)]

    def owned(self, o: int, n: int) -> tuple[int, int] | None:
        """[a, b): the part of flat range [o, o + n) this rank owns, in flat coordinates."""
        a, b = max(o, self.shard_start), min(o + n, self.shard_start + self.shard_numel)
        return (a, b) if a < b else None

    def owned_slice(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's shard of a full (padded) flat buffer of the unit."""
        return buf[self.shard_start:self.shard_start + self.shard_numel]

    def values(self) -> torch.Tensor:
        """This rank's (shard of the) flat values the checkpoint holds: the master, or a frozen
        unit's compute copy (on the host, or resident for a gpu unit)."""
        if self.optimizer is not None:
            return self.optimizer.master.data
        return self.weights.host if self.weights.host is not None else self.weights.resident

    def flat_values(self, dtype: torch.dtype, device) -> torch.Tensor:
        """The parameters' current values on this rank as one flat tensor: its shard, zero padding
        included."""
        t = (torch.zeros if self.sharded else torch.empty)(self.shard_numel, dtype=dtype, device=device)
        for (_, p), o in zip(self.params, self.offsets):
            ab = self.owned(o, p.numel())
            if ab:
                t[ab[0] - self.shard_start:ab[1] - self.shard_start].copy_(p.data.reshape(-1)[ab[0] - o:ab[1] - o])
        return t

    def views(self, flat: torch.Tensor):
        """(name, parameter, view of `flat` shaped like it) for every parameter."""
        for (fqn, p), o in zip(self.params, self.offsets):
            yield fqn, p, flat[o:o + p.numel()].view(p.shape)

    def bind(self, flat: torch.Tensor, grad: bool = False) -> None:
        """Point every parameter's data (or grad) at its view of `flat`."""
        for _, p, v in self.views(flat):
            if grad:
                p.grad = v
            else:
                p.data = v
