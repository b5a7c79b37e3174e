"""The engine's optimizer: every unit's master weights and AdamW moments, the fused AdamW on the
GPU (gpu units) or on the CPU worker (host units) and clipping by the global grad norm (a
non-finite norm is kept as it is: the engine's `optimizer_step` and the trainer skip that step).

A host unit's CPU step starts once the step's grad norm is known and runs while the GPU goes on
with the next forward: one pass of `flame.ops.cpu_adamw` reads the master, moments and grads and
writes the new master, moments and compute copy (into the unit's pinned host copy); the schedule
waits for it (`wait_for`) before that unit's next H2D. Without a C compiler, torch's fused CPU
AdamW does the same in separate passes.

With `speculative` (the plan's `speculative_step`), a host unit's CPU step instead starts as soon
as its grads for the step are on the host, during the rest of the backward, unclipped and at the
lr the next `step()` is expected to use, and writes into a spare set of master and moment
buffers, leaving the state as it was. `finish` makes the spare buffers the state (a swap) when
the step turns out unclipped at that lr, and otherwise steps again from the untouched state with
the clip coefficient; a skipped step (`discard_step`) only restores a separate compute copy. The
step after a clipped or skipped one does not speculate. Either way the result is the usual
step's, bit for bit: the same kernel on the same inputs. A run that can never redo a step (no
clipping, no skipping of non-finite steps: `redo` False) has no spare buffers: the speculative
update goes into the state itself, and `finish` only counts the step.
With one micro-batch a step, a unit's early pieces (gradients.py: a large parameter such as the
outer unit's untied output head, whose grad arrives at the start of the backward) are stepped
speculatively on their own as soon as they reach the host, the rest of the unit when it
completes: each job runs the kernel over its pieces' ranges only, into the same spare buffers,
at the one lr chosen by the unit's first piece. Commit, redo and undo stay per unit (a redo steps
the whole unit from the untouched state). The kernel runs over the same ranges (the unit's
`decay_segments`, cut at its pieces) with or without speculation, so the results stay the same.

Clipping scales the grads inside the kernel; weight decay is decoupled as in AdamW, with the
no_decay parameters (norms, biases, embeddings) excluded as in the plain optimizer.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from flame.offload.runtime.units import Unit, same_tensor, set_event
from flame.offload.runtime.worker import CpuWorker
from flame.ops import cpu_adamw

logger = logging.getLogger(__name__)


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
    # seconds this step's speculative update took so far, all its pieces (booked if it is discarded;
    # the CPU worker alone touches it)
    speculated_s: float = 0.0
    # speculative steps write here: master, exp_avg, exp_avg_sq (swapped with the state when kept)
    spare: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class HostOptimizer:
    def __init__(self, units: list[Unit], worker: CpuWorker, lr: float, betas, eps: float, weight_decay: float,
                 no_decay: set[str], cpu_threads: int, speculative: bool = False, redo: bool = True):
        self.units, self.worker = units, worker
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.speculative = speculative  # host units step as their grads land (see the module doc)
        # a speculative update may have to be redone: it goes into spare buffers (else in place)
        self.redo = redo
        # the last step clipped or was skipped: the next one runs the usual way (clipping comes in
        # runs, early in training; a speculation there would only be redone)
        self.last_step_redone = False
        # the lr the next step() will pass (the trainer's schedule); None: the last one used
        self.next_lr: Callable[[], float] | None = None
        self.no_decay = no_decay  # names of the parameters without weight decay
        self.cpu_threads = cpu_threads  # the CPU worker's torch threads (0: torch's default)
        self.grad_scratch: torch.Tensor | None = None  # master-dtype grads for torch's fused AdamW
        # speculative updates of host units so far, by outcome: kept, redone (clipped or another
        # lr), undone (skipped step); the trainer logs them per step (OffloadOptimizers.log_metrics)
        self.speculations = Counter()
        # the one-pass C kernel (flame.ops.cpu_adamw) when it builds here, else torch's fused AdamW
        host = any(u.mode != "gpu" and not u.frozen for u in units)
        self.kernel = host and cpu_adamw.available()
        if host and not self.kernel:
            logger.info("offload: CPU AdamW: torch's fused kernel (flame's one-pass kernel did not build: %s)",
                        cpu_adamw.unavailable_reason())

    def build_unit(self, u: Unit, master: torch.Tensor) -> None:
        if u.frozen:  # no master, moments or step: u.optimizer stays None
            return
        # ranges NOT decayed (no_decay parameters; the shard's padding is harmless either way) in
        # the coordinates of the unit's (shard of the) master
        u.no_decay_ranges = [(a - u.shard_start, b - a) for (fqn, p), o in zip(u.params, u.offsets)
                             if fqn in self.no_decay and (ab := u.owned(o, p.numel())) for a, b in [ab]]
        # (start, end, decayed): the master cut in order, the no_decay ranges apart and at the
        # unit's pieces (the kernel runs per range; a piece is stepped alone when speculative)
        cuts = sorted({0, master.numel()} | {a for a, _ in u.pieces}
                      | {x for off, n in u.no_decay_ranges for x in (off, off + n)})
        u.decay_segments = [(a, b, not any(off <= a < off + n for off, n in u.no_decay_ranges))
                            for a, b in zip(cuts, cuts[1:])]
        param = nn.Parameter(master, requires_grad=False)
        u.optimizer = UnitOptimizer(param, torch.optim.AdamW([param], lr=self.lr, betas=self.betas, eps=self.eps,
                                                             weight_decay=self.weight_decay, fused=True))
        if self.speculative and self.redo and u.mode != "gpu":
            u.optimizer.spare = tuple(torch.empty_like(master) for _ in range(3))

    def wait_for(self, u: Unit) -> None:
        """The forward needs `u`'s new weights: wait for its CPU AdamW (timed: an exposed optimizer)."""
        if u.optimizer is not None and not u.optimizer.step_done.is_set():
            t = time.perf_counter()
            u.optimizer.step_done.wait()
            self.worker.account("forward_waits_for_cpu_adam", u.index, t)
        self.worker.check()

    def wait_all(self) -> None:
        for u in self.units:
            if u.optimizer is not None:
                u.optimizer.step_done.wait()
        self.worker.check()

    def _decay(self, u: Unit, lr: float, master: torch.Tensor, lo: int = 0) -> None:
        """torch's fused AdamW decays the whole flat `master` (p *= 1 - lr * wd inside its one
        pass); the no_decay parameters (norms, a small part) are divided by that factor first. A
        separate decay pass over the decayed parameters cost a full read + write of the master a step.
        `master`: the unit's master from element `lo` on."""
        if self.weight_decay:
            for off, n in u.no_decay_ranges:
                a, b = max(off, lo) - lo, min(off + n, lo + master.numel()) - lo
                if a < b:
                    master[a:b].div_(1.0 - lr * self.weight_decay)

    def step_on_gpu(self, u: Unit, coef: float) -> None:
        """A gpu unit's step now, on the compute stream, from its accumulated grads."""
        o, acc = u.optimizer, u.grads.accumulator
        # clipping folded into the fused AdamW (it divides grads by grad_scale): no extra pass
        o.adamw.grad_scale = torch.full((), 1.0 / coef, device=o.master.device) if coef != 1.0 else None
        o.master.grad = acc if acc.dtype == o.master.dtype else acc.to(o.master.dtype)
        o.adamw.param_groups[0]["lr"] = self.lr
        self._decay(u, self.lr, o.master.data)
        o.adamw.step()
        o.master.grad = None

    def start_on_cpu(self, u: Unit, coef: float) -> None:
        """A host unit's step, queued on the CPU worker (after the grads' adds queued before it)."""
        self._submit(u, self._cpu_step, coef, self.lr)

    def _submit(self, u: Unit, job, *args) -> None:
        # jobs of one unit run in order: the last one's event means all of them are done
        done = threading.Event()
        u.optimizer.step_done = done
        self.worker.submit(job, u, *args, u.weights.upload_read_done, done)

    # ------------------------------------------------------------------ speculative steps
    def speculate(self, u: Unit, pieces: list[int], grads_ready) -> None:
        """`u`'s grads of the step are complete in `pieces` (Unit.pieces; on the host once
        `grads_ready`, their D2H, ends): queue their unclipped step at the expected lr now (the
        engine calls this only with speculation on); every piece of the unit at the first one's lr."""
        o = u.optimizer
        if self.last_step_redone or o is None or u.mode == "gpu":
            return
        if o.speculated_lr is None:
            o.speculated_lr = self.next_lr() if self.next_lr is not None else self.lr
        self._submit(u, self._speculative_step, o.speculated_lr, pieces, grads_ready)

    def begin_step(self, coef: float) -> None:
        """At step(), before `finish` of every unit: remember whether this step clipped."""
        self.last_step_redone = coef != 1.0

    def finish(self, u: Unit, coef: float) -> None:
        """At step(): keep `u`'s speculative update when it is the step's (unclipped, the same lr),
        else step again from the state it left untouched; without one, step now."""
        o = u.optimizer
        if o.speculated_lr is None:
            self.start_on_cpu(u, coef)
            return
        kept = coef == 1.0 and o.speculated_lr == self.lr
        if not kept and not self.redo:
            # the run neither clips nor skips steps, and the lr follows the schedule next_lr reads
            raise RuntimeError(f"offload: unit {u.name}'s in-place speculative update was made at lr "
                               f"{o.speculated_lr} (clip coefficient 1), the step has lr {self.lr} and clip "
                               f"coefficient {coef}: it cannot be redone")
        o.speculated_lr = None
        self.speculations["kept" if kept else "redone"] += 1
        self._submit(u, self._commit if kept else self._redo_step, coef, self.lr)

    def discard_step(self) -> None:
        """The step is skipped: drop every speculative update (its compute copy included)."""
        self.last_step_redone = self.speculative
        for u in self.units:
            o = u.optimizer
            if o is not None and o.speculated_lr is not None:
                if not self.redo:
                    raise RuntimeError(f"offload: unit {u.name}'s speculative update went into its state "
                                       "(a run without clipping or skip_nan_inf): it cannot be undone")
                o.speculated_lr = None
                self.speculations["undone"] += 1
                self._submit(u, self._undo)

    def _speculative_step(self, u: Unit, lr: float, pieces: list[int], grads_ready, upload_read_done, done) -> None:
        try:
            self._wait_inputs(u, upload_read_done, grads_ready)
            t = time.perf_counter()
            # in place: the step count moves at the commit, once for all of the unit's pieces
            self._step_body(u, 1.0, lr, into_spare=self.redo, pieces=pieces, count_step=False)
            u.optimizer.speculated_s += time.perf_counter() - t
        finally:
            done.set()

    def _commit(self, u: Unit, coef: float, lr: float, upload_read_done, done) -> None:
        """The speculative update is the step's: its buffers become the state, the old ones the
        spare (a master that is the pinned compute copy: the compute copy moves with it); an
        update made in place only counts the step."""
        try:
            t = time.perf_counter()
            o = u.optimizer
            st = o.adamw.state[o.master]
            if o.spare is None:
                st["step"].add_(1)
                o.speculated_s = 0.0
                self.worker.account("speculative_commit", u.index, t)
                return
            new = o.spare
            o.spare = (o.master.data, st["exp_avg"], st["exp_avg_sq"])
            if same_tensor(u.weights.host, o.master):
                u.weights.host = new[0]
            o.master.data = new[0]
            st["exp_avg"], st["exp_avg_sq"] = new[1], new[2]
            st["step"].add_(1)
            o.speculated_s = 0.0
            self.worker.account("speculative_commit", u.index, t)
        finally:
            done.set()

    def _redo_step(self, u: Unit, coef: float, lr: float, upload_read_done, done) -> None:
        """The speculation is not the step's (clipped, or another lr): step from the untouched state."""
        self.worker.seconds["speculative_discarded"] += u.optimizer.speculated_s
        u.optimizer.speculated_s = 0.0
        self._cpu_step(u, coef, lr, upload_read_done, done)

    def _undo(self, u: Unit, upload_read_done, done) -> None:
        """A skipped step: the state is untouched; a separate compute copy gets the master's values back."""
        try:
            t = time.perf_counter()
            o = u.optimizer
            self.worker.seconds["speculative_discarded"] += o.speculated_s
            o.speculated_s = 0.0
            if not same_tensor(u.weights.host, o.master):
                u.weights.host.copy_(o.master.data)
            self.worker.account("speculative_undo", u.index, t)
        finally:
            done.set()

    # ------------------------------------------------------------------ the CPU step
    def _cpu_step(self, u: Unit, coef: float, lr: float, upload_read_done, done) -> None:
        try:
            self._wait_inputs(u, upload_read_done)
            self._step_body(u, coef, lr)
        finally:
            done.set()

    def _wait_inputs(self, u: Unit, upload_read_done, grads_ready=None) -> None:
        """`grads_ready`: the D2H of the grads this job reads (None: the unit's last one)."""
        if self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)
        if upload_read_done is not None:
            upload_read_done.synchronize()  # the last H2D read of the host copy has finished
        ready = grads_ready if grads_ready is not None else u.grads.d2h_done
        if ready is not None:
            ready.synchronize()  # the grads are on the host

    @staticmethod
    def state(o: UnitOptimizer) -> dict:
        """The unit's AdamW state in torch's layout, created before the first step as torch's AdamW
        would (step 0, zero moments: exactly what AdamW starts from)."""
        st = o.adamw.state.get(o.master)
        if not st:
            st = o.adamw.state[o.master] = {"step": torch.zeros((), dtype=torch.float32, device=o.master.device),
                                            "exp_avg": torch.zeros_like(o.master.data),
                                            "exp_avg_sq": torch.zeros_like(o.master.data)}
        return st

    def _step_body(self, u: Unit, coef: float, lr: float, into_spare: bool = False,
                   pieces: list[int] | None = None, count_step: bool = True) -> None:
        """One AdamW step of a host unit with grads scaled by `coef`: in place, or (`into_spare`)
        into the unit's spare buffers with the state left as it was; over the unit's `pieces`
        only (None: all). Writes the compute copy when it is not the master itself. The state's
        step count moves only in place with `count_step`."""
        o = u.optimizer
        ranges = u.pieces if pieces is None else [u.pieces[i] for i in pieces]
        st = self.state(o)
        src = (o.master.data, st["exp_avg"], st["exp_avg_sq"])
        dst = o.spare if into_spare else src
        host = None if same_tensor(u.weights.host, o.master) else u.weights.host
        o.adamw.param_groups[0]["lr"] = lr
        t0 = time.perf_counter()
        step = int(st["step"]) + 1
        if self.kernel and {o.master.dtype, u.grads.accumulator.dtype} <= cpu_adamw.DTYPES:
            grad = u.grads.accumulator
            copy = host if host is not None and host.dtype == torch.bfloat16 else None
            for a, b, decayed in u.decay_segments:
                if not any(lo <= a and b <= hi for lo, hi in ranges):
                    continue
                master, exp_avg, exp_avg_sq = (t[a:b] for t in src)
                cpu_adamw.adamw(master, grad[a:b], exp_avg, exp_avg_sq, step=step, lr=lr, beta1=self.betas[0],
                                beta2=self.betas[1], eps=self.eps, weight_decay=self.weight_decay if decayed else 0.0,
                                grad_mul=coef, out=tuple(t[a:b] for t in dst) if into_spare else None,
                                compute_copy=None if copy is None else copy[a:b], threads=self.cpu_threads)
            host = None if copy is not None else host
        else:
            for a, b in ranges:
                self._torch_fused_step(u, src, dst, coef, lr, step, a, b)
        if host is not None:
            for a, b in ranges:
                host[a:b].copy_(dst[0][a:b])
        if not into_spare and count_step:
            st["step"].fill_(step)
        t1 = time.perf_counter()
        self.worker.seconds["cpu_adam"] += t1 - t0
        if self.worker.trace is not None:
            self.worker.trace.append(("cpu_step", u.index, t0, t1))

    def _torch_fused_step(self, u: Unit, src, dst, coef: float, lr: float, step: int, lo: int, hi: int) -> None:
        """Without the C kernel (or for float16 master or grads, which it does not take): torch's
        fused CPU AdamW (in place, so `dst` first gets a copy of `src`) on grads converted to the
        master dtype, over [lo, hi) of the flat buffers."""
        state, out = [t[lo:hi] for t in src], [t[lo:hi] for t in dst]
        if dst is not src:
            torch._foreach_copy_(out, state)
        master = out[0]
        self._decay(u, lr, master, lo)
        torch._fused_adamw_([master], [self._master_grad(u, lo, hi)], [out[1]], [out[2]], [],
                            [torch.full((), float(step))], lr=lr, beta1=self.betas[0], beta2=self.betas[1],
                            weight_decay=self.weight_decay, eps=self.eps, amsgrad=False, maximize=False,
                            grad_scale=torch.full((), 1.0 / coef) if coef != 1.0 else None, found_inf=None)

    def _master_grad(self, u: Unit, lo: int, hi: int) -> torch.Tensor:
        """The unit's grads [lo, hi) in the master dtype for torch's fused AdamW: the accumulator's
        own, or a conversion into one reused buffer (a fresh tensor per unit and step would
        page-fault its whole size in again every step)."""
        acc, dtype = u.grads.accumulator[lo:hi], u.optimizer.master.dtype
        if acc.dtype == dtype:
            return acc
        if self.grad_scratch is None or self.grad_scratch.dtype != dtype or self.grad_scratch.numel() < acc.numel():
            largest = max(x.grads.accumulator.numel() for x in self.units if x.mode != "gpu" and not x.frozen)
            self.grad_scratch = torch.empty(largest, dtype=dtype)
        out = self.grad_scratch[:acc.numel()]
        out.copy_(acc)
        return out
