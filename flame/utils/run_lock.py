"""One trainer per dump folder: an exclusive ``flock`` on ``DUMP/.flame.lock``.

The lock belongs to an open file, so the kernel releases it when the holder dies, however it
dies (no stale lock after ``kill -9``). The file names the holder (PID, host, start time) so a
refused launch can say who is using the folder. ``train.sh`` takes it on node 0 before torchrun
starts and tells the trainer so (``FLAME_RUN_LOCK``); a trainer started by plain torchrun takes
it itself on rank 0.
"""

import datetime
import errno
import fcntl
import os
import socket


class DumpFolderInUse(Exception):
    """Another live process holds the dump folder's lock (the message names it)."""

LOCK_NAME = ".flame.lock"
# stdlib only: the launcher loads this file without importing flame (and torch)
ENV = "FLAME_RUN_LOCK"
"""Set by the launcher to the real path of the dump folder whose lock it holds."""


def acquire(dump_folder: str) -> int | None:
    """Take the lock of ``dump_folder``; returns the open descriptor (keep it open for the run).

    Raises DumpFolderInUse naming the holder when another process has it, OSError when the
    folder cannot be written. Returns None (with the
    reason for the caller to log) only on file systems without flock support.
    """
    os.makedirs(dump_folder, exist_ok=True)
    fd = os.open(os.path.join(dump_folder, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _read_holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise DumpFolderInUse(
                f"job.dump_folder {dump_folder!r} is in use by {holder}; stop that run or pick another "
                "--job.dump_folder") from None
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise
    os.ftruncate(fd, 0)
    stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()} {stamp}\n".encode(), 0)
    return fd


def holds_lock_for(dump_folder: str) -> bool:
    """Whether the launcher of this process already holds the lock of ``dump_folder``."""
    return os.environ.get(ENV) == os.path.realpath(dump_folder)


def _read_holder(fd: int) -> str:
    try:
        pid, host, since = os.pread(fd, 512, 0).decode(errors="replace").split()[:3]
        return f"PID {pid} on {host} (since {since})"
    except (OSError, ValueError):
        return "another process (its PID is not recorded yet)"
