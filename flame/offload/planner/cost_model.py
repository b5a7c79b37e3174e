"""Stream-level step-time and memory model of an offload plan.

Resources: the compute stream, the H2D copy engine, the D2H copy engine and the CPU optimizer
thread. Each phase of a step is a flow shop over the blocks in execution order, simulated with
the recurrence finish[stage][j] = max(finish[stage-1][j], finish[stage][j-1], slot_free[j]) + time,
which is exact for in-order streams that overlap freely. Approximations (said here, refit by
calibration): block compute time = GEMM FLOPs / measured GEMM rate + attention FLOPs / measured
attention rate (elementwise work is folded into those rates by calibration); during the
backward both copy directions are taken as busy together, so each gets its share of the
measured duplex rate; the forward's H2D runs alone at the full H2D rate, unless blocks offload
their activations (then the forward's copies share the duplex rate too).

Data parallelism (`world` > 1, see runtime.engine): host units are sharded, so per rank the host
and pinned bytes, the PCIe traffic and the CPU optimizer work are those of one shard
(ceil(numel / world) elements); the GPU holds the full gathered slots / resident copies plus a
grad shard per host unit. Each fetch adds an all-gather after its H2D (added to the copy stage:
conservative, the two run on different engines), each backward a reduce-scatter (added to the
compute stage: the engine issues it there), and the replicated "gpu" units one all-reduce a step.
Collective times are ring-algorithm bus-bandwidth times, (world - 1) / world * bytes / busbw
(all-reduce twice that), with the profile's allgather_gbps / reducescatter_gbps when measured,
else DEFAULT_COLLECTIVE_GBPS. With world = 1 every term is exactly the one-GPU model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flame.offload.planner.block_costs import ModelCosts, UnitCosts
from flame.offload.planner.hardware import HardwareProfile

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
# elements per chunk of the engine's GPU grad conversion (128 MiB in fp32; runtime.engine)
CONV_CHUNK = 1 << 25
# elements per chunk of the host grad adds and norms, the size of their float32 scratch buffer
# (runtime.host_math)
HOST_MATH_CHUNK = 1 << 25
# a parameter that is at least this share of its host unit's trained elements is handed on alone
# as soon as its grad arrives (speculative step, one round a step: its D2H and its CPU AdamW start
# before the rest of the unit's backward has run; runtime.gradients). A third: the output head of
# an untied outer unit (about half of it) qualifies; a Llama block's MLP projections (about a
# quarter each) do not, so blocks stay whole instead of fragmenting into several small jobs.
EARLY_PIECE_SHARE = 1 / 3
RUNTIME_OVERHEAD_BYTES = 256 * 2**20  # cuBLAS workspaces, small buffers: refit by calibration
# bus bandwidth (nccl-tests' busbw) of all-gather / reduce-scatter when the profile has none: a
# deliberately conservative figure (below NVLink's several hundred GB/s, above PCIe-only hosts)
DEFAULT_COLLECTIVE_GBPS = 100.0


def early_piece(param_numel: int, unit_numel: int) -> bool:
    """Whether a parameter of `param_numel` elements is handed on alone in a unit of `unit_numel`
    trained elements (EARLY_PIECE_SHARE)."""
    return param_numel >= EARLY_PIECE_SHARE * unit_numel


def shard_numel(numel: int, world: int) -> int:
    """Elements of one rank's shard of a host unit (its flat numel padded to a multiple of world)."""
    return -(-numel // world)


def padded_numel(numel: int, world: int) -> int:
    return shard_numel(numel, world) * world


def collective_s(nbytes: float, world: int, gbps: float) -> float:
    """Ring time of an all-gather or reduce-scatter of `nbytes` (the full buffer) over `world`
    ranks at bus bandwidth `gbps` (0: DEFAULT_COLLECTIVE_GBPS); 0 for one rank."""
    if world <= 1:
        return 0.0
    return (world - 1) / world * nbytes / ((gbps or DEFAULT_COLLECTIVE_GBPS) * 1e9)


@dataclass
class Dtypes:
    compute: str = "bfloat16"
    master: str = "float32"
    grad: str = "float32"
    moment: str = "float32"

    @property
    def c(self) -> int:
        return DTYPE_BYTES[self.compute]

    @property
    def master_extra(self) -> int:
        """Bytes/param of a separate master copy (none when it is the compute copy)."""
        return 0 if self.master == self.compute else DTYPE_BYTES[self.master]

    @property
    def grad_extra(self) -> int:
        """Bytes/param of a separate grad accumulator (none when grads stay in compute dtype)."""
        return 0 if self.grad == self.compute else DTYPE_BYTES[self.grad]

    @property
    def moments(self) -> int:
        return 2 * DTYPE_BYTES[self.moment]


# unit modes: gpu = everything on GPU, fused GPU AdamW; host_opt = compute copy resident on GPU,
# grads D2H, master/moments on host, CPU AdamW, new copy H2D once a step; stream = compute copy
# streamed from pinned host every pass, grads D2H, CPU AdamW.
MODES = ("gpu", "host_opt", "stream")
# activation modes of a block: keep = saved tensors stay on the GPU; selective = its inputs and the
# outputs of its matmuls and attention stay, the rest of its forward runs again in the backward
# (runtime.selective); recompute = only its inputs stay, its whole forward runs again in the
# backward; offload = saved tensors go to pinned host memory and come back ahead of its backward
# (runtime.activations); recompute_host = recompute, with its inputs in pinned host memory between
# its forward and its backward (the same arenas)
ACT_MODES = ("keep", "selective", "recompute", "offload", "recompute_host")
RECOMPUTED = ("recompute", "recompute_host")  # modes that run the block's whole forward again


# what the engine holds on the GPU for its whole life, by kind (OffloadEngine.memory_report
# measures the same categories)
MEMORY_CATEGORIES = ("compute", "grads", "grad_acc", "master", "moments", "slots", "grad_slots", "conversion",
                     "shards")


def host_grad_dtype(dt: Dtypes, rounds: int) -> str:
    """The dtype host units' grads reach and stay on the host in. With one micro-batch a step
    nothing sums them after autograd wrote them in the compute dtype (a data-parallel
    reduce-scatter sums in that dtype too), so a wider grad dtype would hold the same values: they
    stay in the compute dtype, exactly, in fewer bytes to copy, keep and read. With more
    micro-batches they are summed in the grad dtype."""
    return dt.compute if rounds == 1 and DTYPE_BYTES[dt.compute] < DTYPE_BYTES[dt.grad] else dt.grad


def gpu_acc_extra(mode: str, dt: Dtypes) -> int:
    """Bytes/param of a host unit's GPU grad accumulator (rounds > 1): a host_opt unit whose grads
    are already in grad dtype accumulates in its own grad buffer, at no extra memory."""
    return 0 if mode == "host_opt" and dt.grad_extra == 0 else DTYPE_BYTES[dt.grad]


def unit_gpu_categories(u: UnitCosts, mode: str, dt: Dtypes, gpu_acc: bool = False, world: int = 1) -> dict[str, int]:
    """GPU bytes a unit owns, by category (`gpu_acc`: a host unit accumulating its grads on the GPU
    over the rounds of a step; `world` > 1: host units sharded, "gpu" units replicated)."""
    out = dict.fromkeys(MEMORY_CATEGORIES, 0)
    sharded = world > 1 and mode != "gpu"
    full = padded_numel(u.numel, world) if sharded else u.numel
    # gradients, master copies and moments exist for the trainable parameters only
    t = u.trainable_numel
    if gpu_acc and mode != "gpu":
        # sharded: a separate accumulator of the reduce-scattered shard, in grad dtype
        out["grad_acc"] = shard_numel(t, world) * DTYPE_BYTES[dt.grad] if sharded else t * gpu_acc_extra(mode, dt)
    if sharded:  # the grad shard the full grad is reduce-scattered into
        out["shards"] = shard_numel(t, world) * dt.c
    if mode in ("gpu", "host_opt"):
        # compute copy + its grad (autograd writes grads in the param dtype); full (gathered) size
        out["compute"] = full * dt.c
        out["grads"] = (padded_numel(t, world) if sharded else t) * dt.c
    if mode == "gpu":
        # a separate master / accumulator only when its dtype differs from the compute dtype
        out["master"] = t * dt.master_extra
        out["grad_acc"] = t * dt.grad_extra
        out["moments"] = t * dt.moments
    return out


def unit_gpu_bytes(u: UnitCosts, mode: str, dt: Dtypes, gpu_acc: bool = False, world: int = 1) -> int:
    return sum(unit_gpu_categories(u, mode, dt, gpu_acc, world).values())


def static_gpu_bytes(units: list[UnitCosts], modes: list[str], dt: Dtypes, depth: int, rounds: int,
                     accs: list[bool] | None = None, world: int = 1) -> dict[str, int]:
    """GPU bytes the engine allocates for its whole life, by category: the units' own buffers,
    the weight and grad slots of streamed units, the grad conversion chunks. `accs`: per unit,
    grads accumulated on the GPU (only for host units with rounds > 1, see effective_accs)."""
    out = dict.fromkeys(MEMORY_CATEGORIES, 0)
    accs = effective_accs(modes, accs, rounds)
    for u, m, a in zip(units, modes, accs):
        for k, v in unit_gpu_categories(u, m, dt, a, world).items():
            out[k] += v
    streamed = [padded_numel(u.numel, world) for u, m in zip(units, modes) if m == "stream"]
    if streamed:  # see WeightSchedule.build_slots and Gradients.build_slots (runtime)
        out["slots"] = (depth + 3) * max(streamed) * dt.c
        out["grad_slots"] = 2 * max(padded_numel(u.trainable_numel, world) for u, m in zip(units, modes)
                                    if m == "stream") * dt.c
    host = [shard_numel(u.trainable_numel, world) for u, m in zip(units, modes) if m != "gpu"]
    g = DTYPE_BYTES[host_grad_dtype(dt, rounds)]
    if host and rounds == 1 and g != dt.c:
        out["conversion"] = 2 * min(CONV_CHUNK, max(host)) * g
    return out


def effective_accs(modes: list[str], accs: list[bool] | None, rounds: int) -> list[bool]:
    """Which units really accumulate on the GPU: host units of a plan with rounds > 1 (GPU units
    always do; with one round there is nothing to accumulate). Missing entries: on the host."""
    accs = list(accs or [])
    return [rounds > 1 and m != "gpu" and i < len(accs) and bool(accs[i]) for i, m in enumerate(modes)]


def grad_conversion_bytes(dt: Dtypes, rounds: int) -> int:
    """Bytes/param the CPU optimizer moves converting grads to the master dtype (read + write;
    0 when they already are)."""
    g = host_grad_dtype(dt, rounds)
    return 0 if g == dt.master else DTYPE_BYTES[g] + DTYPE_BYTES[dt.master]


def speculative_spare_bytes(dt: Dtypes) -> int:
    """Bytes per trained parameter of a speculative unit's spare master and moments."""
    return DTYPE_BYTES[dt.master] + dt.moments


def unit_host_bytes(u: UnitCosts, mode: str, dt: Dtypes, rounds: int = 1, gpu_acc: bool = False,
                    world: int = 1, spare: bool = False) -> tuple[int, int]:
    """(total host bytes, of which pinned) of a unit on one rank (its shard when world > 1);
    `spare`: a speculative step's spare master and moments (Plan.speculative_redo)."""
    if mode == "gpu":
        return 0, 0
    # a frozen parameter is its compute copy alone: no grad buffers, master copy or moments
    n, t = shard_numel(u.numel, world), shard_numel(u.trainable_numel, world)
    g = DTYPE_BYTES[host_grad_dtype(dt, rounds)]
    spare_pinned = t * dt.c if spare and not dt.master_extra else 0
    spare = t * speculative_spare_bytes(dt) if spare else 0
    # a spare master that takes turns with the master as the pinned compute copy is pinned too
    if rounds == 1 or gpu_acc:
        # pinned: compute copy the GPU streams from (the master itself when dtypes match) + the
        # grad accumulator the D2H writes into directly (once per step)
        pinned = n * dt.c + t * g + spare_pinned
        return pinned - spare_pinned + t * (dt.master_extra + dt.moments) + spare, pinned
    # rounds > 1: grads arrive in compute dtype into a pinned staging buffer, added on the CPU
    pinned = n * dt.c + t * dt.c + spare_pinned
    return pinned - spare_pinned + t * (dt.master_extra + g + dt.moments) + spare, pinned


@dataclass
class Prediction:
    step_s: float
    gpu_bytes: int
    host_bytes: int
    pinned_bytes: int
    compute_s: float
    h2d_bytes: int
    d2h_bytes: int
    cpu_s: float
    useful_flops: float
    static_gpu: dict = field(default_factory=dict)
    """The engine's own GPU buffers by category (OffloadEngine.memory_report, runtime/memory.py, measures these)."""
    activation_bytes: int = 0
    """Saved for the backward at the end of the forward."""
    transient_bytes: int = 0
    """The step's peak on top of static + activation_bytes (the loss's transients at the end of the
    forward, or a block's backward minus the activations already freed by then: may be negative)."""
    phase_s: list = field(default_factory=list)
    """Seconds of each phase of the step, in order: forward and backward of every round, then
    the GPU optimizer and the all-reduce of replicated units (they add up to step_s)."""


def _flow(jobs, depth, gates=None, lead=(0.0, 0.0)):
    """Flow shop over jobs [(t_cpu, t_h2d, t_compute, t_d2h[, t_host_add])] in order; returns makespan.

    H2D of job j waits for the slot freed by the compute of job j-depth-1 (prefetch depth). The
    optional last stage is the CPU worker adding a job's grads (after their D2H) into its host
    accumulator; the phase ends when the last add has (the next micro-batch's D2H of the same
    unit reuses the staging buffer). `gates[j]`: the job whose D2H must end before job j's
    compute starts (offloaded activations: the GPU copies are freed only after it), or None.
    `lead`: (t_d2h, t_host_add) of work ready at the start, ahead of the jobs' on those two lanes
    (an early piece's copy and CPU step: runtime.gradients)."""
    f_cpu = f_h = f_c = 0.0
    f_d, f_e = lead[0], lead[0] + lead[1]
    comp_end, d_end = [], []
    for j, job in enumerate(jobs):
        a, b, c, d = job[:4]
        e = job[4] if len(job) > 4 else 0.0
        f_cpu = f_cpu + a
        slot = comp_end[j - depth - 1] if j - depth - 1 >= 0 else 0.0
        f_h = max(f_cpu, f_h, slot) + b if b else max(f_cpu, f_h)
        gate = d_end[gates[j]] if gates and gates[j] is not None else 0.0
        f_c = max(f_h, f_c, gate) + c
        comp_end.append(f_c)
        f_d = max(f_c, f_d) + d if d else f_d
        d_end.append(f_d)
        f_e = max(f_d, f_e) + e if e else f_e
    return max(f_c, f_d, f_e)


def kept_bytes(u: UnitCosts, act: str) -> int:
    """Bytes a block in activation mode `act` keeps on the GPU from its forward to its backward
    (measured micro-batch)."""
    if act == "keep":
        return u.act_keep_bytes
    if act == "selective":
        return u.act_select_bytes if u.act_select_bytes is not None else u.act_keep_bytes
    if act == "recompute":
        return u.act_recompute_bytes
    return 0  # offload, recompute_host


def selective_recompute_s(u: UnitCosts, prof: HardwareProfile, scale: float) -> float:
    """Seconds the backward spends recomputing a selective block's non-matmul ops (norms, rotary,
    activation functions): memory-bound, approximated as writing and reading back the saved
    tensors it does not keep at the HBM rate."""
    if u.act_select_bytes is None:
        return 0.0
    return scale * 2 * max(0, u.act_keep_bytes - u.act_select_bytes) / (prof.hbm_gbps * 1e9)


def offload_bytes(u: UnitCosts, act: str = "offload") -> int:
    """Bytes a block in activation mode `act` keeps on the host, which cross PCIe each way
    (measured micro-batch): its saved tensors (offload), its inputs (recompute_host), else none."""
    if act == "recompute_host":
        return u.act_recompute_bytes
    if act != "offload":
        return 0
    return u.act_offload_bytes if u.act_offload_bytes is not None else u.act_keep_bytes


def duplex_shares(prof: HardwareProfile) -> tuple[float, float]:
    """(H2D, D2H) bytes/s while both directions are busy: the measured duplex rate split in the
    ratio of the one-way rates."""
    share = prof.duplex_gbps * 1e9 / (prof.h2d_gbps + prof.d2h_gbps)
    return share * prof.h2d_gbps, share * prof.d2h_gbps


def adam_traffic_bytes(dt: Dtypes, rounds: int) -> int:
    """Host memory bytes the fused AdamW moves per parameter: reads the grad, reads and writes the
    master and both moments."""
    return DTYPE_BYTES[host_grad_dtype(dt, rounds)] + 2 * DTYPE_BYTES[dt.master] + 4 * DTYPE_BYTES[dt.moment]


def cpu_contention(prof: HardwareProfile, dt: Dtypes, rounds: int, cpu_rate: float, copy_bytes: float,
                   window_s: float) -> float:
    """How much slower the CPU optimizer runs while `copy_bytes` cross PCIe from/to host memory over
    `window_s` seconds (>= 1; see predict)."""
    if copy_bytes <= 0 or window_s <= 0:
        return 1.0
    need = adam_traffic_bytes(dt, rounds) * cpu_rate
    capacity = max(2 * prof.host_memcpy_gbps * 1e9, need)
    room = max(capacity - copy_bytes / window_s, 0.25 * capacity)
    return max(1.0, need / room)


def unit_times(u: UnitCosts, prof: HardwareProfile, scale: float, fudge: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of a unit at `scale` x the measured micro-batch: its timed seconds
    when the calibration timed it (the compute scale is the blocks' and is not applied), else its
    FLOPs at the profile's rates times `fudge`."""
    if u.timed_s:
        return scale * u.timed_s[0], scale * u.timed_s[1]
    g = prof.gemm_rate()
    a = 1e12 * prof.attn_tflops
    moved = u.bwd_in_fwd_gemm_flops
    fwd = scale * ((u.fwd_gemm_flops + moved) / g + u.fwd_attn_flops / a) * fudge
    bwd = scale * ((u.bwd_gemm_flops - moved) / g + u.bwd_attn_flops / a) * fudge
    return fwd, bwd


@dataclass
class MemoryPrediction:
    gpu_bytes: int
    host_bytes: int
    pinned_bytes: int
    static_gpu: dict
    activation_bytes: int
    transient_bytes: int


@dataclass
class StateMemory:
    """The memory of a plan's placement of weights, grads and optimizer state (not activations)."""
    static_gpu: dict
    host_bytes: int
    pinned_bytes: int


@dataclass
class ActivationMemory:
    """The memory of a plan's activation modes: what lives on the GPU from the forward to the
    backward, the step's peak (activations included) above the static bytes, pinned arenas."""
    activation_bytes: float
    peak_bytes: float
    host_bytes: int


def state_memory(costs: ModelCosts, dt: Dtypes, layer_modes, outer_mode: str, depth: int, rounds: int,
                 layer_accs: list[bool] | None = None, outer_acc: bool = False, world: int = 1,
                 spare: bool = False) -> StateMemory:
    layers, outer = costs.layers, costs.outer
    units = [outer] + list(layers)
    modes = [outer_mode] + list(layer_modes)
    accs = effective_accs(modes, [outer_acc] + list(layer_accs or [False] * len(layers)), rounds)
    static = static_gpu_bytes(units, modes, dt, depth, rounds, accs, world)
    host = pinned = 0
    for u, m, a in zip(units, modes, accs):
        h, p = unit_host_bytes(u, m, dt, rounds, a, world, spare)
        host += h
        pinned += p
    if rounds > 1 and any(m != "gpu" and not a for m, a in zip(modes, accs)):
        host += HOST_MATH_CHUNK * 4  # the host adds' float32 scratch chunk (runtime.host_math)
    if grad_conversion_bytes(dt, rounds):  # the CPU optimizer's one master-dtype grad buffer (largest host unit)
        host += max((shard_numel(u.trainable_numel, world) for u, m in zip(units, modes) if m != "gpu"), default=0) \
            * DTYPE_BYTES[dt.master]
    return StateMemory(static, host, pinned)


def activation_memory(costs: ModelCosts, dt: Dtypes, layer_acts, depth: int, micro_batch: int) -> ActivationMemory:
    scale = micro_batch / costs.micro_batch
    layers, outer = costs.layers, costs.outer
    # what stays on the GPU from the forward to the backward: an offloaded block's nothing
    layer_act = [scale * kept_bytes(u, a) for u, a in zip(layers, layer_acts)]
    act = sum(layer_act) + scale * outer.act_keep_bytes
    # offloaded blocks' GPU copies in flight (runtime.activations): in the forward the last two
    # offloaded blocks' until the later one ends, the last one's through the head and loss; in
    # block k's backward the restored ones of blocks k-depth..k
    off = [scale * offload_bytes(u, a) for u, a in zip(layers, layer_acts)]
    # The peak is at the end of the forward or in a block's backward. At the end of the forward
    # every activation is alive, plus the loss's transients: the chunked head + loss's own
    # (training.loss_chunk_tokens), the loss backward's (the largest saved tensor, e.g. the
    # log-softmax, with its incoming and outgoing gradient), the outer's weight grads arriving as
    # new tensors before they are added into the unit's grad buffer.
    loss_trans = max(costs.extra.get("loss_chunk_transient_bytes", 0), scale * 2.0 * outer.max_saved_bytes,
                     outer.trainable_numel * dt.c)
    # In block k's backward the outer's and later blocks' activations are gone: blocks 0..k's, plus
    # its transient: a recomputed block's activations and gradient buffers (measured when the
    # calibration ran the block on the GPU; else its saved bytes + twice the largest), a kept
    # block's gradient buffers.
    offloaded = [x for x in off if x]
    peak, kept = act + loss_trans + (offloaded[-1] if offloaded else 0.0), 0.0
    if len(offloaded) > 1:
        peak = max(peak, act + max(a + b for a, b in zip(offloaded, offloaded[1:])))
    for k, (l, a, la) in enumerate(zip(layers, layer_acts, layer_act)):
        kept += la
        if a in RECOMPUTED or a == "selective":  # the backward holds the block's whole saved set again
            t = l.bwd_peak_bytes or l.act_keep_bytes + 2 * l.max_saved_bytes
        else:
            t = 2 * l.max_saved_bytes
        peak = max(peak, kept + sum(off[max(0, k - depth):k + 1]) + scale * t)
    # the offloaded blocks' pinned arenas (each rank its own activations)
    return ActivationMemory(act, peak, int(sum(off)))


def combine_memory(state: StateMemory, acts: ActivationMemory) -> MemoryPrediction:
    gpu = sum(state.static_gpu.values()) + int(acts.peak_bytes) + RUNTIME_OVERHEAD_BYTES
    return MemoryPrediction(gpu, state.host_bytes + acts.host_bytes, state.pinned_bytes + acts.host_bytes,
                            state.static_gpu, int(acts.activation_bytes), int(acts.peak_bytes - acts.activation_bytes))


def predict_memory(costs: ModelCosts, dt: Dtypes, layer_modes, layer_acts, outer_mode: str, depth: int,
                   micro_batch: int, rounds: int, layer_accs: list[bool] | None = None, outer_acc: bool = False,
                   world: int = 1, spare: bool = False) -> MemoryPrediction:
    """Peak GPU bytes and host/pinned bytes of one plan on one rank (the memory half of `predict`;
    the solver bisects over its two halves, cached, before timing one candidate)."""
    return combine_memory(state_memory(costs, dt, layer_modes, outer_mode, depth, rounds, layer_accs, outer_acc, world,
                                       spare),
                          activation_memory(costs, dt, layer_acts, depth, micro_batch))


def predict(costs: ModelCosts, prof: HardwareProfile, dt: Dtypes, layer_modes, layer_acts, outer_mode: str,
            depth: int, micro_batch: int, rounds: int, cpu_threads: int, fudge: float = 1.0,
            layer_accs: list[bool] | None = None, outer_acc: bool = False, world: int = 1,
            node_ranks: int = 1, memory: MemoryPrediction | None = None, speculative: bool = False,
            spare: bool | None = None) -> Prediction:
    """Predicted steady-state step time and peak memory of one plan (`memory`: its predict_memory,
    when the caller has it already; `layer_accs`, `outer_acc`:
    grads of host units accumulated on the GPU over the rounds, sent to the host once a step),
    per rank of `world` data-parallel ranks (host units sharded; bytes are one rank's), `node_ranks`
    of which share this machine's CPUs for their optimizers. `speculative`: host units' CPU steps
    run in the last backward as their grads land, unclipped (`spare`, default `speculative`: into
    spare buffers, Plan.speculative_redo); steps that clip redo them, which this steady-state
    prediction leaves out."""
    spare = speculative if spare is None else spare
    scale = micro_batch / costs.micro_batch
    layers, outer = costs.layers, costs.outer
    c = dt.c
    # the fused CPU AdamW's rate for the master dtype (its moments take that dtype)
    cpu_rate = prof.cpu_adam_rate(cpu_threads, node_ranks, dt.master)
    h2d = prof.h2d_gbps * 1e9
    h2d_bwd, d2h_bwd = duplex_shares(prof)
    memcpy = prof.host_memcpy_gbps * 1e9

    units = [outer] + list(layers)
    modes = [outer_mode] + list(layer_modes)
    acts = ["keep"] + list(layer_acts)
    accs = effective_accs(modes, [outer_acc] + list(layer_accs or [False] * len(layers)), rounds)
    times = [unit_times(u, prof, scale, fudge) for u in units]
    g = DTYPE_BYTES[dt.grad]
    # per rank: a host unit's shard (the whole unit with one rank or in "gpu" mode) ...
    sn = [shard_numel(u.numel, world) if m != "gpu" else u.numel for u, m in zip(units, modes)]
    # ... of which take gradients: grad traffic, reduce-scatters and optimizer work are theirs only
    tn = [shard_numel(u.trainable_numel, world) if m != "gpu" else u.trainable_numel for u, m in zip(units, modes)]
    # ... and the collectives around its full (padded) compute-dtype buffer
    ag_s = [collective_s(padded_numel(u.numel, world) * c, world, prof.allgather_gbps) if m != "gpu" else 0.0
            for u, m in zip(units, modes)]
    rs_s = [collective_s(padded_numel(u.trainable_numel, world) * c, world, prof.reducescatter_gbps) if m != "gpu" else 0.0
            for u, m in zip(units, modes)]
    # CPU work per host unit at the step's end: the fused AdamW and the new compute copy when
    # master != compute dtype; grads in another dtype than the master are converted into a
    # master-dtype buffer first. Each conversion is one copy op: its bytes read + written move at
    # twice the profile's memcpy rate (which counts the bytes copied): a dtype conversion reads
    # and writes at about that rate on a host whose memcpy rate was measured.
    # flame's one-pass kernel (a profile measured with it) does all of it in the measured pass.
    conv = 0 if prof.cpu_adam_one_pass else dt.master_extra and (dt.master_extra + c)
    gconv = 0 if prof.cpu_adam_one_pass else grad_conversion_bytes(dt, rounds)
    host_acc = [m != "gpu" and rounds > 1 and not a for m, a in zip(modes, accs)]
    cpu_t = [n / cpu_rate + n * (conv + gconv) / (2 * memcpy) if m != "gpu" else 0.0 for n, m in zip(tn, modes)]
    # speculative: the same CPU work, queued on the CPU worker after the unit's last D2H of the
    # step instead of gating its next forward; the one-pass kernel writes the spare buffers in its
    # pass, torch's in-place fused AdamW needs master and moments copied there first
    copied = 0 if prof.cpu_adam_one_pass or not spare else speculative_spare_bytes(dt)
    # ... and the one-pass kernel writing into the spare buffers runs at its measured out-of-place rate
    out_of_place = prof.cpu_adam_out_of_place_slowdown if spare and prof.cpu_adam_one_pass else 1.0
    spec_t = [t * out_of_place + n * copied / memcpy if speculative and m != "gpu" else 0.0
              for t, n, m in zip(cpu_t, tn, modes)]
    gate_t = [0.0 if speculative else t for t in cpu_t]
    # speculative, one round, one rank: the outer's untied head is an early piece (runtime.gradients;
    # the loss's backward delivers its grad first): its D2H and its share of the outer's CPU step
    # run from the backward's start, ahead of every block's, not after the outer's backward
    early = (speculative and rounds == 1 and world == 1 and modes[0] != "gpu" and outer.head_numel < tn[0]
             and early_piece(outer.head_numel, tn[0]))
    head_share = outer.head_numel / tn[0] if early else 0.0
    # host accumulation, every micro-batch after the unit's D2H, on the CPU worker: the first
    # copies the staged grads (read c, write g bytes/param), the others add: same dtype read c,
    # read+write g; mixed dtypes convert a chunk into a scratch buffer first (+ write g, read g),
    # see runtime.host_math. The last round also takes the sum's norm chunk by chunk while the
    # chunk is in cache; approximated as one more read of g bytes/param. These bytes move at the
    # memcpy rate, half the conversions' traffic rate: several ops per chunk, each handing the GIL
    # back and forth with the training thread, which runs Python meanwhile.
    add_bytes = c + 2 * g + (2 * g if c != g else 0)

    def acc_s(j: int, r: int) -> float:
        if not host_acc[j]:
            return 0.0
        return tn[j] * ((add_bytes if r else c + g) + (g if r == rounds - 1 else 0)) / memcpy
    # GPU accumulation: one add per round into a separate accumulator (read grad and accumulator,
    # write accumulator) on the compute stream (sharded: always separate, the shard's size)
    add_t = [n * (c + 2 * g) / (prof.hbm_gbps * 1e9) if a and (world > 1 or gpu_acc_extra(m, dt)) else 0.0
             for n, m, a in zip(tn, modes, accs)]
    # bytes per param crossing D2H and in which rounds: once a step in the host grad dtype (one
    # round) or the grad dtype when accumulated on the GPU; otherwise compute dtype every round
    wire = [DTYPE_BYTES[host_grad_dtype(dt, rounds)] if rounds == 1 or a else c for a in accs]
    n = len(layers)
    phases = []
    h2d_bytes = d2h_bytes = 0
    compute = 0.0
    # offloaded activations (bytes per unit, 0 for the outer): D2H after the block's forward,
    # H2D with its weights in the backward. The forward's H2D then shares the link with them.
    off = [0] + [int(scale * offload_bytes(u, a)) for u, a in zip(layers, layer_acts)]
    h2d_fwd, d2h_fwd = (h2d_bwd, d2h_bwd) if any(off) else (h2d, d2h_bwd)
    # the compute after offloaded block i waits for the previous offloaded block's D2H (its GPU
    # copies are dropped then): job i + 1 (forward jobs: the units, then the outer's compute)
    gates = [None] * (n + 2)
    offl = [j for j in range(1, n + 1) if off[j]]
    for p, i in zip(offl, offl[1:]):
        gates[i + 1] = p
    for r in range(rounds):
        fw = []
        for j, (u, m) in enumerate(zip(units, modes)):
            need = m == "stream" or (m == "host_opt" and r == 0)
            b = sn[j] * c if need else 0
            h2d_bytes += b
            d2h_bytes += off[j]
            # the outer's forward is the head and loss at the end (the embedding lookup at the
            # start costs next to nothing): its weights and CPU step gate the start, its compute
            # runs after the last block
            fw.append((gate_t[j] if r == 0 else 0.0, b / h2d_fwd + (ag_s[j] if need else 0.0), times[j][0] if j else 0.0,
                       off[j] / d2h_fwd))
            compute += times[j][0]
        fw.append((0.0, 0.0, times[0][0], 0.0))
        phases.append(_flow(fw, depth, gates))
        if r == 0:
            fw0 = fw
        bw = []
        for k in range(n, -1, -1):  # layers n-1..0 then outer (index 0)
            m = modes[k]
            # streamed layers still in a slot after the forward (the last depth+1) are not refetched
            refetch = m == "stream" and k >= 1 and (k - 1) < n - (depth + 1)
            b = (sn[k] * c if refetch else 0) + off[k]
            sends = m != "gpu" and (not accs[k] or r == rounds - 1)
            d = tn[k] * wire[k] if sends else 0
            h2d_bytes += b
            d2h_bytes += d
            spec = spec_t[k] if r == rounds - 1 else 0.0
            if k == 0:  # the early head went ahead (`lead` below)
                d, spec = d * (1 - head_share), spec * (1 - head_share)
            redo = times[k][0] if acts[k] in RECOMPUTED else \
                selective_recompute_s(units[k], prof, scale) if acts[k] == "selective" else 0.0
            ct = times[k][1] + redo + add_t[k]
            compute += ct
            bw.append((0.0, b / h2d_bwd + (ag_s[k] if refetch else 0.0), ct + rs_s[k], d / d2h_bwd,
                       acc_s(k, r) + spec))
        phases.append(_flow(bw, depth, lead=(head_share * tn[0] * wire[0] / d2h_bwd, head_share * spec_t[0])))
    gpu_params = sum(u.trainable_numel for u, m in zip(units, modes) if m == "gpu")
    # the GPU AdamW, then for replicated "gpu" units one all-reduce (reduce-scatter + all-gather)
    # of their grads a step
    phases.append(gpu_params / (prof.gpu_adam_gparams * 1e9) + collective_s(gpu_params * g, world, prof.reducescatter_gbps)
                  + collective_s(gpu_params * g, world, prof.allgather_gbps))
    # The CPU optimizer runs in the first forward, while offloaded activations go D2H into the same
    # host memory. Host memory traffic is taken to sustain max(2 x the memcpy rate, what the AdamW
    # alone moves at its measured rate); the forward's average activation traffic is taken out of
    # it first, and the CPU work stretches when the AdamW's traffic no longer fits in the rest.
    # The weights' H2D reads are left out of this term: beside them alone the AdamW's rate stays
    # within its step-to-step spread; activations copied to the host in bulk slow it measurably.
    slow = cpu_contention(prof, dt, rounds, cpu_rate, sum(off), phases[0])
    if slow > 1.0:  # (speculative: no CPU work in the forward, nothing changes)
        cpu_t = [t * slow for t in cpu_t]
        phases[0] = _flow([(a * slow, b, cc, d) for a, b, cc, d in fw0], depth, gates)
    total = sum(phases)

    m = memory or predict_memory(costs, dt, layer_modes, layer_acts, outer_mode, depth, micro_batch, rounds,
                                 layer_accs, outer_acc, world, spare)
    useful = rounds * sum(scale * (u.fwd_gemm_flops + u.bwd_gemm_flops + u.fwd_attn_flops + u.bwd_attn_flops) for u in units)
    return Prediction(total, m.gpu_bytes, m.host_bytes, m.pinned_bytes, compute, h2d_bytes, d2h_bytes,
                      sum(spec_t) if speculative else sum(cpu_t),
                      useful, m.static_gpu, m.activation_bytes, m.transient_bytes, phases)
