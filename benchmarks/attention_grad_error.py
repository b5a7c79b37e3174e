"""Spread of the bf16 kernels' relative gradient error against float64 over fresh random inputs.

    python benchmarks/attention_grad_error.py OUT.json [--shape B,T,HQ,HK,D] [--seeds N]

For each mode and seed: ||x - ref|| / ||ref|| of o, dq, dk, dv (flame's Triton kernel vs the
float64 naive reference on the same bf16 inputs), next to the same error of the naive reference
run in bf16 under autograd (what plain torch code would get). Tells a tolerance that fits the
kernel's precision from a defect that fails at every seed.
"""
import argparse
import datetime
import json

import torch

from flame.ops.attention import naive_attention, parallel_attention


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shape", default="1,333,4,4,64")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--commit", default="")
    a = ap.parse_args()
    B, T, HQ, HK, D = map(int, a.shape.split(","))
    rows = []
    for mode in ("softmax", "softpick", "rectified"):
        for seed in range(a.seeds):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, do = (torch.randn(B, T, h, D, device="cuda", generator=g).bfloat16() for h in (HQ, HK, HQ))
            v = torch.randn(B, T, HK, D, device="cuda", generator=g).bfloat16()
            xs = [x.clone().requires_grad_() for x in (q, k, v)]
            o = parallel_attention(*xs, mode)
            o.backward(do)
            rs = [x.double().requires_grad_() for x in (q, k, v)]
            ro, _ = naive_attention(*rs, mode, return_weights=False)
            ro.backward(do.double())
            errs = [rel(o, ro)] + [rel(x.grad, r.grad) for x, r in zip(xs, rs)]
            bs = [x.clone().requires_grad_() for x in (q, k, v)]
            bo, _ = naive_attention(*bs, mode, return_weights=False)
            bo.backward(do)
            berrs = [rel(bo, ro)] + [rel(x.grad, r.grad) for x, r in zip(bs, rs)]
            rows.append({"mode": mode, "seed": seed, **dict(zip(("o", "dq", "dk", "dv"), errs)),
                         **dict(zip(("bf16_o", "bf16_dq", "bf16_dk", "bf16_dv"), berrs))})
    summary = {}
    for mode in ("softmax", "softpick", "rectified"):
        sel = [r for r in rows if r["mode"] == mode]
        summary[mode] = {k: {"max": max(r[k] for r in sel), "median": sorted(r[k] for r in sel)[len(sel) // 2]}
                         for k in ("o", "dq", "dk", "dv", "bf16_o", "bf16_dq", "bf16_dk", "bf16_dv")}
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shape": a.shape, "commit": a.commit,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "summary": summary, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
