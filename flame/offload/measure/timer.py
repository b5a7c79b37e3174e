"""The one timer of the offload measurements (hardware profile, block calibration, benchmarks)."""

from __future__ import annotations

import time

import torch


def seconds_per_call(fn, iters: int = 3, warm_s: float = 0.0) -> float:
    """Seconds per call of `fn` after one warm-up call: CUDA events when a GPU is present, a host
    clock otherwise. With `warm_s`, `fn` first runs for that long: a GPU at its power limit lowers
    its clock within a fraction of a second of sustained GEMMs, and a training step runs at that
    clock."""
    cuda = torch.cuda.is_available()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < warm_s:
        fn()
        if cuda:
            torch.cuda.synchronize()
    fn()
    if not cuda:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters
