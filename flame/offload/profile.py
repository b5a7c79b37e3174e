"""Hardware profile: the rates the cost model needs, measured on the machine and cached as JSON.

`measure()` runs on a CUDA device in well under 30 s (small, repeated transfers and kernels).
On a machine without a GPU the planner loads a stored profile (`load()`); nothing here invents
numbers: every field comes from a measurement, and `source` says where and when it was taken.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from flame.errors import ConfigError

GiB = 1024**3


@dataclass
class HardwareProfile:
    source: str
    """Where the numbers come from (device name, host, date), for the printed plan."""
    device_name: str
    gpu_total_bytes: int
    host_total_bytes: int
    cpu_cores: int
    gemm_tflops: dict[str, float]
    """bf16 TFLOP/s per GEMM shape 'MxNxK' (the model's real shapes when measured for a model),
    plus key 'default' (the mean over measured shapes)."""
    attn_tflops: float
    """Causal attention fwd+bwd TFLOP/s (useful FLOPs, i.e. counting half the dense score matrix)."""
    hbm_gbps: float
    """Device memory copy rate (read+write bytes / s), for memory-bound elementwise work."""
    h2d_gbps: float
    d2h_gbps: float
    duplex_gbps: float
    """Total rate when H2D and D2H run at the same time (both directions summed)."""
    pageable_h2d_gbps: float
    host_memcpy_gbps: float
    cpu_adam_gparams: dict[str, float]
    """Fused CPU AdamW rate (G params/s, fp32 states) per thread count (keys are str(threads))."""
    gpu_adam_gparams: float
    pin_s_per_gib: float
    """Seconds to page-lock one GiB of host memory."""
    allgather_gbps: float = 0.0
    reducescatter_gbps: float = 0.0
    extra: dict = field(default_factory=dict)
    cpu_adam_bf16_gparams: dict[str, float] = field(default_factory=dict)
    """Fused CPU AdamW rate with bf16 params, grads and moments (half the bytes of fp32), per
    thread count; empty in profiles stored before it was measured (the fp32 rate is used then)."""

    def gemm_rate(self, shape: str | None = None) -> float:
        """FLOP/s for a GEMM shape (falls back to the mean of measured shapes)."""
        t = self.gemm_tflops.get(shape) if shape else None
        return 1e12 * (t if t else self.gemm_tflops["default"])

    def cpu_adam_rate(self, threads: int, node_ranks: int = 1, dtype: str = "float32") -> float:
        """params/s of one process's CPU optimizer with `threads` threads and states in `dtype`
        while `node_ranks` processes run theirs at once on the machine: they share its memory
        bandwidth, so each gets at most 1/node_ranks of the rate of all their threads together."""
        table = self.cpu_adam_bf16_gparams if dtype == "bfloat16" and self.cpu_adam_bf16_gparams \
            else self.cpu_adam_gparams
        one = self._adam_rate_at(table, threads)
        return min(one, self._adam_rate_at(table, threads * node_ranks) / node_ranks) if node_ranks > 1 else one

    @staticmethod
    def _adam_rate_at(table: dict[str, float], threads: int) -> float:
        """Measured rate, linear between measured thread counts (proportional below the smallest,
        flat above the largest: more threads than measured are not assumed to help)."""
        pts = sorted((int(k), 1e9 * v) for k, v in table.items())
        if threads <= pts[0][0]:
            return pts[0][1] * threads / pts[0][0]
        for (k0, r0), (k1, r1) in zip(pts, pts[1:]):
            if threads <= k1:
                return r0 + (r1 - r0) * (threads - k0) / (k1 - k0)
        return pts[-1][1]


def save(p: HardwareProfile, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(asdict(p), f, indent=1, sort_keys=True)


# fields of profiles stored by earlier versions, no longer used: dropped when read
RETIRED_FIELDS = (
    # CPU AdamW rate next to pinned H2D copies over the idle rate, stored 2026-11-23 only: it
    # scattered 0.99-1.27 between runs of one machine while the engine's measured AdamW matched
    # the idle rate within 3% (benchmarks/notes/offload-findings.md O4)
    "cpu_adam_under_h2d",
)


def from_dict(d: dict) -> HardwareProfile:
    return HardwareProfile(**{k: v for k, v in d.items() if k not in RETIRED_FIELDS})


def load(path: str) -> HardwareProfile:
    if not os.path.isfile(path):
        raise ConfigError(f"offload.profile={path!r}: file not found")
    try:
        with open(path) as f:
            return from_dict(json.load(f))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"offload.profile={path!r}: not a hardware profile ({e})") from None


# ---------------------------------------------------------------- measurement (GPU)


def _time_cuda(fn, iters: int) -> float:
    """Seconds per call of fn, timed with CUDA events after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3 / iters


def _host_total_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def adam_bench(numel: int, dtype, grad_scale: bool = True):
    """A timed fused CPU AdamW over `numel` random parameters; with `grad_scale`, as the engine
    runs it when the step clips: grads divided by a `grad_scale` inside the kernel (its slower
    path; clipping is on by default and binds early in training). Returns (param, optimizer,
    run(threads, steps) -> G params/s)."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel, generator=g).mul_(0.02).to(dtype))
    p.grad = torch.randn(numel, generator=g).mul_(1e-4).to(dtype)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    opt.grad_scale = torch.full((), 2.0) if grad_scale else None
    opt.step()  # the moments are allocated and first touched here, outside the timing

    def run(threads: int, steps: int) -> float:
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            opt.step()
            t0 = time.perf_counter()
            for _ in range(steps):
                opt.step()
            return numel * steps / (time.perf_counter() - t0) / 1e9
        finally:
            torch.set_num_threads(old)

    return p, opt, run


def measure_cpu_adam(threads_list=None, numel: int = 1 << 27, dtype=torch.float32, steps: int = 3) -> dict[str, float]:
    """Fused CPU AdamW rate in G params/s for each thread count (runs on any machine). 128M
    parameters: on the H100 host 64M-element bf16 runs measured 0.7x of the 218M-element blocks of
    an 8B model (benchmarks/cpu_adam.py)."""
    cores = len(os.sched_getaffinity(0))
    threads_list = threads_list or sorted({1, max(1, cores // 2), max(1, cores - 1), cores})
    _, _, run = adam_bench(numel, dtype)
    return {str(t): run(t, steps) for t in threads_list}


def measure(gemm_shapes: list[tuple[int, int, int]] | None = None, device: str = "cuda") -> HardwareProfile:
    """Measure every rate of the profile on the current CUDA device (~10-25 s)."""
    if not torch.cuda.is_available():
        raise ConfigError("offload.profile: measuring a profile needs a CUDA device; pass a stored one")
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    bf = torch.bfloat16
    gemm_shapes = gemm_shapes or [(8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096)]
    gemm = {}
    for m, n, k in gemm_shapes[:8]:
        a = torch.randn(m, k, device=dev, dtype=bf)
        b = torch.randn(k, n, device=dev, dtype=bf)
        s = _time_cuda(lambda: a @ b, 10)
        gemm[f"{m}x{n}x{k}"] = 2 * m * n * k / s / 1e12
        del a, b
    gemm["default"] = sum(gemm.values()) / len(gemm)

    # causal SDPA fwd+bwd; useful flops = 4*B*H*T^2*D * 0.5 (causal) * 3.5 (fwd 1 + bwd 2.5)
    B, H, T, D = 2, 16, 4096, 128
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=bf, requires_grad=True) for _ in range(3))

    def attn():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(torch.ones_like(o))

    s = _time_cuda(attn, 5)
    attn_tflops = 4 * B * H * T * T * D * 0.5 * 3.5 / s / 1e12
    del q, k, v

    nbytes = 1 << 30  # 1 GiB transfers
    g1 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    g2 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    hbm = 2 * nbytes / _time_cuda(lambda: g2.copy_(g1), 5) / 1e9
    t0 = time.perf_counter()
    h1 = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pin_s = time.perf_counter() - t0
    h2 = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    h2d = nbytes / _time_cuda(lambda: g1.copy_(h1, non_blocking=True), 4) / 1e9
    d2h = nbytes / _time_cuda(lambda: h2.copy_(g2, non_blocking=True), 4) / 1e9
    s2 = torch.cuda.Stream(dev)

    def both():
        g1.copy_(h1, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(g2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s2)

    duplex = 2 * nbytes / _time_cuda(both, 4) / 1e9
    pg = torch.empty(nbytes // 4, dtype=torch.uint8)
    pageable = (nbytes // 4) / _time_cuda(lambda: g1[: nbytes // 4].copy_(pg), 2) / 1e9
    t0 = time.perf_counter()
    for _ in range(3):
        h2.copy_(h1)
    memcpy = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    del g1, g2, h1, h2, pg

    p = torch.nn.Parameter(torch.zeros(1 << 26, device=dev))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    gpu_adam = p.numel() / _time_cuda(opt.step, 5) / 1e9
    del p, opt
    torch.cuda.empty_cache()

    return HardwareProfile(
        source=f"measured on {props.name} ({os.uname().nodename}) at {time.strftime('%Y-%m-%d %H:%M:%S')}",
        device_name=props.name,
        gpu_total_bytes=props.total_memory,
        host_total_bytes=_host_total_bytes(),
        cpu_cores=len(os.sched_getaffinity(0)),
        gemm_tflops=gemm,
        attn_tflops=attn_tflops,
        hbm_gbps=hbm,
        h2d_gbps=h2d,
        d2h_gbps=d2h,
        duplex_gbps=duplex,
        pageable_h2d_gbps=pageable,
        host_memcpy_gbps=memcpy,
        cpu_adam_gparams=measure_cpu_adam(),
        gpu_adam_gparams=gpu_adam,
        pin_s_per_gib=pin_s,
        cpu_adam_bf16_gparams=measure_cpu_adam(dtype=bf),
    )


def measure_collectives(device, group=None, nbytes: int = 1 << 27, iters: int = 3) -> tuple[float, float]:
    """Bus bandwidth in GB/s of the engine's all-gather and reduce-scatter over `group` (the
    inverse of cost_model.collective_s: (world - 1) / world * bytes / seconds), on `nbytes`
    buffers of bf16. Collective: every rank of `group` must call it; all get the same numbers
    (the slowest rank's time)."""
    import torch.distributed as dist

    from flame.offload.runtime.collectives import all_gather_flat, comm_device, reduce_scatter_flat

    world = dist.get_world_size(group)
    dev = comm_device(group, torch.device(device))
    n = max(world, (nbytes // 2 // world) * world)
    full = torch.zeros(n, dtype=torch.bfloat16, device=dev)
    shard = torch.zeros(n // world, dtype=torch.bfloat16, device=dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def seconds(fn) -> float:
        fn()
        sync()
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync()
        return (time.perf_counter() - t0) / iters

    t = torch.tensor([seconds(lambda: all_gather_flat(full, shard, group)),
                      seconds(lambda: reduce_scatter_flat(shard, full, group))], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    busbytes = (world - 1) / world * n * 2
    return busbytes / float(t[0]) / 1e9, busbytes / float(t[1]) / 1e9


def main() -> None:
    """`python -m flame.offload.profile OUT.json`: measure and store a profile."""
    import sys

    out = sys.argv[1] if len(sys.argv) > 1 else "offload_profile.json"
    t0 = time.perf_counter()
    p = measure()
    save(p, out)
    print(json.dumps(asdict(p), indent=1))
    print(f"profile written to {out} in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
