"""Compile (and time) an FLA model's kernels once before a timed run on a fresh GPU machine.

FLA's Triton/tilelang kernels are JIT-compiled on first use (minutes for a GLA/GatedDeltaNet
model on a cold machine); torchrun jobs started afterwards reuse the on-disk kernel caches.
Usage: python benchmarks/fla_warmup.py configs/gla_340M.json --batch 4 --seq 2048 [--steps 3]
Prints the time of each fwd+bwd step; with --stacks FILE dumps all thread stacks to FILE every
60 s (to see where a slow first step spends its time).
"""

import argparse
import faulthandler
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stacks", default=None)
    a = ap.parse_args()
    if a.stacks:
        faulthandler.dump_traceback_later(60, repeat=True, file=open(a.stacks, "w"))
    import flame  # noqa: F401  (registers FLA and flame models)
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(a.config)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
    for i in range(a.steps):
        t = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.cuda.synchronize()
        print(f"step {i}: {time.perf_counter() - t:.1f} s, loss {out.loss.item():.3f}", flush=True)


if __name__ == "__main__":
    main()
