"""Fused CPU AdamW rate in the conditions the offload engine runs it, against the profile's
micro-benchmark (writes JSON + prints a table).

The engine measured its CPU AdamW at 0.5-0.7x the profile's rate (benchmarks/notes/offload-findings.md
O4/O5). Each row changes one condition from the profile's: tensor size (a unit of an 8B block
instead of 64M elements), data (random instead of zeros), the thread (the engine's one worker
thread with its own OpenMP pool instead of the main thread), a main thread that waits on the GPU
meanwhile, and pinned buffers read by H2D copies meanwhile.
Usage: python benchmarks/cpu_adam.py OUT.json [--unit_numel 218103808] [--threads N] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flame.offload.measure.hardware import adam_bench, measure_cpu_adam  # noqa: E402
from flame.offload.runtime.switch_interval import SWITCH_INTERVAL_S  # noqa: E402
from flame.offload.runtime.streams import register_pinned, unregister_pinned  # noqa: E402


def old_profile_rate(dtype, threads: int, numel: int = 1 << 26, steps: int = 3) -> float:
    """The profile's AdamW timing before 2026-11-23: zero parameters, constant grads, no grad_scale."""
    p = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    p.grad = torch.full((numel,), 1e-3, dtype=dtype)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    return numel * steps / (time.perf_counter() - t0) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--unit_numel", type=int, default=218_103_808, help="one Llama-8B block's parameters")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads (default: the engine's, cores - 1)")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="states dtypes")
    args = ap.parse_args()
    threads = args.threads or len(os.sched_getaffinity(0)) - 1  # the engine's optimizer_threads, one rank
    torch.set_num_threads(threads)
    cuda = torch.cuda.is_available()
    pool = ThreadPoolExecutor(max_workers=1)

    def submit(fn):
        def job():
            torch.set_num_threads(threads)  # as HostOptimizer._cpu_step: the worker's own OpenMP pool
            return fn()
        return pool.submit(job)

    def in_worker(fn):
        return submit(fn).result()

    rows = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        name = str(dtype).removeprefix("torch.")
        rows.append((name, "profile (measure_cpu_adam: 128M random, grad_scale set, main thread)",
                     measure_cpu_adam([threads], dtype=dtype)[str(threads)]))
        rows.append((name, "64M, zeros, no grad_scale, main thread (the profile before 2026-11-23)",
                     old_profile_rate(dtype, threads)))
        p, opt, run = adam_bench(args.unit_numel, dtype, grad_scale=False)

        def unit():
            return run(threads, 3)

        rows.append((name, "unit size, random data, main thread", unit()))
        rows.append((name, "unit size, random, worker thread", in_worker(unit)))
        opt.grad_scale = torch.full((), 2.0)  # clipping: the engine's usual case; kept from here on
        rows.append((name, "unit size, random, worker thread, grad_scale set", in_worker(unit)))
        # the main thread busy in Python meanwhile (the engine's forward: hooks, kernel launches):
        # the worker needs the GIL back after each op, and the holder keeps it up to the switch
        # interval (5 ms by default)
        for interval in (sys.getswitchinterval(), SWITCH_INTERVAL_S):
            old = sys.getswitchinterval()
            sys.setswitchinterval(interval)
            f = submit(unit)
            x = torch.zeros(8)
            while not f.done():
                for _ in range(100):
                    x.add_(1.0)
            sys.setswitchinterval(old)
            rows.append((name, f"unit size, worker, main thread busy in Python (switch interval {interval * 1e3:g} ms)",
                         f.result()))
        if cuda:
            a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            for _ in range(200):  # ~0.3 s of GPU work; the main thread blocks on it meanwhile
                a = (a @ a).clamp_(-1, 1)
            f = submit(unit)
            torch.cuda.synchronize()
            rows.append((name, "unit size, worker, main thread in cuda.synchronize", f.result()))
            del a
            # pinned master and grads (the engine's pinned compute copy / staging), H2D reading them
            ptrs = register_pinned(p.data, 1 << 30) + register_pinned(p.grad, 1 << 30)
            rows.append((name, "unit size, worker, pinned buffers", in_worker(unit)))
            dev = torch.empty(p.numel(), dtype=dtype, device="cuda")
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                for _ in range(12):
                    dev.copy_(p.data, non_blocking=True)
            r = in_worker(unit)
            busy = not side.query()
            side.synchronize()
            rows.append((name, "unit size, worker, pinned, H2D reading the master" + ("" if busy else " (copies ended first)"), r))
            unregister_pinned(ptrs)
            del dev
        del p, opt
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "threads": threads,
           "cores": len(os.sched_getaffinity(0)), "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "rows": [{"dtype": d, "case": c, "gparams_per_s": r} for d, c, r in rows]}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("| dtype | case | G params/s | vs profile |\n|---|---|---|---|")
    base = {}
    for d, c, r in rows:
        base.setdefault(d, r)
        print(f"| {d} | {c} | {r:.2f} | {r / base[d]:.2f} |")


if __name__ == "__main__":
    main()
