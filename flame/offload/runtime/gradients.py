"""Gradients of the engine's units: buffers, reduction over the data-parallel ranks, accumulation
over the micro-batches of a step, the copies to the host, and the squared norms for clipping.

Autograd writes a unit's grads into its flat GPU grad buffer (a streamed unit's: one of two
rotating grad slots, lent when its backward starts). When all of a unit's grads of a
micro-batch have arrived:
- "gpu" units add them into their accumulator (or accumulate in the buffer itself);
- host units first reduce-scatter them over the ranks (data parallelism: this rank's shard of
  the sum), then either add them into a GPU accumulator that goes to the host once a step, or
  copy them D2H into a pinned staging buffer; with several micro-batches the CPU worker adds
  the staged grads into the host accumulator, and takes the norm of the sum after the last one.
The squared norms are taken where the grads are (GPU as they leave, CPU worker as they are
summed) and combined once a step, with one host sync.

Early pieces (one micro-batch a step, an unsharded host unit, speculative steps): a parameter
that is a large part of its unit (cost_model.early_piece: the untied output head of the outer
unit, whose grad the loss's backward delivers first) is handed on alone as soon as its grad
arrives: its range goes D2H into the same staging buffer and the optimizer is told (a
speculative CPU step over that range) while the rest of the unit's backward runs. When the unit
completes, the rest goes the same way. The piece's grads stay in the GPU buffer until then: the
unit's norm is taken and the buffer zeroed over the whole unit at once, as without early pieces.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from flame.offload.planner.cost_model import CONV_CHUNK, early_piece
from flame.offload.runtime.collectives import reduce_scatter_flat
from flame.offload.runtime.streams import Streams
from flame.offload.runtime.units import Slot, Unit, set_event
from flame.offload.runtime.worker import CpuWorker

TOO_MANY_ROUNDS = ("offload: the plan has {} micro-batch(es) per step but the trainer ran more; "
                   "plan with the trainer's training.gradient_accumulation_steps")


@dataclass(eq=False)
class UnitGrads:
    """A unit's grads (the gradient state of the unit)."""

    buffer: torch.Tensor | None = None  # GPU, full unit (padded): what autograd writes; stream: a grad slot's
    slot: Slot | None = None  # stream: the grad slot lent to its last backward
    buffer_free: object = None  # event: the last D2H has read `buffer`
    shard: torch.Tensor | None = None  # sharded: GPU, this rank's shard of the reduce-scattered grads
    shard_free: object = None  # event: `shard` read by its D2H
    staging: torch.Tensor | None = None  # host units: pinned, this rank's shard, what each D2H writes
    staging_free: threading.Event = field(default_factory=set_event)  # the CPU worker has read `staging`
    # the step's sum the optimizer reads: on the GPU for gpu units, on the host for host units
    # (`staging` itself when the grads arrive once a step)
    accumulator: torch.Tensor | None = None
    device_accumulator: torch.Tensor | None = None  # accumulate_on_gpu: the sum on the GPU
    d2h_done: object = None  # event: the last D2H into `staging` is done
    arrived: int = 0  # parameters whose grads arrived this micro-batch
    flushed: bool = False  # this micro-batch's grads were handed on
    sent: bool = False  # this step's GPU-accumulated grads went to the host
    host_sq_norm: float | None = None  # squared norm of the host accumulator, once its last round is added
    sent_pieces: set[int] = field(default_factory=set)  # this micro-batch's pieces handed on (Unit.pieces)


class Gradients:
    def __init__(self, units: list[Unit], streams: Streams, device: torch.device, compute_dtype: torch.dtype,
                 grad_dtype: torch.dtype, host_grad_dtype: torch.dtype, rounds: int, group, world: int,
                 comm_device: torch.device, worker: CpuWorker):
        """`grad_dtype`: the dtype grads are summed in over micro-batches (and gpu units' grads
        kept in); `host_grad_dtype`: the dtype host units' grads reach the host in once a step
        (cost_model.host_grad_dtype: the compute dtype with one micro-batch, else `grad_dtype`)."""
        self.units, self.s, self.device = units, streams, device
        self.compute_dtype, self.grad_dtype, self.host_grad_dtype = compute_dtype, grad_dtype, host_grad_dtype
        self.rounds = rounds
        self.direct = rounds == 1  # one micro-batch a step: grads go straight into the accumulator
        self.round = 0  # micro-batches run since the last optimizer step
        self.group, self.world, self.comm_device = group, world, comm_device
        self.worker = worker
        self.clean = True  # no grads since the last step: zero_grad has nothing to do
        self.conversion: list[torch.Tensor] = []  # two GPU chunks: grads converted to grad dtype before D2H
        self.slots: list[Slot] = []
        self.use_counter = 0
        self.gpu_sq = torch.zeros((), dtype=torch.float32, device=device)  # squared norms taken on the GPU
        # called with a host unit, the indices of its pieces (Unit.pieces) whose grads of the step
        # are complete and queued for the host, and the event their D2H ends with: the optimizer's
        # speculative step. None (no speculation): nothing to do then, and no early pieces.
        self.on_sent: Callable[[Unit, list[int], object], None] | None = None
        # the step's last host accumulation job: the norm waits for it, not for the speculative
        # steps queued among the accumulations (the forward waits for those per unit)
        self.last_accumulation: Future | None = None

    # ------------------------------------------------------------------ buffers
    def build_conversion(self) -> None:
        host_units = [u for u in self.units if u.mode != "gpu" and not u.frozen]
        if self.direct and host_units and self.host_grad_dtype != self.compute_dtype:
            # two rotating chunk buffers for the GPU-side grad conversion before D2H
            n = min(CONV_CHUNK, max(u.shard_numel for u in host_units))
            self.conversion = [torch.empty(n, dtype=self.host_grad_dtype, device=self.device) for _ in range(2)]

    def build_slots(self) -> None:
        stream_units = [u for u in self.units if u.mode == "stream" and not u.frozen]
        if stream_units:
            big = max(u.padded_numel for u in stream_units)
            self.slots = [Slot(torch.empty(big, dtype=self.compute_dtype, device=self.device)) for _ in range(2)]

    def build_host(self, u: Unit) -> None:
        g = u.grads = UnitGrads()
        if u.mode == "gpu" or u.frozen:  # a frozen unit: no grads at all
            return
        if self.direct and not u.sharded and not u.accumulate_on_gpu:
            self._cut_pieces(u)
        if self.direct or u.accumulate_on_gpu:
            # grads arrive on the host once a step already in their host dtype (as autograd wrote
            # them, converted or accumulated on the GPU), straight into the accumulator the CPU
            # AdamW reads
            g.staging = torch.zeros(u.shard_numel, dtype=self.host_grad_dtype)
            g.accumulator = g.staging
        else:
            g.staging = torch.zeros(u.shard_numel, dtype=self.compute_dtype)
            g.accumulator = torch.zeros(u.shard_numel, dtype=self.grad_dtype)

    @staticmethod
    def _cut_pieces(u: Unit) -> None:
        """Its large parameters (cost_model.early_piece) become pieces of their own."""
        big = {k: (o, o + p.numel()) for k, ((_, p), o) in enumerate(zip(u.params, u.offsets))
               if len(u.params) > 1 and p.numel() and early_piece(p.numel(), u.numel)}
        cuts = sorted({0, u.shard_numel} | {x for r in big.values() for x in r})
        u.pieces = list(zip(cuts, cuts[1:]))
        u.early = {k: u.pieces.index(r) for k, r in big.items()}

    def build_device(self, u: Unit) -> None:
        g, dev = u.grads, self.device
        if u.frozen:
            return
        # full grad buffer (padded: the reduce-scatter's input; autograd never writes the padding)
        g.buffer = torch.zeros(u.padded_numel, dtype=self.compute_dtype, device=dev) if u.mode != "stream" else None
        if u.sharded:
            g.shard = torch.empty(u.shard_numel, dtype=self.compute_dtype, device=dev)
        if u.mode == "gpu":
            g.accumulator = g.buffer if self.grad_dtype == self.compute_dtype else \
                torch.zeros(u.numel, dtype=self.grad_dtype, device=dev)
        if u.accumulate_on_gpu:  # a host_opt unit with grads in grad dtype accumulates in its grad buffer
            # (sharded: the shard of the sum accumulates, the full grad is reduce-scattered each round)
            same = u.mode == "host_opt" and self.grad_dtype == self.compute_dtype and not u.sharded
            g.device_accumulator = g.buffer if same else torch.zeros(u.shard_numel, dtype=self.grad_dtype, device=dev)

    # ------------------------------------------------------------------ during the backward
    def forward_start(self) -> None:
        """A micro-batch's forward begins."""
        if self.s.cuda:  # grads of the last round left the GPU buffers before they refill
            for u in self.units:
                if u.mode == "host_opt" and u.grads.buffer_free is not None:
                    torch.cuda.current_stream().wait_event(u.grads.buffer_free)
        for u in self.units:
            u.grads.arrived, u.grads.flushed = 0, False
            u.grads.sent_pieces.clear()

    def lend_slot(self, u: Unit) -> None:
        """A streamed unit's backward begins: a zeroed grad slot receives its grads."""
        g = u.grads
        gs = min(self.slots, key=lambda s: s.last_use)
        self.use_counter += 1
        gs.owner, gs.last_use, g.slot = u, self.use_counter, gs
        self.s.wait(self.s.current(), gs.free)
        g.buffer = gs.buffer[: u.padded_numel]
        g.buffer.zero_()
        u.bind(g.buffer, grad=True)

    def arrived(self, u: Unit, k: int) -> bool:
        """The grad of `u`'s parameter `k` arrived; True when it was the unit's last. With
        speculative steps, a parameter that is an early piece (not the last) goes to the host now
        (one round: autograd writes no more into it this step)."""
        self.clean = False
        g = u.grads
        g.arrived += 1
        if g.arrived == len(u.params):
            return True
        if k in u.early and self.on_sent is not None:
            if self.round > 0:
                raise RuntimeError(TOO_MANY_ROUNDS.format(self.rounds))
            self._send(u, g.buffer, [u.early[k]], then_zero=None)  # zeroed with the rest
        return False

    def end_round(self) -> None:
        self.round += 1

    def hand_on(self, u: Unit) -> None:
        """All of `u`'s grads of this micro-batch are in its buffer: accumulate or send to the host."""
        g = u.grads
        g.flushed = True
        if u.mode == "gpu":
            if g.accumulator is not g.buffer:
                g.accumulator.add_(g.buffer)
                g.buffer.zero_()
            return
        if self.direct and self.round > 0:
            raise RuntimeError(TOO_MANY_ROUNDS.format(self.rounds))
        # this rank's part of the micro-batch's grads: the whole unit, or the reduce-scattered shard
        grad = self._reduce_scatter(u) if u.sharded else g.buffer
        if u.accumulate_on_gpu:
            self._accumulate_on_gpu(u, grad)
            return
        zero = g.buffer if u.mode == "host_opt" and not u.sharded else None
        if self.direct:
            # the norm of the full grad (of the own shard), computed on the GPU while the copy runs
            self.gpu_sq += torch.linalg.vector_norm(grad, dtype=torch.float32).square()
            # the pieces not handed on yet: all but the early ones; the buffer zeroed after their copy
            self._send(u, grad, [i for i in range(len(u.pieces)) if i not in g.sent_pieces], zero)
        else:
            g.staging_free.wait()
            g.staging_free.clear()
            self._d2h(u, lambda: self._copy_out(u, grad, 0, u.shard_numel), zero)
        if u.sharded:
            g.shard_free = g.d2h_done
        elif g.slot is not None:
            g.slot.free = g.d2h_done
        if self.direct:
            return
        first, last = self.round == 0, self.round == self.rounds - 1
        ev = g.d2h_done

        def accumulate():
            ev.synchronize()
            t = time.perf_counter()
            # the last round completes the sum: its norm is taken chunk by chunk right after the
            # add (cache-hot), overlapped with the rest of the backward
            if first:
                g.accumulator.copy_(g.staging)
            else:
                g.host_sq_norm = self.worker.math.add_(g.accumulator, g.staging, norm=last)
            self.worker.account("accumulate_and_norm" if last else "accumulate", u.index, t)
            g.staging_free.set()

        self.last_accumulation = self.worker.submit(accumulate)
        if last:
            self._sent(u, [0])  # queued after the add: the worker runs jobs in order

    def _send(self, u: Unit, grad: torch.Tensor, pieces: list[int], then_zero: torch.Tensor | None) -> None:
        """One round a step: `pieces` of `u`'s grads (`grad`: its buffer, or this rank's shard)
        to the host, then `then_zero` zeroed; the optimizer is told."""
        u.grads.sent_pieces.update(pieces)

        def copy_out():
            for i in pieces:
                self._copy_out(u, grad, *u.pieces[i])

        self._d2h(u, copy_out, then_zero)
        self._sent(u, pieces)

    def _copy_out(self, u: Unit, grad: torch.Tensor, lo: int, hi: int) -> None:
        """grad[lo:hi] into the same range of `u`'s pinned staging buffer (on the D2H stream)."""
        if not self.conversion:
            self.s.copy(u.grads.staging, lo, hi, grad[lo:hi], to_host=True)
            return
        # convert on the GPU in chunks, copy each chunk out; the stream orders buffer reuse
        n = self.conversion[0].numel()
        for k, a in enumerate(range(lo, hi, n)):
            b = min(hi, a + n)
            buf = self.conversion[k % 2][: b - a]
            buf.copy_(grad[a:b])
            self.s.copy(u.grads.staging, a, b, buf, to_host=True)

    def _sent(self, u: Unit, pieces: list[int]) -> None:
        if self.on_sent is not None:
            self.on_sent(u, pieces, u.grads.d2h_done)

    def _reduce_scatter(self, u: Unit) -> torch.Tensor:
        """Sum the unit's full grad over the ranks into this rank's shard on the compute stream;
        the full buffer is free again right after (zeroed, or its grad slot released)."""
        g = u.grads
        self.s.wait(self.s.current(), g.shard_free)  # the last D2H of the shard has read it
        reduce_scatter_flat(g.shard, g.buffer[:u.padded_numel], self.group)
        if u.mode == "host_opt":
            g.buffer.zero_()  # autograd adds the next round's grads into it
        elif g.slot is not None:
            g.slot.free = self.s.record()
        return g.shard

    def _accumulate_on_gpu(self, u: Unit, grad: torch.Tensor) -> None:
        """Add this micro-batch's grads (the buffer, or the rank's reduce-scattered shard) into the
        unit's GPU accumulator; after the plan's last round send the sum to the host: one D2H a
        step instead of one a round, no CPU adds."""
        g = u.grads
        if g.sent:
            raise RuntimeError(TOO_MANY_ROUNDS.format(self.rounds))
        if g.device_accumulator is not grad:
            if self.round == 0:  # overwrite: nothing to zero between steps
                self.s.wait(self.s.current(), g.buffer_free)  # once the last step's D2H has read it
                g.device_accumulator.copy_(grad)
            else:
                g.device_accumulator.add_(grad)
            if u.sharded:
                pass  # the full buffer was freed by the reduce-scatter; the shard is reused in stream order
            elif u.mode == "host_opt":
                g.buffer.zero_()  # autograd adds the next round's grads into it
            else:
                g.slot.free = self.s.record()  # the grad slot is free once the add has run
        if self.round == self.rounds - 1:
            self._send_accumulated(u)

    def _send_accumulated(self, u: Unit) -> None:
        """The accumulated grads D2H into the pinned buffer the CPU AdamW reads; their squared
        norm computed on the GPU meanwhile (as with one round)."""
        g = u.grads
        g.sent = True
        self.gpu_sq += torch.linalg.vector_norm(g.device_accumulator, dtype=torch.float32).square()
        # accumulated in its grad buffer: empty it for the next step once copied
        self._d2h(u, lambda: self.s.copy(g.staging, 0, u.shard_numel, g.device_accumulator, to_host=True),
                  g.buffer if g.device_accumulator is g.buffer else None)
        self._sent(u, [0])

    def _d2h(self, u: Unit, copy_out, then_zero: torch.Tensor | None) -> None:
        """Run `copy_out` (u's grads into its pinned staging buffer) on the D2H stream after the
        compute stream's work so far, then zero `then_zero` there; record when it is done."""
        g = u.grads
        cur = self.s.current()
        with self.s.on(self.s.d2h):
            if self.s.cuda:
                self.s.d2h.wait_stream(cur)
            copy_out()
            if then_zero is not None:
                then_zero.zero_()
            g.d2h_done = self.s.record(self.s.d2h)
        g.buffer_free = g.d2h_done

    # ------------------------------------------------------------------ at the optimizer step
    def step_sq_norm(self) -> float:
        """The squared global grad norm of the step (summed over the ranks, the gpu units' grads
        all-reduced first); the next step's rounds start from here. The one host sync of the step."""
        for u in self.units:  # fewer micro-batches than planned: send what was accumulated
            if u.accumulate_on_gpu and not u.grads.sent and self.round > 0:
                self._send_accumulated(u)
        t = time.perf_counter()
        # all accumulations queued by the backward are done (they wait on D2H events; the worker
        # runs jobs in order, so the last one's end means every earlier one's)
        if self.last_accumulation is not None:
            self.last_accumulation.result()
            self.last_accumulation = None
        self.worker.check()
        self.worker.seconds["step_waits_for_accumulation"] += time.perf_counter() - t
        sq = self.gpu_sq.clone()  # the norms taken on the GPU as grads left for the host
        gpu_units = [u for u in self.units if u.mode == "gpu" and not u.frozen]
        # units accumulated on the host: the norm of the sum, taken by the last accumulation (or
        # here when the step ran fewer micro-batches than planned)
        t = time.perf_counter()
        cpu_sq = 0.0
        for u in self.units:
            if u.mode == "gpu" or u.frozen:
                continue
            g = u.grads
            if not (self.direct or u.accumulate_on_gpu):
                cpu_sq += g.host_sq_norm if g.host_sq_norm is not None else self.worker.math.sq_norm(g.accumulator)
            g.host_sq_norm = None
        self.worker.seconds["step_norms_on_host"] += time.perf_counter() - t
        if self.world > 1:
            import torch.distributed as dist

            # replicated "gpu" units: sum their grads over the ranks (as DDP does, once a step)
            for u in gpu_units:
                dist.all_reduce(u.grads.accumulator, group=self.group)
            # sharded units: the squared norms of the owned shards, summed over the ranks
            sq = (sq + cpu_sq).to(self.comm_device)
            dist.all_reduce(sq, group=self.group)
            sq, cpu_sq = sq.to(self.device), 0.0
        if gpu_units:
            norms = torch._foreach_norm([u.grads.accumulator for u in gpu_units], 2, dtype=torch.float32)
            sq = sq + torch.stack([x.float() for x in norms]).square().sum()
        v = float(sq.item()) + cpu_sq
        self.gpu_sq.zero_()
        self.round = 0
        return v

    def zero_unit(self, u: Unit) -> None:
        """A gpu unit's grads after its optimizer step."""
        g = u.grads
        g.buffer.zero_()
        if g.accumulator is not g.buffer:
            g.accumulator.zero_()

    def zero_all(self) -> None:
        """Every grad buffer and accumulator zeroed (no copy may still be using them)."""
        for u in self.units:
            g = u.grads
            for t in (g.buffer if u.mode != "stream" else None, g.accumulator, g.device_accumulator):
                if t is not None:
                    t.zero_()
            g.sent = False
        self.gpu_sq.zero_()
        self.round = 0
        self.clean = True
