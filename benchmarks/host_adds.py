"""The offload engine's host grad accumulation (HostMath.add_ with the norm, what the CPU worker runs
for every host-accumulated unit in the last round) at several intra-op thread counts, alone and next
to the other host activity of a backward: a thread running Python (the autograd thread's hooks and
the recomputed forward) and a thread spin-waiting on the GPU (a CUDA synchronize). Prints a table,
writes JSON. The interpreter's switch interval is the engine's. Finding O5: on some machines these adds ran 2-3x slower inside training than alone.

    python benchmarks/host_adds.py [--numel 218103808] [--threads 4,8,12,15] [--out benchmarks/results/host_adds_<device>.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flame.offload.runtime.switch_interval import SWITCH_INTERVAL_S  # noqa: E402
from flame.offload.planner.cost_model import HOST_MATH_CHUNK  # noqa: E402
from flame.offload.runtime.host_math import HostMath  # noqa: E402


def busy_python(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i


def busy_cuda(stop: threading.Event) -> None:
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(20):
            a @ a
        torch.cuda.synchronize()  # spin-waits by default while the GPU works


def time_adds(acc, staged, threads: int, reps: int, chunk: int) -> float:
    """Seconds per add + norm, run on a worker thread as the engine does (its own intra-op pool)."""
    out = {}

    def work():
        torch.set_num_threads(threads)
        hm = HostMath(chunk)
        hm.add_(acc, staged, norm=True)  # warm (scratch, pages)
        t0 = time.perf_counter()
        for _ in range(reps):
            hm.add_(acc, staged, norm=True)
        out["s"] = (time.perf_counter() - t0) / reps

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out["s"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=218_103_808, help="elements (default: one Llama-3 8B block)")
    ap.add_argument("--threads", default="")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--switch_us", default=str(int(SWITCH_INTERVAL_S * 1e6)),
                    help="interpreter switch intervals to try, microseconds (default: the engine's)")
    ap.add_argument("--chunks_m", default=str(HOST_MATH_CHUNK >> 20), help="HostMath chunk sizes to try, M elements")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    threads = [int(x) for x in args.threads.split(",")] if args.threads else sorted({2, 4, 8, 12, max(1, cores - 1)})
    acc = torch.randn(args.numel, dtype=torch.bfloat16)
    staged = torch.randn(args.numel, dtype=torch.bfloat16)
    gb = args.numel * 8 / 1e9  # read staged, read + write acc, read acc for the norm (bf16)
    conditions = [("alone", [])]
    conditions.append(("next to a Python thread", [busy_python]))
    if torch.cuda.is_available():
        conditions.append(("next to a Python thread and a CUDA-sync thread", [busy_python, busy_cuda]))
    rows = []
    print(f"{cores} cores, {args.numel / 1e6:.0f}M bf16 elements per add + norm")
    print("| condition | switch us | chunk M | threads | ms | GB/s |\n|---|---|---|---|---|---|")
    for name, others in conditions:
        for us in (int(x) for x in args.switch_us.split(",")):
            for cm in (int(x) for x in args.chunks_m.split(",")):
                for n in threads:
                    sys.setswitchinterval(us / 1e6)
                    stop = threading.Event()
                    bg = [threading.Thread(target=f, args=(stop,), daemon=True) for f in others]
                    for t in bg:
                        t.start()
                    time.sleep(0.2)
                    s = time_adds(acc, staged, n, args.reps, cm << 20)
                    stop.set()
                    for t in bg:
                        t.join()
                    rows.append({"condition": name, "switch_us": us, "chunk": cm << 20, "threads": n, "s": s,
                                 "gbps": gb / s})
                    print(f"| {name} | {us} | {cm} | {n} | {1e3 * s:.1f} | {gb / s:.1f} |", flush=True)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out = args.out or os.path.join("benchmarks", "results",
                                   "host_adds_" + re.sub(r"[^a-z0-9]+", "_", dev.lower()).strip("_") + ".json")
    with open(out, "w") as f:
        json.dump({"device": dev, "cores": cores, "torch": torch.__version__, "command": " ".join(sys.argv),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "numel": args.numel, "rows": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
