"""The engine's one CPU thread and the ledger of the host time it and the training thread spend.

One worker runs every host job in submission order: the adds and norms of host-accumulated
grads (HostMath, whose scratch buffer it owns) and the CPU AdamW of each host unit. One thread
keeps the order the jobs depend on (a unit's adds before its optimizer step) without locks.
While the worker lives the interpreter's GIL switch interval is short (a counted lease, see
switch_interval.py): given back at shutdown, or when the worker is collected without one.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from flame.offload.runtime.host_math import HostMath
from flame.offload.runtime.switch_interval import ShortSwitchInterval


class CpuWorker:
    def __init__(self):
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-cpu")
        self.math = HostMath()  # chunked adds and norms of host grads (this worker only)
        # seconds spent per kind of host work since the last reset_seconds() (calibration compares
        # them with the cost model's CPU terms); worker keys and training-thread keys never overlap
        self.seconds: Counter = Counter()
        # None, or a list the worker appends (kind, unit index, start, end) to, perf_counter
        # seconds, per job (benchmarks/offload_blocks.py lines them up with the GPU's timeline)
        self.trace: list | None = None
        self.error: BaseException | None = None  # the first exception a job raised (raised again by check())
        self.switch_interval = ShortSwitchInterval()
        self.switch_interval.acquire()
        weakref.finalize(self, self.switch_interval.release)

    def submit(self, fn, *args) -> Future:
        future = self.pool.submit(fn, *args)
        future.add_done_callback(self._keep_error)
        return future

    def _keep_error(self, future) -> None:
        if self.error is None and future.exception() is not None:
            self.error = future.exception()

    def check(self) -> None:
        """Raise the first exception a job raised (a job's failure must not pass unseen)."""
        if self.error is not None:
            raise RuntimeError("offload: a CPU job failed") from self.error

    def wait(self) -> None:
        """Every job submitted so far has run (raises a job's exception)."""
        self.pool.submit(lambda: None).result()
        self.check()

    def account(self, kind: str, unit_index: int, t0: float) -> None:
        """Book the seconds from `t0` to now under `kind` (and trace them)."""
        t1 = time.perf_counter()
        self.seconds[kind] += t1 - t0
        if self.trace is not None:
            self.trace.append((kind, unit_index, t0, t1))

    def reset_seconds(self) -> dict[str, float]:
        """The host-time counters since the last reset (then zeroed)."""
        out, self.seconds = dict(self.seconds), Counter()
        return out

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True)
        self.switch_interval.release()
