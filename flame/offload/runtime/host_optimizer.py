"""The engine's optimizer: every unit's master weights and AdamW moments, the fused AdamW on the
GPU (gpu units) or on the CPU worker (host units) and clipping by the global grad norm (a
non-finite norm is kept as it is: the engine's `optimizer_step` and the trainer skip that step).

A host unit's CPU step starts once the step's grad norm is known and runs while the GPU goes on
with the next forward: it writes the new compute copy into the unit's pinned host copy, and the
schedule waits for it (`wait_for`) before that unit's next H2D. Clipping is folded into the fused
AdamW (it divides the grads by `grad_scale`); weight decay is decoupled as in AdamW, with the
no_decay parameters (norms, biases, embeddings) excluded as in the plain optimizer.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

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
    step_done: threading.Event = field(default_factory=set_event)  # the CPU step has written the new weights


class HostOptimizer:
    def __init__(self, units: list[Unit], worker: CpuWorker, lr: float, betas, eps: float, weight_decay: float,
                 no_decay: set[str], cpu_threads: int):
        self.units, self.worker = units, worker
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
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
        u.optimizer.step_done.clear()
        self.worker.submit(self._cpu_step, u, coef, self.lr, u.weights.upload_read_done)

    def _cpu_step(self, u: Unit, coef: float, lr: float, upload_read_done) -> None:
        o = u.optimizer
        try:
            if self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)
            if upload_read_done is not None:
                upload_read_done.synchronize()  # the last H2D read of the host copy has finished
            if u.grads.d2h_done is not None:
                u.grads.d2h_done.synchronize()  # the grads are on the host
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
        finally:
            o.step_done.set()

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
