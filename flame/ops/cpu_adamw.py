"""AdamW over flat CPU tensors in one pass, optionally out of place, with the bf16 compute copy
written in the same pass.

The offload engine steps host units on the CPU. torch's fused CPU AdamW updates in place and
needs grads in the master dtype, so a step was three passes over memory (grads converted to the
master dtype, the AdamW, the bf16 compute copy), and keeping the old state for an undo cost a
fourth (a copy of master and moments). This kernel reads master, moments and grads (fp32 or bf16)
once and writes the new master, moments and compute copy once: in place, or into a second set of
buffers so that the old state stays as it was.

The kernel is C (OpenMP over blocks of elements; one loop per dtype combination, which the compiler
vectorizes), built on first use with the system C compiler
(`$CC`, a command with its arguments, else `cc`; Triton needs one too) into `$XDG_CACHE_HOME/flame/cpu_kernels` (overridable
with `FLAME_CPU_KERNEL_CACHE`), keyed by the source, compiler and CPU's instruction sets, and called through ctypes, which lets
go of the GIL for the call. Where no compiler works, or the default cache directory cannot be
written (a read-only home), `available()` is False and the caller uses torch's fused AdamW
instead; a `FLAME_CPU_KERNEL_CACHE` that names no writable directory is the user's to fix
(`ConfigError`).

The update is torch's AdamW (decoupled weight decay, bias corrections) in float32 arithmetic:
  g = grad * grad_mul
  m' = m + (1 - beta1) * (g - m)
  v' = beta2 * v + (1 - beta2) * g * g
  p' = p * decay - step_size * m' / (sqrt(v') / bc2_sqrt + eps)
with decay = 1 - lr * weight_decay, step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t).
bf16 values are widened exactly and rounded to nearest even when stored.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from flame.errors import ConfigError
from flame.utils.cache_dir import cache_dir

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* round to nearest even; a NaN becomes the canonical quiet NaN (a select, so loops vectorize) */
static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (bf16_t)((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

#define LD_F32(x, i) ((x)[i])
#define LD_BF16(x, i) bf16_to_f32((x)[i])
#define ST_F32(x, i, y) ((x)[i] = (y))
#define ST_BF16(x, i, y) ((x)[i] = f32_to_bf16(y))

/* One typed loop per (state dtype, grad dtype, in place or not, compute copy or not): restrict
   pointers and no per-element dtype tests, so that the compiler vectorizes it. In place, the
   state pointers are also the destinations (two restrict pointers to one buffer would be
   undefined behaviour). */
#define ADAMW_BODY(LS, SS, LG, PD, MD, VD, COPY)                                      \
    for (int64_t i = lo; i < hi; i++) {                                               \
        float gi = LG(g, i) * grad_mul;                                               \
        float mi = LS(m, i);                                                          \
        float vi = LS(v, i);                                                          \
        float mn = mi + a1 * (gi - mi);                                               \
        float vn = beta2 * vi + a2 * gi * gi;                                         \
        float pn = LS(p, i) * decay - step_size * mn / (sqrtf(vn) / bc2_sqrt + eps);  \
        SS(MD, i, mn);                                                                \
        SS(VD, i, vn);                                                                \
        SS(PD, i, pn);                                                                \
        if (COPY) w[i] = f32_to_bf16(pn);                                             \
    }

#define ARGS_TAIL int64_t lo, int64_t hi, float decay, float step_size, float bc2_sqrt, \
                  float grad_mul, float a1, float beta2, float a2, float eps

#define DEFINE_ADAMW(NAME, S, G, LS, SS, LG)                                                        \
static void NAME##_in(S *restrict p, const G *restrict g, S *restrict m, S *restrict v,             \
                      bf16_t *restrict w, ARGS_TAIL) { ADAMW_BODY(LS, SS, LG, p, m, v, 0) }         \
static void NAME##_in_copy(S *restrict p, const G *restrict g, S *restrict m, S *restrict v,        \
                           bf16_t *restrict w, ARGS_TAIL) { ADAMW_BODY(LS, SS, LG, p, m, v, 1) }    \
static void NAME##_out(const S *restrict p, const G *restrict g, const S *restrict m,               \
                       const S *restrict v, S *restrict P, S *restrict M, S *restrict V,            \
                       bf16_t *restrict w, ARGS_TAIL) { ADAMW_BODY(LS, SS, LG, P, M, V, 0) }        \
static void NAME##_out_copy(const S *restrict p, const G *restrict g, const S *restrict m,          \
                            const S *restrict v, S *restrict P, S *restrict M, S *restrict V,       \
                            bf16_t *restrict w, ARGS_TAIL) { ADAMW_BODY(LS, SS, LG, P, M, V, 1) }

DEFINE_ADAMW(f32_f32, float, float, LD_F32, ST_F32, LD_F32)
DEFINE_ADAMW(f32_bf16, float, bf16_t, LD_F32, ST_F32, LD_BF16)
DEFINE_ADAMW(bf16_f32, bf16_t, float, LD_BF16, ST_BF16, LD_F32)
DEFINE_ADAMW(bf16_bf16, bf16_t, bf16_t, LD_BF16, ST_BF16, LD_BF16)

#define DISPATCH(NAME, S, G)                                                                        \
    if (in_place) {                                                                                 \
        if (w) NAME##_in_copy((S *)P, (const G *)g, (S *)M, (S *)V, w, lo, hi, decay, step_size,    \
                              bc2_sqrt, grad_mul, a1, beta2, a2, eps);                              \
        else NAME##_in((S *)P, (const G *)g, (S *)M, (S *)V, w, lo, hi, decay, step_size,           \
                       bc2_sqrt, grad_mul, a1, beta2, a2, eps);                                     \
    } else {                                                                                        \
        if (w) NAME##_out_copy((const S *)p, (const G *)g, (const S *)m, (const S *)v, (S *)P,      \
                               (S *)M, (S *)V, w, lo, hi, decay, step_size, bc2_sqrt, grad_mul,     \
                               a1, beta2, a2, eps);                                                 \
        else NAME##_out((const S *)p, (const G *)g, (const S *)m, (const S *)v, (S *)P, (S *)M,     \
                        (S *)V, w, lo, hi, decay, step_size, bc2_sqrt, grad_mul, a1, beta2, a2, eps); \
    }

/* state (p, m, v) and its destination (P, M, V: either p, m, v themselves or buffers that overlap
   neither them nor g) in one dtype (state_bf16), grads in theirs (grad_bf16); w: the bf16 compute
   copy or NULL */
void flame_adamw(const void *p, const void *g, const void *m, const void *v,
                 void *P, void *M, void *V, uint16_t *w, int64_t n,
                 int state_bf16, int grad_bf16, float decay, float step_size, float bc2_sqrt,
                 float grad_mul, float beta1, float beta2, float eps, int threads) {
    const int64_t block = 1 << 14;
    const int64_t nblocks = (n + block - 1) / block;
    const int in_place = P == p;
    const float a1 = 1.0f - beta1, a2 = 1.0f - beta2;
    #pragma omp parallel for schedule(static) num_threads(threads > 0 ? threads : 1)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
        if (!state_bf16 && !grad_bf16) { DISPATCH(f32_f32, float, float) }
        else if (!state_bf16) { DISPATCH(f32_bf16, float, bf16_t) }
        else if (!grad_bf16) { DISPATCH(bf16_f32, bf16_t, float) }
        else { DISPATCH(bf16_bf16, bf16_t, bf16_t) }
    }
}
"""
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]

DTYPES = {torch.float32, torch.bfloat16}  # of master, moments and grads the kernel takes

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None


def _cpu_signature() -> str:
    """The instruction sets `-march=native` builds for: a library built on one CPU model must not
    load on another (a cache directory shared by a cluster's nodes)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine() + platform.processor()


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cc + _cpu_signature()).encode()).hexdigest()[:16]
    directory = cache_dir("cpu_kernels", "FLAME_CPU_KERNEL_CACHE")
    lib = directory / f"flame_adamw_{key}.so"
    if not lib.exists():  # (a read-only directory holding the built library is fine)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            tmp = tempfile.mkdtemp(dir=directory)
        except OSError as e:
            env = os.environ.get("FLAME_CPU_KERNEL_CACHE")
            if env:
                why = "not a directory" if directory.exists() and not directory.is_dir() else e.strerror
                raise ConfigError(f"FLAME_CPU_KERNEL_CACHE={env!r}: cannot build the CPU AdamW kernel there ({why}); "
                                  "name a writable directory or unset it") from None
            raise
        try:
            src = Path(tmp) / "adamw.c"
            src.write_text(_SOURCE)
            out = Path(tmp) / lib.name
            subprocess.run([*shlex.split(cc), *_FLAGS, str(src), "-o", str(out), "-lm"], check=True,
                           capture_output=True, text=True)
            os.replace(out, lib)  # atomic: concurrent builders each install a whole file
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    f = ctypes.CDLL(str(lib)).flame_adamw
    f.restype = None
    f.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int] + [ctypes.c_float] * 7 + [ctypes.c_int]
    return f


def available() -> bool:
    """Whether the kernel is built (on first call) and loads; the reason it is not: `unavailable_reason()`.
    Raises ConfigError when `FLAME_CPU_KERNEL_CACHE` names no directory it can build in."""
    global _lib, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib = _build()
            except (OSError, subprocess.CalledProcessError) as e:
                lines = (getattr(e, "stderr", "") or str(e)).strip().splitlines() or [str(e)]
                # the compiler's first error says why; its last line is often "compilation terminated."
                _error = f"{type(e).__name__}: {next((x for x in lines if 'error' in x.lower()), lines[-1]).strip()}"
        return _lib is not None


def unavailable_reason() -> str | None:
    return _error


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    lo_a, lo_b = a.data_ptr(), b.data_ptr()
    return lo_a < lo_b + b.numel() * b.element_size() and lo_b < lo_a + a.numel() * a.element_size()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def adamw(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
          step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
          grad_mul: float = 1.0, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
          compute_copy: torch.Tensor | None = None, threads: int = 0) -> None:
    """One AdamW step of flat contiguous CPU tensors; `step` counts this step (1 for the first).
    Writes the new (param, exp_avg, exp_avg_sq) into `out` when given (the inputs stay unchanged),
    else in place; `compute_copy` (bf16), when given, receives the new param. Needs `available()`."""
    state = (param, exp_avg, exp_avg_sq)
    dst = out if out is not None else state
    n = param.numel()
    for t in (*state, *dst, grad) + ((compute_copy,) if compute_copy is not None else ()):
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() != n:
            raise ValueError("cpu_adamw: flat contiguous CPU tensors of one size expected")
    state_bf16 = param.dtype == torch.bfloat16
    if any(t.dtype != param.dtype for t in (*state, *dst)) or param.dtype not in DTYPES:
        raise ValueError(f"cpu_adamw: master and moments of one dtype, float32 or bfloat16 (got {param.dtype})")
    if grad.dtype not in DTYPES or (compute_copy is not None and compute_copy.dtype != torch.bfloat16):
        raise ValueError("cpu_adamw: grads float32 or bfloat16, compute copy bfloat16")
    # the kernel's loops take their buffers as non-overlapping (restrict): in place means every
    # destination is its state tensor, out of place that no destination overlaps an input
    writes = ((*dst,) if out is not None else ()) + ((compute_copy,) if compute_copy is not None else ())
    if any(_overlap(d, r) for d in writes for r in (*state, grad)):
        raise ValueError("cpu_adamw: out and compute_copy must not overlap the state or the grads")
    _lib(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
         dst[0].data_ptr(), dst[1].data_ptr(), dst[2].data_ptr(), _ptr(compute_copy), n,
         int(state_bf16), int(grad.dtype == torch.bfloat16), 1.0 - lr * weight_decay,
         lr / (1.0 - beta1 ** step), math.sqrt(1.0 - beta2 ** step), grad_mul, beta1, beta2, eps,
         threads or torch.get_num_threads())
