"""Where each unit's compute weights are on the GPU, and when they get there.

"gpu" units keep their compute copy on the GPU. A "host_opt" unit keeps one too and refreshes it
from its pinned host copy once after every CPU optimizer step, before its next forward. A
"stream" unit has its weights on the GPU only while it runs: they are copied into a slot of a
rotating pool `prefetch_depth` blocks ahead, in the forward and again in the backward. All
copies run on the H2D stream; with data parallelism each rank copies its shard into its slice of
the unit's buffer and the slices are all-gathered in place on a comm stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from flame.offload.runtime.collectives import all_gather_flat
from flame.offload.runtime.streams import Streams
from flame.offload.runtime.units import Slot, Unit, same_tensor


@dataclass(eq=False)
class UnitWeights:
    """A unit's compute weights (the schedule's state of the unit)."""

    resident: torch.Tensor | None = None  # gpu, host_opt: the compute copy on the GPU (padded when sharded)
    host: torch.Tensor | None = None  # host units: this rank's shard, pinned; the CPU AdamW writes it
    slot: Slot | None = None  # stream: the slot that holds the weights now
    ready: object = None  # event: the whole weights are on the GPU
    needs_upload: bool = False  # host_opt: `host` is newer than `resident`
    upload_read_done: object = None  # event: the last H2D read of `host` (the next CPU step writes after it)


class WeightSchedule:
    def __init__(self, units: list[Unit], streams: Streams, device: torch.device, compute_dtype: torch.dtype,
                 depth: int, group, world: int, wait_for_optimizer: Callable[[Unit], None]):
        """`wait_for_optimizer(u)`: returns once u's CPU optimizer step has written its host copy."""
        self.units, self.s, self.device, self.dtype, self.depth = units, streams, device, compute_dtype, depth
        self.group = group
        self.wait_for_optimizer = wait_for_optimizer
        # all-gathers of the weights run here, off the compute stream (prefetched like the H2D)
        self.comm = torch.cuda.Stream(device) if streams.cuda and world > 1 else None
        self.slots: list[Slot] = []
        self.slot_of_storage: dict[int, Slot] = {}  # data_ptr of a slot's storage -> the slot
        self.use_counter = 0

    def build_slots(self) -> None:
        stream_units = [u for u in self.units if u.mode == "stream"]
        if stream_units:
            big = max(u.padded_numel for u in stream_units)
            # depth+1 ahead of (or behind) the running block, the running block, and the block whose
            # backward may still be finishing (protected until its grads are out)
            self.slots = [Slot(torch.empty(big, dtype=self.dtype, device=self.device)) for _ in range(self.depth + 3)]
            self.slot_of_storage = {s.buffer.untyped_storage().data_ptr(): s for s in self.slots}

    def build_unit(self, u: Unit, master: torch.Tensor) -> None:
        """u's compute copies from its master values (`master`: the flat master, possibly the
        very tensor that becomes the master parameter)."""
        w = u.weights = UnitWeights()
        if u.mode == "gpu":
            w.resident = master if master.dtype == self.dtype else master.to(self.dtype)
            return
        # the pinned compute copy the GPU is filled from (exact size, registered later); with
        # master dtype == compute dtype it is the master itself: the CPU step waits for the last
        # H2D read of it before writing (host_optimizer)
        w.host = master.to(self.dtype) if master.dtype != self.dtype else master

    def build_resident(self, u: Unit) -> None:
        """host_opt: the GPU compute copy, filled now (no H2D before the first forward)."""
        w = u.weights
        if u.mode != "host_opt":
            return
        w.resident = torch.empty(u.padded_numel, dtype=self.dtype, device=self.device)
        self._upload_resident_now(u)

    def _upload_resident_now(self, u: Unit) -> None:
        """host_opt: the GPU compute copy from the pinned host copy, synchronously (gathered
        from every rank's shard when sharded)."""
        w = u.weights
        self.s.copy(w.host, 0, u.shard_numel, w.resident[u.shard_start:], to_host=False, non_blocking=False)
        if u.sharded:
            all_gather_flat(w.resident, u.owned_slice(w.resident), self.group)

    def bind_initial(self, u: Unit) -> None:
        """Parameters point at the resident copy; a streamed unit's at a slot (nothing meaningful
        until fetched)."""
        w = u.weights
        u.bind(w.resident if w.resident is not None else self.slots[0].buffer[: u.numel])

    # ------------------------------------------------------------------ fetching
    def fetch(self, u: Unit, protect: set[int]) -> None:
        """Make `u`'s weights available on the GPU (issue the H2D on the copy stream); the units
        with an index in `protect` keep their slots."""
        w = u.weights
        if u.mode == "gpu":
            return
        if u.mode == "host_opt":
            if not w.needs_upload:
                return
            self.wait_for_optimizer(u)
            with self.s.on(self.s.h2d):
                self.s.copy(w.host, 0, u.shard_numel, w.resident[u.shard_start:], to_host=False)
                w.upload_read_done = self.s.record(self.s.h2d)
            w.ready = self._gather(u, w.resident, w.upload_read_done)
            w.needs_upload = False
            return
        self.use_counter += 1
        if w.slot is not None and w.slot.owner is u:
            w.slot.last_use = self.use_counter
            return
        self.wait_for_optimizer(u)
        cands = [s for s in self.slots if s.owner is None or s.owner.index not in protect]
        slot = min(cands, key=lambda s: s.last_use)
        if slot.owner is not None:
            slot.owner.weights.slot = None
        slot.owner, slot.last_use, w.slot = u, self.use_counter, slot
        with self.s.on(self.s.h2d):
            self.s.wait(self.s.h2d, slot.free)
            self.s.copy(w.host, 0, u.shard_numel, slot.buffer[u.shard_start:], to_host=False)
            w.upload_read_done = self.s.record(self.s.h2d)
        w.ready = self._gather(u, slot.buffer, w.upload_read_done)
        u.bind(slot.buffer[: u.numel])

    def _gather(self, u: Unit, buf: torch.Tensor, h2d_done):
        """Sharded: all-gather the rank's slice of `buf` (just copied H2D) in place into the whole
        unit, on the comm stream once the copy is done; returns the event of the full weights."""
        if not u.sharded:
            return h2d_done
        with self.s.on(self.comm):
            self.s.wait(self.comm, h2d_done)
            all_gather_flat(buf[:u.padded_numel], u.owned_slice(buf), self.group)
            return self.s.record(self.comm)

    def use(self, u: Unit) -> None:
        """The compute stream waits for `u`'s weights."""
        if u.mode != "gpu" and u.weights.ready is not None and self.s.cuda:
            torch.cuda.current_stream().wait_event(u.weights.ready)

    def release(self, u: Unit) -> None:
        """The compute stream's work so far is the last to read u's slot."""
        if u.weights.slot is not None:
            u.weights.slot.free = self.s.record()

    def drop_slot(self, u: Unit) -> None:
        w = u.weights
        if w.slot is not None:
            w.slot.owner, w.slot = None, None

    # ------------------------------------------------------------------ prefetch order
    def forward_start(self) -> None:
        """The model's forward begins: the outer unit and the first blocks."""
        outer = self.units[0]
        self.fetch(outer, set())
        for j in range(1, min(len(self.units), self.depth + 2)):
            self.fetch(self.units[j], set(range(1, self.depth + 2)))
        self.use(outer)

    def block_forward(self, u: Unit) -> None:
        """Block `u`'s forward begins: it and the next `depth` blocks."""
        protect = set(range(u.index, u.index + self.depth + 1))
        for j in range(u.index, min(u.index + self.depth + 1, len(self.units))):
            self.fetch(self.units[j], protect)
        self.use(u)

    def block_backward(self, u: Unit) -> None:
        """Block `u`'s backward begins: it and the `depth` blocks below, each with its offloaded
        activations."""
        protect = set(range(max(1, u.index - self.depth), u.index + 2))
        for j in range(u.index, max(0, u.index - self.depth - 1), -1):
            self.fetch(self.units[j], protect)
            if self.units[j].activations is not None:  # prefetched with the weights, the same depth
                self.units[j].activations.fetch()
        self.use(u)

    # ------------------------------------------------------------------ after the optimizer
    def stale(self, u: Unit) -> None:
        """u's optimizer step is writing new weights: the next forward uploads them again."""
        u.weights.needs_upload = u.mode == "host_opt"
        self.drop_slot(u)  # the slot holds the old weights: the next forward refetches

    def refresh_from_master(self, u: Unit, master: torch.Tensor) -> None:
        """The compute copies again equal to the master values (after the GPU step or a load)."""
        w = u.weights
        if u.mode == "gpu":
            if not same_tensor(w.resident, master):
                w.resident.copy_(master)
            return
        if not same_tensor(w.host, master):
            w.host.copy_(master)
        if u.mode == "host_opt":
            self._upload_resident_now(u)
        else:
            self.drop_slot(u)
