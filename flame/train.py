"""flame's training job: ``torchrun -m flame.train --job.config_file X.toml [--section.key value]``.

The training step (``Trainer.train_step``) reads top to bottom: fetch the micro-batches of
one optimizer step, count their target tokens globally, forward/backward each with the loss
normalized by that count, clip, step (or skip on NaN/Inf), log.
"""

import contextlib
import faulthandler
import json
import math
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import init_logger, logger

import torch.distributed._functional_collectives as funcol

from flame.components.checkpoint import FlameCheckpointManager
from flame.components.chunked_loss import (choose_loss_chunk_tokens, chunked_head_loss, install_chunked_head,
                                           take_chunked_loss, uninstall_chunked_head)
from flame.components.loss import IGNORE_INDEX, compiled_cross_entropy_sum, cross_entropy_sum, uses_compiled_loss
from flame.components.metrics import MetricsLogger, write_run_summary
from flame.components.optimizer import group_settings, lr_at_loaded_step
from flame.config.manager import FlameConfigManager, accumulation_steps
from flame.distributed.device import init_process_group, local_device
from flame.errors import ConfigError, NonFiniteError
from flame.models import build as model_build
from flame.models.cpu import prepare_model_build
from flame.models.fla_requirements import missing_backend
from flame.models.hf_attention import uses_native_varlen
from flame.utils.startup import mark_imports_done, startup_split
from flame.offload.gpu_cap import apply_gpu_cap
from flame.offload import maybe_offload
from flame.utils import outcome, run_lock
from flame.utils.autotune import prepare_triton_autotune
from flame.utils.process_guard import StopRequest, die_with_launcher


def _check_dump_folder(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_test_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"job.dump_folder {path!r}: not writable ({e.strerror})") from None


def _parallel_dims(cfg, world_size: int) -> ParallelDims:
    p = cfg.parallelism
    degrees = dict(
        dp_shard=p.data_parallel_shard_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
    )
    if degrees["pp"] > 1 or degrees["cp"] > 1 or degrees["ep"] > 1:
        raise ConfigError("pipeline/context/expert parallelism are not supported by flame yet (degree > 1 given)")
    try:
        return ParallelDims(**degrees, world_size=world_size)
    except AssertionError:
        raise ConfigError(
            f"parallel degrees dp_replicate={degrees['dp_replicate']} x dp_shard={degrees['dp_shard']} x "
            f"tp={degrees['tp']} do not multiply to the world size {world_size}"
        ) from None


def _init_like_one_process(model, model_config, seed: int, varlen: bool, lora=None) -> None:
    """Give a sharded model on CPU the weights one process would draw from ``seed``.

    DTensor random ops have no RNG tracker on CPU meshes, so every rank draws the same local
    shard (TP heads and FSDP rows repeat across ranks). CPU runs are small: each rank builds
    the full model, initializes it and keeps its own slices.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    full = model_build.build_meta_model(model_config, varlen=varlen)
    if lora is not None and lora.rank > 0:
        from flame.lora import apply_lora

        apply_lora(full, lora)
    full.to_empty(device="cpu")
    model_build.init_weights(full, seed)
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
    set_model_state_dict(model, full.state_dict(), options=opts)


def _loss_memory_bytes(cfg, device: torch.device) -> int | None:
    """GPU memory the automatic loss choice may count on: the offload budget, else the device's size."""
    if device.type != "cuda":
        return None
    budget = cfg.offload.gpu_memory_gib if cfg.offload.enable != "off" else 0
    return int(budget * 2**30) if budget else torch.cuda.get_device_properties(device).total_memory


def _compiled_loss(cfg, device: torch.device) -> bool:
    return uses_compiled_loss(cfg.compile.enable, device.type)


def sdpa_priority(device: torch.device):
    """Context that orders torch SDPA backends for dense attention: cuDNN first on CUDA (faster than
    the flash backend on Hopper; torchtitan does the same). ``FLAME_SDPA_BACKENDS`` overrides, e.g.
    ``flash,efficient,cudnn,math``. Under per-block compile the choice is made at trace time."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = os.environ.get("FLAME_SDPA_BACKENDS", "cudnn,flash,efficient,math").split(",")
    table = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
             "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel([table[n.strip()] for n in names if n.strip()], set_priority=True)


def split_rows(batch: dict, rows: int) -> list[dict]:
    """A (non-varlen) batch as micro-batches of `rows` sequences each."""
    n = batch["input_ids"].shape[0]
    if "cu_seqlens" in batch or n % rows:
        raise ConfigError(f"offload plan micro-batch {rows}: cannot split a batch of {n} sequences"
                          + (" (varlen batches are one packed stream)" if "cu_seqlens" in batch else ""))
    return [{k: v[i:i + rows] for k, v in batch.items()} for i in range(0, n, rows)]


def all_sum(x: torch.Tensor, mesh) -> torch.Tensor:
    """Sum over a mesh without a host sync (torchtitan's dist_sum returns a Python float)."""
    return funcol.all_reduce(x, reduceOp="sum", group=mesh) if mesh is not None else x


class Trainer(Stateful):
    def __init__(self, cfg):
        self.cfg = cfg
        t = cfg.training
        _check_dump_folder(cfg.job.dump_folder)
        self.device = local_device()
        if cfg.profiling.enable_memory_snapshot and self.device.type != "cuda":
            raise ConfigError(f"profiling.enable_memory_snapshot: snapshots record CUDA allocations; this run is on "
                              f"{self.device.type}")
        prepare_triton_autotune(self.device.type)
        world_size = init_process_group(cfg.comm, cfg.job.dump_folder)
        # before anything is allocated on the GPU: the allocator's settings and reserved-bytes cap
        apply_gpu_cap(cfg.offload, self.device)
        self.parallel_dims = pd = _parallel_dims(cfg, world_size)
        if pd.dp_enabled:
            batch_mesh = pd.get_mesh("batch")
            self.dp_degree, self.dp_rank = batch_mesh.size(), batch_mesh.get_local_rank()
        else:
            self.dp_degree, self.dp_rank = 1, 0
        # one source of truth for the loop, the loss normalization and the offload planner
        t.gradient_accumulation_steps = accumulation_steps(t, self.dp_degree)
        seed = cfg.debug.seed if cfg.debug.seed is not None else 0
        torch.manual_seed(seed)
        dist_utils.set_determinism(pd, self.device, cfg.debug, distinct_seed_mesh_dims=["pp"])

        from flame.data import build_dataloader, build_tokenizer
        from flame.data.loader import workers_from_a_fork_server

        self.tokenizer = build_tokenizer(cfg)
        self.model_config = model_build.load_model_config(cfg.model.config, cfg.model.module)
        # flame's transformer and HF models (flame's varlen attention) take the data's bound on a
        # document's length as max_seqlen; FLA's models find it themselves
        self.inputs_take_max_seqlen = (self.model_config.model_type == "transformer"
                                       or not uses_native_varlen(self.model_config))
        vocab = model_build.fit_vocab(self.model_config, len(self.tokenizer), cfg.model.vocab_multiple)
        self.dataloader = build_dataloader(cfg, self.tokenizer, self.dp_rank, self.dp_degree)
        self.val_loader = (
            build_dataloader(cfg, self.tokenizer, self.dp_rank, self.dp_degree, split="validation")
            if cfg.validation.enable
            else None
        )

        # before the model is built: FLA layers bind their activation functions at construction
        prepare_model_build(self.device.type)
        model = model_build.build_meta_model(self.model_config, varlen=t.varlen)
        model_build.check_position_limit(model, self.model_config, *((t.context_len, "training.context_len")
                                         if t.varlen else (t.seq_len, "training.seq_len")))
        missing = missing_backend(model, self.device)
        if missing:  # FLA would raise in the first backward, after minutes of compiling
            raise ConfigError(f"model.config {cfg.model.config}: {missing}")
        adapter_params = 0  # trained LoRA weights (the meta model's global shapes), for the FLOPs count
        if cfg.lora.rank > 0:  # on the meta model, before parallelize: FSDP2 shards the adapters with their blocks
            from flame.lora import apply_lora, is_adapter_key

            logger.info(apply_lora(model, cfg.lora))
            adapter_params = sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))
        self.loss_auto = t.loss_chunk_tokens == -1
        if self.loss_auto:  # chosen before the offload planner, which measures the loss it will run
            t.loss_chunk_tokens, why = choose_loss_chunk_tokens(
                model, t.local_batch_size * t.seq_len, pd.tp_enabled, _loss_memory_bytes(cfg, self.device),
                compiled_loss=_compiled_loss(cfg, self.device))
            logger.info(why)
        self.n_params = model_build.count_params(model)
        logger.info(
            f"Model {self.model_config.model_type} from {cfg.model.config}: {self.n_params:,} parameters, vocab {vocab}"
        )

        def init_weights(m) -> None:
            model_build.init_weights(m, seed)
            if self.device.type == "cpu" and any(isinstance(p, DTensor) for p in m.parameters()):
                _init_like_one_process(m, self.model_config, seed, t.varlen, cfg.lora)

        # the model and its optimizers, parallelized, materialized and initialized (or run by the
        # host-offload engine, with the same calls)
        loaders = (self.dataloader, self.val_loader)
        if self.device.type == "cpu" or cfg.offload.enable == "on":
            workers_from_a_fork_server(loaders)  # known now: the server's imports run beside the setup
        # offload.enable auto: the server starts once offloading is decided, before the host state
        # (state in host memory: a CPU run, started above, or an offloaded one, started there)
        self.parts = maybe_offload(model, pd, cfg, self.device, init_weights,
                                   before_host_state=lambda: workers_from_a_fork_server(loaders))
        model = self.parts.model
        model.train()
        self.model = model
        o = cfg.optimizer
        logger.info(f"Optimizer {o.name}, lr {o.lr:g}, weight decay {o.weight_decay:g}"
                    + (" (stepped by the offload engine)" if self.parts.weights is not None else ""))
        self.chunked_head = None
        if t.loss_chunk_tokens > 0:  # validated with the config (no TP)
            self.chunked_head = install_chunked_head(model, t.loss_chunk_tokens)

        # DDP (replicate) averages gradients; the loss is already normalized by global tokens
        self.loss_scale = self.parts.loss_scale
        self.amp = self.parts.autocast
        self.optimizers = self.parts.optimizers
        self.lr_schedulers = build_lr_schedulers(self.optimizers, cfg.lr_scheduler, t.steps)
        # compiled loss with compiled blocks on GPU (fuses the float32 upcast of the logits)
        self.loss_fn = compiled_cross_entropy_sum if _compiled_loss(cfg, self.device) else cross_entropy_sum
        self.step = 0
        self.ntokens_seen = 0
        self.skipped_steps = 0
        self.consecutive_skips = 0
        if t.max_consecutive_skips < 0:
            raise ConfigError(f"training.max_consecutive_skips {t.max_consecutive_skips}: must be >= 0 (0: no limit)")
        self.stop_request = None  # main() installs the SIGTERM/SIGINT handlers
        self.checkpointer = FlameCheckpointManager(
            dataloader=self.dataloader,
            model_parts=[model],
            optimizers=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self},
            checkpoint_config=cfg.checkpoint,
            sd_adapter=None,
            base_folder=cfg.job.dump_folder,
        )
        if self.parts.weights is not None:  # the weights are not the model's parameters
            self.checkpointer.states["model"] = self.parts.weights
        if cfg.lora.rank > 0:  # alpha, which no tensor holds, is checked on resume
            from flame.lora.scale import STATE_KEY, AdapterScale

            self.checkpointer.states[STATE_KEY] = AdapterScale(cfg.lora.rank, cfg.lora.alpha)
        if cfg.lora.rank > 0 and cfg.lora.dropout > 0:  # the dropout masks continue on resume
            from flame.lora.rng import GeneratorState

            self.checkpointer.states["lora_rng"] = GeneratorState(model, self.device)

        from flame.models.flops import flops_per_token

        ctx = t.context_len if t.varlen else t.seq_len
        self.flops_per_token = flops_per_token(self.model_config, t.seq_len, ctx, frozen_base=cfg.lora.rank > 0,
                                               adapter_params=adapter_params)["total"]
        peak = None
        if self.device.type == "cuda":
            peak = peak_flops(torch.cuda.get_device_name(self.device))
        self.metrics = MetricsLogger(cfg, pd, self.device, self.flops_per_token, peak, t.steps)
        if torch.distributed.get_rank() == 0:
            self._write_resolved_config()

    # -- checkpointed state --------------------------------------------------------------
    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state_dict):
        self.step = int(state_dict["step"])
        self.ntokens_seen = int(state_dict["ntokens_seen"])
        self.skipped_steps = int(state_dict.get("skipped_steps", 0))

    def _write_resolved_config(self) -> None:
        path = os.path.join(self.cfg.job.dump_folder, "job_config.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.cfg.to_dict(), f, indent=2, default=str)
        os.replace(tmp, path)

    # -- one optimizer step --------------------------------------------------------------
    def model_inputs(self, batch: dict) -> tuple[dict, torch.Tensor]:
        """The model's keyword inputs for one micro-batch and its labels in the same token layout."""
        if "cu_seqlens" in batch:
            # the number of documents changes every step: a dynamic size from the first compiled call
            # (otherwise dynamo specializes on it and compiles every block again at step 2)
            torch._dynamo.maybe_mark_dynamic(batch["cu_seqlens"], 0)
            # packed documents: one row of B*T tokens, boundaries in cu_seqlens (FLA's form)
            inputs = {
                "input_ids": batch["input_ids"].reshape(1, -1),
                "position_ids": batch["position_ids"].reshape(1, -1),
                "cu_seqlens": batch["cu_seqlens"],
            }
            if self.inputs_take_max_seqlen:
                # the kernels size their grid by the longest document: the data pipeline's bound is
                # one value for every step (no host sync in the compiled blocks, no recompilation)
                t = self.cfg.training
                inputs["max_seqlen"] = min(t.context_len, t.seq_len)
            return inputs, batch["labels"].reshape(1, -1)
        return {"input_ids": batch["input_ids"]}, batch["labels"]

    def forward_logits(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits of one micro-batch and its labels in the same layout."""
        inputs, labels = self.model_inputs(batch)
        with self.amp:
            logits = self.model(**inputs, use_cache=False).logits
        return logits, labels

    def forward_loss_sum(self, batch: dict) -> torch.Tensor:
        """Sum of the token losses of one micro-batch (the caller normalizes)."""
        if self.chunked_head is None:
            return self.loss_fn(*self.forward_logits(batch))
        inputs, labels = self.model_inputs(batch)
        with chunked_head_loss(self.chunked_head, labels), self.amp:
            out = self.model(**inputs, use_cache=False).logits
        try:
            return take_chunked_loss(self.chunked_head, out)
        except ConfigError:
            if not self.loss_auto:
                raise
        # auto mode, a model that changes its logits after the head: the plain loss from now on
        logger.info("loss: plain logits + cross-entropy (the model changes its output layer's result)")
        uninstall_chunked_head(self.chunked_head)
        self.chunked_head = None
        return self.forward_loss_sum(batch)

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items() if not k.startswith("_")}

    def next_batches(self, data_iter) -> list[dict]:
        start = time.perf_counter()
        batches = [next(data_iter) for _ in range(self.cfg.training.gradient_accumulation_steps)]
        self.metrics.data_time_since += time.perf_counter() - start
        return batches

    def train_step(self, data_iter) -> None:
        cfg, pd = self.cfg, self.parallel_dims
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        batches = [self._to_device(b) for b in self.next_batches(data_iter)]
        micro = self.parts.micro_batch
        if micro and micro < batches[0]["input_ids"].shape[0]:
            # the planner's micro-batch: every loaded batch runs as several forward/backward passes
            batches = [part for b in batches for part in split_rows(b, micro)]

        # normalize by the target tokens of the whole optimizer step, over all DP ranks
        local_tokens = sum((b["labels"] != IGNORE_INDEX).sum() for b in batches)
        global_tokens = all_sum(local_tokens.float(), pd.get_optional_mesh("batch"))
        loss_total = torch.zeros((), device=self.device)
        if getattr(self.optimizers, "writes_state_in_backward", False):
            # the backward's in-place speculative CPU steps write the weights and moments an
            # async checkpoint's staging may still be copying (clip_and_step waits too late)
            self.checkpointer.maybe_wait_for_staging()
        for batch in batches:
            loss = self.forward_loss_sum(batch) / global_tokens.clamp(min=1)
            (loss * self.loss_scale).backward()
            loss_total += loss.detach()
        step_tokens = sum(b["input_ids"].numel() for b in batches)
        self.ntokens_seen += step_tokens
        self.metrics.tokens_since += step_tokens
        self.metrics.trained_tokens_since += global_tokens  # all DP ranks; a device tensor read at log steps

        grad_norm, skipped = self.clip_and_step()
        if skipped:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            self.metrics.skipped_steps = self.skipped_steps
            logger.warning(f"step {self.step}: gradient norm is {grad_norm}; optimizer step skipped")
            limit = cfg.training.max_consecutive_skips
            if limit and self.consecutive_skips > limit:
                raise NonFiniteError(f"{self.consecutive_skips} optimizer steps in a row skipped (non-finite gradient "
                                     f"norm) at step {self.step}, more than training.max_consecutive_skips {limit}; "
                                     "nothing was saved for these steps")
        else:
            self.consecutive_skips = 0
            self.lr_schedulers.step()  # a skipped step does not advance the schedule
        self.optimizers.zero_grad()
        # without skip_nan_inf a NaN/Inf stops the run here, before anything is saved: one scalar
        # read per step, after the optimizer's kernels are queued (skip_nan_inf reads it before)
        if not cfg.training.skip_nan_inf and not math.isfinite(float(grad_norm)):
            raise NonFiniteError(f"non-finite gradient norm ({float(grad_norm)}) at step {self.step}; nothing was "
                                 "saved for this step (lower optimizer.lr, or set training.skip_nan_inf)")

        if self.metrics.should_log(self.step):
            loss_value = all_sum(loss_total, pd.get_optional_mesh("loss")).item()
            if not math.isfinite(loss_value) and not skipped:
                raise NonFiniteError(f"non-finite loss ({loss_value}) at step {self.step}; nothing was saved for this step")
            # optimizers may report metrics of their own (the offload engine's speculative steps)
            extra = {"tokens_seen": self.ntokens_seen * self.dp_degree}
            extra.update(getattr(self.optimizers, "log_metrics", dict)())
            self.metrics.log(self.step, loss_value, float(grad_norm), lr, extra)

    def clip_and_step(self) -> tuple[torch.Tensor, bool]:
        t = self.cfg.training
        grad_norm = self.parts.clip_grad_norm(t.max_norm)  # only measures when max_norm is 0
        if t.skip_nan_inf and not torch.isfinite(grad_norm).item():
            return grad_norm, True
        self.checkpointer.maybe_wait_for_staging()
        self.optimizers.step()
        return grad_norm, False

    # -- validation ----------------------------------------------------------------------
    @torch.no_grad()
    def validate(self) -> None:
        """Held-out loss and perplexity, overall and per source, on ``validation.steps`` batches."""
        from flame.data import SourceLossMeter

        self.model.eval()
        meter = SourceLossMeter(self.val_loader.source_names)
        it = iter(self.val_loader)
        for _ in range(max(self.cfg.validation.steps, 1)):
            raw = next(it)
            logits, labels = self.forward_logits(self._to_device(raw))
            token_loss = F.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
            )
            meter.update(token_loss, labels, raw["_source_ids"])
        self.metrics.log_scalars(meter.compute(), self.step)
        self.model.train()

    def probe(self) -> None:
        """Research probes on one held-out batch (the first validation batch)."""
        from flame.components.probes import run_probes

        if getattr(self, "probe_ids", None) is None:
            from flame.data import build_dataloader

            loader = self.val_loader if self.val_loader is not None else build_dataloader(
                self.cfg, self.tokenizer, self.dp_rank, self.dp_degree, split="validation"
            )
            self.probe_ids = next(iter(loader))["input_ids"][:1].to(self.device)
        with self.amp:
            values = run_probes(self.model, self.probe_ids, self.cfg.probes.sink_threshold)
        self.metrics.log_scalars(values, self.step)

    # -- the loop ------------------------------------------------------------------------
    def train(self) -> int:
        """Train to ``training.steps``; returns the exit code (0, or 128 + signal after a stop request)."""
        cfg = self.cfg
        settings = group_settings(self.lr_schedulers)
        resumed = self.checkpointer.load(step=cfg.checkpoint.load_step)
        if resumed:
            lr_at_loaded_step(self.lr_schedulers, settings)
        if cfg.model.init_from:
            from flame.components.init_from import load_init_from

            load_init_from(self, resumed)
        if cfg.checkpoint.create_seed_checkpoint:
            self.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
            return 0
        if self.step > 0 and self.step >= cfg.training.steps:
            return self._already_finished()
        stop = self.stop_request or StopRequest()
        stop.attach(torch.distributed.get_world_size())
        split = startup_split()
        if split:
            logger.info(f"Start-up: {split}")
        logger.info(
            f"Training from step {self.step + 1} to {cfg.training.steps}: batch {cfg.training.local_batch_size} x "
            f"seq {cfg.training.seq_len} x accumulation {cfg.training.gradient_accumulation_steps} x dp {self.dp_degree}"
        )
        self.metrics.reset_clock(self.step)
        data_iter = iter(self.dataloader)
        from torchtitan.tools.utils import GarbageCollection

        from flame.components.profiling import memory_snapshots, training_profiler

        # automatic GC off, generation-1 collection every training.gc_freq steps (as torchtitan):
        # no gen-2 pauses at random steps
        gc_handler = GarbageCollection(gc_freq=cfg.training.gc_freq, debug=cfg.training.gc_debug)

        with training_profiler(cfg.profiling, global_step=self.step, base_folder=cfg.job.dump_folder,
                               device=self.device, last_step=cfg.training.steps) as prof, \
                memory_snapshots(cfg.profiling, global_step=self.step, base_folder=cfg.job.dump_folder) as snapshots:
            while self.step < cfg.training.steps:
                self.step += 1
                stop.poll()  # shares this rank's stop flag while the step runs
                gc_handler.run(self.step)
                calibrator = self.parts.calibrator
                if calibrator is not None and calibrator.before_step():
                    self.metrics.start_allocated_peak()  # the logger resets the peak at every log
                self.train_step(data_iter)
                report = calibrator.after_step(self.metrics.allocated_peak()) if calibrator is not None else None
                if report is not None:
                    self.metrics.log_scalars({f"offload/{k}": v for k, v in report.items()
                                              if isinstance(v, (int, float))}, self.step)
                    self.parts.calibrator = None  # once per launch
                self.checkpointer.save(self.step, last_step=self.step == cfg.training.steps)
                if self._export_with_checkpoint():
                    from flame.components.export import export_trained_model

                    export_trained_model(self, os.path.join(cfg.job.dump_folder, "hf_steps", f"step-{self.step}"))
                if self.val_loader is not None and self.step % cfg.validation.freq == 0:
                    self.validate()
                if cfg.probes.interval > 0 and self.step % cfg.probes.interval == 0:
                    self.probe()
                if prof:
                    prof.step()
                if snapshots:
                    snapshots.step()
                if self.step == 1 and self.device.type == "cuda":
                    # shorter timeout once compilation and lazy init are done (its barrier is CUDA-only)
                    dist_utils.set_pg_timeouts(timedelta(seconds=cfg.comm.train_timeout_seconds), self.parallel_dims)
                signum = stop.requested()
                if signum:
                    return self._stop(signum)
        import gc

        gc.enable()  # GarbageCollection disabled it for the loop only
        self._check_finite_weights()
        self.export_hf()
        write_run_summary(self)
        return 0

    def _stop(self, signum: int) -> int:
        """After SIGTERM/SIGINT: save this step (whatever checkpoint.interval says) and exit 128 + signum."""
        ck = self.checkpointer
        name = signal.Signals(signum).name
        if ck.enable:
            if not ck._should_save(self.step, self.step == self.cfg.training.steps):
                interval, ck.interval = ck.interval, self.step  # one save now, through the ordinary path
                try:
                    ck.save(self.step)
                finally:
                    ck.interval = interval
            ck.maybe_wait_for_staging()
            if ck.async_mode != "disabled" and hasattr(ck, "_async_wait"):
                ck._async_wait()
            line = f"flame: stopped at step {self.step} ({name}); relaunch the same command to resume"
        else:
            line = (f"flame: stopped at step {self.step} ({name}); checkpointing is disabled (checkpoint.enable), "
                    "so nothing was saved and a relaunch starts over")
        return outcome.report("stopped", line, 128 + signum, echo=torch.distributed.get_rank() == 0)

    def _already_finished(self) -> int:
        """A relaunch of a run whose final checkpoint exists: no training, no second export."""
        hf_dir = os.path.join(self.cfg.job.dump_folder, "hf")
        missing = self.cfg.checkpoint.export_hf and not os.path.isdir(hf_dir)
        if torch.distributed.get_rank() == 0:
            print(f"flame: already finished at step {self.step} (training.steps {self.cfg.training.steps})"
                  + ("; writing the missing Hugging Face export" if missing else "; nothing to do"), flush=True)
        if missing:
            self.export_hf()
        return 0

    def _check_finite_weights(self) -> None:
        """A NaN/Inf weight is never exported (one pass over the local shards, once per run)."""
        if self.parts.weights is not None or not self.cfg.checkpoint.export_hf:
            return
        bad = torch.zeros((), device=self.device)
        for p in self.model.parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            bad += (~torch.isfinite(local.detach())).any().float()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(bad)
        if bad.item():
            raise NonFiniteError(f"the weights hold NaN/Inf at step {self.step}; not exported")

    def _export_with_checkpoint(self) -> bool:
        """``checkpoint.export_hf_every_checkpoint``: an HF folder next to every interval checkpoint."""
        ck = self.cfg.checkpoint
        return (ck.enable and ck.export_hf_every_checkpoint and self.step % ck.interval == 0
                and self.step != self.cfg.training.steps)  # the final export goes to DUMP/hf

    def export_hf(self) -> None:
        if not self.cfg.checkpoint.export_hf:
            return
        from flame.components.export import export_trained_model, maybe_upload

        self.hf_upload = maybe_upload(self, export_trained_model(self))

    def close(self) -> None:
        if getattr(self, "hf_upload", None) is not None:
            self.hf_upload.wait(self.cfg.checkpoint.hf_upload_timeout_seconds)
        if getattr(self, "checkpointer", None) is not None:
            self.checkpointer.close()
        if getattr(self, "metrics", None) is not None:
            self.metrics.close()


def _lock_dump_folder(dump_folder: str) -> int | None:
    """Rank 0 holds the dump folder's lock unless flame's launcher already does."""
    if int(os.environ.get("RANK", "0")) != 0 or run_lock.holds_lock_for(dump_folder):
        return None
    try:
        fd = run_lock.acquire(dump_folder)
    except run_lock.DumpFolderInUse as e:
        raise ConfigError(str(e)) from None
    except OSError as e:
        raise ConfigError(f"job.dump_folder {dump_folder!r}: not writable ({e.strerror})") from None
    if fd is None:
        logger.warning(f"{dump_folder}: the file system has no flock; two runs on this folder are not prevented")
    return fd


def _print_stacks_on_sigusr1() -> None:
    """`kill -USR1` prints every thread's Python stack to stderr and the run goes on (where a job
    hangs). faulthandler writes to a file descriptor at the signal: it gets its own copy of
    stderr's, which a library that points descriptor 2 elsewhere for a while (to capture a
    compiler's output, say) does not move. A replaced sys.stderr (a test's capture) may have no
    descriptor: the process's own stderr is used instead."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            own = os.fdopen(os.dup(stream.fileno()), "w")
        except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: no fileno
            continue
        faulthandler.register(signal.SIGUSR1, file=own, all_threads=True)  # faulthandler keeps `own` open
        return


def peak_flops(device_name: str) -> float:
    """torchtitan's peak bf16 FLOP/s of a GPU. It reads ``lspci`` to tell H100 variants apart and,
    where lspci is not installed (most containers), warns on every run before it falls back to the
    device name, which torch already gives as "H100 PCIe" / "H100 NVL": that warning is dropped."""
    import logging
    import shutil

    from torchtitan.tools.logging import logger as titan_logger
    from torchtitan.tools.utils import get_peak_flops

    if shutil.which("lspci") is not None:
        return get_peak_flops(device_name)

    def no_lspci_warning(record: logging.LogRecord) -> bool:
        return "lspci" not in record.getMessage()

    titan_logger.addFilter(no_lspci_warning)
    try:
        return get_peak_flops(device_name)
    finally:
        titan_logger.removeFilter(no_lspci_warning)


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 user error (one ``flame: error:`` line), 3 NaN/Inf, 128 + N stopped by
    signal N (after saving), 1 internal error (traceback)."""
    mark_imports_done()
    init_logger()
    die_with_launcher()
    _print_stacks_on_sigusr1()
    stop = StopRequest().install()
    trainer = cfg = lock = None
    code = 0
    try:
        cfg = FlameConfigManager().parse_args(argv)
        lock = _lock_dump_folder(cfg.job.dump_folder)
        trainer = Trainer(cfg)
        trainer.stop_request = stop
        code = trainer.train()
    except ConfigError as e:
        code = outcome.report("error", f"flame: error: {e}", outcome.EXIT_USER_ERROR)
    except NonFiniteError as e:
        code = outcome.report("nonfinite", f"flame: stopped: {e}", outcome.EXIT_NONFINITE)
    except BaseException as e:  # torch's CheckpointException is a BaseException
        full = None if isinstance(e, (SystemExit, KeyboardInterrupt)) else outcome.find_errno(e)
        if isinstance(e, torch.OutOfMemoryError) and trainer is not None:
            engine = getattr(getattr(trainer, "optimizers", None), "engine", None)
            if engine is not None:  # a plan that did not fit its budget: what was planned, what was there
                try:
                    logger.error(engine.memory_explanation())
                except Exception as why:  # the crash report below must not be lost to this line
                    logger.error(f"offload: GPU memory report failed: {why!r}")
        if full is None:
            outcome.report_crash(e)
            raise
        where = full.filename or (cfg.job.dump_folder if cfg is not None else "the dump folder")
        code = outcome.report("error", f"flame: error: the disk is full ({full.strerror}) writing {where}; free space "
                                       "and relaunch the same command to resume", outcome.EXIT_USER_ERROR)
    finally:
        stop.uninstall()
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if lock is not None:
            os.close(lock)
    return code


if __name__ == "__main__":
    sys.exit(main())
