"""Training throughput of flame's trainer next to torchtitan's own Llama3, in one device run.

    python benchmarks/throughput.py --suite transformer [--out DIR] [--budget-s 500]
    python benchmarks/throughput.py --suite linear | multi | smoke | all
    python benchmarks/throughput.py --cases flame_tf_1B,native_1B   # a subset, by name

Every case runs in its own process (torchrun for more than one GPU) through the *real* training
loop of its framework: ``flame.train.Trainer.train()`` (forward, flame's loss, backward, clip,
AdamW, LR schedule, metrics) and ``torchtitan.train.Trainer.train()`` on torchtitan's Llama3 with a
"1.3B"/"340M" flavor registered in-process (d 2048 / 24 layers / 16 heads / vocab 32000, the same
dimensions as ``benchmarks/configs/transformer_1B.json`` and ``configs/llama_1B.json``). Both read
the same synthetic token stream (uniform random ids, fixed seed; varlen cases: random document
lengths, EOS at each document end for torchtitan, ``cu_seqlens``/``position_ids`` for flame).

Timing: ``train_step`` is wrapped; the device is synchronized once before the first timed step and
once after the last, so the window holds ``--steps`` whole optimizer steps after ``--warmup``
steps (compilation, autotuning, allocator warm-up). tokens/s = timed tokens / window seconds.
FLOPs per token: ``full`` = 6 x matmul parameters + 12 x layers x heads x head_dim x seq (the
issue's and torchtitan's convention: attention counted without the causal half), ``causal`` =
flame.models.flops (causal attention, document lengths for varlen, the chunked linear-attention
terms for GLA/GatedDeltaNet). MFU is against the bf16 matmul ceiling measured in the same run.
Peak memory: ``torch.cuda.max_memory_reserved`` / ``_allocated`` over the timed window.
``--probe-batch`` cases then search the largest batch whose whole train step fits (doubling, then
bisection; one dynamic-shape recompile), in the same process.

Writes ``throughput_<suite>.json`` (+ per-case logs, profiler tables) under ``--out`` (default
``$OUT`` when set, else ``benchmarks/results``) and prints the table last.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TF_1B = "benchmarks/configs/transformer_1B.json"
TF_340M = "benchmarks/configs/transformer_340M.json"
NATIVE_DIMS = {  # torchtitan flavors registered in-process (same dims as the flame configs)
    "1.3B": dict(dim=2048, n_layers=24, n_heads=16, vocab_size=32000, rope_theta=10000.0),
    "340M": dict(dim=1024, n_layers=24, n_heads=16, vocab_size=32000, rope_theta=10000.0),
    "debug": dict(dim=64, n_layers=2, n_heads=4, vocab_size=256, rope_theta=10000.0),
}
NATIVE_CONFIG = {"1.3B": TF_1B, "340M": TF_340M, "debug": "benchmarks/configs/transformer_debug.json"}


def case(name, kind, model, seq=4096, batch=2, **kw):
    c = dict(name=name, kind=kind, model=model, seq=seq, batch=batch, ac="none", compile=True,
             varlen=False, nproc=1, tp=1, data="synthetic", probe_batch=False, profile=False,
             env={}, timeout=150, ref=None, args=[])
    c.update(kw)
    return c


def suites():
    T = {
        "transformer": [
            case("native_1B", "native", "1.3B"),
            case("flame_tf_1B", "flame", TF_1B, ref="native_1B", profile=True, probe_batch=True, probe_s=25,
                 timeout=200),
            case("native_1B_varlen", "native", "1.3B", varlen=True),
            case("flame_tf_1B_varlen", "flame", TF_1B, varlen=True, ref="native_1B_varlen"),
            case("flame_tf_1B_varlen_torch", "flame", TF_1B, varlen=True, ref="native_1B_varlen",
                 env={"FLAME_VARLEN_SOFTMAX": "varlen"}),
            case("native_340M", "native", "340M"),
            case("flame_tf_340M", "flame", TF_340M, ref="native_340M"),
            case("flame_llama_1B", "flame", "configs/llama_1B.json", ref="native_1B"),
            case("flame_tf_1B_flash_first", "flame", TF_1B, ref="flame_tf_1B",
                 env={"FLAME_SDPA_BACKENDS": "flash,efficient,cudnn,math"}),
            case("flame_tf_1B_corpus", "flame", TF_1B, data="corpus", ref="flame_tf_1B"),
        ],
        # full activation checkpointing for every row so that 32K fits; same settings per length
        "linear": [
            case("flame_tf_1B_ac", "flame", TF_1B, ac="full", probe_batch=True, probe_s=40, timeout=150,
                 phases=[[4096, 2], [32768, 1]]),
            case("flame_gdn_1B_ac", "flame", "configs/gated_deltanet_1B.json", ac="full", compile=False,
                 timeout=150, phases=[[4096, 2], [32768, 1]], ref="flame_tf_1B_ac", probe_batch=True, probe_s=25),
            case("flame_gla_1B_ac", "flame", "configs/gla_1B.json", ac="full", compile=False, timeout=150,
                 phases=[[4096, 2], [32768, 1]], ref="flame_tf_1B_ac", probe_batch=True, probe_s=25),
        ],
        "multi": [
            case("flame_tf_1B_fsdp1", "flame", TF_1B, nproc=1, loss_steps=True),
            case("flame_tf_1B_fsdp2", "flame", TF_1B, nproc=2, ref="flame_tf_1B_fsdp1", loss_steps=True),
            case("flame_tf_1B_tp2", "flame", TF_1B, nproc=2, tp=2, batch=2, ref="flame_tf_1B_fsdp2", loss_steps=True,
                 profile=True),
            case("native_1B_fsdp2", "native", "1.3B", nproc=2),
            # the blocks keep their gathered bf16 weights from forward to backward: one all-gather
            # per block a step instead of two (2.7 GB more per GPU)
            case("flame_tf_1B_fsdp2_keep", "flame", TF_1B, nproc=2, ref="flame_tf_1B_fsdp1",
                 args=["--parallelism.fsdp_reshard_after_forward", "never"]),
            # twice the tokens per GPU: the same collectives hide behind twice the compute
            case("flame_tf_1B_fsdp1_b4", "flame", TF_1B, nproc=1, batch=4),
            case("flame_tf_1B_fsdp2_b4", "flame", TF_1B, nproc=2, batch=4, ref="flame_tf_1B_fsdp1_b4"),
        ],
        "smoke": [  # CPU plumbing check with tiny models
            case("native_debug", "native", "debug", seq=64, batch=2, compile=False, timeout=120),
            case("flame_debug", "flame", "benchmarks/configs/transformer_debug.json", seq=64, batch=2,
                 compile=False, ref="native_debug", probe_batch=True, profile=True, timeout=120),
            case("native_debug_varlen", "native", "debug", seq=64, batch=2, compile=False, varlen=True),
            case("flame_debug_varlen", "flame", "benchmarks/configs/transformer_debug.json", seq=64, batch=2,
                 compile=False, varlen=True, ref="native_debug_varlen"),
            case("flame_debug_phases", "flame", "configs/debug/llama.json", seq=64, batch=2, compile=False,
                 ac="full", phases=[[64, 2], [128, 1]], probe_batch=True),
            case("flame_debug_corpus", "flame", "configs/debug/llama.json", seq=64, batch=2, compile=False,
                 data="corpus"),
        ],
    }
    T["all"] = T["transformer"] + T["linear"] + T["multi"]
    return T


# --------------------------------------------------------------------------------------------
# synthetic data (identical token statistics for both frameworks)
# --------------------------------------------------------------------------------------------
EOS = 2


def doc_bounds(gen, T: int, min_len: int = 64, max_len: int = 4096) -> list[int]:
    """Start offsets of the documents of one row (random lengths, uniform in [min_len, max_len))."""
    import torch

    starts, pos = [], 0
    hi = min(max_len, T)
    lo = min(min_len, hi - 1)
    while pos < T:
        starts.append(pos)
        pos += int(torch.randint(lo, hi, (1,), generator=gen))
    return starts


class SyntheticBatches:
    """Infinite stream of (input_ids, labels[, documents]) rows; ``fmt`` 'flame' or 'native'."""

    def __init__(self, B, T, vocab, varlen, fmt, seed=0):
        self.B, self.T, self.vocab, self.varlen, self.fmt, self.seed = B, T, vocab, varlen, fmt, seed
        self.doc_lengths = []  # every document length produced (for the attention FLOP count)

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass

    def __iter__(self):
        import torch

        gen = torch.Generator().manual_seed(self.seed)
        B, T = self.B, self.T
        while True:
            ids = torch.randint(3, self.vocab, (B, T + 1), generator=gen)
            starts = []
            if self.varlen:
                for b in range(B):
                    s = doc_bounds(gen, T)
                    starts.append(s)
                    ends = s[1:] + [T]
                    self.doc_lengths.extend(e - a for a, e in zip(s, ends))
                    for e in ends[:-1]:
                        ids[b, e - 1] = EOS  # the last token of each document (torchtitan's marker)
            inp, lab = ids[:, :T].contiguous(), ids[:, 1:].contiguous()
            if self.fmt == "native":
                yield {"input": inp}, lab
                continue
            batch = {"input_ids": inp, "labels": lab}
            if self.varlen:
                cu, pos = [0], torch.empty(B, T, dtype=torch.long)
                for b, s in enumerate(starts):
                    ends = s[1:] + [T]
                    for a, e in zip(s, ends):
                        pos[b, a:e] = torch.arange(e - a)
                        cu.append(b * T + e)
                batch["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
                batch["position_ids"] = pos
            yield batch


# --------------------------------------------------------------------------------------------
# timing around the frameworks' own train_step
# --------------------------------------------------------------------------------------------
class StepTimer:
    """Wraps ``trainer.train_step``; phases = [(warmup, steps, tag)], run back to back."""

    def __init__(self, trainer, device, warmup, steps, profile_steps=0, out_prefix=None):
        self.trainer, self.device = trainer, device
        self.warmup, self.steps = warmup, steps
        self.profile_steps, self.out_prefix = profile_steps, out_prefix
        self.n = 0
        self.t0 = self.t1 = None
        self.step_times = []
        self.mem = {}
        self.prof = None
        self.profile_summary = None
        self.losses = []
        self.orig = trainer.train_step
        trainer.train_step = self

    def _sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, data_iter):
        import torch

        self.n += 1
        n, w, k = self.n, self.warmup, self.steps
        if n == w + 1:
            self._sync()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            self.t0 = self.last = time.perf_counter()
        if n == w + k + 1 and self.profile_steps:
            self.prof = _start_profiler()
        out = self.orig(data_iter)
        if w < n <= w + k:
            now = time.perf_counter()
            self.step_times.append(now - self.last)  # host-side, for spread only
            self.last = now
        if n == w + k:
            self._sync()
            self.t1 = time.perf_counter()
            if self.device.type == "cuda":
                self.mem = {
                    "peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / 2**30,
                    "peak_allocated_gib": torch.cuda.max_memory_allocated(self.device) / 2**30,
                    "capacity_gib": torch.cuda.get_device_properties(self.device).total_memory / 2**30,
                }
        if self.prof is not None and n == w + k + self.profile_steps:
            self._sync()
            self.profile_summary = _stop_profiler(self.prof, self.profile_steps, self.out_prefix)
            self.prof = None
        return out

    def result(self, tokens_per_step):
        if self.t0 is None or self.t1 is None:
            return None
        dt = self.t1 - self.t0
        return {
            "timed_steps": self.steps,
            "window_s": dt,
            "step_time_s": dt / self.steps,
            "tokens_per_second": tokens_per_step * self.steps / dt,
            "host_step_s_median": statistics.median(self.step_times) if self.step_times else None,
            "host_step_s_max": max(self.step_times) if self.step_times else None,
            **self.mem,
        }


def _start_profiler():
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    p = profile(activities=acts, record_shapes=False)
    p.__enter__()
    return p


def _kernel_category(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("nccl",)):
        return "communication"
    if any(s in n for s in ("flash", "fmha", "cudnn", "attn", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "matmul", "_mm", "cublas")):
        return "matmul"
    if "adam" in n or "foreach" in n or "multi_tensor" in n:
        return "optimizer/foreach"
    if "triton" in n:
        return "triton (fused/inductor/FLA)"
    if any(s in n for s in ("cross_entropy", "log_softmax", "nll")):
        return "loss"
    if "memcpy" in n or "memset" in n:
        return "memcpy/memset"
    return "other (eager elementwise/reduce)"


def _stop_profiler(p, steps, out_prefix):
    import torch

    p.__exit__(None, None, None)
    ka = p.key_averages()
    cats, kernels = {}, []
    for e in ka:
        dev_t = getattr(e, "self_device_time_total", None)
        if dev_t is None:
            dev_t = getattr(e, "self_cuda_time_total", 0.0)
        # kernels only: user annotations ("Optimizer.step#AdamW.step", "ProfilerStep*") overlap them
        is_kernel = (str(getattr(e, "device_type", "")).endswith("CUDA") and dev_t > 0
                     and "#" not in e.key and not e.key.startswith("ProfilerStep"))
        if is_kernel:
            c = _kernel_category(e.key)
            cats[c] = cats.get(c, 0.0) + dev_t / 1e3
            kernels.append((dev_t / 1e3, e.count, e.key[:110]))
    kernels.sort(reverse=True)
    summary = {
        "steps": steps,
        "device_ms_per_step_by_category": {k: round(v / steps, 3) for k, v in sorted(cats.items(), key=lambda x: -x[1])},
        "device_busy_ms_per_step": round(sum(cats.values()) / steps, 3),
        "top_kernels_ms_per_step": [[round(t / steps, 3), c // steps, k] for t, c, k in kernels[:25]],
    }
    if out_prefix:
        try:
            sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
            with open(out_prefix + "_profile.txt", "w") as f:
                f.write(ka.table(sort_by=sort, row_limit=40, max_name_column_width=90))
        except Exception as e:  # the table is a convenience
            summary["table_error"] = repr(e)
    return summary


def probe_batch(trainer, make_batch, start_b, limit_s, fmt, step_fn, max_b=256):
    """Largest batch (per device) whose whole train step runs without OOM; doubling then bisection."""
    import gc

    import torch

    t_start = time.perf_counter()
    tried = {}

    def fits(b):
        try:
            step_fn(make_batch(b))
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        for opt in getattr(trainer.optimizers, "optimizers", [trainer.optimizers]):
            opt.zero_grad(set_to_none=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        tried[b] = ok
        return ok

    lo, hi = start_b, None
    b = start_b * 2
    while b <= max_b and time.perf_counter() - t_start < limit_s:
        if fits(b):
            lo, b = b, b * 2
        else:
            hi = b
            break
    while hi is not None and hi - lo > max(1, lo // 8) and time.perf_counter() - t_start < limit_s:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return {"largest_batch_fits": lo, "smallest_batch_oom": hi, "exact": hi is not None and hi - lo == 1,
            "tried": tried, "probe_s": time.perf_counter() - t_start}


# --------------------------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------------------------
def _rank0():
    return int(os.environ.get("RANK", "0")) == 0


def _write(path, obj):
    if _rank0():
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, default=str)


def worker_flame(c, out_dir, warmup, steps):
    import torch

    from flame.config.manager import FlameConfigManager
    from flame.train import Trainer
    from torchtitan.tools.logging import init_logger

    init_logger()
    phases = c.get("phases") or [[c["seq"], c["batch"]]]
    T0, B0 = phases[0]
    dump = os.path.join("/tmp", f"flame_bench_{c['name']}_{os.getpid()}")
    argv = [
        "--job.config_file", "flame/models/fla.toml", "--job.dump_folder", dump,
        "--model.config", c["model"], "--model.tokenizer_path", "flame/assets/tokenizer",
        "--training.dataset", "flame/assets/sample_corpus", "--training.num_workers", "2" if c["data"] == "corpus" else "0",
        "--training.batch_size", str(B0), "--training.seq_len", str(T0), "--training.context_len", str(T0),
        "--training.steps", str(10**6), "--metrics.log_freq", str(10**6),
        "--lr_scheduler.warmup_steps", "2", "--checkpoint.no-enable-checkpoint", "--checkpoint.no-export-hf",
        "--activation_checkpoint.mode", c["ac"], "--offload.enable", "off",
        "--parallelism.tensor_parallel_degree", str(c["tp"]),
    ]
    argv += ["--compile.enable"] if c["compile"] else ["--compile.no-enable"]
    argv += ["--training.varlen"] if c["varlen"] else []
    argv += c["args"]  # the case's own options (after the common ones: they win)
    cfg = FlameConfigManager().parse_args(argv)
    trainer = Trainer(cfg)
    vocab = int(trainer.model_config.vocab_size)
    results, sources = [], []
    prefix = os.path.join(out_dir, c["name"])
    try:
        for i, (T, B) in enumerate(phases):
            prof = 3 if (c["profile"] and i == 0) else 0
            dp = trainer.dp_degree
            if c["data"] == "synthetic":
                src = SyntheticBatches(B, T, vocab, c["varlen"], "flame", seed=1000 + trainer.dp_rank)
                sources.append(src)
                trainer.dataloader = src
            elif i > 0:
                raise RuntimeError("phases need synthetic data")
            if i > 0:
                # a new length compiles fresh static graphs, as a fresh run at that length would.
                # (Turning automatic dynamic shapes off instead made every new max_seqlen of a varlen
                # step a static recompile, up to the cache limit, then eager: run 2026-11-22.)
                torch._dynamo.reset()
            timer = StepTimer(trainer, trainer.device, warmup, steps, prof, prefix)
            cfg.training.steps = trainer.step + warmup + steps + prof
            trainer.metrics.total_steps = cfg.training.steps
            trainer.train()
            trainer.train_step = timer.orig
            r = timer.result(B * T) or {}
            r.update(seq=T, batch=B, global_tokens_per_second=r.get("tokens_per_second", 0) * dp, dp=dp)
            r["flops"] = flops_for(trainer.model_config, T, sources[-1].doc_lengths if (sources and c["varlen"]) else None)
            if timer.profile_summary:
                r["profile"] = timer.profile_summary
            hist = [rec for _, rec in trainer.metrics.history]
            if hist:
                r["last_logged_loss"] = hist[-1].get("loss")
            results.append(r)
            # what is measured so far survives a later phase or the batch probe running past the timeout
            _write(os.path.join(out_dir, f"{c['name']}.json"),
                   {"phases": results, "n_params": trainer.n_params, "incomplete": True})
        if c.get("loss_steps"):
            results[0]["losses"] = loss_trace(trainer, cfg, vocab, T0, B0)
        if c["probe_batch"]:
            T, B = phases[0]
            gen_src = SyntheticBatches(1, T, vocab, False, "flame", seed=7)

            def make(b):
                gen_src.B = b
                return next(iter(gen_src))

            def step_fn(batch):
                trainer.step = 10**5 + 1  # not a log step
                trainer.train_step(iter([batch]))

            results[0]["memory_probe"] = probe_batch(trainer, make, B, c.get("probe_s", 75), "flame", step_fn,
                                                     max_b=256 if trainer.device.type == "cuda" else 8)
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return {"phases": results, "n_params": trainer.n_params}


def loss_trace(trainer, cfg, vocab, T, B, n=8):
    """Losses of n more steps on a fixed data stream (TP vs non-TP comparison). The model goes on
    from its timed steps, which saw the same data in every case with one data-parallel rank."""
    import torch

    with torch.no_grad():
        torch.manual_seed(0)
    src = SyntheticBatches(B * trainer.dp_degree, T, vocab, False, "flame", seed=4242)
    it = iter(src)
    out = []
    rank = trainer.dp_rank
    for _ in range(n):
        full = next(it)
        batch = {k: v[rank * B:(rank + 1) * B] for k, v in full.items()}
        trainer.step = 10**5 + 1
        losses = []
        orig_log = trainer.metrics.log
        trainer.metrics.should_log = lambda s: True
        trainer.metrics.log = lambda step, loss, *a, **k: losses.append(loss)
        trainer.train_step(iter([batch]))
        trainer.metrics.log = orig_log
        out.append(losses[-1] if losses else None)
    return out


def worker_native(c, out_dir, warmup, steps):
    import dataclasses

    import torch

    from flame.distributed.device import bind_torchtitan_device, device_type

    kind = device_type()
    bind_torchtitan_device(kind)
    import torchtitan.train as tt_train
    from torchtitan.config import ConfigManager
    from torchtitan.models import llama3
    from torchtitan.models.llama3 import TransformerModelArgs
    from torchtitan.protocols.train_spec import get_train_spec, register_train_spec
    from torchtitan.tools.logging import init_logger

    init_logger()
    for k, v in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                 ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(k, v)
    flavor = c["model"]
    extra = dict(attn_type="varlen", attn_mask_type="block_causal") if c["varlen"] else {}
    llama3.llama3_args[flavor] = TransformerModelArgs(**NATIVE_DIMS[flavor], **extra)
    T, B = c["seq"], c["batch"]
    vocab = NATIVE_DIMS[flavor]["vocab_size"]
    holder = {}

    def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, **kw):
        holder["src"] = SyntheticBatches(B, T, vocab, c["varlen"], "native", seed=1000 + dp_rank)
        return holder["src"]

    class _Tok:
        eos_id = EOS
        bos_id = 1

        def get_vocab_size(self):
            return vocab

    spec = dataclasses.replace(get_train_spec("llama3"), build_dataloader_fn=build_dataloader,
                               build_tokenizer_fn=lambda job_config: _Tok(), build_validator_fn=None)
    register_train_spec("llama3_bench", spec)
    dump = os.path.join("/tmp", f"tt_bench_{c['name']}_{os.getpid()}")
    argv = [
        "--model.name", "llama3_bench", "--model.flavor", flavor, "--job.dump_folder", dump,
        "--training.local_batch_size", str(B), "--training.seq_len", str(T),
        "--training.steps", str(warmup + steps), "--metrics.log_freq", str(10**6),
        "--lr_scheduler.warmup_steps", "2", "--activation_checkpoint.mode", c["ac"],
        "--parallelism.tensor_parallel_degree", str(c["tp"]),
        "--optimizer.lr", "3e-4", "--optimizer.eps", "1e-15", "--optimizer.weight_decay", "0.01",
        "--training.max_norm", "1.0",
    ]
    argv += ["--compile.enable"] if c["compile"] else []
    if kind == "cpu":
        argv += ["--comm.init_timeout_seconds", "300"]
    cfg = ConfigManager().parse_args(argv)
    if kind == "cpu":  # CPU smoke runs only: torchtitan's memory monitor is CUDA-only
        import torchtitan.components.metrics as tt_metrics

        class _NoMem:
            device_name = "cpu"

            def get_peak_stats(self):
                return tt_metrics.DeviceMemStats(0, 0, 0, 0, 0, 0)

            def reset_peak_stats(self):
                pass

        tt_metrics.build_device_memory_monitor = lambda: _NoMem()
        tt_train.dist_utils.set_pg_timeouts = lambda *a, **k: None  # its barrier is CUDA-only
    trainer = tt_train.Trainer(cfg)
    if kind == "cpu":
        from torch.distributed.fsdp import FSDPModule

        for m in trainer.model_parts[0].modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    timer = StepTimer(trainer, trainer.device, warmup, steps, 3 if c["profile"] else 0,
                      os.path.join(out_dir, c["name"]))
    cfg.training.steps = warmup + steps + (3 if c["profile"] else 0)
    try:
        trainer.train()
        r = timer.result(B * T) or {}
        dp = trainer.parallel_dims.dp_shard * trainer.parallel_dims.dp_replicate
        r.update(seq=T, batch=B, dp=dp, global_tokens_per_second=r.get("tokens_per_second", 0) * dp)
        from flame.models import build as model_build

        mc = model_build.load_model_config(NATIVE_CONFIG[flavor])
        r["flops"] = flops_for(mc, T, holder["src"].doc_lengths if c["varlen"] else None)
        if timer.profile_summary:
            r["profile"] = timer.profile_summary
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return {"phases": [r]}


def flops_for(model_config, T, doc_lengths=None):
    """{'full', 'causal', 'dense'} training FLOPs per token (see the module doc)."""
    from flame.models.flops import flops_per_token, param_counts
    from flame.models.registry import layer_mixers

    dense = 6.0 * param_counts(model_config)["matmul"]
    mixers = layer_mixers(model_config)
    full_attn = 0.0
    for m in mixers:
        if m.kind == "softmax":
            full_attn += 3 * 2 * m.heads * (m.dk + m.dv) * T  # all T keys (issue/torchtitan convention)
    lin = flops_per_token(model_config, T)["attention"] if any(m.kind != "softmax" for m in mixers) else 0.0
    if doc_lengths:
        # causal attention inside each document: mean keys per token = sum L(L+1)/2 / sum L
        ctx_keys = sum(L * (L + 1) / 2 for L in doc_lengths) / max(sum(doc_lengths), 1)
        causal_attn = sum(3 * 2 * m.heads * (m.dk + m.dv) * ctx_keys for m in mixers if m.kind == "softmax")
        causal = dense + causal_attn + lin
    else:
        causal = flops_per_token(model_config, T)["total"]
    return {"full": dense + full_attn + lin, "causal": causal, "dense": dense}


def worker_ceiling(out_dir):
    import torch

    if not torch.cuda.is_available():
        return {"bf16_matmul_tflops": None, "device": "cpu"}
    dev = torch.device("cuda")
    res = {"device": torch.cuda.get_device_name(dev)}
    for n in (8192, 4096):
        xs = [(torch.randn(n, n, device=dev, dtype=torch.bfloat16), torch.randn(n, n, device=dev, dtype=torch.bfloat16))
              for _ in range(3)]
        for a, b in xs:
            a @ b
        torch.cuda.synchronize()
        times = []
        for i in range(30):
            a, b = xs[i % 3]
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        res[f"bf16_matmul_{n}_tflops"] = 2 * n**3 / statistics.median(times) / 1e12
    res["bf16_matmul_tflops"] = max(res["bf16_matmul_8192_tflops"], res["bf16_matmul_4096_tflops"])
    if not os.environ.get("THROUGHPUT_NO_COMPONENTS"):
        res.update(components(dev))
    return res


def _bench(fn, reps=20):
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def components(dev):
    """Micro-benchmarks of the pieces the fixes touch (ms, median of 20, fresh random inputs)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    B, H, T, D = 2, 16, 4096, 128
    q, k, v = (torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    flops = 7 * B * H * T * T * D  # causal fwd (2BHT^2D) + bwd (2.5x)
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def run():
            with sdpa_kernel([be]):
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
            o.backward(g)
        try:
            ms = _bench(run)
            out[f"sdpa_{name}_fwd_bwd_ms"] = ms
            out[f"sdpa_{name}_tflops"] = flops / ms / 1e9
        except Exception as e:
            out[f"sdpa_{name}_error"] = str(e).splitlines()[0][:200]
    # cross-entropy over the logits of one micro-batch (B*T x vocab), float32 math
    from flame.components.loss import cross_entropy_sum

    N, V, Dm = 2 * 4096, 32000, 2048
    h = torch.randn(N, Dm, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, Dm, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    y = torch.randint(0, V, (N,), device=dev)
    comp = torch.compile(cross_entropy_sum)

    def ce(fn):
        def run():
            logits = h @ w.t()
            fn(logits, y).backward()
        return run

    out["lm_head_ce_eager_ms"] = _bench(ce(cross_entropy_sum))
    try:
        out["lm_head_ce_compiled_ms"] = _bench(ce(comp))
    except Exception as e:
        out["lm_head_ce_compiled_error"] = str(e).splitlines()[0][:200]
    try:
        from fla.modules import FusedLinearCrossEntropyLoss

        fl = FusedLinearCrossEntropyLoss(reduction="sum")
        out["lm_head_ce_fla_fused_linear_ms"] = _bench(lambda: fl(h, y, w).backward())
    except Exception as e:
        out["lm_head_ce_fla_fused_linear_error"] = str(e).splitlines()[0][:200]
    return out


# --------------------------------------------------------------------------------------------
# orchestration
# --------------------------------------------------------------------------------------------
def versions():
    v = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "torchtitan", "fla", "transformers"):
        try:
            m = __import__(mod)
            v[mod] = getattr(m, "__version__", "?")
        except Exception:
            v[mod] = None
    try:
        import torch

        v["cuda"] = torch.version.cuda
        v["cudnn"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
    except Exception:
        pass
    return v


def run_case(c, out_dir, warmup, steps, timeout):
    log = os.path.join(out_dir, f"{c['name']}.log")
    res_path = os.path.join(out_dir, f"{c['name']}.json")
    if os.path.exists(res_path):
        os.remove(res_path)
    payload = json.dumps(c)
    worker = [os.path.abspath(__file__), "--worker", payload, "--out", out_dir,
              "--warmup", str(warmup), "--steps", str(steps)]
    if c["nproc"] > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={c['nproc']}"] + worker
    else:
        cmd = [sys.executable] + worker
    env = dict(os.environ, **c.get("env", {}))
    env.setdefault("PYTHONPATH", ROOT)
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t
    if os.path.exists(res_path):
        with open(res_path) as f:
            r = json.load(f)
        os.remove(res_path)  # merged into the suite's JSON (the device returns a limited file count)
        if rc == 0:
            os.remove(log)
    else:
        with open(log) as f:
            tail = f.read()[-1500:]
        r = {"error": f"rc={rc}", "log_tail": tail}
    r.update(case=c, wall_s=wall, rc=rc)
    return r


def rows(results, ceiling):
    peak = (ceiling or {}).get("bf16_matmul_tflops")
    table = []
    by_name = {r["case"]["name"]: r for r in results}
    for r in results:
        c = r["case"]
        for ph in r.get("phases", [{}]) or [{}]:
            if not ph or "tokens_per_second" not in ph:
                table.append({"case": c["name"], "error": r.get("error", "no timing"), "seq": c["seq"], "batch": c["batch"]})
                continue
            fl = ph["flops"]
            tps = ph["tokens_per_second"]  # per data-parallel rank
            per_gpu = tps / c.get("tp", 1)  # a rank with tensor parallelism spans tp GPUs
            row = {
                "case": c["name"], "framework": c["kind"], "model": c["model"], "seq": ph["seq"], "batch": ph["batch"],
                "ac": c["ac"], "compile": c["compile"], "varlen": c["varlen"], "nproc": c["nproc"], "tp": c["tp"],
                "tokens_per_second": tps, "global_tokens_per_second": ph.get("global_tokens_per_second", tps),
                "tflops_full": per_gpu * fl["full"] / 1e12, "tflops_causal": per_gpu * fl["causal"] / 1e12,
                "peak_reserved_gib": ph.get("peak_reserved_gib"), "peak_allocated_gib": ph.get("peak_allocated_gib"),
            }
            if peak:
                row["mfu_full_pct"] = 100 * row["tflops_full"] / peak
                row["mfu_causal_pct"] = 100 * row["tflops_causal"] / peak
            if "memory_probe" in ph:
                row["largest_batch_fits"] = ph["memory_probe"]["largest_batch_fits"]
            ref = by_name.get(c.get("ref") or "")
            if ref:
                rph = [p for p in ref.get("phases", []) if p and p.get("seq") == ph["seq"] and "tokens_per_second" in p]
                if rph:
                    key = "global_tokens_per_second"
                    row["ref"] = c["ref"]
                    row["ratio_vs_ref"] = ph.get(key, tps) / rph[0].get(key, rph[0]["tokens_per_second"])
                    if ref["case"]["nproc"] != c["nproc"]:  # weak scaling: global tokens/s per GPU vs the ref's
                        row["scaling_efficiency"] = row["ratio_vs_ref"] * ref["case"]["nproc"] / c["nproc"]
            table.append(row)
    return table


def fmt_table(table, ceiling, device):
    head = f"device: {device}; bf16 matmul ceiling {ceiling.get('bf16_matmul_tflops') or float('nan'):.0f} TFLOP/s (measured)"
    cols = ["case", "seq", "batch", "ac", "tok/s", "TFLOP/s(full)", "MFU%(full)", "TFLOP/s(causal)", "peakGiB", "maxB", "ratio", "vs"]
    lines = [head, " | ".join(cols)]
    for r in table:
        if "error" in r:
            lines.append(f"{r['case']} | {r['seq']} | {r['batch']} | - | ERROR {r['error']}")
            continue

        def f(x, p=1):
            return "-" if x is None else f"{x:,.{p}f}"

        lines.append(" | ".join([
            r["case"], str(r["seq"]), str(r["batch"]), r["ac"], f(r["global_tokens_per_second"], 0), f(r["tflops_full"]),
            f(r.get("mfu_full_pct")), f(r["tflops_causal"]), f(r["peak_reserved_gib"]),
            str(r.get("largest_batch_fits", "-")), f(r.get("ratio_vs_ref"), 3), r.get("ref") or "-",
        ]))
    return "\n".join(lines)


def markdown(doc) -> str:
    """The table of a results JSON as Markdown (for the README's Performance section)."""
    v = doc.get("versions", {})
    c = doc.get("ceiling", {})
    out = [f"Device: {doc.get('device')} (measured bf16 matmul ceiling {c.get('bf16_matmul_tflops') or float('nan'):.0f} TFLOP/s); "
           f"torch {v.get('torch')}, triton {v.get('triton')}, torchtitan {v.get('torchtitan')}, fla {v.get('fla')}, "
           f"transformers {v.get('transformers')}, CUDA {v.get('cuda')}; {doc.get('warmup_steps')} warm-up + "
           f"{doc.get('timed_steps')} timed steps per row, {doc.get('date')}.", "",
           "| case | seq | batch | AC | tokens/s | TFLOP/s (full) | MFU % (full) | TFLOP/s (causal) | peak GiB | largest batch | ratio | vs |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows(doc["cases"], c):  # derived again from the raw cases: the current FLOP accounting
        if "error" in r:
            out.append(f"| {r['case']} | {r['seq']} | {r['batch']} | | not measured: {r['error'][:60]} | | | | | | | |")
            continue

        def f(x, p=1):
            return "-" if x is None else f"{x:,.{p}f}"

        out.append("| " + " | ".join([
            r["case"], str(r["seq"]), str(r["batch"]), r["ac"], f(r["global_tokens_per_second"], 0), f(r["tflops_full"]),
            f(r.get("mfu_full_pct")), f(r["tflops_causal"]), f(r["peak_reserved_gib"]),
            str(r.get("largest_batch_fits", "-")), f(r.get("ratio_vs_ref"), 3), r.get("ref") or "-"]) + " |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default="transformer", choices=sorted(suites()))
    ap.add_argument("--cases", default="", help="comma-separated case names (default: the whole suite)")
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "benchmarks", "results"))
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=500.0, help="stop starting new cases after this")
    ap.add_argument("--no-components", action="store_true", help="skip the SDPA/CE micro-benchmarks")
    ap.add_argument("--markdown", default=None, help="print the table of a results JSON as Markdown and exit")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.markdown:
        print(markdown(json.load(open(a.markdown))))
        return 0
    os.makedirs(a.out, exist_ok=True)

    if a.worker is not None:
        if a.worker == "ceiling":
            res = worker_ceiling(a.out)
            _write(os.path.join(a.out, "ceiling.json"), res)
            return 0
        c = json.loads(a.worker)
        fn = worker_native if c["kind"] == "native" else worker_flame
        res = fn(c, a.out, a.warmup, a.steps)
        _write(os.path.join(a.out, f"{c['name']}.json"), res)
        return 0

    start = time.perf_counter()
    todo = suites()[a.suite]
    if a.cases:
        want = a.cases.split(",")
        todo = [c for c in sum(suites().values(), []) if c["name"] in want]
        todo = list({c["name"]: c for c in todo}.values())
    # the ceiling worker (matmul + component micro-benchmarks) runs first, in its own process
    log = os.path.join(a.out, "ceiling.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "ceiling", "--out", a.out]
    env = dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", ROOT))
    if a.no_components:
        env["THROUGHPUT_NO_COMPONENTS"] = "1"
    with open(log, "w") as f:
        try:
            subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            pass
    cpath = os.path.join(a.out, "ceiling.json")
    ceiling = json.load(open(cpath)) if os.path.exists(cpath) else {}
    for pth in (cpath, log):
        if os.path.exists(pth) and ceiling:
            os.remove(pth)
    print(f"[throughput] ceiling: {json.dumps(ceiling)}", flush=True)

    results = []
    for c in todo:
        left = a.budget_s - (time.perf_counter() - start)
        if left < 45:
            results.append({"case": c, "error": "skipped: out of time budget", "phases": []})
            print(f"[throughput] skip {c['name']} (budget)", flush=True)
            continue
        r = run_case(c, a.out, a.warmup, a.steps, min(c["timeout"], left))
        results.append(r)
        ph = (r.get("phases") or [{}])[0] or {}
        print(f"[throughput] {c['name']}: rc={r['rc']} wall={r['wall_s']:.0f}s "
              f"tok/s={ph.get('tokens_per_second', float('nan')):,.0f} {r.get('error', '')}", flush=True)

    table = rows(results, ceiling)
    device = ceiling.get("device", "cpu")
    doc = {
        "suite": a.suite, "command": " ".join([os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "versions": versions(), "warmup_steps": a.warmup, "timed_steps": a.steps,
        "ceiling": ceiling, "table": table, "cases": results, "wall_s": time.perf_counter() - start,
    }
    name = f"throughput_{a.suite}.json" if not a.cases else "throughput_cases.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(doc, f, indent=2, default=str)
    print(fmt_table(table, ceiling, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
