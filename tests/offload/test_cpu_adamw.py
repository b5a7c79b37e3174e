"""flame.ops.cpu_adamw, the one-pass CPU AdamW of host units: against a float64 evaluation of
AdamW's formula and against torch's AdamW, in place and out of place, fp32 and bf16 state."""

import os
import subprocess
import sys

import pytest
import torch

from flame.errors import ConfigError
from flame.ops import cpu_adamw

pytestmark = pytest.mark.skipif(not cpu_adamw.available(), reason="no C compiler: the engine uses torch's fused AdamW")

HP = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def inputs(n, state_dtype, grad_dtype, seed):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(state_dtype)
    m = (torch.randn(n, generator=g) * 1e-2).to(state_dtype)
    v = (torch.rand(n, generator=g) * 1e-4).to(state_dtype)
    grad = (torch.randn(n, generator=g) * 1e-2).to(grad_dtype)
    return p, grad, m, v


def reference(p, grad, m, v, step, grad_mul):
    """AdamW (decoupled decay, bias corrections) in float64."""
    p, grad, m, v = (t.double() for t in (p, grad, m, v))
    b1, b2 = HP["beta1"], HP["beta2"]
    g = grad * grad_mul
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    denom = (v / (1 - b2 ** step)).sqrt() + HP["eps"]
    p = p * (1 - HP["lr"] * HP["weight_decay"]) - HP["lr"] * (m / (1 - b1 ** step)) / denom
    return p, m, v


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


@pytest.mark.parametrize("state_dtype,grad_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("out_of_place", [False, True])
def test_matches_float64_adamw(state_dtype, grad_dtype, out_of_place):
    n, step, grad_mul = 100_003, 7, 0.37  # not a multiple of any block or vector width
    p, grad, m, v = inputs(n, state_dtype, grad_dtype, seed=n + step)
    want = reference(p, grad, m, v, step, grad_mul)
    before = [t.clone() for t in (p, grad, m, v)]
    out = tuple(torch.empty_like(t) for t in (p, m, v)) if out_of_place else None
    copy = torch.empty(n, dtype=torch.bfloat16)
    cpu_adamw.adamw(p, grad, m, v, step=step, grad_mul=grad_mul, out=out, compute_copy=copy, **HP)
    got = out if out_of_place else (p, m, v)
    tol = 1e-6 if state_dtype == torch.float32 else 1e-2
    for name, a, b in zip(("param", "exp_avg", "exp_avg_sq"), got, want):
        assert rel(a, b) < tol, (name, rel(a, b))
    assert torch.equal(copy, got[0].to(torch.bfloat16))  # the compute copy: the new master rounded
    assert torch.equal(grad, before[1])
    if out_of_place:  # the state stays as it was
        for a, b in zip((p, m, v), (before[0], before[2], before[3])):
            assert torch.equal(a, b)


def test_close_to_torch_adamw_over_steps():
    """Five steps against torch.optim.AdamW (fused) on the same grads: within float32 rounding."""
    n = 4099
    p, _, _, _ = inputs(n, torch.float32, torch.float32, seed=1)
    ref = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([ref], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], fused=True)
    m, v = torch.zeros(n), torch.zeros(n)
    g = torch.Generator().manual_seed(2)
    for step in range(1, 6):
        grad = torch.randn(n, generator=g)
        ref.grad = grad.clone()
        opt.step()
        cpu_adamw.adamw(p, grad, m, v, step=step, **HP)
    st = opt.state[ref]
    for a, b in ((p, ref.detach()), (m, st["exp_avg"]), (v, st["exp_avg_sq"])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_thread_count_does_not_change_the_result():
    n = 300_001
    outs = []
    for threads in (1, 2, 3):
        p, grad, m, v = inputs(n, torch.float32, torch.bfloat16, seed=3)
        cpu_adamw.adamw(p, grad, m, v, step=2, threads=threads, **HP)
        outs.append((p, m, v))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


def test_rejects_mismatched_tensors():
    p, grad, m, v = inputs(16, torch.float32, torch.float32, seed=4)
    with pytest.raises(ValueError, match="one size"):
        cpu_adamw.adamw(p, grad[:8], m, v, step=1, **HP)
    with pytest.raises(ValueError, match="one dtype"):
        cpu_adamw.adamw(p, grad, m.bfloat16(), v, step=1, **HP)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_adamw.adamw(p, grad, m, v, step=1, compute_copy=torch.empty(16), **HP)


def test_concurrent_first_builds_share_one_library(tmp_path):
    """Processes building into an empty cache at once each load a whole library (installed by
    rename), and leave one file."""
    script = ("import torch; from flame.ops import cpu_adamw; assert cpu_adamw.available(), cpu_adamw.unavailable_reason();"
              "p = torch.ones(8); cpu_adamw.adamw(p, torch.ones(8), torch.zeros(8), torch.zeros(8), step=1, lr=0.1,"
              " beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0); assert (p < 1).all()")
    env = dict(os.environ, FLAME_CPU_KERNEL_CACHE=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    for proc in procs:
        assert proc.wait(timeout=120) == 0, proc.stderr.read()
    assert [f.suffix for f in tmp_path.iterdir()] == [".so"]


@pytest.fixture
def fresh_build(monkeypatch):
    """`available()` builds again (the module keeps its first answer; restored afterwards)."""
    monkeypatch.setattr(cpu_adamw, "_lib", None)
    monkeypatch.setattr(cpu_adamw, "_error", None)


def test_cache_variable_naming_no_directory_is_a_user_error(tmp_path, monkeypatch, fresh_build):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for value in (a_file, a_file / "sub"):
        monkeypatch.setenv("FLAME_CPU_KERNEL_CACHE", str(value))
        with pytest.raises(ConfigError, match=f"^FLAME_CPU_KERNEL_CACHE='{value}': .*[Nn]ot a directory"):
            cpu_adamw.available()


def test_unwritable_default_cache_falls_back(tmp_path, monkeypatch, fresh_build):
    """The default cache not writable (a read-only home) is the machine's limit, not a user
    mistake: no kernel, and the reason names the directory."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    monkeypatch.delenv("FLAME_CPU_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(a_file))
    assert not cpu_adamw.available()
    assert str(a_file / "flame" / "cpu_kernels") in cpu_adamw.unavailable_reason()


def test_compiler_failure_reason_is_its_first_error_line(tmp_path, monkeypatch, fresh_build):
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\necho "adamw.c:1: warning: w" >&2\necho "adamw.c:2: error: no omp.h" >&2\n'
                  'echo "compilation terminated." >&2\nexit 1\n')
    cc.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("FLAME_CPU_KERNEL_CACHE", str(cache))
    assert not cpu_adamw.available()
    assert cpu_adamw.unavailable_reason() == "CalledProcessError: adamw.c:2: error: no omp.h"
    assert list(cache.iterdir()) == []  # the build's temporary directory is gone


def test_overlapping_destinations_are_refused():
    """The kernel's loops take their buffers as non-overlapping: out of place, a destination that
    overlaps an input (or a compute copy inside the state) is a ValueError, not a wrong update."""
    p, grad, m, v = inputs(64, torch.float32, torch.float32, seed=5)
    with pytest.raises(ValueError, match="overlap"):
        cpu_adamw.adamw(p, grad, m, v, step=1, out=(p, torch.empty(64), torch.empty(64)), **HP)
    with pytest.raises(ValueError, match="overlap"):
        cpu_adamw.adamw(p, grad, m, v, step=1, out=(torch.empty(64), torch.empty(64), grad), **HP)
    state = torch.zeros(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlap"):
        cpu_adamw.adamw(state, grad.bfloat16(), state.clone(), state.clone(), step=1, compute_copy=state, **HP)


def test_bf16_stores_round_to_nearest_even_and_keep_nan_and_inf():
    """bf16 state: NaN grads give the canonical quiet NaN, infinities stay infinite, finite values
    equal torch's round-to-nearest-even of the float32 result (weight decay and lr 0: p unchanged)."""
    n = 4096
    g = torch.Generator().manual_seed(6)
    p = torch.randn(n, generator=g).bfloat16()
    grad = torch.randn(n, generator=g)
    grad[:3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    cpu_adamw.adamw(p, grad, m, v, step=1, lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)
    bits = m.view(torch.int16)
    assert bits[0].item() == 0x7fc0 and torch.isnan(v[0])
    assert m[1].item() == float("inf") and m[2].item() == -float("inf") and v[1].item() == float("inf")
    a1 = torch.tensor(1.0) - torch.tensor(0.9)  # 1 - beta1 in float32, as the kernel computes it
    want = (a1 * grad[3:]).bfloat16()  # m' = 0 + a1 * (g - 0): one float32 product, rounded to bf16
    assert torch.equal(m[3:], want)


@pytest.mark.skipif("clang" in subprocess.run(["sh", "-c", "${CC:-cc} --version"], capture_output=True, text=True).stdout,
                    reason="the vectorizer report read here is gcc's")
def test_every_typed_loop_is_vectorized(tmp_path):
    """The update runs at memory speed only when the compiler vectorizes its loops: gcc reports
    each of the 16 typed loops (state and grad dtypes, in place or not, compute copy or not)."""
    src = tmp_path / "adamw.c"
    src.write_text(cpu_adamw._SOURCE)
    proc = subprocess.run(["sh", "-c", f"${{CC:-cc}} {' '.join(cpu_adamw._FLAGS)} -fopt-info-vec-optimized "
                           f"{src} -o {tmp_path / 'a.so'} -lm"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # gcc names the line of each DEFINE_ADAMW(...) that expands a loop
    defines = {str(i + 1) for i, line in enumerate(cpu_adamw._SOURCE.splitlines()) if line.startswith("DEFINE_ADAMW(")}
    reports = [line.split(":")[1] for line in proc.stderr.splitlines() if "loop vectorized" in line]
    assert len(defines) == 4 and defines <= set(reports) and len(reports) >= 16, proc.stderr
