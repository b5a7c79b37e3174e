"""Where one training step's GPU time goes, for acceptance rows run through ``bash train.sh``.

Each row of ``benchmarks/acceptance.py`` runs as it does there, with torchtitan's profiler on for
one step near the end (``--profiling.*``); the step's Chrome trace is summarized: GPU kernel time
by category (GEMMs, attention kernels, inductor's fused kernels, copies, collectives), the top
kernels by time, and how much of the step the GPU was idle. A profiled step runs slower than an
unprofiled one: this finds causes, its tokens/s are no measurement.

usage:
    python benchmarks/step_profile.py OUT.json --rows paper_softpick,paper_sdpa [--steps 6] [--parallel N]
    python benchmarks/step_profile.py --summarize TRACE.json     # one trace file's summary
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import glob
import gzip
import json
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import acceptance  # noqa: E402

# first match wins; names are the kernels' names as CUPTI reports them
CATEGORIES = [
    ("flame_attention", r"attn_fwd_kernel|attn_bwd_dkdv_kernel|attn_bwd_dq_kernel|bwd_delta_kernel"),
    ("flash_or_cudnn_attention", r"flash|fmha|cudnn|sdpa"),
    ("flex_attention", r"triton_tem_fused"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|cublas|sm90_|sm80_"),
    ("collective", r"nccl"),
    ("inductor_fused", r"^triton_"),
    ("copy_or_fill", r"Memcpy|Memset|copy|fill|elementwise_kernel|vectorized_elementwise"),
]


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def summarize(trace: dict, top: int = 30) -> dict:
    """GPU time of the profiled step: kernels (and copies, fills) by category and by name, the
    step's wall time (the ``ProfilerStep#N`` span) and the GPU's busy share of it."""
    events = trace.get("traceEvents", [])
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_cat: dict[str, float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0, 0.0])
    spans = []
    for e in gpu:
        dur = float(e.get("dur", 0.0))
        name = str(e.get("name", ""))
        by_cat[category(name)] += dur
        by_name[name][0] += 1
        by_name[name][1] += dur
        spans.append((float(e["ts"]), float(e["ts"]) + dur))
    busy = 0.0
    end = float("-inf")
    for a, b in sorted(spans):  # union of the GPU's busy intervals (streams may overlap)
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    step_us = max((float(e.get("dur", 0.0)) for e in steps), default=0.0)
    if spans:
        gpu_span_us = max(b for _, b in spans) - min(a for a, _ in spans)
    else:
        gpu_span_us = 0.0
    total = sum(by_cat.values())
    names = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {
        "step_wall_ms": round(step_us / 1e3, 2),
        "gpu_span_ms": round(gpu_span_us / 1e3, 2),
        "gpu_busy_ms": round(busy / 1e3, 2),
        "gpu_kernel_sum_ms": round(total / 1e3, 2),
        "by_category_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "calls": c, "ms": round(t / 1e3, 3), "category": category(n)}
                        for n, (c, t) in names],
    }


def profiled(row: acceptance.Row, steps: int) -> acceptance.Row:
    """The row with torchtitan's profiler tracing step ``steps - 1`` (one warmup step before it)."""
    extra = ["--profiling.enable_profiling", "--profiling.profile_freq", str(steps - 1),
             "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1"]
    args = [a for a in row.args]
    i = args.index("--training.steps")
    args[i + 1] = str(steps)
    return dataclasses.replace(row, args=args + extra, steps=steps, seed="")


def run_one(row: acceptance.Row, runs: str, steps: int, gpu) -> dict:
    res = acceptance.run_row(profiled(row, steps), runs, row.cap_s, gpu)
    traces = sorted(glob.glob(os.path.join(res["dump"], "profile_trace*", "iteration_*", "rank0_trace.json*")))
    out = {"row": row.name, "exit": res["exit"], "command": res["command"],
           "tokens_per_second_profiled_run": res["tokens_per_second"]}
    if traces:
        out["trace"] = traces[-1]
        out.update(summarize(load_trace(traces[-1])))
    elif res["exit"] != 0:
        out["error_tail"] = res.get("error_tail")
    return out


def print_summary(s: dict, label: str = "") -> None:
    label = s.get("row") or label
    print(f"{label}: step {s.get('step_wall_ms')} ms, GPU busy {s.get('gpu_busy_ms')} ms "
          f"(kernel sum {s.get('gpu_kernel_sum_ms')} ms)")
    if not s.get("by_category_ms"):
        print("  no GPU kernels in this trace (a CPU run's trace, or the GPU was not profiled)")
    for k, v in s.get("by_category_ms", {}).items():
        print(f"  {k:28s} {v:10.2f} ms")
    for k in s.get("top_kernels", [])[:15]:
        print(f"    {k['ms']:9.3f} ms  x{k['calls']:<5d} {k['category']:24s} {k['name'][:90]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--rows", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--summarize", metavar="TRACE")
    a = ap.parse_args()
    if a.summarize:
        try:
            trace = load_trace(a.summarize)
        except (OSError, ValueError) as e:
            print(f"step_profile: error: {a.summarize}: {e.strerror if isinstance(e, OSError) else e}", file=sys.stderr)
            return 2
        if not isinstance(trace, dict) or "traceEvents" not in trace:
            print(f"step_profile: error: {a.summarize}: not a profiler trace (no traceEvents)", file=sys.stderr)
            return 2
        print_summary(summarize(trace), a.summarize)
        return 0
    if not a.out or not a.rows:
        ap.error("OUT.json and --rows are required")
    if a.steps < 3:
        ap.error("--steps must be at least 3 (one step to wait, one to warm up, one traced)")
    rows = {r.name: r for r in acceptance.all_rows(a.steps)}
    names = [n for n in a.rows.split(",") if n]
    unknown = [n for n in names if n not in rows]
    if unknown:
        ap.error(f"unknown rows: {', '.join(unknown)}")
    runs = os.path.join(os.environ.get("TMPDIR", "/tmp"), "flame_step_profile")
    os.makedirs(runs, exist_ok=True)
    slots, _ = acceptance.gpu_slots(a.parallel)
    with concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
        futs = [pool.submit(run_one, rows[n], runs, a.steps, slots[i % a.parallel]) for i, n in enumerate(names)]
        results = [f.result() for f in futs]
    doc = {"device": acceptance.device_info(), "versions": acceptance.versions(), "commit": acceptance.commit(),
           "steps": a.steps, "rows": results}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    for r in results:
        print_summary(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
