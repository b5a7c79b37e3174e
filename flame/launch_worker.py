"""What torchrun runs for flame's launcher: arm the parent-death guard, then run ``flame.train``.

Importing flame (torch, FLA, transformers) takes seconds; a launcher killed during those seconds
must not leave the workers behind, so the guard is armed first, from a standard-library file
loaded by path, before anything of flame is imported.
"""

import importlib.util
import os
import runpy
import sys
import time

os.environ["FLAME_WORKER_START"] = repr(time.time())  # start-up split (flame/utils/startup.py)

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("_flame_process_guard", os.path.join(_here, "utils", "process_guard.py"))
_guard = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_guard)
_guard.die_with_launcher()

if os.environ.pop("FLAME_DROP_TORCHRUN_NCCL_DEFAULT", None):
    os.environ.pop("TORCH_NCCL_ASYNC_ERROR_HANDLING", None)  # torchrun's default (see flame/launch.py)
if sys.path and os.path.abspath(sys.path[0] or ".") == _here:
    del sys.path[0]  # the script's folder: flame's subpackages must not become top-level modules
runpy.run_module("flame.train", run_name="__main__", alter_sys=True)
