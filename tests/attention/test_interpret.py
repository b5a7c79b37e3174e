"""flame's Triton attention kernels under TRITON_INTERPRET=1 (CPU) against float64 references.

The interpreter must be switched on before triton.jit runs, so the checks run in a subprocess.
Fixed 16x16 tiles are used when interpreting (no autotuning); float32 inputs (the interpreter
mishandles bf16 in tl.dot).
"""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import torch
from flame.ops.attention import naive_attention, parallel_attention

def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()

def check(B, T, HQ, HK, D, mode, cu=None, scale=1.0):
    g = torch.Generator().manual_seed(hash((B, T, HQ, HK, D, mode)) % 2**31)
    q, k = (torch.randn(B, T, h, D, generator=g, dtype=torch.float64) * scale for h in (HQ, HK))
    v = torch.randn(B, T, HK, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, T, HQ, D, generator=g, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref, _ = naive_attention(*ref_in, mode, cu_seqlens=cu)
    o_ref.backward(do)
    got_in = [x.float().requires_grad_() for x in (q, k, v)]
    o = parallel_attention(*got_in, mode, cu_seqlens=cu)
    o.backward(do.float())
    errs = [rel(a, b) for a, b in zip([o] + [x.grad for x in got_in], [o_ref] + [x.grad for x in ref_in])]
    assert max(errs) < 1e-5, (B, T, HQ, HK, D, mode, cu, errs)
    print("ok", mode, B, T, HQ, HK, D, None if cu is None else cu.tolist(), ["%.1e" % e for e in errs])

for mode in ("softmax", "softpick", "rectified"):
    check(2, 37, 4, 2, 24, mode)                                     # GQA, T and D not tile multiples
    check(1, 45, 2, 1, 32, mode, torch.tensor([0, 10, 11, 30, 45]))  # varlen incl. a 1-token document
    check(2, 20, 2, 2, 16, mode, torch.tensor([0, 7, 33, 40]))       # varlen over a batch of 2
    check(1, 33, 2, 2, 16, mode, scale=4.0)                          # large logits
check(1, 18, 1, 1, 256, "softpick")                                  # largest head dim
"""


def test_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    if r.returncode and "No module named 'triton'" in r.stderr:
        pytest.skip("triton is not installed")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert r.stdout.count("ok ") == 13, r.stdout
