"""The offload engine: executes a Plan on a model, block by block.

It composes the parts, each owning its state of every unit: the schedule (compute weights, GPU
slots, prefetch: schedule.py), the gradients (buffers, reduce-scatter, accumulation, copies to
the host, norms: gradients.py), the optimizer (masters, moments, AdamW on GPU or CPU, clipping,
NaN skips: host_optimizer.py), the CPU worker (worker.py), the activation arenas
(activations.py) and the model hooks that drive them (hooks.py); it checkpoints their state
under the plain run's names (state_dict.py) and reports the device memory they hold (memory.py).

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

import torch
import torch.nn as nn

from flame.errors import ConfigError
from flame.models.blocks import clean_name, find_blocks
from flame.offload.planner.cost_model import ACT_MODES, Dtypes, host_grad_dtype
from flame.offload.planner.plan import Plan
from flame.offload.runtime.activations import HostActivations
from flame.offload.runtime.collectives import comm_device, multi_rank, native
from flame.offload.runtime.gradients import Gradients
from flame.offload.runtime.hooks import ModelHooks
from flame.offload.runtime.host_optimizer import HostOptimizer, clip_coefficient, global_norm
from flame.offload.runtime.memory import device_bytes
from flame.offload.runtime.schedule import WeightSchedule
from flame.offload.runtime.state_dict import EngineStateDict
from flame.offload.runtime.streams import PIN_PIECE_BYTES, PinnedBuffers, Streams
from flame.offload.runtime.units import Unit, same_tensor
from flame.offload.runtime.worker import CpuWorker

DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class OffloadEngine:
    def __init__(self, model: nn.Module, plan: Plan, device: torch.device, lr: float = 1e-3,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0, description: str = "",
                 no_decay: set[str] | None = None, pin_piece_bytes: int = PIN_PIECE_BYTES, group=None):
        """`group`: the data-parallel process group the host units are sharded over; None takes
        the default group when torch.distributed is initialized with more than one rank.
        `no_decay`: names of the parameters without weight decay (norms, biases, embeddings, as in
        the plain optimizer). `pin_piece_bytes`: the cudaHostRegister piece of every pinned buffer."""
        import torch.distributed as dist

        self.model, self.plan, self.device = model, plan, torch.device(device)
        if group is None and multi_rank():
            group = dist.group.WORLD
        self.group = group
        self.world = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        if self.world > 1 and self.device.type == "cuda" and not native(group):
            raise ConfigError(f"offload: data parallelism on {self.device} needs the NCCL backend, "
                              f"got {dist.get_backend(group)}")
        self.comm_device = comm_device(group, self.device) if self.world > 1 else self.device
        self.description = description
        dts = plan.dtypes
        compute, master, grad, moment = (DT[dts[k]] for k in ("compute", "master", "grad", "moment"))
        if moment != master:
            raise ConfigError(f"offload.moment_dtype={dts['moment']}: torch AdamW keeps moments in the master dtype ({dts['master']})")
        self.master_dtype = master
        self.streams = Streams(self.device, pin_piece_bytes)
        self.cuda = self.streams.cuda
        self.worker = CpuWorker()  # holds the short GIL switch interval until close()
        blocks_name, blocks = find_blocks(model)
        if len(blocks) != len(plan.layer_modes):
            raise ConfigError(f"offload.plan: {len(plan.layer_modes)} blocks in the plan, model has {len(blocks)}")
        bad = next((a for a in plan.layer_acts if a not in ACT_MODES), None)
        if bad is not None or len(plan.layer_acts) != len(blocks):
            raise ConfigError(f"offload.plan: activation mode {bad!r}, expected one of {', '.join(ACT_MODES)} per block"
                              if bad is not None else f"offload.plan: {len(plan.layer_acts)} activation modes, "
                              f"model has {len(blocks)} blocks")
        self.blocks = blocks
        # id(parameter) -> every state-dict name of it (tied parameters have several), without the
        # AC/compile wrappers' parts: the names a plain run's checkpoint and optimizer state use
        self.fqns: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.fqns.setdefault(id(p), []).append(clean_name(n))
        block_ids = set()
        layer_params = []
        for b in blocks:
            ps = [(self.fqns[id(p)][0], p) for p in b.parameters()]
            block_ids |= {id(p) for _, p in ps}
            layer_params.append(ps)
        outer = [(self.fqns[id(p)][0], p) for p in model.parameters() if id(p) not in block_ids]
        accs = plan.unit_accs()
        # a unit with frozen parameters (a LoRA base) keeps only those, as a frozen unit placed as
        # the plan says; its trainable ones (the adapters) join one resident "trainable" unit
        trainable = [(n, p) for ps in [outer] + layer_params for n, p in ps
                     if p.requires_grad and any(not q.requires_grad for _, q in ps)]
        moved = {id(p) for _, p in trainable}

        def unit(index, name, ps, mode, act, acc):
            frozen = any(not p.requires_grad for _, p in ps)
            return Unit(index, name, [(n, p) for n, p in ps if id(p) not in moved], mode, act, acc and not frozen,
                        self.world, self.rank, frozen=frozen)

        self.units = [unit(0, "outer", outer, plan.outer_mode, "keep", accs[0])] + [
            unit(i + 1, f"{blocks_name}.{i}", ps, plan.layer_modes[i], plan.layer_acts[i], accs[i + 1])
            for i, ps in enumerate(layer_params)]
        if trainable:
            self.units.append(Unit(len(self.units), "trainable", trainable, "gpu", "keep", False, self.world, self.rank))
        self.optimizer = HostOptimizer(self.units, self.worker, lr, betas, eps, weight_decay,
                                       {clean_name(n) for n in no_decay or ()}, plan.cpu_threads,
                                       speculative=plan.speculative_step, redo=plan.speculative_redo)
        self.schedule = WeightSchedule(self.units, self.streams, self.device, compute, plan.prefetch_depth, group,
                                       self.world, self.optimizer.wait_for)
        host_grad = DT[host_grad_dtype(Dtypes(**dts), plan.rounds)]
        self.gradients = Gradients(self.units, self.streams, self.device, compute, grad, host_grad, plan.rounds,
                                   group, self.world, self.comm_device, self.worker)
        if plan.speculative_step:
            self.gradients.on_sent = self.optimizer.speculate
        for mod in model.modules():  # buffers (rotary tables, ...) live on the compute device
            for k, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[k] = b.to(self.device)
        self.pinned = PinnedBuffers(pin_piece_bytes)
        self._build_buffers()
        for u in self.units:
            if u.activation_mode in ("offload", "recompute_host"):
                u.activations = HostActivations(u.name, self.streams, self.device, self.cuda, pin_piece_bytes)
        self._clip_coefficient: float | None = None  # from clip_grad_norm_, for the next step()
        self.checkpoint = EngineStateDict(model, self.units, self.fqns, self.schedule, self.optimizer, self.streams,
                                          group, self.comm_device)
        self.hooks = ModelHooks(model, blocks, self.units, self.schedule, self.gradients, self.pinned, self.device)

    # ------------------------------------------------------------------ buffers
    def _build_buffers(self) -> None:
        self.gradients.build_conversion()
        self.schedule.build_slots()
        self.gradients.build_slots()
        for u in self.units:
            # one unit at a time, its parameters rebound before the next: the model's original
            # storage (fp32 on the GPU when built there) is freed unit by unit, never all kept.
            # A frozen unit has no master: its values go straight into the compute dtype.
            dtype = self.schedule.dtype if u.frozen else self.master_dtype
            master = u.flat_values(dtype, self.device if u.mode == "gpu" else torch.device("cpu"))
            self.schedule.build_unit(u, master)
            self.gradients.build_host(u)
            self.schedule.build_resident(u)
            self.optimizer.build_unit(u, master)
            self.gradients.build_device(u)
            self.schedule.bind_initial(u)
            if u.grads.buffer is not None:
                u.bind(u.grads.buffer, grad=True)
        if self.cuda:
            # page-lock in the background while the GPU side is set up; joined before the first forward
            self.pinned.register_in_background([t for u in self.units if u.mode != "gpu"
                                                for t in (u.weights.host, u.grads.staging, self._spare_host(u))
                                                if t is not None])

    @staticmethod
    def _spare_host(u) -> torch.Tensor | None:
        """A speculative unit's spare master when the master is its pinned compute copy: the two
        take turns as the H2D source, so both are page-locked."""
        o = u.optimizer
        return o.spare[0] if o is not None and o.spare is not None and same_tensor(u.weights.host, o.master) else None

    # ------------------------------------------------------------------ optimizer
    def reset_host_seconds(self) -> dict[str, float]:
        """The host-time counters since the last reset (then zeroed)."""
        return self.worker.reset_seconds()

    def optimizer_step(self, max_norm: float = 0.0, skip_nan_inf: bool = False, lr: float | None = None):
        """Clip by the global grad norm, step every unit; returns (grad_norm, skipped): a
        non-finite norm with `skip_nan_inf` skips the step and zeroes the grads."""
        total = self._grad_norm(max_norm)
        if skip_nan_inf and not math.isfinite(total):
            self._zero_all()
            return torch.tensor(total), True
        self.step(lr)
        return torch.tensor(total), False

    def clip_grad_norm_(self, max_norm: float = 0.0) -> torch.Tensor:
        """The step's global grad norm; the next step() scales the grads by min(1, max_norm /
        norm) (max_norm 0: no clipping). Once a step, after the last backward: it collects the
        step's grads (the step's one host sync)."""
        return torch.tensor(self._grad_norm(max_norm))

    def _grad_norm(self, max_norm: float) -> float:
        total = global_norm(self.gradients.step_sq_norm())
        self._clip_coefficient = clip_coefficient(total, max_norm)
        return total

    def step(self, lr: float | None = None) -> None:
        """Step every unit with the grads clipped by the last clip_grad_norm_ (taken here, without
        clipping, when it was not called). GPU units step now; host units are stepped on the CPU
        thread in forward order, each writing its new compute copy into the pinned buffer (or keep
        the speculative update they made in the backward, when it is this step's); the next
        forward waits per unit."""
        if lr is not None:
            self.optimizer.lr = lr
        if self._clip_coefficient is None:
            self._grad_norm(0.0)
        coef, self._clip_coefficient = self._clip_coefficient, None
        self.optimizer.begin_step(coef)
        for u in self.units:
            if u.mode == "gpu" and not u.frozen:
                self.optimizer.step_on_gpu(u, coef)
                self.schedule.refresh_from_master(u, u.optimizer.master.data)
                self.gradients.zero_unit(u)
        for u in self.units:
            if u.mode != "gpu" and not u.frozen:
                u.grads.sent = False
                self.schedule.stale(u)
                self.optimizer.finish(u, coef)
        self.gradients.clean = True

    def zero_grad(self) -> None:
        """Nothing to do right after optimizer_step (the next step's first round overwrites every
        accumulator): the trainer's call after each step must not wait for the CPU optimizer."""
        if not self.gradients.clean:
            self._zero_all()

    def _zero_all(self) -> None:
        self._clip_coefficient = None
        self.optimizer.discard_step()  # a skipped step: no speculative update may stay
        self.worker.wait()
        if self.cuda:  # no copy may still read or write the buffers zeroed here
            torch.cuda.synchronize()
        self.gradients.zero_all()

    def synchronize(self) -> None:
        """Wait for the CPU optimizer and all copies (before checkpointing or evaluation)."""
        self.pinned.join()
        self.worker.wait()
        self.optimizer.wait_all()
        if self.cuda:
            torch.cuda.synchronize()

    def memory_report(self) -> dict[str, int]:
        """Bytes the engine holds on the compute device, by the categories of
        cost_model.static_gpu_bytes (memory.device_bytes says how each is counted)."""
        return device_bytes(self.units, self.schedule, self.gradients, self.model, self.device)

    def memory_explanation(self) -> str:
        """The engine's GPU buffers next to the plan's prediction, by category, and the device's
        allocated bytes now and at peak (logged when the run runs out of GPU memory: what was
        planned and what was there)."""
        gib = 2 ** 30
        have, planned = self.memory_report(), self.plan.predicted.get("static_gpu_bytes") or {}
        cats = ", ".join(f"{k} {have.get(k, 0) / gib:.2f} (planned {planned.get(k, 0) / gib:.2f})"
                         for k in sorted(set(have) | set(planned)) if k != "total" and (have.get(k) or planned.get(k)))
        pr = self.plan.predicted
        line = (f"offload: GPU memory, GiB: engine buffers: {cats}; planned activations "
                f"{pr.get('activation_bytes', 0) / gib:.2f}, transients {pr.get('transient_bytes', 0) / gib:.2f}, "
                f"peak {pr.get('peak_gpu_bytes', 0) / gib:.2f}")
        if self.cuda:
            line += (f"; allocated now {torch.cuda.memory_allocated(self.device) / gib:.2f}, "
                     f"peak {torch.cuda.max_memory_allocated(self.device) / gib:.2f}")
        return line

    # ------------------------------------------------------------------ checkpoint (state_dict.py)
    def model_state_keys(self) -> list[str]:
        """The names model_state_dict returns (no gathering)."""
        return self.checkpoint.model_state_keys()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        self.synchronize()
        return self.checkpoint.model_state_dict()

    def load_model_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.synchronize()
        self.checkpoint.load_model_state_dict(sd)

    def optimizer_state_dict(self) -> dict:
        self.synchronize()
        return self.checkpoint.optimizer_state_dict()

    def load_optimizer_state_dict(self, sd: dict) -> None:
        self.synchronize()
        self.checkpoint.load_optimizer_state_dict(sd)

    def state_dict(self) -> dict:
        return {"model": self.model_state_dict(), "optimizer": self.optimizer_state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.load_model_state_dict(sd["model"])
        if "optimizer" in sd:
            self.load_optimizer_state_dict(sd["optimizer"])

    def describe(self) -> str:
        return self.description or repr(self.plan)

    def close(self) -> None:
        """Finish pending work, unpin, and take the hooks off the model (no reference from the
        model back to the engine is left: dropping both frees every buffer)."""
        self.synchronize()
        self.worker.shutdown()
        self.pinned.release()
        for u in self.units:
            if u.activations is not None:
                u.activations.close()
        self.hooks.remove()
