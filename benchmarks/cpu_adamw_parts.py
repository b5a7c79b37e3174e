"""flame's CPU AdamW kernel (`flame.ops.cpu_adamw`): the one-pass step (state and compute copy)
against the step split in two (the compute copy alone, `copy_only`; then the state without the
copy), alone and while pinned H2D and D2H copies stream (what the engine's forward does beside the
CPU steps). Writes JSON and prints a table.

Usage: python benchmarks/cpu_adamw_parts.py OUT.json [--numel 402653184] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flame.ops import cpu_adamw  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--numel", type=int, default=402_653_184, help="elements of the flat state (one 3B head)")
    ap.add_argument("--threads", type=int, default=0, help="OpenMP threads (default: cores - 1, as the engine)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if not cpu_adamw.available():
        sys.exit(f"flame: error: the CPU AdamW kernel did not build: {cpu_adamw.unavailable_reason()}")
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) - 1)
    n = args.numel
    gen = torch.Generator().manual_seed(0)
    p = torch.randn(n, generator=gen)
    m = torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    grads = {"float32": torch.randn(n, generator=gen), "bfloat16": torch.randn(n, generator=gen).bfloat16()}
    w = torch.empty(n, dtype=torch.bfloat16)
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_mul=0.5, threads=threads)
    cuda = torch.cuda.is_available()
    copies = None
    if cuda:  # pinned host buffers and their GPU twins: 1 GiB each way
        k = 1 << 28
        h2d_src, d2h_dst = torch.empty(k, pin_memory=True), torch.empty(k, pin_memory=True)
        dev_a, dev_b = torch.empty(k, device="cuda"), torch.randn(k, device="cuda")
        up, down = torch.cuda.Stream(), torch.cuda.Stream()

        def copies(rounds: int):
            for _ in range(rounds):
                with torch.cuda.stream(up):
                    dev_a.copy_(h2d_src, non_blocking=True)
                with torch.cuda.stream(down):
                    d2h_dst.copy_(dev_b, non_blocking=True)

    def rate(part: str, grad: torch.Tensor, with_copies: bool) -> float:
        step = [2]

        def once():
            cpu_adamw.adamw(p, grad, m, v, step=step[0], compute_copy=None if part == "state" else w,
                            copy_only=part == "copy", **hp)
            step[0] += 1

        once()  # first touch, the library loaded
        if with_copies:
            copies(64)  # queued ahead: they run on the copy engines meanwhile
        t = time.perf_counter()
        for _ in range(args.repeats):
            once()
        dt = time.perf_counter() - t
        busy = with_copies and not (up.query() and down.query())
        if with_copies:
            torch.cuda.synchronize()
        return n * args.repeats / dt / 1e9, busy

    rows = []
    for gname, grad in grads.items():
        for with_copies in (False, True) if cuda else (False,):
            for part in ("one pass", "copy", "state"):
                r, busy = rate(part, grad, with_copies)
                rows.append({"grad_dtype": gname, "part": part, "copies": with_copies,
                             "copies_outlasted": busy, "gparams_per_s": r})
    res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "threads": threads, "cores": len(os.sched_getaffinity(0)), "numel": n, "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"| grads | part | H2D+D2H meanwhile | G params/s | (threads {threads}, {n} elements)\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['grad_dtype']} | {r['part']} | {r['copies']}{'' if r['copies_outlasted'] or not r['copies'] else ' (ended first)'}"
              f" | {r['gparams_per_s']:.2f} |")


if __name__ == "__main__":
    main()
