"""Benchmark flame's attention kernels against torch SDPA (causal, bf16): TFLOP/s for fwd, bwd, fwd+bwd.

    python benchmarks/attention.py [--B 4 --T 4096 --H 16 --HK 16 --D 128] [--out benchmarks/results]

FLOPs: causal forward = 2 * 2 * B * H * T^2 * D / 2, backward = 2.5 x forward (FlashAttention
convention, the same count for every kernel). Writes benchmarks/results/attention_<device>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def cases(args):
    from flame.models.attention import attention, get_backend
    from flame.ops.attention import parallel_attention

    def sdpa(q, k, v, cu):
        return attention(q, k, v, get_backend("sdpa"), cu_seqlens=cu)[0]

    def flex(q, k, v, cu):
        return attention(q, k, v, get_backend("flex"), cu_seqlens=cu)[0]

    def fla(q, k, v, cu):
        return attention(q, k, v, get_backend("fla"), cu_seqlens=cu)[0]

    def mk(mode):
        return lambda q, k, v, cu: parallel_attention(q, k, v, mode, cu_seqlens=cu)

    return [
        ("sdpa (softmax)", sdpa),
        ("flex (softmax)", flex),
        ("fla parallel_attn (softmax)", fla),
        ("flame triton softmax", mk("softmax")),
        ("flame triton softpick", mk("softpick")),
        ("flame triton rectified", mk("rectified")),
    ]


def run(args):
    B, T, H, HK, D = args.B, args.T, args.H, args.HK, args.D
    rows = []
    for varlen in [x == "varlen" for x in args.layouts.split(",")]:
        if varlen:
            # B*T tokens as documents of uneven lengths (flattened, batch 1)
            total = B * T
            lens, pos, rng = [], 0, torch.Generator().manual_seed(0)
            while pos < total:
                n = min(int(torch.randint(T // 8, 2 * T, (1,), generator=rng)), total - pos)
                lens.append(n)
                pos += n
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
            shape_b, shape_t = 1, total
            causal_pairs = sum(n * (n + 1) / 2 for n in lens)
        else:
            cu, shape_b, shape_t = None, B, T
            causal_pairs = B * T * (T + 1) / 2
        fwd_flops = 4 * H * causal_pairs * D
        q = torch.randn(shape_b, shape_t, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        k = torch.randn(shape_b, shape_t, HK, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        v = torch.randn(shape_b, shape_t, HK, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
        do = torch.randn_like(q)
        for name, fn in cases(args):
            if args.only and not any(t in name for t in args.only.split(",")):
                continue
            try:
                o = fn(q, k, v, cu)
                o.backward(do)  # compile / tune outside the timing
                t_f = bench_ms(lambda: fn(q, k, v, cu))
                t_fb = bench_ms(lambda: fn(q, k, v, cu).backward(do))
                t_b = max(t_fb - t_f, 1e-6)
                rows.append(dict(kernel=name, varlen=varlen, fwd_ms=t_f, bwd_ms=t_b, fwd_bwd_ms=t_fb,
                                 fwd_tflops=fwd_flops / t_f / 1e9, bwd_tflops=2.5 * fwd_flops / t_b / 1e9,
                                 fwd_bwd_tflops=3.5 * fwd_flops / t_fb / 1e9))
            except Exception as e:  # report, keep going
                rows.append(dict(kernel=name, varlen=varlen, error=f"{type(e).__name__}: {str(e)[:200]}"))
            q.grad = k.grad = v.grad = None
            print(_fmt(rows[-1]), flush=True)
    return rows


def _fmt(r):
    if "error" in r:
        return f"{r['kernel']:<30} {'varlen' if r['varlen'] else 'dense':<7} ERROR {r['error']}"
    return (f"{r['kernel']:<30} {'varlen' if r['varlen'] else 'dense':<7} "
            f"{r['fwd_tflops']:8.1f} {r['bwd_tflops']:8.1f} {r['fwd_bwd_tflops']:8.1f}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--HK", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--layouts", default="dense,varlen", help="comma list of dense,varlen")
    p.add_argument("--only", default="", help="comma list of substrings of kernel names to run")
    p.add_argument("--tag", default="", help="suffix of the JSON file name")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA device")
    print(f"{'kernel':<30} {'layout':<7} {'fwd':>8} {'bwd':>8} {'fwd+bwd':>8}   (TFLOP/s, bf16, causal, "
          f"B={args.B} T={args.T} H={args.H} HK={args.HK} D={args.D})", flush=True)
    rows = run(args)
    ref = {r["varlen"]: r for r in rows if r["kernel"] == "sdpa (softmax)" and "error" not in r}
    for r in rows:
        if "error" not in r and r["varlen"] in ref:
            r["fwd_bwd_vs_sdpa"] = r["fwd_bwd_tflops"] / ref[r["varlen"]]["fwd_bwd_tflops"]
    import triton

    device = torch.cuda.get_device_name()
    result = dict(
        device=device, torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        command=" ".join([os.path.basename(sys.executable)] + sys.argv),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        shape=dict(B=args.B, T=args.T, H=args.H, HK=args.HK, D=args.D, dtype="bfloat16", causal=True),
        flops_convention="fwd = 4*H*D*sum(causal pairs); bwd = 2.5*fwd",
        results=rows,
        tuned_tiles=__import__("flame.ops.attention.parallel", fromlist=["tuned_configs"]).tuned_configs(),
    )
    os.makedirs(args.out, exist_ok=True)
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_").lower()
    path = os.path.join(args.out, f"attention_{tag}{args.tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print("ratios fwd+bwd vs sdpa:", {f"{r['kernel']}/{'varlen' if r['varlen'] else 'dense'}":
                                     round(r.get("fwd_bwd_vs_sdpa", float("nan")), 3) for r in rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
