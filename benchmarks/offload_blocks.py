"""Per-block forward timing of one engine row of `benchmarks/offload_engine.py` (writes JSON, prints per
block): the plan a result JSON stored for the row is rebuilt, three steps warm the engine up, and
one steady step records a CUDA event and the host clock at every block's forward pre-hook (and at
the start and end of each round's forward: the last interval is the last block, the head and the
loss). GPU intervals longer than the block timed alone point at the engine; host intervals equal
to the GPU's mean the forward is paced by the host (the CPU AdamW in round 0). The engine's CPU
worker jobs (accumulations, AdamW steps) of the last warm-up step and the timed one are traced on the
host clock next to the host's step marks.
Usage: python benchmarks/offload_blocks.py RESULT.json OUT.json [--row b_8B_bf16_24GiB_32k]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import offload_engine as bench  # noqa: E402  (benchmarks/offload_engine.py: model shapes and the loss)
from offload_predict import ROW_OF, plan_of_row  # noqa: E402

from flame.offload import optimizer_threads  # noqa: E402
from flame.offload.runtime.engine import OffloadEngine  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result", help="a benchmarks/offload_engine.py result JSON holding the row's plan")
    ap.add_argument("out")
    ap.add_argument("--row", default="b_8B_bf16_24GiB_32k")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    with open(args.result) as f:
        res = json.load(f)
    pl = res[args.row]["plan"]
    size, dt, seq = ROW_OF[args.row]
    mb, rounds = pl["micro_batch"], pl["rounds"]
    plan = plan_of_row(pl, dt, seq, mb, rounds, optimizer_threads(len(os.sched_getaffinity(0)), 1))
    bench.LOSS_CHUNK["tokens"] = res.get("loss_chunk_tokens", 0)
    cfg = bench.llama(size)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dt.compute))
    bench.prepare_loss(model)
    eng = OffloadEngine(model, plan, torch.device("cuda"), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (mb, seq), device="cuda")
    marks, state = [], {"phase": None}

    def mark(label):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((state["phase"], label, e, time.perf_counter()))

    def pre_hook(i):
        def hook(mod, args):
            if state["phase"] is not None:  # not during the backward's recompute
                mark(i)
        return hook

    for i, block in enumerate(model.model.layers):
        block.register_forward_pre_hook(pre_hook(i))

    def step(timed: bool):
        for r in range(rounds):
            state["phase"] = f"forward {r}" if timed else None
            if timed:
                mark("start")
            loss = bench.loss_of(model, ids) / rounds
            if timed:
                mark("end")
            state["phase"] = None
            host_marks.append((f"backward {r}", time.perf_counter()))
            loss.backward()
        host_marks.append(("optimizer_step", time.perf_counter()))
        eng.optimizer_step(1.0, True)
        host_marks.append(("optimizer_step returned", time.perf_counter()))

    host_marks = []
    for k in range(3):
        if k == 2:  # the CPU worker's jobs from here: the timed forward waits on this step's AdamW
            eng.worker.trace, host_marks = [], []
        step(False)
    step(True)
    eng.synchronize()
    t0 = host_marks[0][1]
    out_trace = [(kind, idx, 1e3 * (a - t0), 1e3 * (b - t0)) for kind, idx, a, b in eng.worker.trace]
    out_marks = [(lab, 1e3 * (t - t0)) for lab, t in host_marks]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "row": args.row, "phases": {}}
    for r in range(rounds):
        m = [x for x in marks if x[0] == f"forward {r}"]
        gpu = [a[2].elapsed_time(b[2]) for a, b in zip(m, m[1:])]
        host = [1e3 * (b[3] - a[3]) for a, b in zip(m, m[1:])]
        labels = [f"{a[1]}->{b[1]}" for a, b in zip(m, m[1:])]
        out["phases"][f"forward {r}"] = {"interval": labels, "gpu_ms": gpu, "host_ms": host}
        print(f"forward {r}: GPU {sum(gpu):.1f} ms, host {sum(host):.1f} ms")
        print("| interval | GPU ms | host ms |\n|---|---|---|")
        for lab, g, h in zip(labels, gpu, host):
            print(f"| {lab} | {g:.1f} | {h:.1f} |")
    # the CPU worker's jobs and the host's step marks, ms from the last warm-up step's first backward
    out["cpu_trace"], out["host_marks"] = out_trace, out_marks
    out["forward_marks_host_ms"] = [(ph, lab, 1e3 * (t - t0)) for ph, lab, _, t in marks]
    for lab, t in out_marks:
        print(f"{t:9.1f} ms  host: {lab}")
    for kind in sorted({k for k, *_ in out_trace}):
        jobs = [x for x in out_trace if x[0] == kind]
        print(f"{kind}: {len(jobs)} jobs, {sum(b - a for _, _, a, b in jobs):.1f} ms busy, "
              f"{jobs[0][2]:.1f} .. {jobs[-1][3]:.1f} ms")
    out["host_seconds_4_steps"] = dict(eng.reset_host_seconds())
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    eng.close()


if __name__ == "__main__":
    main()
