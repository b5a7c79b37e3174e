"""Time flame's Triton attention kernels (fwd, bwd dK/dV, bwd dQ) one by one over launch configs.

    python benchmarks/attention_tiles.py [--B 4 --T 4096 --H 16 --D 128] [--modes softmax,softpick,rectified]
        [--jobs 12] [--out DIR]

Every (kernel, mode, tile) is compiled first in ``--jobs`` worker processes (``JITFunction.warmup``
into the shared Triton cache), then timed in this process with ``triton.testing.do_bench``.
Prints ms and TFLOP/s per kernel and tile (fwd = 4*H*D*causal pairs; the backward's 2.5x fwd split
as 4/7 for dK/dV and 3/7 for dQ, by their matmuls) and writes attention_tiles_<device>.json.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FWD = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3),
       (128, 32, 8, 3), (64, 32, 4, 3)]
BWD_DKDV = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 2), (128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 4, 3),
            (128, 16, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 2), (64, 32, 8, 3), (64, 64, 8, 2)]
BWD_DQ = [(128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 4, 3), (128, 128, 8, 2), (128, 64, 4, 3),
          (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 3), (128, 16, 8, 3)]


def _setup(B, T, H, D, small=False):
    import torch

    n = 64 if small else T
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, n, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o = torch.empty_like(q)
    lse = torch.empty(H, B * n, device="cuda", dtype=torch.float32)
    delta = torch.empty(H, B * n, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cu = torch.empty(1, device="cuda", dtype=torch.int32)
    return dict(q=q, k=k, v=v, do=do, o=o, lse=lse, delta=delta, dq=dq, dk=dk, dv=dv, cu=cu)


def _launcher(t, kernel, mode_id, cfg, B, T, H, D, warm=False):
    from flame.ops.attention import kernels as K
    from flame.ops.attention.parallel import LOG2E
    from flame.ops.attention.utils import cdiv, next_pow2

    outer, inner, nw, ns = cfg
    bd = max(16, next_pow2(D))
    scale = D ** -0.5
    common = dict(D=D, BD=bd, MODE=mode_id, IS_VARLEN=False, PREC="tf32", num_warps=nw, num_stages=ns)
    if kernel == "fwd":
        fn, grid = K.attn_fwd_kernel, (cdiv(T, outer), H, B)
        args = (t["q"], t["k"], t["v"], t["o"], t["lse"], t["cu"], scale * LOG2E, 1e-6, T, B * T, H, H)
        kw = dict(BM=outer, BN=inner, **common)
    elif kernel == "dkdv":
        fn, grid = K.attn_bwd_dkdv_kernel, (cdiv(T, outer), H, B)
        args = (t["q"], t["k"], t["v"], t["do"], t["lse"], t["delta"], t["dk"], t["dv"], t["cu"], scale * LOG2E,
                scale, T, B * T, H, H)
        kw = dict(BN=outer, BM=inner, RAW_SIGN=True, **common)
    else:
        fn, grid = K.attn_bwd_dq_kernel, (cdiv(T, outer), H, B)
        args = (t["q"], t["k"], t["v"], t["do"], t["lse"], t["delta"], t["dq"], t["cu"], scale * LOG2E, scale, T, B * T, H, H)
        kw = dict(BM=outer, BN=inner, RAW_SIGN=True, **common)
    if warm:
        return lambda: fn.warmup(*args, grid=grid, **kw)
    return lambda: fn[grid](*args, **kw)


def _compile(jobs, B, T, H, D):
    t = _setup(B, T, H, D, small=True)
    out = []
    for kernel, mode_id, cfg in jobs:
        try:
            _launcher(t, kernel, mode_id, cfg, B, T, H, D, warm=True)()
            out.append(None)
        except Exception as e:  # e.g. out of shared memory
            out.append(f"{type(e).__name__}: {str(e)[:120]}")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, default=16)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--modes", default="softmax,softpick,rectified")
    p.add_argument("--jobs", type=int, default=12)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = p.parse_args()
    import torch
    from triton.testing import do_bench

    from flame.ops.attention import kernels as K
    from flame.ops.attention.utils import check_mode

    B, T, H, D = args.B, args.T, args.H, args.D
    jobs = [(kern, check_mode(m), cfg) for m in args.modes.split(",")
            for kern, cfgs in (("fwd", FWD), ("dkdv", BWD_DKDV), ("dq", BWD_DQ)) for cfg in cfgs]
    errors = {}
    if args.jobs > 1:
        chunks = [jobs[i::args.jobs] for i in range(args.jobs)]
        ctx = __import__("multiprocessing").get_context("spawn")
        with cf.ProcessPoolExecutor(args.jobs, mp_context=ctx) as ex:
            for chunk, res in zip(chunks, ex.map(_compile, chunks, *[[x] * len(chunks) for x in (B, T, H, D)])):
                errors.update({j: e for j, e in zip(chunk, res) if e})
    print(f"compiled {len(jobs)} variants, {len(errors)} failed", flush=True)

    t = _setup(B, T, H, D)
    fwd_flops = 4 * H * D * B * T * (T + 1) / 2
    flops = {"fwd": fwd_flops, "dkdv": fwd_flops * 2.5 * 4 / 7, "dq": fwd_flops * 2.5 * 3 / 7}
    rows = []
    for mode in args.modes.split(","):
        mode_id = check_mode(mode)
        # o, lse and delta of this mode (default tiles) for the backward kernels
        _launcher(t, "fwd", mode_id, FWD[0], B, T, H, D)()
        n = B * T * H
        K.bwd_delta_kernel[(n // 64,)](t["o"], t["do"], t["delta"], n, B * T, H, D=D, BD=D, BR=64, num_warps=4)
        for kern, cfgs in (("fwd", FWD), ("dkdv", BWD_DKDV), ("dq", BWD_DQ)):
            for cfg in cfgs:
                r = dict(mode=mode, kernel=kern, tile=list(cfg))
                if (kern, mode_id, cfg) in errors:
                    r["error"] = errors[(kern, mode_id, cfg)]
                else:
                    try:
                        ms = do_bench(_launcher(t, kern, mode_id, cfg, B, T, H, D), warmup=5, rep=25)
                        r.update(ms=ms, tflops=flops[kern] / ms / 1e9)
                    except Exception as e:
                        r["error"] = f"{type(e).__name__}: {str(e)[:120]}"
                rows.append(r)
                print(f"{mode:<10} {kern:<5} {str(cfg):<18} " +
                      (f"{r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s" if "ms" in r else r["error"]), flush=True)
    best = {}
    for r in rows:
        key = (r["mode"], r["kernel"])
        if "ms" in r and (key not in best or r["ms"] < best[key]["ms"]):
            best[key] = r
    print("best:")
    for (mode, kern), r in best.items():
        print(f"  {mode:<10} {kern:<5} {tuple(r['tile'])} {r['ms']:.3f} ms")
    delta_ms = do_bench(lambda: K.bwd_delta_kernel[(n // 64,)](t["o"], t["do"], t["delta"], n, B * T, H, D=D, BD=D, BR=64,
                                                                num_warps=4), warmup=5, rep=25)
    print(f"delta kernel {delta_ms:.4f} ms; torch (do.float()*o.float()).sum(-1): "
          f"{do_bench(lambda: (t['do'].float() * t['o'].float()).sum(-1), warmup=5, rep=25):.4f} ms")
    import triton

    device = torch.cuda.get_device_name()
    tag = re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_").lower()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"attention_tiles_{tag}.json")
    with open(path, "w") as f:
        json.dump(dict(device=device, triton=triton.__version__, torch=torch.__version__,
                       shape=dict(B=B, T=T, H=H, D=D, dtype="bfloat16", causal=True), delta_ms=delta_ms,
                       rows=rows), f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
