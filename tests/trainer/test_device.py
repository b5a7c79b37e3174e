"""flame.distributed.device: the process group's setup."""

import pytest
import torch
from torchtitan.distributed import utils as dist_utils

from flame.distributed import device


def _init_with(monkeypatch, cuda: bool, backend: str) -> list:
    barriers = []
    monkeypatch.setattr(dist_utils, "init_distributed", lambda comm, base_folder: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.distributed, "barrier", lambda **kw: barriers.append(kw))
    assert device.init_process_group(None, "/tmp") == 1
    return barriers


def test_nccl_connects_before_gpu_memory_is_measured(monkeypatch):
    """On a GPU the NCCL communicator is made at once (a barrier on this process's device), so its
    device buffers are in place before the GPU cap and the planner count what lies outside
    torch's allocator; a lazy first collective after the plan filled the GPU ran out of memory."""
    assert _init_with(monkeypatch, True, "cuda:nccl,cpu:gloo") == [{"device_ids": [3]}]
    assert _init_with(monkeypatch, True, "nccl") == [{"device_ids": [3]}]
    assert _init_with(monkeypatch, False, "gloo") == []


SCRIPT = """
import json, torch
from flame.config.manager import FlameConfigManager
from flame.distributed.device import init_process_group, local_device
from flame.offload.measure.hardware import outside_allocator_bytes
cfg = FlameConfigManager().parse_args([])
device = local_device()
init_process_group(cfg.comm, "/tmp")
before = outside_allocator_bytes(device)
x = torch.ones(1 << 20, device=device)
torch.distributed.all_reduce(x)
torch.distributed.barrier(device_ids=[device.index])
torch.cuda.synchronize()
print("RESULT", json.dumps({"before": before, "after": outside_allocator_bytes(device)}))
torch.distributed.destroy_process_group()
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_collectives_after_init_take_no_new_driver_memory():
    """On a GPU, NCCL's communicator and its device buffers exist once the process group is set up:
    the first collectives add (almost) nothing outside torch's allocator, so what the GPU cap and
    the planner measured at setup is what the run holds."""
    import json
    import os
    import subprocess
    import sys

    from tests.trainer.helpers import PYTHONPATH, ROOT, free_port

    env = dict(os.environ, PYTHONPATH=PYTHONPATH, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert r["after"] - r["before"] < 16 * 2**20, r
