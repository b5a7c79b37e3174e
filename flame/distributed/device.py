"""Pick the training device and make torchtitan's library code agree with it.

torchtitan binds ``device_type``/``device_module`` at import time to "cuda" even on a
machine without CUDA; flame trains on CPU (gloo) when no GPU is visible, so those module
globals are rebound once, before any torchtitan object is built.
"""

import os

import torch

_TORCHTITAN_MODULES = (
    "torchtitan.tools.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.distributed.utils",
    "torchtitan.components.metrics",
    "torchtitan.components.validate",
    "torchtitan.tools.profiling",
)


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def bind_torchtitan_device(kind: str) -> None:
    import importlib

    module = torch.cuda if kind == "cuda" else torch.cpu
    for name in _TORCHTITAN_MODULES:
        mod = importlib.import_module(name)
        if hasattr(mod, "device_type"):
            mod.device_type = kind
        if hasattr(mod, "device_module"):
            mod.device_module = module


def local_device() -> torch.device:
    """The device of this process: ``cuda:LOCAL_RANK`` or ``cpu``."""
    kind = device_type()
    bind_torchtitan_device(kind)
    if kind == "cuda":
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        return dev
    return torch.device("cpu")


def init_process_group(comm_config, dump_folder: str) -> int:
    """Initialise torch.distributed (NCCL on GPU, gloo on CPU); returns the world size."""
    from torchtitan.distributed import utils as dist_utils

    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    world = dist_utils.init_distributed(comm_config, base_folder=dump_folder)
    if torch.cuda.is_available() and "nccl" in str(torch.distributed.get_backend()):
        # NCCL creates its communicator, with device buffers outside torch's allocator, on the first
        # collective: have that happen now, so those bytes are in use when the GPU cap and the
        # offload planner measure what lies outside the allocator (lazily, after a plan that
        # fills the GPU, it fails for want of memory)
        torch.distributed.barrier(device_ids=[torch.cuda.current_device()])
    return world
