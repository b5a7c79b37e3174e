"""Tokens/s of flame's data pipeline (read + tokenize + pack) on CPU.

    python benchmarks/data_throughput.py                  # bundled corpus, workers 0,1,2,4,8
    python benchmarks/data_throughput.py --seconds 20 --workers 0,4

Measures, for online tokenization of text and for a pre-tokenized token folder, the steady-state
rate at which the loader hands out batches (after the first batch, so worker start-up is reported
separately), with ``num_workers`` = 0 (main process: the per-worker rate), 1, 2, 4, 8. Prints a
table and writes ``benchmarks/results/data_throughput_cpu.json``.

Reference consumption: a 340M-parameter model needs about 6 * 340e6 FLOPs per token for
forward + backward (attention adds a few percent at 2k context). One H100 (989 TFLOP/s dense bf16)
at 20-40 % MFU therefore consumes roughly 100k-200k tokens/s; measured FLA runs of this size are
typically in the tens of thousands to ~100k tokens/s per GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# One tokenizer thread everywhere: workers=0 then measures what one worker process does (forked
# workers run single-threaded anyway), instead of the Rust tokenizer spreading over all cores.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

H100_FLOPS = 989e12
PARAMS_340M = 340e6


def consumption(mfu: float) -> float:
    return mfu * H100_FLOPS / (6 * PARAMS_340M)


def measure(loader, seconds: float, tokens_per_batch: int) -> dict:
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    startup = time.perf_counter() - t0
    n = 0
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        next(it)
        n += 1
    dt = time.perf_counter() - t1
    # Stop this loader's workers before the next measurement, or they compete for the cores.
    it.close()
    inner = getattr(loader, "_iterator", None)
    if inner is not None and hasattr(inner, "_shutdown_workers"):
        inner._shutdown_workers()
    loader._iterator = None
    gc.collect()
    time.sleep(0.5)
    return {"startup_s": round(startup, 2), "batches": n, "seconds": round(dt, 2),
            "tokens_per_s": round(n * tokens_per_batch / dt)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(REPO / "flame" / "assets" / "sample_corpus"))
    ap.add_argument("--tokenizer", default=str(REPO / "flame" / "assets" / "tokenizer"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--workers", default="0,1,2,4,8")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--varlen", action="store_true", help="also build cu_seqlens/position_ids (context 2048)")
    ap.add_argument("--output", default=str(REPO / "benchmarks" / "results" / "data_throughput_cpu.json"))
    args = ap.parse_args()

    from flame.data import build_dataloader_from_options, load_tokenizer, options_for_test
    from flame.utils.preprocess import parse_args, preprocess

    tok = load_tokenizer(args.tokenizer)
    tmp = tempfile.mkdtemp(prefix="flame-bench-")
    token_dir = os.path.join(tmp, "tokens")
    t0 = time.perf_counter()
    meta = preprocess(parse_args(["--dataset", args.dataset, "--tokenizer", args.tokenizer, "--output", token_dir]))
    preprocess_s = time.perf_counter() - t0
    tokens_per_batch = args.batch_size * args.seq_len
    rows = []
    for mode, dataset in (("text (online tokenization)", args.dataset), ("pre-tokenized folder", token_dir)):
        for w in [int(x) for x in args.workers.split(",")]:
            opts = options_for_test(dataset=dataset, batch_size=args.batch_size, seq_len=args.seq_len,
                                    varlen=args.varlen, context_len=args.seq_len, num_workers=w,
                                    prefetch_factor=4 if w else None, seed=0)
            r = measure(build_dataloader_from_options(opts, tok), args.seconds, tokens_per_batch)
            r.update(mode=mode, num_workers=w)
            rows.append(r)
            print(f"{mode:28s} workers={w}: {r['tokens_per_s']:>10,} tokens/s  (start-up {r['startup_s']} s)",
                  flush=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "tokenizers_parallelism": os.environ["TOKENIZERS_PARALLELISM"], "platform": platform.platform(), "python": platform.python_version()},
        "config": {"seq_len": args.seq_len, "batch_size": args.batch_size, "varlen": args.varlen,
                   "dataset": os.path.relpath(args.dataset, REPO), "tokenizer": "bundled 8k byte-level BPE",
                   "seconds_per_point": args.seconds},
        "preprocess": {"documents": meta["num_docs"], "tokens": meta["num_tokens"], "seconds": round(preprocess_s, 2),
                       "tokens_per_s": round(meta["num_tokens"] / preprocess_s)},
        "results": rows,
        "reference_340m_h100_tokens_per_s": {"mfu_20pct": round(consumption(0.2)), "mfu_40pct": round(consumption(0.4))},
    }
    print()
    print(f"{'mode':28s} {'workers':>7s} {'tokens/s':>12s} {'x 340M@H100 (40% MFU)':>22s}")
    for r in rows:
        print(f"{r['mode']:28s} {r['num_workers']:>7d} {r['tokens_per_s']:>12,} "
              f"{r['tokens_per_s'] / consumption(0.4):>22.1f}")
    print(f"\npreprocess (1 process): {result['preprocess']['tokens_per_s']:,} tokens/s; "
          f"340M on one H100 consumes ~{consumption(0.2):,.0f}-{consumption(0.4):,.0f} tokens/s (20-40 % MFU)")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
