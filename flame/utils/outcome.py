"""How a worker ended, told to the launcher in one line.

Every rank that ends other than normally writes one small JSON record to ``FLAME_OUTCOME_DIR``
(a folder ``train.sh`` makes outside the dump folder, in RAM where possible, so a full disk
cannot swallow it) and prints its line to its own stderr (the per-rank log). The launcher
prints the one line that explains the run instead of torchrun's failure report.

Kinds and exit codes: ``error`` (bad user input or setup, 2), ``stopped`` (a signal: 128 +
signal number), ``nonfinite`` (NaN/Inf, 3), ``crash`` (an internal error: a traceback, 1).
"""

import errno
import json
import os
import sys
import time
import traceback

ENV = "FLAME_OUTCOME_DIR"
EXIT_USER_ERROR = 2
EXIT_NONFINITE = 3


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _log_dir() -> str | None:
    # torchrun's per-worker error file sits in the worker's log folder (stdout.log, stderr.log)
    err = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return os.path.dirname(err) if err else None


def report(kind: str, line: str, code: int, echo: bool = True, **extra) -> int:
    """Record how this rank ends and print ``line`` to stderr; returns ``code``."""
    folder = os.environ.get(ENV)
    if folder:
        record = dict(kind=kind, line=line, code=code, rank=_rank(), time=time.time(), log_dir=_log_dir(), **extra)
        try:
            tmp = os.path.join(folder, f".rank{_rank()}.tmp")
            with open(tmp, "w") as f:
                json.dump(record, f)
            os.replace(tmp, os.path.join(folder, f"rank{_rank()}.json"))
        except OSError:
            pass  # the launcher falls back to the console line
    if echo:
        try:
            print(line, file=sys.stderr, flush=True)
        except OSError:
            pass  # stderr goes to a log file on a full disk
    return code


def report_crash(exc: BaseException) -> None:
    """Record an internal error with its traceback's tail (the exception still propagates)."""
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    last = f"{type(exc).__name__}: {exc}".strip().splitlines()
    report("crash", f"flame: crashed on rank {_rank()}: {last[0] if last else type(exc).__name__}", 1,
           echo=False, traceback=tb[-6000:])


def find_errno(exc: BaseException, code: int = errno.ENOSPC) -> OSError | None:
    """The OSError with ``code`` behind ``exc``: causes, contexts and the per-rank failures that
    torch's distributed checkpoint wraps (``CheckpointException.failures``)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == code:
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "exc", None)]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # rank -> (exception, stack summary)
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None
