"""A warm interpreter that starts jobs by forking (``python -m tests.trainer.job_server``).

Importing torch, torchtitan, FLA and transformers costs a new interpreter most of a tiny CPU job's
time. This server imports them once; each job's ranks are forked children that run its module or
script as ``python -m``/``python script.py`` would (``runpy``, ``sys.argv``, its own environment,
working directory, stdout and stderr files, normal interpreter exit with atexit handlers and thread
joins), so every rank still lives and dies in a process of its own.

Protocol, one JSON line each way on stdin/stdout: a request ``{"target": [...], "cwd": ...,
"ranks": [{"env": {...}, "stdout": path, "stderr": path}, ...]}`` is answered with ``{"pids": [...]}``
once forked and ``{"returncode": ...}`` when the ranks have ended: 0, or the first failure's code
(negative: killed by that signal, as subprocess reports). As torchrun's agent does, a failed rank
gets the others terminated, so that none waits in a collective for it.
The caller starts the server with the environment its jobs share: anything read at import time is
read once, so the caller sends here only jobs whose environment differs in per-job names alone
(see ``tests.trainer.helpers``).
"""

import json
import os
import runpy
import signal
import sys

# what the jobs import anyway; the children find them in sys.modules
import torch  # noqa: F401
import flame  # noqa: F401
import flame.train  # noqa: F401


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _wait(pids: list[int]) -> int:
    running, first_failure = set(pids), 0
    while running:
        pid, status = os.wait()
        running.discard(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not first_failure:
            first_failure = code
            for other in running:
                os.kill(other, signal.SIGTERM)
            # a rank stuck in native code may ignore SIGTERM: the caller's timeout kills it then
    return first_failure


def serve():
    """Fork each request's ranks; returns (request, rank) in a child, None when the caller hangs up."""
    for line in sys.stdin:
        request = json.loads(line)
        pids = []
        for rank in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                return request, rank
            pids.append(pid)
        _reply({"pids": pids})
        _reply({"returncode": _wait(pids)})
    return None


def run_child(request: dict, rank: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(rank["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, rank["stdout"], os.O_WRONLY),
                           (2, rank["stderr"], os.O_WRONLY)):
        target = os.open(path, mode)
        os.dup2(target, fd)
        os.close(target)
    target = request["target"]
    if target[0] == "-m":
        sys.argv = [target[1], *target[2:]]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(target)
        sys.path[0] = os.path.dirname(os.path.abspath(target[0]))
        runpy.run_path(target[0], run_name="__main__")


if __name__ == "__main__":
    job = serve()
    if job is not None:
        run_child(*job)  # the child ends here like `python -m ...`: SystemExit or a traceback and exit 1
