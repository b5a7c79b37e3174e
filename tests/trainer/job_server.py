"""A warm interpreter that starts one-rank jobs by forking (``python -m tests.trainer.job_server``).

Importing torch, torchtitan, FLA and transformers costs a new interpreter most of a tiny CPU job's
time. This server imports them once; each job is a forked child that runs its module or script as
``python -m``/``python script.py`` would (``runpy``, ``sys.argv``, its own environment, working
directory, stdout and stderr files, normal interpreter exit with atexit handlers and thread joins),
so every job still lives and dies in a process of its own.

Protocol, one JSON line each way on stdin/stdout: a request ``{"target": [...], "env": {...},
"cwd": ..., "stdout": path, "stderr": path}`` is answered with ``{"pid": ...}`` once forked and
``{"returncode": ...}`` when the child ends (negative: killed by that signal, as subprocess reports).
The caller starts the server with the environment its jobs share: anything read at import time is
read once, so the caller sends here only jobs whose environment differs in per-job names alone
(see ``tests.trainer.helpers``).
"""

import json
import os
import runpy
import sys

# what the jobs import anyway; the children find them in sys.modules
import torch  # noqa: F401
import flame  # noqa: F401
import flame.train  # noqa: F401


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def serve():
    """Fork a child per request; returns the request in the child, None when the caller hangs up."""
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            return request
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"returncode": os.waitstatus_to_exitcode(status)})
    return None


def run_child(request: dict) -> None:
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                           (2, request["stderr"], os.O_WRONLY)):
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
        run_child(job)  # the child ends here like `python -m ...`: SystemExit or a traceback and exit 1
