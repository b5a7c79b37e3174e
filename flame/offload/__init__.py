"""Host-offload engine: plans where every block's state lives and executes the plan.

Trainer entry point: `maybe_offload(model, parallel_dims, job_config, device, init_fn)` returns
the model to train and its optimizers, with the engine or without it, as one `TrainingParts`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from flame.errors import ConfigError
from flame.offload.config import Offload
from flame.offload.runtime.collectives import multi_rank

logger = logging.getLogger(__name__)

__all__ = ["Offload", "TrainingParts", "build_plan", "maybe_offload"]


@contextlib.contextmanager
def _phase(what: str):
    """Log how long a setup phase took (the time before the first step is mostly these)."""
    t0 = time.perf_counter()
    yield
    logger.info("offload: %s took %.1f s", what, time.perf_counter() - t0)


def _get(obj, path, default):
    for k in path.split("."):
        obj = getattr(obj, k, None)
        if obj is None:
            return default
    return obj


def speculative_redo(job_config) -> bool:
    """Whether a speculative CPU step may have to be redone (the plan's `speculative_redo`): the run
    clips by the grad norm or skips non-finite steps. Without either every speculative update is
    the step's (a non-finite norm stops the run before anything is saved)."""
    return float(_get(job_config, "training.max_norm", 1.0) or 0.0) > 0 or bool(_get(job_config, "training.skip_nan_inf", False))


def build_plan(model, job_config, device, world: int = 1, threads_from_profile: bool = False):
    """(plan, costs, profile) for `model` under job_config.offload, measuring what is missing.
    `threads_from_profile`: planning for the profile's machine (the calculator, on a machine
    without that GPU): CPU optimizer threads from its cores instead of the ones this process may
    use, and its measured CUDA context in the GPU budget."""
    from flame.components.loss import uses_compiled_loss
    from flame.offload.measure.hardware import measure
    from flame.offload.measure.tracing import model_costs
    from flame.offload.planner.block_costs import adapters_with_outer
    from flame.offload.planner.budgets import host_budget_bytes
    from flame.offload.planner.cost_model import Dtypes
    from flame.offload.planner.hardware import load, save
    from flame.offload.planner.plan import Plan
    from flame.offload.planner.solver import solve_micro_batches

    off: Offload = _get(job_config, "offload", None) or Offload()
    off.validate()
    local = int(_get(job_config, "training.local_batch_size", 1))
    seq = int(_get(job_config, "training.seq_len", 2048))
    accum = int(_get(job_config, "training.gradient_accumulation_steps", 1) or 1)
    redo = speculative_redo(job_config)
    if off.plan != "auto":
        plan = Plan.load(off.plan)
        plan.check_shape(off.plan, accum * local, seq)
        plan.check_options(off.plan, off, redo)
        from flame.models.blocks import find_blocks
        from flame.models.build import build_meta_model

        # the calculator passes the config alone; a LoRA base counts its frozen parameters, as the costs do
        blocks = find_blocks(model if isinstance(model, torch.nn.Module) else build_meta_model(model.config))[1]
        plan.check_blocks(off.plan, [sum(p.numel() for p in b.parameters() if not p.requires_grad)
                                     or sum(p.numel() for p in b.parameters()) for b in blocks])
        if off.save_plan:  # the plan this run replays, as it writes the plan it solves
            plan.save(off.save_plan)
        return plan, None, None
    candidates = micro_batch_candidates(local, seq, off.micro_batch_tokens, bool(_get(job_config, "training.varlen", False)))
    cdt = getattr(torch, off.compute_dtype)
    chunk = int(_get(job_config, "training.loss_chunk_tokens", 0) or 0)
    # the calculator (threads_from_profile) plans for the profile's GPU
    compiled_loss = uses_compiled_loss(_get(job_config, "compile.enable", False),
                                       "cuda" if threads_from_profile else torch.device(device).type)
    if chunk == -1:  # auto (the trainer resolves it before planning; the plan CLI comes here)
        from flame.components.chunked_loss import choose_loss_chunk_tokens
        from flame.models.build import build_meta_model

        meta = model if hasattr(model, "get_output_embeddings") else build_meta_model(model.config)
        tp = int(_get(job_config, "parallelism.tensor_parallel_degree", 1) or 1) > 1
        chunk, _ = choose_loss_chunk_tokens(meta, local * seq, tp, int(off.gpu_memory_gib * 2**30) or None,
                                            compiled_loss=compiled_loss)
    lora = _get(job_config, "lora", None)
    lora = lora if lora is not None and lora.rank > 0 else None
    costs_of = model_costs(model.config, cdt, candidates, seq, loss_chunk_tokens=chunk, lora=lora,
                           compiled_loss=compiled_loss)
    costs_of = {mb: adapters_with_outer(c) for mb, c in costs_of.items()}
    path = off.profile or os.path.join(_get(job_config, "job.dump_folder", "."), "offload_profile.json")
    if os.path.isfile(path):
        prof = load(path)
    elif torch.device(device).type == "cuda":
        cfg = model.config
        t = local * seq
        d = cfg.hidden_size
        ffn = getattr(cfg, "intermediate_size", None) or 4 * d
        shapes = [(t, d, d), (t, ffn, d), (t, d, ffn), (t, cfg.vocab_size, d)]
        from flame.offload.gpu_cap import applied_gpu_cap

        cap = applied_gpu_cap(device)
        with _phase("measuring the hardware profile"):
            prof = measure(shapes, max_bytes=cap.allocator_bytes if cap is not None and cap.allocator_bytes else None)
        if _rank() == 0:
            save(prof, path)  # one writer: every rank measures, rank 0 caches
        logger.info("offload: hardware profile measured and cached at %s", path)
    else:
        from flame.offload.calculator import BUNDLED_PROFILES

        given = f"offload.profile={path!r}: not found" if off.profile else \
            f"offload.profile not given and no profile cached at {path!r}"
        hint = f"; to plan for a GPU you do not have, pass a stored one, e.g. --offload.profile " \
               f"{os.path.relpath(BUNDLED_PROFILES[0])}" if BUNDLED_PROFILES else ""
        raise ConfigError(f"{given}, and no GPU here to measure one{hint}")
    if world > 1 and multi_rank() and not (prof.allgather_gbps and prof.reducescatter_gbps):
        from flame.offload.measure.hardware import measure_collectives

        prof.allgather_gbps, prof.reducescatter_gbps = measure_collectives(device)
        logger.info("offload: all-gather %.1f GB/s, reduce-scatter %.1f GB/s (bus bandwidth, %d ranks)",
                    prof.allgather_gbps, prof.reducescatter_gbps, world)
    gpu = gpu_plan_bytes(off, device, prof, threads_from_profile)
    host = host_budget_bytes(off.host_memory_gib, off.host_margin_gib)
    cores = prof.cpu_cores if threads_from_profile else len(os.sched_getaffinity(0))
    # ranks on this machine (torchrun's LOCAL_WORLD_SIZE; the calculator, which has none, assumes
    # one machine): they split its cores and share its memory bandwidth for their CPU optimizers
    node_ranks = max(1, min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    threads = off.cpu_threads or optimizer_threads(cores, node_ranks)
    dt = Dtypes(off.compute_dtype, off.master_dtype, off.grad_dtype, off.moment_dtype)
    fudges = None
    if torch.device(device).type == "cuda":
        from flame.offload.measure.calibration import measure_block_fudges
        from flame.offload.planner.refit import use_block_calibration

        # one real block timed at the run's shapes, per candidate micro-batch, scales the
        # FLOP-based compute times (compiled, when the run compiles its blocks); the outer (head
        # and loss) is timed as it is
        backend = _get(job_config, "compile.backend", "inductor") if _get(job_config, "compile.enable", False) else None
        with _phase(f"timing one block at micro-batches {sorted(costs_of)}" + (" (compiled)" if backend else "")):
            timed = measure_block_fudges(model.config, costs_of, prof, seq, cdt, lora=lora, compile_backend=backend)
        fudges = use_block_calibration(costs_of, timed)
    # the micro-batch: the fastest plan over the candidates (every one runs the step's tokens)
    plan, costs = solve_micro_batches(costs_of, accum * local, prof, dt, gpu, host, threads, fudges=fudges,
                                      depths=off.depths(), overrides=off.overrides,
                                      allow_offload=off.enable != "off", world=world, node_ranks=node_ranks,
                                      offload_activations=off.activation_offload,
                                      selective_recompute=off.selective_recompute,
                                      speculative_step=off.speculative_step, speculative_redo=redo,
                                      checkpoint_offload=off.checkpoint_offload)
    if off.calibrate:
        from flame.offload.planner.refit import calibrated_plan_for

        calibrated = calibrated_plan_for(_get(job_config, "job.dump_folder", "."), plan, off.overrides)
        if calibrated is not None:
            logger.info("offload: using the plan an earlier launch's calibration re-solved (%s)",
                        calibrated.predicted.get("calibration"))
            plan = calibrated
    if off.save_plan:
        plan.save(off.save_plan)
    return plan, costs, prof


def gpu_plan_bytes(off: Offload, device, prof, for_profile_machine: bool) -> int:
    """What the plan may allocate on the GPU: the split the trainer applied (`gpu_cap`), else the
    one `planner.budgets.gpu_budget` makes from this GPU's driver memory now, from the profile's
    (planning for its machine), or from nothing (a CPU run: the plan is all there is)."""
    from flame.offload.gpu_cap import applied_gpu_cap
    from flame.offload.planner.budgets import DEFAULT_CUDA_CONTEXT_BYTES, gpu_budget

    applied = applied_gpu_cap(device)
    if applied is not None:
        return applied.plan_bytes
    if torch.device(device).type == "cuda":
        from flame.offload.measure.hardware import outside_allocator_bytes

        total, context = torch.cuda.get_device_properties(device).total_memory, outside_allocator_bytes(device)
    else:
        total = prof.gpu_total_bytes
        context = (prof.cuda_context_bytes or DEFAULT_CUDA_CONTEXT_BYTES) if for_profile_machine else None
    return gpu_budget(off.gpu_memory_gib, off.gpu_margin_gib, total, context).plan_bytes


def optimizer_threads(cores: int, node_ranks: int) -> int:
    """CPU optimizer threads of each of `node_ranks` ranks sharing `cores`: an even split, one core
    each left for the rank's other host work."""
    return max(1, cores // node_ranks - 1)


def micro_batch_candidates(local: int, seq: int, tokens: int, varlen: bool) -> list[int]:
    """Sequences per micro-batch the planner may choose, largest first: a fixed
    `offload.micro_batch_tokens`, else every divisor of the trainer's batch (each loaded batch is
    then run as several micro-batches); varlen batches are one packed stream: never split."""
    if tokens:
        rows = tokens // seq
        if tokens % seq or local % rows:
            raise ConfigError(f"offload.micro_batch_tokens {tokens}: must be a multiple of training.seq_len {seq} "
                              f"whose sequences divide training.batch_size {local}")
        if varlen and rows != local:
            raise ConfigError(f"offload.micro_batch_tokens {tokens} with training.varlen: a packed batch is not split; "
                              f"use {local * seq} or 0")
        return [rows]
    if varlen:
        return [local]
    return [d for d in range(local, 0, -1) if local % d == 0]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if multi_rank() else 0


def agree_on_plan(plan):
    """Rank 0's plan for every rank. Each rank measures its own profile and block timing, so
    their plans may differ by a hair; the sharded engine needs the same units, modes and rounds
    on every rank (its collectives would otherwise mismatch)."""
    if not multi_rank():
        return plan
    import torch.distributed as dist

    box = [plan if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def check_parallel_dims(parallel_dims) -> None:
    """The engine shards its host state over data-parallel ranks only (every rank one shard of
    the same model): one-line ConfigError for tensor, pipeline or context parallelism."""
    if parallel_dims is None:
        return
    for attr, option in (("tp", "tensor_parallel_degree"), ("pp", "pipeline_parallel_degree"),
                         ("cp", "context_parallel_degree")):
        degree = int(getattr(parallel_dims, attr, 1) or 1)
        if degree > 1:
            raise ConfigError(f"offload: parallelism.{option} {degree}: the offload engine composes with "
                              "data parallelism only (set it to 1 or offload.enable=off)")


def _clearly_fits(model: nn.Module, parallel_dims, job_config, device: torch.device) -> bool:
    """First-order check that skips the planner for small models: fp32 master + grads + two
    AdamW moments + a bf16 compute copy (18 bytes/param; a frozen one's fp32 value alone: 4) per
    shard under half the budget."""
    budget = job_config.offload.gpu_memory_gib
    total = budget * 2**30 if budget else torch.cuda.get_device_properties(device).total_memory
    shards = parallel_dims.dp_shard * parallel_dims.tp
    state = sum(p.numel() * (18 if p.requires_grad else 4) for p in model.parameters()) / max(shards, 1)
    return state < 0.5 * total


def refuse_cpu_model_beyond_host(model: nn.Module, parallel_dims) -> None:
    """Training on CPU without offload: one-line ConfigError when the host cannot hold even the
    least the run needs (fp32 weights and grads, 8 bytes a trained parameter, and one fp32
    moment, 4: Muon's; AdamW keeps two) on this machine's ranks; the run would be killed for
    memory mid-way. The host's memory is the smallest of its cgroup, Slurm and MemAvailable."""
    from flame.offload.planner.budgets import host_budget_bytes

    available = host_budget_bytes(0.0, 0.0)
    shards = max(1, int(getattr(parallel_dims, "dp_shard", 1) or 1) * int(getattr(parallel_dims, "tp", 1) or 1))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    per_rank = sum(p.numel() * (12 if p.requires_grad else 4) for p in model.parameters()) / shards
    need = per_rank * ranks
    if available and need > available:
        raise ConfigError(f"model of {sum(p.numel() for p in model.parameters()):,} parameters: training it on CPU "
                          f"needs at least {need / 2**30:.1f} GiB of host memory ({ranks} rank(s); weights, grads "
                          f"and optimizer state), this machine has {available / 2**30:.1f} GiB available; "
                          "use a GPU or a smaller model")


def _offload_decision(model: nn.Module, parallel_dims, job_config, device: torch.device) -> tuple[bool, tuple | None]:
    """The offload decision: ``on`` always offloads; ``auto`` offloads on a GPU when the planner
    says the plain plan does not fit the budgets (on CPU there is nothing to offload to).
    Returns (offload?, the planner's (plan, costs, profile) when ``auto`` made one to decide): the
    engine then runs that plan, so its block timing and compilation are not paid twice."""
    mode = job_config.offload.enable
    if mode == "auto" and device.type != "cuda":
        changed = job_config.offload.changed_options()
        if changed:  # set by the user, unused: say so rather than drop them in silence
            logger.info("offload: enable=auto offloads only on a GPU; on %s these have no effect: %s "
                        "(offload.enable on runs the engine here)", device.type, ", ".join(changed))
        return False, None
    if mode == "off":
        changed = job_config.offload.changed_options()
        if changed:  # budgets, dtypes, ... (a plan file or overrides are config errors): say so
            logger.info("offload: enable=off; these have no effect: %s", ", ".join(changed))
        return False, None
    if mode == "auto":
        if _clearly_fits(model, parallel_dims, job_config, device):
            logger.info("offload: model state uses under half the GPU budget; plain plan, no planner run")
            return False, None
        # shapes only: the model stays on meta; every rank takes rank 0's decision
        plan, costs, prof = build_plan(model, job_config, device, parallel_dims.world_size)
        plan = agree_on_plan(plan)
        if not plan.offloads:
            logger.info("offload: the plain plan fits the budgets; no offload")
            return False, None
        return True, (plan, costs, prof)
    return True, None


@dataclass
class TrainingParts:
    """The model the trainer trains and what it trains it with: the same calls whether the
    offload engine runs the model or torch does (one device, FSDP2, HSDP, DDP)."""

    model: nn.Module
    # torchtitan's optimizers container, or adapter.OffloadOptimizers: step(), zero_grad(),
    # state_dict(), load_state_dict(), and iteration over the torch optimizers the LR scheduler drives
    optimizers: object
    # the step's global grad norm (after the last backward, once a step); the grads are clipped to
    # max_norm for the next optimizers.step() (max_norm 0: measured only)
    clip_grad_norm: Callable[[float], torch.Tensor]
    # the weights when the model's parameters do not hold them (the engine's masters): a Stateful
    # under the model's state_dict names, for checkpoints and the export; None: the model itself
    weights: object | None
    micro_batch: int  # sequences per forward/backward; 0: every loaded batch as it is
    loss_scale: int  # the loss is multiplied by this before the backward (DDP averages its replicas' grads)
    autocast: object  # the context the forward runs under
    calibrator: object | None  # the offload plan's in-run calibration (StepCalibrator), None without
    # the trained state (weights, grads, optimizer state) lives in host memory and is rewritten every
    # step: a data-loader worker forked from this process would keep the pages it shared at the fork,
    # and copy-on-write would then hold that memory twice, so workers start from a fork server
    state_in_host_memory: bool = False


def maybe_offload(model: nn.Module, parallel_dims, job_config, device: torch.device,
                  init_fn: Callable[[nn.Module], None],
                  before_host_state: Callable[[], None] | None = None) -> TrainingParts:
    """The meta `model` made trainable: TP, activation checkpointing and compile applied; then
    either the offload engine takes it (built and initialized by `init_fn` on the host) or data
    parallelism is applied and it is materialized on `device` and initialized by `init_fn`.
    `before_host_state` runs once offloading is decided, before the model state is allocated in
    host memory (the trainer starts its data workers' fork server there)."""
    from flame.components.optimizer import build_optimizers, clip_grad_norm_, param_groups
    from flame.distributed.parallelize import apply_data_parallel, prepare_blocks
    from flame.distributed.precision import autocast_context

    prepare_blocks(model, parallel_dims, job_config)
    mixed = job_config.training.mixed_precision_param
    offloaded = None
    wanted, planned = _offload_decision(model, parallel_dims, job_config, device)
    if wanted:
        from flame.components.muon import refuse_offloaded_muon

        refuse_offloaded_muon(job_config)  # offload.enable auto chose to offload
        if before_host_state is not None:
            before_host_state()
        # the master copy lives in host memory; the engine moves each block where the plan says
        with _phase("initializing the weights in host memory"):
            model.to_empty(device="cpu")
            init_fn(model)
        offloaded = apply_offload(model, job_config, parallel_dims, device, planned)
    if offloaded is None:
        if device.type == "cpu":
            refuse_cpu_model_beyond_host(model, parallel_dims)
        apply_data_parallel(model, parallel_dims, job_config, device)
        model.to_empty(device=device)
        init_fn(model)
        pd = parallel_dims
        return TrainingParts(
            model=model, optimizers=build_optimizers([model], job_config.optimizer, device),
            clip_grad_norm=lambda max_norm: clip_grad_norm_(model.parameters(), max_norm), weights=None,
            micro_batch=0, loss_scale=pd.dp_replicate if (pd.dp_replicate_enabled and not pd.fsdp_enabled) else 1,
            autocast=autocast_context(pd, mixed, device.type, False), calibrator=None,
            state_in_host_memory=device.type == "cpu")
    from flame.offload.adapter import EngineModelState, OffloadOptimizers

    engine, calibrator = offloaded
    groups = param_groups(model, job_config.optimizer.weight_decay, job_config.optimizer.no_weight_decay)
    optimizers = OffloadOptimizers(engine, job_config.optimizer.lr, len(groups))
    # the engine sums the grads over the ranks (as FSDP does), whatever the data-parallel layout
    return TrainingParts(model=model, optimizers=optimizers, clip_grad_norm=optimizers.clip_grad_norm_,
                         weights=EngineModelState(engine), micro_batch=engine.plan.micro_batch, loss_scale=1,
                         autocast=autocast_context(parallel_dims, mixed, device.type, True), calibrator=calibrator,
                         state_in_host_memory=True)


def apply_offload(model, job_config, parallel_dims, device, planned: tuple | None = None):
    """Plan and, when the plan offloads (or offload.enable=on), wrap `model` in an OffloadEngine.

    Called by `maybe_offload` once `_offload_decision` said yes (offload.enable on, or auto). `model`
    must be materialized (CPU or GPU) and initialized, with fp32/master values; the engine moves
    every block to where the plan puts it. Returns (engine, calibrator or None), or None when
    enable=auto and everything fits (the plain path then, no overhead). `planned`: the (plan,
    costs, profile) `_offload_decision` already made for this model (else the plan is built here)."""
    from flame.offload.runtime.engine import OffloadEngine
    from flame.offload.planner.solver import describe

    off: Offload = _get(job_config, "offload", None) or Offload()
    off.validate()
    world = int(getattr(parallel_dims, "world_size", 1) or 1) if parallel_dims is not None else 1
    check_parallel_dims(parallel_dims)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ConfigError("offload: the model must be materialized (init on CPU) before apply_offload")
    if planned is None:
        plan, costs, prof = build_plan(model, job_config, device, world)
        plan = agree_on_plan(plan)
    else:  # agreed on by the ranks when it was made
        plan, costs, prof = planned
    text = describe(plan, costs) if costs is not None else f"replayed plan {off.plan}: {plan.summary()}"
    if off.enable == "auto" and not plan.offloads:
        logger.info("offload: everything fits, plain run\n%s", text)
        return None
    if plan.world != world:  # placement only: the engine shards over the job's ranks anyway
        logger.warning("offload: the plan was made for %d rank(s), the job has %d: its memory "
                       "prediction is per rank of %d", plan.world, world, plan.world)
    from flame.components.optimizer import param_groups

    no_decay_ids = {id(p) for g in param_groups(model, 1.0, list(_get(job_config, "optimizer.no_weight_decay", [])))
                    if g["weight_decay"] == 0.0 for p in g["params"]}
    with _phase("building the engine (host buffers pinned, blocks placed)"):
        engine = OffloadEngine(
            model, plan, torch.device(device),
            no_decay={n for n, p in model.named_parameters(remove_duplicate=False) if id(p) in no_decay_ids},
            lr=float(_get(job_config, "optimizer.lr", 1e-3)),
            betas=(float(_get(job_config, "optimizer.beta1", 0.9)), float(_get(job_config, "optimizer.beta2", 0.95))),
            eps=float(_get(job_config, "optimizer.eps", 1e-8)),
            weight_decay=float(_get(job_config, "optimizer.weight_decay", 0.1)),
            description=text,
        )
    logger.info("%s", text)
    calibrator = None
    if off.calibrate and costs is not None:
        from flame.offload.measure.calibration import StepCalibrator

        calibrator = StepCalibrator(engine, plan, costs, prof, off.overrides, _get(job_config, "job.dump_folder", "."),
                                    off.depths(), write=_rank() == 0)
    return engine, calibrator
