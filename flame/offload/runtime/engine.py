"""The offload engine: executes a Plan on a model, block by block.

Every unit (a decoder block, or "outer" = everything else: embeddings, final norm, head) owns
flat buffers; its module parameters become views into its compute-dtype flat buffer:
- gpu:      compute copy, grads, master and moments on the GPU; fused GPU AdamW.
- host_opt: compute copy resident on the GPU; grads D2H after the unit's backward; master and
            moments on the host; fused CPU AdamW writes the new compute copy into a pinned buffer
            that is copied H2D once before the unit's next forward.
- stream:   like host_opt, but the compute copy lives only in a rotating pool of GPU slots,
            filled from the pinned buffer `prefetch_depth` blocks ahead, in the forward and again
            in the backward. Saved tensors that are slot weights are stored as (unit, offset,
            shape, stride) and re-materialized from the unit's current slot in the backward.
Only streams and events order GPU work; the host waits for the GPU once per step (the global
grad norm the CPU optimizer needs) and on the CPU thread (D2H done before the CPU reads).

Data parallelism (world > 1, ZeRO-3-like over the flat buffers): every host unit's flat numel is
padded to a multiple of the world size and rank r owns [r*S, (r+1)*S). Its host buffers (pinned
compute copy, master, moments, grad staging and accumulator) and its CPU AdamW hold only that
shard: the weights cross PCIe once per rank, the rest goes over NVLink/the network. A fetch
copies the own shard H2D into the rank's slice of the unit's full GPU buffer (slot or resident
copy) and all-gathers in place on a comm stream (FSDP2 does the same in-place gather). After the
unit's backward its full grad is reduce-scattered (sum: the trainer divides the loss by the
global token count, as for FSDP with its division disabled) into a GPU shard buffer, which then
goes D2H (or into the shard-sized GPU accumulator) exactly as the full grad does with one rank.
The grad norm all-reduces the squared norms of the owned shards (padding is zero). The optimizer
step needs no communication; the next fetch gathers the new weights. "gpu" units stay
replicated (the simplest correct choice): their accumulated grads are all-reduced (sum) once a
step before the norm, and every rank steps the same copy on the GPU.
"""

from __future__ import annotations

import math
import sys
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from flame.errors import ConfigError
from flame.models.blocks import find_blocks
from flame.offload.planner.cost_model import ACT_MODES, CONV_CHUNK, MEMORY_CATEGORIES
from flame.offload.planner.plan import Plan
from flame.offload.runtime.activations import HostActivations
from flame.offload.runtime.collectives import all_gather_flat, comm_device, multi_rank, native, reduce_scatter_flat
from flame.offload.runtime.host_math import HostMath
from flame.offload.runtime.selective import selective_checkpoint
from flame.offload.runtime.state_dict import EngineStateDict
from flame.offload.runtime.streams import PIN_PIECE_BYTES, Streams, copy_pieces, register_pinned, unregister_pinned
from flame.offload.runtime.units import Unit, _same, _Slot

TOO_MANY_ROUNDS = ("offload: the plan has {} micro-batch(es) per step but the trainer ran more; "
                   "plan with the trainer's training.gradient_accumulation_steps")
SWITCH_INTERVAL_S = 1e-4
DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _no_cache(kwargs: dict) -> dict:
    """A checkpointed block's keyword arguments without a KV cache: its forward runs again in the
    backward and would append to the cache twice (HF models pass one when `use_cache` is on;
    training never reads it). Selective recompute refuses the second forward's different ops."""
    out = dict(kwargs)
    if out.get("past_key_values") is not None:
        out["past_key_values"] = None
    if out.get("use_cache"):
        out["use_cache"] = False
    return out


class OffloadEngine(EngineStateDict):
    def __init__(self, model: nn.Module, plan: Plan, device: torch.device, lr: float = 1e-3,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0, description: str = "",
                 no_decay: set[str] | None = None, pin_piece_bytes: int = PIN_PIECE_BYTES, group=None):
        """`group`: the data-parallel process group the host units are sharded over; None takes
        the default group when torch.distributed is initialized with more than one rank."""
        self.model, self.plan, self.device = model, plan, torch.device(device)
        import torch.distributed as dist

        if group is None and multi_rank():
            group = dist.group.WORLD
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if self.world > 1 and self.device.type == "cuda" and not native(group):
            raise ConfigError(f"offload: data parallelism on {self.device} needs the NCCL backend, "
                              f"got {dist.get_backend(group)}")
        self.comm_dev = comm_device(group, self.device) if self.world > 1 else self.device
        self.pin_piece_bytes = pin_piece_bytes  # cudaHostRegister piece of every pinned buffer
        self.description = description
        dts = plan.dtypes
        self.cdt, self.mdt, self.gdt, self.odt = (DT[dts[k]] for k in ("compute", "master", "grad", "moment"))
        if self.odt != self.mdt:
            raise ConfigError(f"offload.moment_dtype={dts['moment']}: torch AdamW keeps moments in the master dtype ({dts['master']})")
        self.s = Streams(self.device)
        self.cuda = self.s.cuda
        # all-gathers of the weights run here, off the compute stream (prefetched like the H2D)
        self.comm = torch.cuda.Stream(self.device) if self.cuda and self.world > 1 else None
        self.pin = self.cuda
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        # parameters without weight decay (norms, biases, embeddings) as in the plain optimizer;
        # decay is applied by hand (decoupled, as AdamW does) on the decayed slices of each flat unit
        self.no_decay = set(no_decay or ())
        self.rounds = plan.rounds
        self.direct = plan.rounds == 1
        self.depth = plan.prefetch_depth
        self.round = 0
        self._clean = True  # no grads since the last step: zero_grad has nothing to do
        self.use_counter = 0
        self.pinned_ptrs: list[int] = []
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="offload-cpu")
        # The CPU worker dispatches a few torch ops per host chunk (HostMath) and needs the GIL
        # back after each; the training thread runs Python meanwhile (hooks, the recomputed
        # forward) and keeps the GIL up to the switch interval each time (5 ms by default), which
        # makes the worker's host adds several times slower than alone. At 0.1 ms they run at
        # nearly their speed alone: that interval while the engine lives, restored at close().
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        self.host_math = HostMath()  # chunked adds and norms of host grads (the one pool worker only)
        self._grad_scratch = None  # master-dtype grads of the unit the CPU AdamW steps (one worker: one buffer)
        # seconds spent per kind of host work since the last reset_host_seconds() (calibration:
        # compared with the cost model's CPU terms); pool keys and main-thread keys never overlap
        self.host_seconds = Counter()
        # a list to fill: the CPU worker appends (kind, unit index, start, end), perf_counter
        # seconds, per job (benchmarks/offload_blocks.py lines them up with the GPU's timeline)
        self.trace: list | None = None
        self.cpu_threads = plan.cpu_threads
        blocks_name, blocks = find_blocks(model)
        if len(blocks) != len(plan.layer_modes):
            raise ConfigError(f"offload.plan: {len(plan.layer_modes)} blocks in the plan, model has {len(blocks)}")
        bad = next((a for a in plan.layer_acts if a not in ACT_MODES), None)
        if bad is not None or len(plan.layer_acts) != len(blocks):
            raise ConfigError(f"offload.plan: activation mode {bad!r}, expected one of {', '.join(ACT_MODES)} per block"
                              if bad is not None else f"offload.plan: {len(plan.layer_acts)} activation modes, "
                              f"model has {len(blocks)} blocks")
        self.blocks = blocks
        fqn_of = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            fqn_of.setdefault(id(p), []).append(n)
        self.fqns = fqn_of  # every name of a (possibly tied) parameter
        block_ids = set()
        units = []
        for i, b in enumerate(blocks):
            ps = [(fqn_of[id(p)][0], p) for p in b.parameters()]
            block_ids |= {id(p) for _, p in ps}
            units.append(Unit(i + 1, f"{blocks_name}.{i}", ps, plan.layer_modes[i], plan.layer_acts[i]))
        outer = [(fqn_of[id(p)][0], p) for p in model.parameters() if id(p) not in block_ids]
        self.units = [Unit(0, "outer", outer, plan.outer_mode, "keep")] + units
        for u, acc in zip(self.units, plan.unit_accs()):
            u.gpu_acc = acc
        for u in self.units:
            if self.world > 1 and u.mode != "gpu":
                u.sharded = True
                u.pn = -(-u.numel // self.world) * self.world
                u.sn = u.pn // self.world
                u.lo = self.rank * u.sn
            # ranges NOT decayed (no_decay parameters, the shard's padding is harmless either way)
            # in the coordinates of the unit's (shard of the) master
            u.no_decay = [(a - u.lo, b - a) for (fqn, p), o in zip(u.params, u.offsets)
                          if fqn in self.no_decay and (ab := u.owned(o, p.numel())) for a, b in [ab]]
        for mod in model.modules():  # buffers (rotary tables, ...) live on the compute device
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = b.to(self.device)
        self._build_buffers()
        # activations offloaded to host: per block, its arena; the forward's last offloaded block
        # (its GPU copies are dropped once the next one ends or the forward does)
        for u in self.units:
            u.acts = HostActivations(u.name, self.s, self.device, self.pin, pin_piece_bytes) \
                if u.act == "offload" else None
        self._offloading = None  # the offloaded block whose forward runs now
        self._last_offloaded = None
        # storages of weights that are not slots: never offloaded as activations
        self.weight_ptrs = {u.w.untyped_storage().data_ptr() for u in self.units if u.w is not None}
        self._install_hooks()
        self.gpu_sq = torch.zeros((), dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------------ buffers
    def _flat_from_params(self, u: Unit, dtype, device) -> torch.Tensor:
        """The unit's flat values on this rank: its shard [lo, lo + sn), zero padding included."""
        t = (torch.zeros if u.sharded else torch.empty)(u.sn, dtype=dtype, device=device)
        for (_, p), o in zip(u.params, u.offsets):
            ab = u.owned(o, p.numel())
            if ab:
                t[ab[0] - u.lo:ab[1] - u.lo].copy_(p.data.reshape(-1)[ab[0] - o:ab[1] - o])
        return t

    def _build_buffers(self) -> None:
        dev = self.device
        host_units = [u for u in self.units if u.mode != "gpu"]
        stream_units = [u for u in self.units if u.mode == "stream"]
        self.conv = []
        if self.direct and host_units and self.gdt != self.cdt:
            # two rotating chunk buffers for the GPU-side grad conversion before D2H
            n = min(CONV_CHUNK, max(u.sn for u in host_units))
            self.conv = [torch.empty(n, dtype=self.gdt, device=dev) for _ in range(2)]
        self.slots, self.gslots, self.slot_ptrs = [], [], {}
        if stream_units:
            big = max(u.pn for u in stream_units)
            # depth+1 ahead of (or behind) the running block, the running block, and the block whose
            # backward may still be finishing (protected until its grads are out)
            self.slots = [_Slot(torch.empty(big, dtype=self.cdt, device=dev)) for _ in range(self.depth + 3)]
            self.gslots = [_Slot(torch.empty(big, dtype=self.cdt, device=dev)) for _ in range(2)]
            self.slot_ptrs = {s.buf.untyped_storage().data_ptr(): s for s in self.slots}
        for u in self.units:
            # one unit at a time, its parameters rebound before the next: the model's original
            # storage (fp32 on the GPU when built there) is freed unit by unit, never all kept
            self._build_unit(u)
        if self.pin:
            # page-lock in the background while the GPU side is set up; joined before the first forward
            def pin_all():
                for u in host_units:
                    for t in (u.w_host, u.g_stage):
                        self.pinned_ptrs += register_pinned(t, self.pin_piece_bytes)

            self._pin_thread = threading.Thread(target=pin_all, daemon=True)
            self._pin_thread.start()
        else:
            self._pin_thread = None

    def _build_unit(self, u: Unit) -> None:
        dev, cpu = self.device, torch.device("cpu")
        master = self._flat_from_params(u, self.mdt, dev if u.mode == "gpu" else cpu)
        if u.mode == "gpu":
            u.w = master if self.mdt == self.cdt else master.to(self.cdt)
        else:
            # the pinned compute copy the GPU streams from (exact size, registered later)
            # with master dtype == compute dtype the master is the pinned copy the GPU streams
            # from: the CPU step waits for the last H2D read of it before writing (_cpu_step)
            u.w_host = master.to(self.cdt) if self.mdt != self.cdt else master
            if self.direct or u.gpu_acc:
                # grads arrive on the host once a step already in grad dtype (converted or
                # accumulated on the GPU), straight into the accumulator the CPU AdamW reads
                u.g_stage = torch.zeros(u.sn, dtype=self.gdt)
                u.gacc = u.g_stage
            else:
                u.g_stage = torch.zeros(u.sn, dtype=self.cdt)
                u.gacc = torch.zeros(u.sn, dtype=self.gdt)
            u.w = torch.empty(u.pn, dtype=self.cdt, device=dev) if u.mode == "host_opt" else None
            if u.w is not None:  # the initial compute copy is in place: no H2D before the first forward
                self._xfer(u.w_host, 0, u.sn, u.w[u.lo:], to_host=False, non_blocking=False)
                if u.sharded:
                    all_gather_flat(u.w, u.w[u.lo:u.lo + u.sn], self.group)
        u.master = nn.Parameter(master, requires_grad=False)
        # full grad buffer (padded: the reduce-scatter's input; autograd never writes the padding)
        u.g = torch.zeros(u.pn, dtype=self.cdt, device=dev) if u.mode != "stream" else None
        if u.sharded:
            u.gsh = torch.empty(u.sn, dtype=self.cdt, device=dev)
        if u.mode == "gpu":
            u.gacc = u.g if self.gdt == self.cdt else torch.zeros(u.numel, dtype=self.gdt, device=dev)
        if u.gpu_acc:  # a host_opt unit with grads in grad dtype accumulates in its grad buffer
            # (sharded: the shard of the sum accumulates, the full grad is reduce-scattered each round)
            same = u.mode == "host_opt" and self.gdt == self.cdt and not u.sharded
            u.gacc_dev = u.g if same else torch.zeros(u.sn, dtype=self.gdt, device=dev)
        u.opt = torch.optim.AdamW([u.master], lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.wd,
                                  fused=True)
        # stream: parameters point at a slot (nothing meaningful) until fetched
        u.bind(u.w if u.w is not None else self.slots[0].buf[: u.numel])
        if u.g is not None:
            u.bind(u.g, grad=True)

    # ------------------------------------------------------------------ fetching
    def _fetch(self, u: Unit, protect: set[int]) -> None:
        """Make `u`'s weights available on the GPU (issue the H2D on the copy stream)."""
        if u.mode == "gpu":
            return
        if u.mode == "host_opt":
            if not u.needs_h2d:
                return
            self._wait_unit(u)
            with self.s.on(self.s.h2d):
                self._xfer(u.w_host, 0, u.sn, u.w[u.lo:], to_host=False)
                u.h2d_src_done = self.s.record(self.s.h2d)
            u.ready = self._gather(u, u.w, u.h2d_src_done)
            u.needs_h2d = False
            return
        self.use_counter += 1
        if u.slot is not None and u.slot.owner is u:
            u.slot.last_use = self.use_counter
            return
        self._wait_unit(u)
        cands = [s for s in self.slots if s.owner is None or s.owner.idx not in protect]
        slot = min(cands, key=lambda s: s.last_use)
        if slot.owner is not None:
            slot.owner.slot = None
        slot.owner, slot.last_use, u.slot = u, self.use_counter, slot
        with self.s.on(self.s.h2d):
            self.s.wait(self.s.h2d, slot.free)
            self._xfer(u.w_host, 0, u.sn, slot.buf[u.lo:], to_host=False)
            u.h2d_src_done = self.s.record(self.s.h2d)
        u.ready = self._gather(u, slot.buf, u.h2d_src_done)
        u.bind(slot.buf[: u.numel])

    def _gather(self, u: Unit, buf: torch.Tensor, h2d_done):
        """Sharded: all-gather the rank's slice of `buf` (just copied H2D) in place into the whole
        unit, on the comm stream once the copy is done; returns the event of the full weights."""
        if not u.sharded:
            return h2d_done
        with self.s.on(self.comm):
            self.s.wait(self.comm, h2d_done)
            all_gather_flat(buf[:u.pn], buf[u.lo:u.lo + u.sn], self.group)
            return self.s.record(self.comm)

    def _xfer(self, host: torch.Tensor, lo: int, hi: int, dev: torch.Tensor, to_host: bool,
              non_blocking: bool = True) -> None:
        """host[lo:hi] <-> dev[:hi - lo] in the pieces `host` was page-locked in."""
        copy_pieces(host, lo, hi, dev, to_host, self.pin_piece_bytes, non_blocking)

    def _use(self, u: Unit) -> None:
        """The compute stream waits for `u`'s weights."""
        if u.mode != "gpu" and u.ready is not None and self.cuda:
            torch.cuda.current_stream().wait_event(u.ready)

    def _release(self, u: Unit) -> None:
        if u.slot is not None:
            u.slot.free = self.s.record()

    # ------------------------------------------------------------------ hooks
    def _install_hooks(self) -> None:
        """Hooks on the model; their handles are kept so that close() gives the model back."""
        n = len(self.blocks)
        self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        h = [self.model.register_forward_pre_hook(self._model_pre), self.model.register_forward_hook(self._model_post)]
        self._wrapped = []
        for i, b in enumerate(self.blocks):
            u = self.units[i + 1]
            h += [b.register_forward_pre_hook(self._block_pre(u, i, n)), b.register_forward_hook(self._block_post(u))]
            ckpt = {"recompute": partial(checkpoint, use_reentrant=False),
                    "selective": selective_checkpoint}.get(u.act)
            if ckpt is not None:
                b.forward = lambda *a, _f=b.forward, _c=ckpt, **k: _c(_f, *a, **_no_cache(k))
                self._wrapped.append(b)
        for u in self.units:
            for _, p in u.params:
                h.append(p.register_post_accumulate_grad_hook(self._weak_unit_call(OffloadEngine._grad_arrived, u)))
        self._handles = h

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        for b in self._wrapped:
            del b.forward  # the instance attribute set above; the class's forward shows again
        self._handles, self._wrapped = [], []

    def _join_pin(self) -> None:
        """Wait for the background page-locking: no copy may touch a range being registered."""
        if self._pin_thread is not None:
            self._pin_thread.join()
            self._pin_thread = None

    def _model_pre(self, mod, args):
        self._join_pin()
        outer = self.units[0]
        self._fetch(outer, set())
        for j in range(1, min(len(self.units), self.depth + 2)):
            self._fetch(self.units[j], set(range(1, self.depth + 2)))
        self._use(outer)
        if self.cuda:  # grads of the last round left the GPU buffers before they refill
            for u in self.units:
                if u.mode == "host_opt" and u.g_free is not None:
                    torch.cuda.current_stream().wait_event(u.g_free)
        for u in self.units:
            u.count, u.flushed = 0, False
        self._bwd_started = False
        self._saved_hooks.__enter__()

    def _model_post(self, mod, args, out):
        self._saved_hooks.__exit__(None, None, None)
        if self._last_offloaded is not None:
            self._last_offloaded.release_forward()
            self._last_offloaded = None

    def _block_pre(self, u: Unit, i: int, n: int):
        def hook(mod, args):
            protect = set(range(u.idx, u.idx + self.depth + 1))
            for j in range(u.idx, min(u.idx + self.depth + 1, n + 1)):
                self._fetch(self.units[j], protect)
            self._use(u)
            if u.acts is not None:
                u.acts.begin_forward()
                self._offloading = u.acts

        return hook

    def _block_post(self, u: Unit):
        def hook(mod, args, out):
            self._release(u)
            if u.acts is not None:
                self._offloading = None
                u.acts.copy_out()
                if self._last_offloaded is not None:  # at most two offloaded blocks on the GPU
                    self._last_offloaded.release_forward()
                self._last_offloaded = u.acts
            t = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(self._weak_unit_call(OffloadEngine._bwd_start, u))

        return hook

    def _bwd_start(self, u: Unit) -> None:
        if not self._bwd_started:
            self._bwd_started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)
        protect = set(range(max(1, u.idx - self.depth), u.idx + 2))
        for v in self.units[u.idx + 1:]:  # their backward is done
            if v.acts is not None:
                v.acts.release_backward()
        for j in range(u.idx, max(0, u.idx - self.depth - 1), -1):
            self._fetch(self.units[j], protect)
            if self.units[j].acts is not None:  # prefetched with the weights, the same depth
                self.units[j].acts.fetch()
        self._use(u)
        if u.mode == "stream":
            gs = min(self.gslots, key=lambda s: s.last_use)
            self.use_counter += 1
            gs.owner, gs.last_use, u.gslot = u, self.use_counter, gs
            self.s.wait(self.s.current(), gs.free)
            u.g = gs.buf[: u.pn]
            u.g.zero_()
            u.bind(u.g, grad=True)

    def _weak_unit_call(self, fn, u: Unit):
        """A hook calling fn(engine, u) while the engine lives, for hooks that autograd's C++ side
        owns (parameters, graph nodes). The garbage collector cannot see through those: a strong
        reference to the engine (or to `u`, which holds the parameters) would make a cycle it never
        collects, keeping the engine, the model and all their GPU memory alive after the engine is
        dropped (a later run in the same process then starts that much fuller). Returns None (a
        tensor hook that leaves the gradient as it is)."""
        me, idx = weakref.ref(self), u.idx

        def hook(*_):
            eng = me()
            if eng is not None:
                fn(eng, eng.units[idx])

        return hook

    def _grad_arrived(self, u: Unit) -> None:
        self._clean = False
        u.count += 1
        if u.count == len(u.params):
            self._grads_ready(u)

    def _bwd_end(self) -> None:
        for u in self.units:
            if u.acts is not None:
                u.acts.release_backward()
        for u in self.units:
            if not u.flushed:
                self._grads_ready(u)
        self.round += 1

    def _grads_ready(self, u: Unit) -> None:
        """All of `u`'s grads of this micro-batch are in u.g: accumulate or send to the host."""
        if u.flushed:
            return
        u.flushed = True
        if u.mode == "gpu":
            if u.gacc is not u.g:
                u.gacc.add_(u.g)
                u.g.zero_()
            return
        if u.mode == "stream":
            self._release(u)
        if self.direct and self.round > 0:
            raise RuntimeError(TOO_MANY_ROUNDS.format(self.rounds))
        # this rank's part of the micro-batch's grads: the whole unit, or the reduce-scattered shard
        g = self._reduce_scatter(u) if u.sharded else u.g
        if u.gpu_acc:
            self._acc_on_gpu(u, g)
            return
        if self.direct:
            # the norm of the full grad (of the own shard), computed on the GPU while the copy runs
            self.gpu_sq += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        u.stage_free.wait()
        u.stage_free.clear()

        def copy_out():
            if self.conv:
                # convert on the GPU in chunks, copy each chunk out; the stream orders buffer reuse
                n = self.conv[0].numel()
                for k, a in enumerate(range(0, u.sn, n)):
                    b = min(u.sn, a + n)
                    buf = self.conv[k % 2][: b - a]
                    buf.copy_(g[a:b])
                    self._xfer(u.g_stage, a, b, buf, to_host=True)
            else:
                self._xfer(u.g_stage, 0, u.sn, g, to_host=True)

        self._d2h(u, copy_out, u.g if u.mode == "host_opt" and not u.sharded else None)
        if u.sharded:
            u.gsh_free = u.d2h_done
        elif u.gslot is not None:
            u.gslot.free = u.d2h_done
        if self.direct:
            u.stage_free.set()  # the CPU AdamW waits for d2h_done itself
            return
        first, last = self.round == 0, self.round == self.rounds - 1
        ev = u.d2h_done

        def accumulate():
            ev.synchronize()
            t = time.perf_counter()
            # the last round completes the sum: its norm is taken chunk by chunk right after the
            # add (cache-hot), overlapped with the rest of the backward
            if first:
                u.gacc.copy_(u.g_stage)
            else:
                u.host_sq = self.host_math.add_(u.gacc, u.g_stage, norm=last)
            self._account("accumulate_and_norm" if last else "accumulate", u, t)
            u.stage_free.set()

        self.pool.submit(accumulate)

    def _reduce_scatter(self, u: Unit) -> torch.Tensor:
        """Sum the unit's full grad over the ranks into this rank's shard (u.gsh) on the compute
        stream; the full buffer is free again right after (zeroed, or its grad slot released)."""
        self.s.wait(self.s.current(), u.gsh_free)  # the last D2H of the shard has read it
        reduce_scatter_flat(u.gsh, u.g[:u.pn], self.group)
        if u.mode == "host_opt":
            u.g.zero_()  # autograd adds the next round's grads into it
        elif u.gslot is not None:
            u.gslot.free = self.s.record()
        return u.gsh

    def _acc_on_gpu(self, u: Unit, g: torch.Tensor) -> None:
        """Add this micro-batch's grads `g` (u.g, or the rank's reduce-scattered shard) into the
        unit's GPU accumulator; after the plan's last round send the sum to the host: one D2H a
        step instead of one a round, no CPU adds."""
        if u.sent:
            raise RuntimeError(TOO_MANY_ROUNDS.format(self.rounds))
        if u.gacc_dev is not g:
            if self.round == 0:  # overwrite: nothing to zero between steps
                self.s.wait(self.s.current(), u.g_free)  # once the last step's D2H has read it
                u.gacc_dev.copy_(g)
            else:
                u.gacc_dev.add_(g)
            if u.sharded:
                pass  # the full buffer was freed by the reduce-scatter; gsh is reused in stream order
            elif u.mode == "host_opt":
                u.g.zero_()  # autograd adds the next round's grads into it
            else:
                u.gslot.free = self.s.record()  # the grad slot is free once the add has run
        if self.round == self.rounds - 1:
            self._send_acc(u)

    def _send_acc(self, u: Unit) -> None:
        """The accumulated grads D2H into the pinned buffer the CPU AdamW reads; their squared
        norm computed on the GPU meanwhile (as with one round)."""
        u.sent = True
        self.gpu_sq += torch.linalg.vector_norm(u.gacc_dev, dtype=torch.float32).square()
        # accumulated in its grad buffer: empty it for the next step once copied
        self._d2h(u, lambda: self._xfer(u.g_stage, 0, u.sn, u.gacc_dev, to_host=True),
                  u.g if u.gacc_dev is u.g else None)

    def _d2h(self, u: Unit, copy_out, then_zero: torch.Tensor | None) -> None:
        """Run `copy_out` (u's grads into its pinned staging buffer) on the D2H stream after the
        compute stream's work so far, then zero `then_zero` there; record when it is done."""
        cur = self.s.current()
        with self.s.on(self.s.d2h):
            if self.cuda:
                self.s.d2h.wait_stream(cur)
            copy_out()
            if then_zero is not None:
                then_zero.zero_()
            u.d2h_done = self.s.record(self.s.d2h)
        u.g_free = u.d2h_done

    # ------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor):
        if self.slot_ptrs and t.device.type == self.device.type:
            slot = self.slot_ptrs.get(t.untyped_storage().data_ptr())
            if slot is not None and slot.owner is not None:
                return ("w", slot.owner, t.storage_offset(), tuple(t.shape), t.stride())
        a = self._offloading
        if (a is not None and t.device.type == self.device.type and t.is_floating_point()
                and t.untyped_storage().data_ptr() not in self.weight_ptrs):
            return a.pack(t)
        return t

    @staticmethod
    def _unpack(x):
        # static: every saved tensor of the graph keeps this hook (from C++, unseen by the garbage
        # collector); the engine must not be reachable from it (see _weak_unit_call)
        if isinstance(x, tuple):
            if x[0] == "a":
                return x[1].unpack(x[2])
            _, u, off, shape, stride = x
            return torch.as_strided(u.slot.buf, shape, stride, off)
        return x

    # ------------------------------------------------------------------ optimizer
    def _wait_cpu(self) -> None:
        self.pool.submit(lambda: None).result()

    def _wait_unit(self, u: Unit) -> None:
        """The forward needs `u`'s new weights: wait for its CPU AdamW (timed: an exposed optimizer)."""
        if not u.cpu_done.is_set():
            t = time.perf_counter()
            u.cpu_done.wait()
            self._account("forward_waits_for_cpu_adam", u, t)

    def _account(self, kind: str, u: Unit, t0: float) -> None:
        t1 = time.perf_counter()
        self.host_seconds[kind] += t1 - t0
        if self.trace is not None:
            self.trace.append((kind, u.idx, t0, t1))

    def reset_host_seconds(self) -> dict[str, float]:
        """The host-time counters since the last reset (then zeroed)."""
        out, self.host_seconds = dict(self.host_seconds), Counter()
        return out

    def optimizer_step(self, max_norm: float = 0.0, skip_nan_inf: bool = False, lr: float | None = None):
        """Clip by the global grad norm, step every unit; returns (grad_norm, skipped).

        GPU units step now; host units are stepped on the CPU thread in forward order, each
        writing its new compute copy into the pinned buffer; the next forward waits per unit."""
        if lr is not None:
            self.lr = lr
        for u in self.units:  # fewer micro-batches than planned: send what was accumulated
            if u.gpu_acc and not u.sent and self.round > 0:
                self._send_acc(u)
        t = time.perf_counter()
        self._wait_cpu()  # all accumulations queued by the backward are done (they wait on D2H events)
        self.host_seconds["step_waits_for_accumulation"] += time.perf_counter() - t
        sq = self.gpu_sq.clone()  # the norms taken on the GPU as grads left for the host
        gpu_units = [u for u in self.units if u.mode == "gpu"]
        host_units = [u for u in self.units if u.mode != "gpu"]
        # units accumulated on the host: the norm of the sum, taken by the last accumulation (or
        # here when the step ran fewer micro-batches than planned)
        t = time.perf_counter()
        cpu_sq = 0.0
        for u in host_units:
            if not (self.direct or u.gpu_acc):
                cpu_sq += u.host_sq if u.host_sq is not None else self.host_math.sq_norm(u.gacc)
            u.host_sq = None
        self.host_seconds["step_norms_on_host"] += time.perf_counter() - t
        if self.world > 1:
            import torch.distributed as dist

            # replicated "gpu" units: sum their grads over the ranks (as DDP does, once a step)
            for u in gpu_units:
                dist.all_reduce(u.gacc, group=self.group)
            # sharded units: the squared norms of the owned shards, summed over the ranks
            sq = (sq + cpu_sq).to(self.comm_dev)
            dist.all_reduce(sq, group=self.group)
            sq, cpu_sq = sq.to(self.device), 0.0
        if gpu_units:
            norms = torch._foreach_norm([u.gacc for u in gpu_units], 2, dtype=torch.float32)
            sq = sq + torch.stack([x.float() for x in norms]).square().sum()
        v = float(sq.item()) + cpu_sq  # the one host sync of the step
        total = math.sqrt(v) if math.isfinite(v) and v > 0 else (v if not math.isfinite(v) else 0.0)
        self.gpu_sq.zero_()
        self.round = 0
        skipped = skip_nan_inf and not math.isfinite(total)
        if skipped:
            self._zero_all()
            return torch.tensor(total), True
        coef = min(1.0, max_norm / (total + 1e-6)) if max_norm and max_norm > 0 else 1.0
        for u in gpu_units:
            # clipping folded into the fused AdamW (it divides grads by grad_scale): no extra pass
            u.opt.grad_scale = torch.full((), 1.0 / coef, device=u.master.device) if coef != 1.0 else None
            u.master.grad = u.gacc if u.gacc.dtype == u.master.dtype else u.gacc.to(u.master.dtype)
            u.opt.param_groups[0]["lr"] = self.lr
            self._decay(u, self.lr)
            u.opt.step()
            u.master.grad = None
            if not _same(u.w, u.master):
                u.w.copy_(u.master.data)
            u.g.zero_()
            if u.gacc is not u.g:
                u.gacc.zero_()
        for u in host_units:
            u.sent = False
            u.cpu_done.clear()
            u.needs_h2d = u.mode == "host_opt"
            if u.slot is not None:  # the slot holds the old weights: the next forward refetches
                u.slot.owner, u.slot = None, None
            src_done = getattr(u, "h2d_src_done", None)
            self.pool.submit(self._cpu_step, u, coef, self.lr, src_done)
        self._clean = True
        return torch.tensor(total), False

    def _decay(self, u: Unit, lr: float) -> None:
        """The fused AdamW decays the whole flat master (p *= 1 - lr * wd inside its one pass); the
        no_decay parameters (norms, a small part) are divided by that factor first. A separate
        decay pass over the decayed parameters cost a full read + write of the master a step."""
        if self.wd:
            for off, n in u.no_decay:
                u.master.data[off:off + n].div_(1.0 - lr * self.wd)

    def _cpu_step(self, u: Unit, coef: float, lr: float, src_done) -> None:
        try:
            if self.cpu_threads:
                torch.set_num_threads(self.cpu_threads)
            if src_done is not None:
                src_done.synchronize()  # the last H2D read of w_host has finished
            if u.d2h_done is not None:
                u.d2h_done.synchronize()  # the grads are on the host
            u.opt.grad_scale = torch.full((), 1.0 / coef) if coef != 1.0 else None
            t0 = time.perf_counter()
            u.master.grad = self._master_grad(u)
            t1 = time.perf_counter()
            u.opt.param_groups[0]["lr"] = lr
            self._decay(u, lr)
            u.opt.step()
            u.master.grad = None
            t2 = time.perf_counter()
            if not _same(u.w_host, u.master):
                u.w_host.copy_(u.master.data)
            t3 = time.perf_counter()
            for k, dt in (("grad_to_master_dtype", t1 - t0), ("cpu_adam", t2 - t1), ("new_compute_copy", t3 - t2)):
                self.host_seconds[k] += dt
            if self.trace is not None:
                self.trace.append(("cpu_step", u.idx, t0, t3))
        finally:
            u.cpu_done.set()

    def _master_grad(self, u: Unit) -> torch.Tensor:
        """The unit's grads in the master dtype for the fused AdamW: the accumulator itself, or a
        conversion into one reused buffer (a fresh tensor per unit and step would page-fault its
        whole size in again every step)."""
        if u.gacc.dtype == u.master.dtype:
            return u.gacc
        n = u.gacc.numel()
        if self._grad_scratch is None or self._grad_scratch.dtype != u.master.dtype or self._grad_scratch.numel() < n:
            largest = max(x.gacc.numel() for x in self.units if x.mode != "gpu")
            self._grad_scratch = torch.empty(largest, dtype=u.master.dtype)
        out = self._grad_scratch[:n].view(u.gacc.shape)
        out.copy_(u.gacc)
        return out

    def zero_grad(self) -> None:
        """Nothing to do right after optimizer_step (the next step's first round overwrites every
        accumulator): the trainer's call after each step must not wait for the CPU optimizer."""
        if not self._clean:
            self._zero_all()

    def _zero_all(self) -> None:
        self._wait_cpu()
        if self.cuda:  # no copy may still read or write the buffers zeroed here
            torch.cuda.synchronize()
        for u in self.units:
            for t in (u.g if u.mode != "stream" else None, u.gacc, u.gacc_dev):
                if t is not None:
                    t.zero_()
            u.sent = False
        self.gpu_sq.zero_()
        self.round = 0
        self._clean = True

    def synchronize(self) -> None:
        """Wait for the CPU optimizer and all copies (before checkpointing or evaluation)."""
        self._join_pin()
        self._wait_cpu()
        for u in self.units:
            u.cpu_done.wait()
        if self.cuda:
            torch.cuda.synchronize()

    def memory_report(self) -> dict[str, int]:
        """Bytes the engine holds on the compute device, by the categories of
        cost_model.static_gpu_bytes (each storage counted once, under the first category that
        names it: a master that is the compute copy counts as compute, an accumulator that is the
        grad buffer as grads), plus "other" (the model's buffers, optimizer step counters) and
        "total". Activations and a step's transients are not the engine's and not in here; the
        moments appear after the first step (AdamW allocates them lazily)."""
        rep = dict.fromkeys(MEMORY_CATEGORIES + ("other",), 0)
        seen = set()

        def add(cat, t):
            if t is not None and t.device.type == self.device.type and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                rep[cat] += t.untyped_storage().nbytes()

        for u in self.units:
            if u.mode != "stream":
                add("compute", u.w)
                add("grads", u.g)
            add("grad_acc", u.gacc_dev)  # host units accumulating on the GPU
            add("shards", u.gsh)  # data parallelism: the reduce-scattered grad shard
            if u.mode == "gpu":  # host units keep these on the host
                add("grad_acc", u.gacc)
                add("master", u.master.data)
                st = u.opt.state.get(u.master, {})
                for k, v in st.items():
                    add("moments" if k in ("exp_avg", "exp_avg_sq") else "other", v)
        for cat, bufs in (("slots", [x.buf for x in self.slots]), ("grad_slots", [x.buf for x in self.gslots]),
                          ("conversion", self.conv), ("other", list(self.model.buffers()) + [self.gpu_sq])):
            for b in bufs:
                add(cat, b)
        rep["total"] = sum(rep.values())
        return rep

    def describe(self) -> str:
        return self.description or repr(self.plan)

    def close(self) -> None:
        """Finish pending work, unpin, and take the hooks off the model (no reference from the
        model back to the engine is left: dropping both frees every buffer)."""
        self.synchronize()
        self.pool.shutdown(wait=True)
        sys.setswitchinterval(self._switch_interval)
        unregister_pinned(self.pinned_ptrs)
        self.pinned_ptrs = []
        for u in self.units:
            if u.acts is not None:
                u.acts.close()
        self._remove_hooks()
