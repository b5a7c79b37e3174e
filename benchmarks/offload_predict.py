"""Planner-only sweep (no GPU): the offload benchmark's runs at several `training.loss_chunk_tokens`.

Costs are measured on the meta device, the hardware profile is the one stored in a benchmark
result JSON (default: the H100 run 4), and `solve` picks the plan exactly as benchmarks/offload_engine.py
does (the micro-batch chosen among the divisors of the step's sequences; block calibration factor 1). Prints a table and writes JSON. These are predictions of the
cost model, not measurements: benchmarks/offload_engine.py --loss_chunk_tokens N measures them.

Usage: python benchmarks/offload_predict.py [--result benchmarks/results/offload_h100_run4.json]
       [--chunks 0,4096,2048,1024] [--out benchmarks/results/offload_predicted_loss_chunks.json]
       python benchmarks/offload_predict.py --replay RESULT.json [--out OUT.json]

--replay: the plans a benchmark run executed, predicted again by the current cost model with that
run's profile and block-calibration factor, next to what the run measured and what it predicted
then (after-the-fact: this checks a cost-model change against measurements already taken).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.offload_engine import A_MB, A_SEQ, llama  # noqa: E402
from flame.offload import optimizer_threads  # noqa: E402
from flame.offload.measure.tracing import model_costs  # noqa: E402
from flame.offload.planner.cost_model import Dtypes  # noqa: E402
from flame.offload.planner.hardware import from_dict  # noqa: E402
from flame.offload.planner.plan import Plan  # noqa: E402
from flame.offload.planner.refit import (cpu_adam_scale, predict_again, use_block_calibration,  # noqa: E402
                                         with_cpu_adam_scale)
from flame.offload.planner.solver import solve_micro_batches  # noqa: E402

GiB = 1024**3
# the engine rows of benchmarks/offload_engine.py: (name, model, dtypes, GPU cap GiB, seq, sequences per step)
BF16 = Dtypes("bfloat16", "bfloat16", "bfloat16", "bfloat16")
ROWS = [
    ("a_offload_16GiB", "3B", Dtypes(), 16, A_SEQ, 8 * A_MB),
    ("a_offload_16GiB_bf16_grads", "3B", Dtypes("bfloat16", "float32", "bfloat16", "float32"), 16, A_SEQ, 8 * A_MB),
    ("b_8B_bf16_24GiB", "8B", BF16, 24, 8192, 1),
    ("b_8B_bf16_24GiB_32k", "8B", BF16, 24, 8192, 4),
]

ROW_OF = {name: (size, dt, seq) for name, size, dt, _, seq, _ in ROWS}
ROW_OF["m_8B_bf16_24GiB"] = ROW_OF["b_8B_bf16_24GiB"]  # row b on every GPU of the machine
for _name in ("o_8B_bf16_40GiB_32k", "o_8B_bf16_40GiB_32k_no_act_offload", "o_8B_bf16_40GiB_32k_recompute_only"):
    ROW_OF[_name] = ROW_OF["b_8B_bf16_24GiB"]


def plan_of_row(pl: dict, dt: Dtypes, seq: int, micro_batch: int, rounds: int, threads: int, world: int = 1) -> Plan:
    """The Plan a benchmarks/offload_engine.py row ran, from the decisions its JSON stored (budgets 0)."""
    return Plan(pl["layer_modes"], pl["layer_acts"], pl["outer"], pl["depth"], micro_batch, seq, rounds, threads,
                dataclasses.asdict(dt), 0, 0, world=world, node_ranks=world, layer_gpu_acc=pl.get("layer_gpu_acc") or [],
                outer_gpu_acc=pl.get("outer_gpu_acc", False))


def replay(result: str) -> list[dict]:
    with open(result) as f:
        res = json.load(f)
    prof = from_dict(res["profile"])
    res_command = res.get("command", "")
    chunk = res.get("loss_chunk_tokens", 0)
    rows = []
    print(f"replay of {result} ({prof.device_name}); current cost model, that run's profile and block factor")
    print("| run | world | measured step s | predicted then | predicted now | now vs measured | "
          "CPU AdamW refit | refit vs measured |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        if name not in ROW_OF or "plan" not in r:
            continue
        size, dt, seq = ROW_OF[name]
        pl = r["plan"]
        if "micro_batch" in pl:
            mb, rounds = pl["micro_batch"], pl["rounds"]
        else:  # results written before the plan dict had them: read the printed plan
            mb, rounds = (int(x) for x in re.search(r"micro-batch (\d+)x\d+, (\d+) round", r["plan_text"]).groups())
            if rounds > 1:
                print(f"| {name} | skipped: {rounds} rounds, and this result does not store which blocks "
                      "accumulated on the GPU |")
                continue
        world = r.get("world", 1)
        costs = model_costs(llama(size), getattr(torch, dt.compute), [mb], seq, loss_chunk_tokens=chunk)[mb]
        threads = optimizer_threads(prof.cpu_cores, world)  # as benchmarks/offload_engine.py
        plan = plan_of_row(pl, dt, seq, mb, rounds, threads, world)
        cal = r["block_calibration"]
        # results from 2026-11-23 on also timed the outer (head + loss) before the run
        fudge = use_block_calibration({mb: costs}, {mb: cal})[mb] if "outer_fwd_s" in cal else cal["fudge"]
        pred_now = predict_again(plan, costs, prof, fudge)
        now = pred_now.step_s
        row = {"run": name, "world": world, "measured_step_s": r["step_s"], "predicted_then_s": r["predicted_step_s"],
               "predicted_now_s": now, "error_now": now / r["step_s"] - 1}
        if r.get("measured_phase_s"):  # one step timed phase by phase (benchmarks/offload_engine.py)
            row.update(measured_phase_s=r["measured_phase_s"], predicted_phase_s_then=r.get("predicted_phase_s"),
                       predicted_phase_s_now=pred_now.phase_s)
        # the calibration's first refit: the CPU AdamW rate the engine measured in the run
        adam_s = (r.get("host_seconds_per_step") or {}).get("cpu_adam")
        if adam_s and "optimizer_updates_timed" not in r:
            # results before 2026-11-23 divided the seconds of steps + 1 AdamW updates (the
            # warm-up's ran inside the window) by the timed steps
            steps = int((re.search(r"--steps (\d+)", res_command) or [0, 3])[1])
            adam_s *= steps / (steps + 1)
        if adam_s:
            scale = cpu_adam_scale(plan, costs, prof, adam_s)
            row.update(cpu_adam_scale=scale, refit_cpu_s=predict_again(plan, costs, with_cpu_adam_scale(prof, scale),
                                                                        fudge).step_s)
            row["error_refit_cpu"] = row["refit_cpu_s"] / r["step_s"] - 1
        rows.append(row)
        refit_txt = (f"{row['refit_cpu_s']:.3f} (rate x{row['cpu_adam_scale']:.2f}) | {100 * row['error_refit_cpu']:+.1f}%"
                     if adam_s else "- | -")
        print(f"| {name} | {world} | {r['step_s']:.3f} | {r['predicted_step_s']:.3f} | {now:.3f} | "
              f"{100 * row['error_now']:+.1f}% | {refit_txt} |", flush=True)
        if "measured_phase_s" in row:
            print(f"|   phases s (fwd, bwd per round; optimizer) | | measured "
                  f"{' '.join(f'{x:.3f}' for x in row['measured_phase_s'])} | predicted now "
                  f"{' '.join(f'{x:.3f}' for x in row['predicted_phase_s_now'])} | | | |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--result", default="benchmarks/results/offload_h100_run4.json",
                    help="a benchmarks/offload_engine.py result JSON whose hardware profile is used")
    ap.add_argument("--chunks", default="0,4096,2048,1024", help="loss chunk sizes in tokens (0: plain loss)")
    ap.add_argument("--out", default="", help="JSON output path (default: print only)")
    ap.add_argument("--replay", default="", help="a benchmarks/offload_engine.py result JSON: predict its plans again")
    args = ap.parse_args()
    if args.replay:
        rows = replay(args.replay)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"kind": "cost-model replay of measured runs", "command": " ".join(sys.argv),
                           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}, f, indent=1)
        return
    with open(args.result) as f:
        prof = from_dict(json.load(f)["profile"])
    host = prof.host_total_bytes - 16 * GiB  # as benchmarks/offload_engine.py
    threads = optimizer_threads(prof.cpu_cores, 1)
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    print(f"profile: {prof.device_name} (from {args.result}); predictions, not measurements")
    print("| run | loss chunk | micro-batch x rounds | predicted step s | vs plain | useful MFU % | peak GPU GiB | "
          "streamed | recomputed | outer |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, size, dt, cap, seq, step_sequences in ROWS:
        base = None
        for chunk in chunks:
            costs_of = model_costs(llama(size), getattr(torch, dt.compute),
                                   [mb for mb in range(1, step_sequences + 1) if step_sequences % mb == 0], seq,
                                   loss_chunk_tokens=chunk)
            plan, _ = solve_micro_batches(costs_of, step_sequences, prof, dt, cap * GiB, host, threads)
            pr = plan.predicted
            base = base or pr["step_s"]
            row = {"run": name, "loss_chunk_tokens": chunk, "micro_batch": plan.micro_batch, "rounds": plan.rounds,
                   "predicted_step_s": pr["step_s"], "speedup_vs_plain": base / pr["step_s"], "mfu": pr["mfu"],
                   "peak_gpu_bytes": pr["peak_gpu_bytes"], "transient_bytes": pr["transient_bytes"],
                   "streamed_blocks": plan.layer_modes.count("stream"),
                   "recomputed_blocks": plan.layer_acts.count("recompute"), "outer": plan.outer_mode}
            rows.append(row)
            print(f"| {name} | {chunk or 'plain'} | {plan.micro_batch} x {plan.rounds} | {pr['step_s']:.3f} | "
                  f"{base / pr['step_s']:.2f}x | {100 * pr['mfu']:.1f} | {pr['peak_gpu_bytes'] / GiB:.2f} | "
                  f"{row['streamed_blocks']} | {row['recomputed_blocks']} | {plan.outer_mode} |", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kind": "cost-model predictions (no GPU run)", "command": " ".join(sys.argv),
                       "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
                       "profile_from": args.result, "profile_device": prof.device_name, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
