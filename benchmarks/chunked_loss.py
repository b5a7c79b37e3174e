"""Chunked head + cross-entropy (training.loss_chunk_tokens) against torch's unchunked head + float32
cross-entropy, side by side on one GPU: fwd+bwd time, peak memory above the inputs, and the time
over the head's three matmuls alone (the GEMM floor). Llama-3 8B head shapes by default.

    python benchmarks/chunked_loss.py [--tokens 16384 --hidden 4096 --vocab 128256 --chunks 1024,4096]
        [--baseline path/to/other_chunked_loss.py] [--out benchmarks/results/chunked_loss_<device>.json]

--baseline: another implementation of `linear_cross_entropy_sum` (a file defining it, e.g. an older
flame's module) timed in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flame.components.chunked_loss import linear_cross_entropy_sum  # noqa: E402
from flame.offload.measure.timer import seconds_per_call  # noqa: E402


def timed(fn, iters: int = 5) -> tuple[float, int]:
    """(seconds per call, peak bytes allocated above what was live before) of fn()."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    return seconds_per_call(fn, iters), torch.cuda.max_memory_allocated() - base


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--chunks", default="1024,4096")
    ap.add_argument("--baseline", default="", help="a file defining linear_cross_entropy_sum, timed alongside")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d, v = args.tokens, args.hidden, args.vocab
    h = torch.randn(n, d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, device="cuda", generator=g) / d**0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda", generator=g)
    y[torch.rand(n, device="cuda", generator=g) < 0.05] = -100

    def step(loss_fn):
        def run():
            h.grad = w.grad = None
            loss_fn().backward()
        return run

    impls = [("torch unchunked (float32 cross-entropy)",
              lambda: F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100, reduction="sum"), 0)]
    for c in (int(x) for x in args.chunks.split(",")):
        impls.append((f"flame chunked, {c} tokens", lambda c=c: linear_cross_entropy_sum(h, w, None, y, c), c))
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_chunked_loss", args.baseline)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        for c in (int(x) for x in args.chunks.split(",")):
            impls.append((f"baseline {os.path.basename(args.baseline)}, {c} tokens",
                          lambda c=c: mod.linear_cross_entropy_sum(h, w, None, y, c), c))
    # the floor: the head's three matmuls (forward, dX, dW have the same FLOPs), timed as three forwards
    x, wd = h.detach(), w.detach()
    gemm3_s = 3 * timed(lambda: F.linear(x, wd))[0]
    ref = impls[0][1]().item()
    rows = []
    print(f"{dev}, torch {torch.__version__}: {n} tokens x hidden {d} x vocab {v}; "
          f"three head matmuls {1e3 * gemm3_s:.1f} ms")
    print("| implementation | fwd+bwd ms | over 3 matmuls | peak GiB above inputs | loss rel. diff |")
    print("|---|---|---|---|---|")
    for name, fn, c in impls:
        s, peak = timed(step(fn))
        loss = fn().item()
        rows.append({"impl": name, "chunk_tokens": c, "fwd_bwd_s": s, "over_gemm": s / gemm3_s, "peak_bytes": peak,
                     "loss_rel_diff": abs(loss - ref) / abs(ref)})
        print(f"| {name} | {1e3 * s:.1f} | {s / gemm3_s:.2f}x | {peak / 2**30:.2f} | {rows[-1]['loss_rel_diff']:.1e} |",
              flush=True)
    out = args.out or os.path.join("benchmarks", "results",
                                   "chunked_loss_" + re.sub(r"[^a-z0-9]+", "_", dev.lower()).strip("_") + ".json")
    with open(out, "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "command": " ".join(sys.argv),
                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   "tokens": n, "hidden": d, "vocab": v, "three_matmuls_s": gemm3_s, "rows": rows}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
