"""Hardware profile measurement: every rate of `planner.hardware.HardwareProfile`, taken on the
machine (`measure()` runs on a CUDA device in well under 30 s: small, repeated transfers and
kernels), and the bus bandwidth of the engine's collectives.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict

import torch

from flame.errors import ConfigError
from flame.offload.measure.timer import seconds_per_call
from flame.offload.planner.hardware import HardwareProfile, save
from flame.offload.runtime.collectives import all_gather_flat, comm_device, reduce_scatter_flat
from flame.ops import cpu_adamw

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


def one_pass_bench(numel: int, dtype, out_of_place: bool = False):
    """The engine's host step with flame's one-pass kernel: `numel` random parameters with master
    and moments in `dtype`, bf16 grads scaled as by clipping, and (fp32 master) the bf16 compute
    copy written in the same pass; `out_of_place`: the new master and moments written into a second
    set of buffers, as a speculative step that may be redone does. Returns run(threads, steps) ->
    G params/s."""
    g = torch.Generator().manual_seed(0)
    p = torch.randn(numel, generator=g).mul_(0.02).to(dtype)
    grad = torch.randn(numel, generator=g).mul_(1e-4).to(torch.bfloat16)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    copy = torch.empty(numel, dtype=torch.bfloat16) if dtype != torch.bfloat16 else None
    out = tuple(torch.empty_like(p) for _ in range(3)) if out_of_place else None
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_mul=0.5, compute_copy=copy, out=out)
    cpu_adamw.adamw(p, grad, m, v, step=1, threads=len(os.sched_getaffinity(0)), **hp)  # first touch

    def run(threads: int, steps: int) -> float:
        cpu_adamw.adamw(p, grad, m, v, step=2, threads=threads, **hp)
        t0 = time.perf_counter()
        for i in range(steps):
            cpu_adamw.adamw(p, grad, m, v, step=3 + i, threads=threads, **hp)
        return numel * steps / (time.perf_counter() - t0) / 1e9

    return run


def measure_cpu_adam(threads_list=None, numel: int = 1 << 27, dtype=torch.float32, steps: int = 3) -> dict[str, float]:
    """The host step's rate in G params/s for each thread count (runs on any machine): flame's
    one-pass kernel where it builds (`cpu_adamw.available()`), else torch's fused AdamW. 128M
    parameters: on the H100 host 64M-element bf16 runs measured 0.7x of the 218M-element blocks of
    an 8B model (benchmarks/cpu_adam.py)."""
    cores = len(os.sched_getaffinity(0))
    threads_list = threads_list or sorted({1, max(1, cores // 2), max(1, cores - 1), cores})
    run = one_pass_bench(numel, dtype) if cpu_adamw.available() else adam_bench(numel, dtype)[2]
    return {str(t): run(t, steps) for t in threads_list}


def measure_out_of_place_slowdown(numel: int = 1 << 27, steps: int = 3) -> float:
    """In-place rate / out-of-place rate of flame's one-pass kernel (fp32 state, all cores but
    one, as the engine's CPU worker runs); 1.0 where the kernel does not build (torch's fused
    AdamW copies the state aside instead, which the cost model counts by its bytes)."""
    if not cpu_adamw.available():
        return 1.0
    threads = max(1, len(os.sched_getaffinity(0)) - 1)
    rates = [one_pass_bench(numel, torch.float32, out_of_place)(threads, steps) for out_of_place in (False, True)]
    return max(1.0, rates[0] / rates[1])


MiB = 1 << 20


def transfer_bytes(room: int) -> int:
    """Size of each of the two device buffers the copy rates are timed on: 1 GiB, or an eighth of
    the bytes the allocator may hold (a GPU cap), whole MiB, at least 16 MiB."""
    return max(16 * MiB, min(1 << 30, room // 8) // MiB * MiB)


def fitting_gemm(m: int, n: int, k: int, room: int) -> tuple[int, int, int]:
    """The matmul shape timed for (m, n, k) in bf16 within half of ``room``: fewer rows (tokens)
    while the operands and result do not fit, down to 256, then fewer columns, down to 1024."""
    def fits():
        return 2 * (m * k + k * n + m * n) <= room // 2

    while m > 256 and not fits():
        m //= 2
    while n > 1024 and not fits():
        n //= 2
    return m, n, k


def measure(gemm_shapes: list[tuple[int, int, int]] | None = None, device: str = "cuda",
            max_bytes: int | None = None) -> HardwareProfile:
    """Measure every rate of the profile on the current CUDA device (~10-25 s). ``max_bytes``: what
    this process's allocator may hold (an offload GPU cap); the buffers are sized to stay within it."""
    if not torch.cuda.is_available():
        raise ConfigError("offload.profile: measuring a profile needs a CUDA device; pass a stored one")
    dev = torch.device(device)
    props = torch.cuda.get_device_properties(dev)
    bf = torch.bfloat16
    gemm_shapes = gemm_shapes or [(8192, 8192, 8192), (8192, 4096, 4096), (8192, 14336, 4096)]
    room = max_bytes or props.total_memory
    gemm = {}
    for m, n, k in (fitting_gemm(*shape, room) for shape in gemm_shapes[:8]):
        a = torch.randn(m, k, device=dev, dtype=bf)
        b = torch.randn(k, n, device=dev, dtype=bf)
        s = seconds_per_call(lambda: a @ b, 10)
        gemm[f"{m}x{n}x{k}"] = 2 * m * n * k / s / 1e12
        del a, b
    gemm["default"] = sum(gemm.values()) / len(gemm)

    # causal SDPA fwd+bwd; useful flops = 4*B*H*T^2*D * 0.5 (causal) * 3.5 (fwd 1 + bwd 2.5)
    B, H, T, D = 2, 16, 4096, 128
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=bf, requires_grad=True) for _ in range(3))

    def attn():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(torch.ones_like(o))

    s = seconds_per_call(attn, 5)
    attn_tflops = 4 * B * H * T * T * D * 0.5 * 3.5 / s / 1e12
    del q, k, v

    nbytes = transfer_bytes(room)
    g1 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    g2 = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    hbm = 2 * nbytes / seconds_per_call(lambda: g2.copy_(g1), 5) / 1e9
    t0 = time.perf_counter()
    h1 = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    pin_s = time.perf_counter() - t0
    h2 = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    h2d = nbytes / seconds_per_call(lambda: g1.copy_(h1, non_blocking=True), 4) / 1e9
    d2h = nbytes / seconds_per_call(lambda: h2.copy_(g2, non_blocking=True), 4) / 1e9
    s2 = torch.cuda.Stream(dev)

    def both():
        g1.copy_(h1, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(g2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s2)

    duplex = 2 * nbytes / seconds_per_call(both, 4) / 1e9
    pg = torch.empty(nbytes // 4, dtype=torch.uint8)
    pageable = (nbytes // 4) / seconds_per_call(lambda: g1[: nbytes // 4].copy_(pg), 2) / 1e9
    t0 = time.perf_counter()
    for _ in range(3):
        h2.copy_(h1)
    memcpy = 3 * nbytes / (time.perf_counter() - t0) / 1e9
    del g1, g2, h1, h2, pg

    p = torch.nn.Parameter(torch.zeros(1 << 26, device=dev))
    p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    gpu_adam = p.numel() / seconds_per_call(opt.step, 5) / 1e9
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
        cpu_adam_one_pass=cpu_adamw.available(),
        cpu_adam_out_of_place_slowdown=measure_out_of_place_slowdown(),
        cuda_context_bytes=outside_allocator_bytes(dev),
    )


def outside_allocator_bytes(device) -> int:
    """Device memory in use now that torch's caching allocator did not reserve: this process's
    CUDA context, loaded kernel modules and library handles (and other processes' memory on the
    same GPU, if any)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def measure_collectives(device, group=None, nbytes: int = 1 << 27, iters: int = 3) -> tuple[float, float]:
    """Bus bandwidth in GB/s of the engine's all-gather and reduce-scatter over `group` (the
    inverse of planner.cost_model.collective_s: (world - 1) / world * bytes / seconds), on `nbytes`
    buffers of bf16. Collective: every rank of `group` must call it; all get the same numbers
    (the slowest rank's time)."""
    import torch.distributed as dist

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


def main() -> int:
    """`python -m flame.offload.profile OUT.json`: measure and store a profile."""
    if {"-h", "--help"} & set(sys.argv[1:]):
        print("usage: python -m flame.offload.profile [OUT.json]  (default offload_profile.json)\n"
              "Measures this machine's hardware profile for the offload planner (needs a CUDA GPU, about 25 s).")
        return 0
    out = sys.argv[1] if len(sys.argv) > 1 else "offload_profile.json"
    t0 = time.perf_counter()
    try:
        p = measure()
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    save(p, out)
    print(json.dumps(asdict(p), indent=1))
    print(f"profile written to {out} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
