"""The engine's units (a decoder block, or "outer": everything else) and GPU weight slots."""

from __future__ import annotations

import threading

import torch
import torch.nn as nn


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype


class Unit:
    def __init__(self, idx: int, name: str, params: list[tuple[str, nn.Parameter]], mode: str, act: str):
        self.idx, self.name, self.mode, self.act = idx, name, mode, act
        self.params = params  # (fqn, param), unique params
        self.offsets, off = [], 0
        for _, p in params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.slot = None  # stream: the GPU slot holding the weights
        self.gslot = None
        self.ready = None  # event: weights on the GPU
        self.g_free = None  # event: GPU grad buffer free again
        self.d2h_done = None
        self.cpu_done = threading.Event()
        self.cpu_done.set()
        self.stage_free = threading.Event()
        self.stage_free.set()
        self.count = 0
        self.flushed = False
        self.needs_h2d = False
        self.gpu_acc = False  # grads accumulated on the GPU over the rounds (host units, rounds > 1)
        self.gacc_dev = None
        self.sent = False  # this step's accumulated grads went to the host
        self.host_sq = None  # squared norm of the host accumulator, once its last round is added
        # data-parallel shard of the flat buffers (see the module doc): padded numel, shard numel,
        # first owned element; the whole unit (pn = sn = numel, lo = 0) with one rank or in "gpu" mode
        self.sharded = False
        self.pn = self.sn = self.numel
        self.lo = 0
        self.gsh = None  # GPU shard the full grad is reduce-scattered into
        self.gsh_free = None  # event: gsh read by its D2H
        self.acts = None  # activations offloaded to host (act == "offload"): a HostActivations

    def owned(self, o: int, n: int) -> tuple[int, int] | None:
        """[a, b): the part of flat range [o, o + n) this rank owns, in flat coordinates."""
        a, b = max(o, self.lo), min(o + n, self.lo + self.sn)
        return (a, b) if a < b else None

    def bind(self, flat: torch.Tensor, grad: bool = False) -> None:
        for (_, p), o in zip(self.params, self.offsets):
            v = flat[o:o + p.numel()].view(p.shape)
            if grad:
                p.grad = v
            else:
                p.data = v


class _Slot:
    def __init__(self, buf):
        self.buf, self.owner, self.free, self.last_use = buf, None, None, -1
