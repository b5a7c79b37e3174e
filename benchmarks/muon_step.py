"""One optimizer step of flame's MuonWithAdamW against AdamW on a model's parameters (writes JSON +
prints a table).

The model is built from its JSON config with flame's builder, directly on the device (CUDA when
present, else CPU), and every parameter gets a random gradient; the optimizers are the ones
``--optimizer.name AdamW`` and ``--optimizer.name Muon`` build in training (default options). Rows:
the whole step of each, and Muon's part alone next to torch.optim.Muon over the same matrices (one
matrix at a time, the formula flame's batched step reproduces). ``--adamw_tokens_per_s`` (a
training run's AdamW rate) with ``--tokens_per_step`` projects Muon's tokens/s overhead from the
extra step time.
Usage: python benchmarks/muon_step.py OUT.json [--config configs/transformer_340M.json] [--iters 10]
CPU smoke check: python benchmarks/muon_step.py /tmp/muon_step.json --config configs/debug/transformer_tiny.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from flame.components.muon import MUON_GROUP, hidden_matrices  # noqa: E402
from flame.components.optimizer import build_optimizers  # noqa: E402
from flame.config.manager import FlameConfigManager  # noqa: E402
from flame.models import build as model_build  # noqa: E402
from flame.offload.measure.timer import seconds_per_call  # noqa: E402


def optimizer_config(name: str):
    return FlameConfigManager().parse_args(["--optimizer.name", name]).optimizer


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/transformer_340M.json", help="the model's JSON config")
    ap.add_argument("--iters", type=int, default=10, help="timed steps per row (after one warm-up step)")
    ap.add_argument("--warm_s", type=float, default=1.0, help="seconds of steps before timing (GPU clocks)")
    ap.add_argument("--adamw_tokens_per_s", type=float, default=None, help="a training run's AdamW tokens/s")
    ap.add_argument("--tokens_per_step", type=int, default=8 * 4096, help="that run's tokens per step")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the timer's clock follows CUDA

    model = model_build.build_meta_model(model_build.load_model_config(args.config))
    model.to_empty(device=device)
    model_build.init_weights(model, seed=0)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    hidden = [p for p in params if id(p) in hidden_matrices(model)]
    shapes = dict(Counter("x".join(map(str, p.shape)) for p in hidden))

    def per_step_ms(opt) -> float:
        return seconds_per_call(opt.step, iters=args.iters, warm_s=args.warm_s) * 1e3

    rows = {}
    opt = build_optimizers([model], optimizer_config("AdamW"), device)
    rows["adamw"] = per_step_ms(opt)
    del opt
    opt = build_optimizers([model], optimizer_config("Muon"), device)
    rows["muon_with_adamw"] = per_step_ms(opt)
    muon = opt.optimizers[0].muon
    rows["muon_part"] = per_step_ms(muon)
    group = next(g for g in muon.param_groups if g[MUON_GROUP])
    del opt, muon
    torch_muon = torch.optim.Muon(hidden, lr=group["lr"], weight_decay=group["weight_decay"],
                                  momentum=group["momentum"], adjust_lr_fn=group["adjust_lr_fn"])
    rows["torch_muon_per_matrix"] = per_step_ms(torch_muon)

    extra_ms = rows["muon_with_adamw"] - rows["adamw"]
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "config": args.config, "parameters": sum(p.numel() for p in params),
           "muon_matrices": len(hidden), "muon_shapes": shapes, "iters": args.iters,
           "per_step_ms": rows, "ratio_muon_to_adamw": rows["muon_with_adamw"] / rows["adamw"],
           "extra_ms_per_step": extra_ms,
           "muon_part_speedup_over_torch_per_matrix": rows["torch_muon_per_matrix"] / rows["muon_part"]}
    if args.adamw_tokens_per_s:
        step_ms = args.tokens_per_step / args.adamw_tokens_per_s * 1e3
        res["projected_tokens_per_s_overhead"] = extra_ms / (step_ms + extra_ms)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{res['device']}, torch {res['torch']}, {args.config}: {len(hidden)} Muon matrices {shapes}")
    print("| step | ms |\n|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} |")
    print(f"Muon+AdamW / AdamW: {res['ratio_muon_to_adamw']:.2f} (+{extra_ms:.2f} ms); torch.optim.Muon per matrix / "
          f"flame's Muon part: {res['muon_part_speedup_over_torch_per_matrix']:.2f}")
    if "projected_tokens_per_s_overhead" in res:
        print(f"projected tokens/s overhead: {res['projected_tokens_per_s_overhead']:.1%}")


if __name__ == "__main__":
    main()
