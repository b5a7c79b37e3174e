import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# pytest-xdist workers (pyproject addopts -n) share the cores: each takes its share for torch's
# intra-op threads instead of one per core each, which oversubscribes them
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True)
def _session_environment():
    """Each test ends with the environment it started with: an in-process trainer sets variables
    (torchtitan's PYTHONHASHSEED and flight-recorder settings, the rendezvous address) that would
    otherwise reach every later job of this process (and keep it from the warm job interpreter)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
