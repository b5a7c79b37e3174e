"""flame.distributed.device: the process group's setup."""

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
