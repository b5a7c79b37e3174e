"""The interpreter's GIL switch interval, shortened while an offload engine lives.

The engine's CPU worker dispatches a few torch ops per host chunk (HostMath) and needs the GIL
back after each; the training thread runs Python meanwhile (hooks, the recomputed forward) and
keeps the GIL up to the switch interval each time (5 ms by default), which makes the worker's
host adds several times slower than alone. At 0.1 ms they run at nearly their speed alone.

The interval is process-wide, so every lease counts: the first one saves the interval and
shortens it, the last one released restores the saved value, whatever order engines close in.
"""

from __future__ import annotations

import sys
import threading

SWITCH_INTERVAL_S = 1e-4

_lock = threading.Lock()
_holders = 0
_saved: float | None = None


class ShortSwitchInterval:
    """One holder's lease on the short interval: `acquire` once, `release` once (later calls of
    either do nothing); also a context manager."""

    def __init__(self, seconds: float = SWITCH_INTERVAL_S):
        self.seconds = seconds
        self.held = False

    def acquire(self) -> None:
        global _holders, _saved
        with _lock:
            if self.held:
                return
            if _holders == 0:
                _saved = sys.getswitchinterval()
            _holders += 1
            self.held = True
            sys.setswitchinterval(min(sys.getswitchinterval(), self.seconds))

    def release(self) -> None:
        global _holders, _saved
        with _lock:
            if not self.held:
                return
            self.held = False
            _holders -= 1
            if _holders == 0:
                sys.setswitchinterval(_saved)
                _saved = None

    def __enter__(self) -> ShortSwitchInterval:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
