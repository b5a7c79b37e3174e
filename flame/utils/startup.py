"""Where a run's start-up went, from train.sh's start to the first training step.

train.sh's launcher exports its start time (``FLAME_LAUNCH_TIME``) and each worker its own, taken
before anything of flame is imported (``FLAME_WORKER_START``, ``flame/launch_worker.py``); the
trainer marks the end of its imports (`mark_imports_done`) and logs the split when setup is done.
"""
from __future__ import annotations

import os
import time

_IMPORTS_DONE: float | None = None


def mark_imports_done() -> None:
    global _IMPORTS_DONE
    _IMPORTS_DONE = time.time()


def _env_time(name: str) -> float | None:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return None


def seconds_since_launch() -> float | None:
    """Seconds since train.sh started this run, or None outside train.sh."""
    launch = _env_time("FLAME_LAUNCH_TIME")
    return None if launch is None else max(0.0, time.time() - launch)


def startup_split(now: float | None = None) -> str | None:
    """"N s since train.sh started: launcher and torchrun A s, imports B s, setup C s", or None
    outside train.sh (no launch time)."""
    now = time.time() if now is None else now
    launch, worker, imported = _env_time("FLAME_LAUNCH_TIME"), _env_time("FLAME_WORKER_START"), _IMPORTS_DONE
    if launch is None:
        return None
    parts = []
    if worker is not None and imported is not None and launch <= worker <= imported <= now:
        parts = [f"launcher and torchrun {worker - launch:.1f} s", f"imports {imported - worker:.1f} s",
                 f"setup {now - imported:.1f} s"]
    return f"{now - launch:.1f} s since train.sh started" + (f" ({', '.join(parts)})" if parts else "")
