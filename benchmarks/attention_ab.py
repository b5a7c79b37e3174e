"""A/B of flame's attention kernels against an earlier kernels.py, kernel by kernel, at the 340M paper shape.

    git show 838ada9~2:flame/ops/attention/kernels.py > /tmp/kernels_old.py
    python benchmarks/attention_ab.py /tmp/kernels_old.py OUT.json

The earlier file is the one from before the statistics (base-2 log denominators, dO.O) became
head-major ([HQ, tokens]; before, [tokens, HQ]). Both run with the shipped tiles of this GPU on the
same inputs (16 x 4096 x 16 heads of 64, bf16, dense and varlen); per mode it writes each kernel's
ms (forward, delta, dK/dV, dQ), the relative difference of the outputs and gradients, and, dense
only, the tree's kernels over every candidate tile.
"""
import importlib.util, json, os, sys
import torch
from triton.testing import do_bench
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flame.ops.attention import kernels as NEW
from flame.ops.attention.parallel import LOG2E
from flame.ops.attention import tiles as TL
from flame.ops.attention.tune import varlen_offsets
spec = importlib.util.spec_from_file_location("kernels_old", sys.argv[1])
OLD = importlib.util.module_from_spec(spec); spec.loader.exec_module(OLD)

B, T, H, D = 16, 4096, 16, 64
scale = D ** -0.5
dev = torch.cuda.get_device_name()
shipped = TL.shipped_tiles(dev)
out = {"device": dev, "rows": []}
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
N = B * T
def cdiv(a, b): return (a + b - 1) // b

def launchers(K, head_major, mode_id, tf, tkv, tq, cu, ms):
    """The four launches of module K (forward, delta, dK/dV, dQ) and their outputs; ``head_major``:
    statistics [H, N] and the token count among the arguments (the tree's kernels), else [N, H]."""
    varlen = cu is not None
    cuu = cu if varlen else torch.empty(1, device="cuda", dtype=torch.int32)
    nd = (cu.numel() - 1) if varlen else B
    stats = (H, N) if head_major else (N, H)
    ntok = (N,) if head_major else ()
    o = torch.empty_like(q)
    lse = torch.empty(*stats, device="cuda", dtype=torch.float32)
    delta = torch.empty(*stats, device="cuda", dtype=torch.float32)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = dict(D=D, BD=D, MODE=mode_id, IS_VARLEN=varlen, PREC="tf32", RAW_SIGN=True)
    tile = lambda c, outer, inner: {outer: c[0], inner: c[1], "num_warps": c[2], "num_stages": c[3]}
    bwd = (cuu, scale * LOG2E, scale, T, *ntok, H, H)
    f = lambda: K.attn_fwd_kernel[(cdiv(ms, tf[0]), H, nd)](
        q, k, v, o, lse, cuu, scale * LOG2E, 1e-6, T, *ntok, H, H, **tile(tf, "BM", "BN"), **common)
    dl = lambda: K.bwd_delta_kernel[(cdiv(N * H, 128),)](
        o, do, delta, N * H, *((N, H) if head_major else ()), D=D, BD=D, BR=128, num_warps=4)
    kv = lambda: K.attn_bwd_dkdv_kernel[(cdiv(ms, tkv[0]), H, nd)](
        q, k, v, do, lse, delta, dk, dv, *bwd, **tile(tkv, "BN", "BM"), **common)
    dqf = lambda: K.attn_bwd_dq_kernel[(cdiv(ms, tq[0]), H, nd)](
        q, k, v, do, lse, delta, dq, *bwd, **tile(tq, "BM", "BN"), **common)
    return (f, dl, kv, dqf), (o, dq, dk, dv)


def run_old(*args):
    return launchers(OLD, False, *args)


def run_new(*args):
    return launchers(NEW, True, *args)


def bench(fns):
    for fn in fns: fn()
    torch.cuda.synchronize()
    return [do_bench(fn, warmup=10, rep=150) for fn in fns]

def rel(a, b): return ((a.float() - b.float()).norm() / b.float().norm()).item()

for layout in ("dense", "varlen"):
    cu = None; ms = T
    if layout == "varlen":
        cu = torch.tensor(varlen_offsets(N, T), device="cuda", dtype=torch.int32)
    for mode_id, mode in enumerate(("softmax", "softpick", "rectified")):
        tile = lambda kern: tuple(shipped[f"{kern}/{mode}/d64/bfloat16/g1/{layout}/t4096"])
        tf, tkv, tq = tile("fwd"), tile("dkdv"), tile("dq")
        fo, ro = run_old(mode_id, tf, tkv, tq, cu, ms)
        t_old = bench(fo)
        fn, rn = run_new(mode_id, tf, tkv, tq, cu, ms)
        t_new = bench(fn)
        errs = [rel(a, b) for a, b in zip(rn, ro)]
        row = dict(layout=layout, mode=mode, tiles=[tf, tkv, tq], old_ms=t_old, new_ms=t_new, rel_err_vs_old=errs)
        # sweep candidates for the new kernels
        sweep = {}
        for kern in (("fwd", "dkdv", "dq") if layout == "dense" else ()):
            res = []
            for c in TL.candidates(kern, mode, 64):
                try:
                    a = dict(tf=tf, tkv=tkv, tq=tq); a[{"fwd": "tf", "dkdv": "tkv", "dq": "tq"}[kern]] = tuple(c)
                    fns, _ = run_new(mode_id, a["tf"], a["tkv"], a["tq"], cu, ms)
                    idx = {"fwd": 0, "dkdv": 2, "dq": 3}[kern]
                    fns[0](); fns[1]()
                    res.append((tuple(c), do_bench(fns[idx], warmup=5, rep=60)))
                except Exception as e:
                    res.append((tuple(c), str(e)[:80]))
            sweep[kern] = res
        row["sweep_new"] = sweep
        out["rows"].append(row)
        print(layout, mode, "old", ["%.3f" % x for x in t_old], "new", ["%.3f" % x for x in t_new],
              "sum old %.3f new %.3f" % (sum(t_old), sum(t_new)),
              "err", ["%.1e" % e for e in errs], flush=True)
        for kern, res in sweep.items():
            print("   ", kern, " ".join(f"{c}:{t:.3f}" if isinstance(t, float) else f"{c}:ERR" for c, t in res), flush=True)
import triton
out.update(triton=triton.__version__, torch=torch.__version__, command=" ".join(sys.argv),
           shape=dict(B=B, T=T, H=H, D=D, dtype="bfloat16"))
with open(sys.argv[2], "w") as f:
    json.dump(out, f, indent=1)
print("wrote", sys.argv[2])
