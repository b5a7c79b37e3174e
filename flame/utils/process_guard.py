"""Process life of a training worker: it dies with its launcher, and it stops cleanly on a signal.

torchrun starts every worker in its own session, so killing the launcher's process group does
not reach the workers. Each worker therefore asks the kernel for SIGKILL when its parent
(torchrun) dies (``PR_SET_PDEATHSIG``), and a watchdog thread covers the window before that
request and the case where torchrun survives its launcher: it kills the worker once the parent
changes or the launcher (``FLAME_LAUNCHER_PID``) is gone.

SIGTERM/SIGINT only set a flag; the training loop finishes its step, all ranks agree on the
stop (one small all-reduce per step on a CPU group, overlapped with the step), save and exit.
"""

import ctypes
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "FLAME_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a live launcher from a reused PID); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"


def die_with_launcher(poll_seconds: float = 1.0) -> bool:
    """Under torchrun: SIGKILL this worker when torchrun or flame's launcher goes away.

    Returns whether the guard was armed (only processes started by torchrun arm it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    if os.environ.get("FLAME_GUARD_PID") == str(os.getpid()):
        return True  # armed already (flame/launch_worker.py does it before importing flame)
    os.environ["FLAME_GUARD_PID"] = str(os.getpid())
    parent = os.getppid()
    set_parent_death_signal(signal.SIGKILL)
    launcher = int(os.environ.get(LAUNCHER_ENV, "0") or 0)
    launcher_start = _start_time(launcher) if launcher else None

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        return bool(launcher) and _start_time(launcher) != launcher_start

    if gone() or (launcher and launcher_start is None):
        os.kill(os.getpid(), signal.SIGKILL)

    def watch():
        while True:
            time.sleep(poll_seconds)
            if gone():
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="flame-launcher-watchdog", daemon=True).start()
    return True


class StopRequest:
    """SIGTERM/SIGINT as a request to stop after the current step.

    A signal repeated within ``debounce_seconds`` counts as the same request (Slurm and torchrun
    both forward one preemption to every process); a later one exits at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, debounce_seconds: float = 1.0):
        self.signum = 0
        self.first = 0.0
        self.debounce = debounce_seconds
        self.previous = {}
        self.group = None
        self._flag = None
        self._work = None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self.previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self.first = signum, now
            try:
                print(f"flame: {signal.Signals(signum).name} received: stopping after this step "
                      "(send it again to exit at once)", file=sys.stderr, flush=True)
            except OSError:
                pass  # stderr on a full disk: the stop itself must not fail
        elif now - self.first > self.debounce:
            os._exit(128 + signum)

    # -- agreement over ranks --------------------------------------------------------------
    def attach(self, world_size: int) -> None:
        """Make every rank see a signal that reached any rank (called on all ranks after init)."""
        import torch
        import torch.distributed as dist

        if world_size > 1:
            # a CPU group: the flag travels without touching the GPU stream
            self.group = dist.new_group(backend="gloo")
            self._flag = torch.zeros(1, dtype=torch.int32)

    def poll(self) -> None:
        """Start sharing this rank's flag (waited for in ``requested``)."""
        if self.group is None:
            return
        import torch.distributed as dist

        self._flag.fill_(self.signum)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

    def requested(self) -> int:
        """The signal number every rank agrees to stop on (0: go on)."""
        if self._work is None:
            return self.signum
        self._work.wait()
        self._work = None
        return int(self._flag.item())
