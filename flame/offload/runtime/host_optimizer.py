"""The engine's optimizer: every unit's master weights and AdamW moments, the fused AdamW on the
GPU (gpu units) or on the CPU worker (host units) and clipping by the global grad norm (a
non-finite norm is kept as it is: the engine's `optimizer_step` and the trainer skip that step).

A host unit's CPU step starts once the step's grad norm is known and runs while the GPU goes on
with the next forward: it writes the new compute copy into the unit's pinned host copy, and the
schedule waits for it (`wait_for`) before that unit's next H2D.

With `speculative` (the plan's `speculative_step`), a host unit's CPU step instead starts as soon
as its grads for the step are on the host, during the rest of the backward, unclipped and at the
lr the next `step()` is expected to use; its master and moments are copied aside first. `finish`
keeps that update when the step turns out unclipped at that lr, and otherwise restores the copy
and steps again with the clip coefficient; a skipped step (`discard_step`) restores it. The step
after a clipped or skipped one does not speculate. Either way the result is the usual step's, bit
for bit: the same fused AdamW on the same inputs.

Clipping is folded into the fused AdamW (it divides the grads by `grad_scale`); weight decay is
decoupled as in AdamW, with the no_decay parameters (norms, biases, embeddings) excluded as in the
plain optimizer.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from flame.offload.runtime.units import Unit, same_tensor, set_event
from flame.offload.runtime.worker import CpuWorker


def global_norm(sq: float) -> float:
    """The norm from its square; a non-finite square stays as it is (the step is then skipped)."""
    return math.sqrt(sq) if math.isfinite(sq) and sq > 0 else (sq if not math.isfinite(sq) else 0.0)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """The factor the grads are scaled by (torch's clip_grad_norm_ rule); 1.0 without clipping."""
    return min(1.0, max_norm / (total_norm + 1e-6)) if max_norm and max_norm > 0 else 1.0


@dataclass(eq=False)
class UnitOptimizer:
    """A unit's optimizer state."""

    master: nn.Parameter  # this rank's flat master (its shard): on the GPU for gpu units, else on the host
    adamw: torch.optim.AdamW  # fused, over `master` alone; holds the moments
    # the CPU step has written the new weights: a fresh event per submitted job, so that a job
    # superseded by a later one cannot announce the later one's result
    step_done: threading.Event = field(default_factory=set_event)
    speculated_lr: float | None = None  # the lr of this step's speculative update; None: none ran
    backup: list | None = None  # master, then the AdamW state (if any) before the speculative update
    backup_has_state: bool = False  # the AdamW had moments when the backup was taken


class HostOptimizer:
    def __init__(self, units: list[Unit], worker: CpuWorker, lr: float, betas, eps: float, weight_decay: float,
                 no_decay: set[str], cpu_threads: int, speculative: bool = False):
        self.units, self.worker = units, worker
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.speculative = speculative  # host units step as their grads land (see the module doc)
        # the last step clipped or was skipped: the next one runs the usual way (clipping comes in
        # runs, early in training; a speculation there would only be redone)
        self.last_step_redone = False
        # the lr the next step() will pass (the trainer's schedule); None: the last one used
        self.next_lr: Callable[[], float] | None = None
        self.no_decay = no_decay  # names of the parameters without weight decay
        self.cpu_threads = cpu_threads  # the CPU worker's torch threads (0: torch's default)
        self.grad_scratch: torch.Tensor | None = None  # master-dtype grads of the unit the CPU AdamW steps

    def build_unit(self, u: Unit, master: torch.Tensor) -> None:
        if u.frozen:  # no master, moments or step: u.optimizer stays None
            return
        # ranges NOT decayed (no_decay parameters; the shard's padding is harmless either way) in
        # the coordinates of the unit's (shard of the) master
        u.no_decay_ranges = [(a - u.shard_start, b - a) for (fqn, p), o in zip(u.params, u.offsets)
                             if fqn in self.no_decay and (ab := u.owned(o, p.numel())) for a, b in [ab]]
        param = nn.Parameter(master, requires_grad=False)
        u.optimizer = UnitOptimizer(param, torch.optim.AdamW([param], lr=self.lr, betas=self.betas, eps=self.eps,
                                                             weight_decay=self.weight_decay, fused=True))

    def wait_for(self, u: Unit) -> None:
        """The forward needs `u`'s new weights: wait for its CPU AdamW (timed: an exposed optimizer)."""
        if u.optimizer is not None and not u.optimizer.step_done.is_set():
            t = time.perf_counter()
            u.optimizer.step_done.wait()
            self.worker.account("forward_waits_for_cpu_adam", u.index, t)

    def wait_all(self) -> None:
        for u in self.units:
            if u.optimizer is not None:
                u.optimizer.step_done.wait()

    def _decay(self, u: Unit, lr: float) -> None:
        """The fused AdamW decays the whole flat master (p *= 1 - lr * wd inside its one pass); the
        no_decay parameters (norms, a small part) are divided by that factor first. A separate
        decay pass over the decayed parameters cost a full read + write of the master a step."""
        if self.weight_decay:
            for off, n in u.no_decay_ranges:
                u.optimizer.master.data[off:off + n].div_(1.0 - lr * self.weight_decay)

    def step_on_gpu(self, u: Unit, coef: float) -> None:
        """A gpu unit's step now, on the compute stream, from its accumulated grads."""
        o, acc = u.optimizer, u.grads.accumulator
        # clipping folded into the fused AdamW (it divides grads by grad_scale): no extra pass
        o.adamw.grad_scale = torch.full((), 1.0 / coef, device=o.master.device) if coef != 1.0 else None
        o.master.grad = acc if acc.dtype == o.master.dtype else acc.to(o.master.dtype)
        o.adamw.param_groups[0]["lr"] = self.lr
        self._decay(u, self.lr)
        o.adamw.step()
        o.master.grad = None

    def start_on_cpu(self, u: Unit, coef: float) -> None:
        """A host unit's step, queued on the CPU worker (after the grads' adds queued before it)."""
        self._submit(u, self._cpu_step, coef, self.lr)

    def _submit(self, u: Unit, job, *args) -> None:
        done = threading.Event()
        u.optimizer.step_done = done
        self.worker.submit(job, u, *args, u.weights.upload_read_done, done)

    # ------------------------------------------------------------------ speculative steps
    def speculate(self, u: Unit) -> None:
        """`u`'s grads of the step are complete (on the host once their D2H ends): queue its
        unclipped step at the expected lr now (the engine calls this only with speculation on)."""
        if self.last_step_redone or u.optimizer is None or u.mode == "gpu":
            return
        lr = self.next_lr() if self.next_lr is not None else self.lr
        u.optimizer.speculated_lr = lr
        self._submit(u, self._speculative_step, lr)

    def begin_step(self, coef: float) -> None:
        """At step(), before `finish` of every unit: remember whether this step clipped."""
        self.last_step_redone = coef != 1.0

    def finish(self, u: Unit, coef: float) -> None:
        """At step(): keep `u`'s speculative update when it is the step's (unclipped, the same lr),
        else restore and step again; without one, step now."""
        o = u.optimizer
        if o.speculated_lr is None:
            self.start_on_cpu(u, coef)
            return
        kept = coef == 1.0 and o.speculated_lr == self.lr
        o.speculated_lr = None
        if not kept:
            self._submit(u, self._redo_step, coef, self.lr)

    def discard_step(self) -> None:
        """The step is skipped: undo every speculative update (weights, moments, compute copy)."""
        self.last_step_redone = self.speculative
        for u in self.units:
            o = u.optimizer
            if o is not None and o.speculated_lr is not None:
                o.speculated_lr = None
                self._submit(u, self._undo)

    def _speculative_step(self, u: Unit, lr: float, upload_read_done, done) -> None:
        try:
            self._wait_inputs(u, upload_read_done)
            t = time.perf_counter()
            self._backup(u)
            self.worker.account("speculative_backup", u.index, t)
            self._step_body(u, 1.0, lr)
        finally:
            done.set()

    def _redo_step(self, u: Unit, coef: float, lr: float, upload_read_done, done) -> None:
        try:
            t = time.perf_counter()
            self._restore(u, compute_copy=False)  # the step below writes the compute copy
            self.worker.account("speculative_rollback", u.index, t)
            self._step_body(u, coef, lr)
        finally:
            done.set()

    def _undo(self, u: Unit, upload_read_done, done) -> None:
        try:
            t = time.perf_counter()
            self._restore(u, compute_copy=True)
            self.worker.account("speculative_rollback", u.index, t)
        finally:
            done.set()

    def _backup(self, u: Unit) -> None:
        """Copy the master and the AdamW state aside, into buffers kept from step to step."""
        o = u.optimizer
        state = o.adamw.state.get(o.master)
        tensors = [o.master.data] + ([state["exp_avg"], state["exp_avg_sq"], state["step"]] if state else [])
        if o.backup is None or len(o.backup) < len(tensors):
            o.backup = [torch.empty_like(t) for t in tensors]
        for b, t in zip(o.backup, tensors):
            b.copy_(t)
        o.backup_has_state = bool(state)

    def _restore(self, u: Unit, compute_copy: bool) -> None:
        o = u.optimizer
        o.master.data.copy_(o.backup[0])
        if o.backup_has_state:
            state = o.adamw.state[o.master]
            for b, k in zip(o.backup[1:], ("exp_avg", "exp_avg_sq", "step")):
                state[k].copy_(b)
        else:  # before the first step: no moments yet, as the fused AdamW will find it
            o.adamw.state.pop(o.master, None)
        if compute_copy and not same_tensor(u.weights.host, o.master):
            u.weights.host.copy_(o.master.data)

    # ------------------------------------------------------------------ the CPU step
    def _cpu_step(self, u: Unit, coef: float, lr: float, upload_read_done, done) -> None:
        try:
            self._wait_inputs(u, upload_read_done)
            self._step_body(u, coef, lr)
        finally:
            done.set()

    def _wait_inputs(self, u: Unit, upload_read_done) -> None:
        if self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        if upload_read_done is not None:
            upload_read_done.synchronize()  # the last H2D read of the host copy has finished
        if u.grads.d2h_done is not None:
            u.grads.d2h_done.synchronize()  # the grads are on the host

    def _step_body(self, u: Unit, coef: float, lr: float) -> None:
        o = u.optimizer
        o.adamw.grad_scale = torch.full((), 1.0 / coef) if coef != 1.0 else None
        t0 = time.perf_counter()
        o.master.grad = self._master_grad(u)
        t1 = time.perf_counter()
        o.adamw.param_groups[0]["lr"] = lr
        self._decay(u, lr)
        o.adamw.step()
        o.master.grad = None
        t2 = time.perf_counter()
        if not same_tensor(u.weights.host, o.master):
            u.weights.host.copy_(o.master.data)
        t3 = time.perf_counter()
        for k, dt in (("grad_to_master_dtype", t1 - t0), ("cpu_adam", t2 - t1), ("new_compute_copy", t3 - t2)):
            self.worker.seconds[k] += dt
        if self.worker.trace is not None:
            self.worker.trace.append(("cpu_step", u.index, t0, t3))

    def _master_grad(self, u: Unit) -> torch.Tensor:
        """The unit's grads in the master dtype for the fused AdamW: the accumulator itself, or a
        conversion into one reused buffer (a fresh tensor per unit and step would page-fault its
        whole size in again every step)."""
        acc, dtype = u.grads.accumulator, u.optimizer.master.dtype
        if acc.dtype == dtype:
            return acc
        n = acc.numel()
        if self.grad_scratch is None or self.grad_scratch.dtype != dtype or self.grad_scratch.numel() < n:
            largest = max(x.grads.accumulator.numel() for x in self.units if x.mode != "gpu" and not x.frozen)
            self.grad_scratch = torch.empty(largest, dtype=dtype)
        out = self.grad_scratch[:n].view(acc.shape)
        out.copy_(acc)
        return out
