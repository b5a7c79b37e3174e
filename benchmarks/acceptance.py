"""The commands users run, through ``bash train.sh``, on this machine's GPU(s).

Every row is a real command line: flame's shipped TOML and configs at their real size, with the
bundled corpus and tokenizer in place of hub datasets and tokenizers (the machine is offline),
fewer steps, no hub upload. Each row runs in its own process group with a wall cap. Per row:
exit code, seconds from launch to the first finished step, steady tokens/s (median of the
second half of the logged steps), peak reserved GPU memory (``torch.cuda.max_memory_reserved``,
logged by the trainer at every step), loss at the first and last step, and the number of
recompilations (``TORCH_LOGS=recompiles``).

usage:
    python benchmarks/acceptance.py OUT.json [--rows a,b,...] [--groups g,...] [--steps N] [--budget_s S] [--parallel N]
    python benchmarks/acceptance.py --list
    python benchmarks/acceptance.py --markdown OUT.json     # the table of a result file

Rows that do not fit the budget are recorded as not run, never dropped.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOML = os.path.join(ROOT, "flame/models/fla.toml")
TOKENIZER = os.path.join(ROOT, "flame/assets/tokenizer")
CORPUS = os.path.join(ROOT, "flame/assets/sample_corpus")
SFT_SAMPLE = os.path.join(ROOT, "flame/assets/sft_sample")
# a killed row's processes can take minutes to exit while their pinned host memory is released
GROUP_EXIT_WAIT_S = 120.0
STACK_DUMP_WAIT_S = 3.0


@dataclass
class Row:
    name: str
    group: str
    what: str
    args: list[str]
    steps: int
    cap_s: int
    env: dict = field(default_factory=dict)
    config_edit: dict | None = None  # model JSON keys replaced in a copy of --model.config
    # the row whose tokens/s this row's is divided by in the table, and the least ratio the issue asks
    reference: str | None = None
    target_ratio: float | None = None
    # a row whose dump is drawn with this one's by ``python -m flame.plot`` next to the result JSON
    plot_with: str | None = None
    # rows naming the same seed start from the same weights: a checkpoint of initial weights made
    # once a call by a plain run of the first of them (``--checkpoint.create_seed_checkpoint``),
    # loaded by each (``--checkpoint.initial_load_path``). From one seed value a resident run
    # draws its weights on the GPU and an offloaded one (masters in host memory) on the CPU.
    seed: str = ""


def _cfg(name: str) -> str:
    return os.path.join(ROOT, "configs", f"{name}.json")


def flame_readme(steps: int, config: str = "transformer_340M") -> list[str]:
    """fla-org/flame's README command (transformer 340M, 64K-token varlen rows)."""
    return [
        "--job.config_file", TOML, "--model.config", _cfg(config), "--model.tokenizer_path", TOKENIZER,
        "--optimizer.name", "AdamW", "--optimizer.eps", "1e-15", "--optimizer.lr", "1e-3",
        "--lr_scheduler.warmup_steps", "1024", "--lr_scheduler.lr_min", "0.1", "--lr_scheduler.decay_type", "cosine",
        "--training.batch_size", "1", "--training.seq_len", "65536", "--training.context_len", "4096",
        "--training.varlen", "--training.gradient_accumulation_steps", "1", "--training.steps", str(steps),
        "--training.max_norm", "1.0", "--training.skip_nan_inf", "--training.dataset", CORPUS,
        "--training.streaming", "--training.num_workers", "32", "--training.prefetch_factor", "2",
        "--training.seed", "42", "--training.compile", "--checkpoint.interval", "2048", "--checkpoint.load_step", "-1",
        "--checkpoint.keep_latest_k", "2", "--metrics.log_freq", "1",
    ]


def softpick_paper(config: str, steps: int, compile_: bool = True) -> list[str]:
    """The softpick paper's command (340M, batch 16 x 4096, FSDP over all GPUs)."""
    return [
        "--job.config_file", TOML, "--model.config", config, "--model.tokenizer_path", TOKENIZER,
        "--optimizer.eps", "1e-15", "--optimizer.lr", "3e-4",
        "--lr_scheduler.warmup_steps", "1024", "--lr_scheduler.lr_min", "0.1", "--lr_scheduler.decay_type", "cosine",
        "--training.batch_size", "16", "--training.seq_len", "4096", "--training.gradient_accumulation_steps", "1",
        "--training.steps", str(steps), "--training.max_norm", "1.0", "--training.skip_nan_inf",
        "--training.dataset", CORPUS, "--training.num_workers", "32", "--training.prefetch_factor", "2",
        "--training.seed", "79", *(["--training.compile"] if compile_ else []),
        "--checkpoint.interval", "8192", "--checkpoint.load_step", "-1",
        "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600",
        "--training.data_parallel_replicate_degree", "1", "--training.data_parallel_shard_degree", "-1",
        "--training.tensor_parallel_degree", "1",
    ]


# the TOML's schedule (1024 warmup steps of 10000): torchtitan shrinks a warmup longer than the
# run to the run's steps, so a row of a few steps sets the schedule's length to run its first steps
# the initial weights config_transformer_1B and its offloaded twin both start from (Row.seed)
PAIR_SEED = "transformer_1B"
TOML_TOTAL_STEPS = ("--lr_scheduler.total_steps", "10000")
TOML_SCHEDULE = ("--lr_scheduler.warmup_steps", "1024", *TOML_TOTAL_STEPS)


def config_run(config: str, steps: int, batch: int, seq: int, extra: tuple = (), lr: str = "1e-3",
               schedule: tuple = ("--lr_scheduler.warmup_steps", "5")) -> list[str]:
    """A model JSON at its real size with flame's defaults (compile on, no checkpoints)."""
    return [
        "--job.config_file", TOML, "--model.config", config, "--model.tokenizer_path", TOKENIZER,
        "--training.dataset", CORPUS, "--training.batch_size", str(batch), "--training.seq_len", str(seq),
        "--training.steps", str(steps), "--training.num_workers", "4", "--training.compile",
        "--optimizer.lr", lr, *schedule, "--metrics.log_freq", "1",
        "--checkpoint.no-enable-checkpoint", "--checkpoint.no-export-hf", *extra,
    ]


# attn_impl values of the README's table, run on the 340M transformer
ATTN_IMPLS = ["sdpa", "flex", "fla", "parallel_attn", "parallel_softpick_attn", "parallel_rectified_attn",
              "scaled_sdpa", "parallel_scaled_attn", "parallel_scaled_softpick_attn",
              "parallel_scaled_rectified_attn", "naive"]

# model JSONs up to 1B (batch x seq that the README's tables show fitting one 80 GB GPU, with AC where needed)
CONFIGS_UP_TO_1B = [
    "transformer_340M", "llama_340M", "qwen3_340M", "gla_340M", "delta_net_340M", "gated_deltanet_340M",
    "gsa_340M", "hgrn2_340M", "mamba_340M", "mamba2_340M", "retention_lm_340M", "softpick_transformer_120M",
    "vanilla_transformer_120M", "transformer_1B", "llama_1B", "qwen3_1B", "gla_1B", "delta_net_1B",
    "gated_deltanet_1B", "gsa_1B", "mamba_1B", "mamba2_1B", "samba_1B", "softpick_transformer_1B",
    "vanilla_transformer_1B",
]
# Mamba mixers run FLA's pure-torch path with flame's chunked scans (flame/models/ssm_scan.py) when
# mamba_ssm and causal_conv1d are not installed (they are not on the GPU image). The settings are
# the ones FLA's own scans needed (its Mamba loop stepped through time, its Mamba2 SSD ran out of
# memory at 1B): 2 x 2048 with full AC, and Mamba and Samba without compile, kept so the rows
# compare with the earlier results until the chunked scans have been measured on a GPU
TORCH_PATH_FAMILIES = ("mamba", "mamba2", "samba")
# families whose first step compiles FLA's Triton kernels (and tilelang's on Hopper) and autotunes
# them: on a cold machine that alone took 3-5 minutes a row, so these rows get a longer wall cap
FLA_KERNEL_FAMILIES = ("gla", "delta", "gated", "gsa", "hgrn2", "retention", "mamba", "mamba2", "samba")
CONFIGS_7B = ["transformer_7B", "softpick_transformer_7B", "vanilla_transformer_7B", "gla_7B"]


# the speed rows of the fla-org README and the softpick paper (a tokens/s target, a ratio to
# paper_sdpa) and that reference run at least this many steps: the median then spans 10 steps, not 4
# (the SFT, LoRA and Muon rows keep their own step counts)
TARGET_MIN_STEPS = 20


def all_rows(steps: int, muon_steps: int | None = None) -> list[Row]:
    target_steps = max(steps, TARGET_MIN_STEPS)
    rows = [Row("smoke_tiny", "smoke", "configs/debug/transformer_tiny.json, 8 x 256 (checks the harness; runs on CPU)",
                config_run(_cfg("debug/transformer_tiny"), steps, 8, 256, ("--training.no-compile",
                                                                         "--training.mixed_precision_param", "float32")),
                steps, 180)]
    rows += [Row("flame_readme", "readme", "fla-org/flame README: transformer_340M, 1 x 65536 varlen, context 4096, compile",
                flame_readme(target_steps), target_steps, 420)]
    # the same command again in a fresh process: inductor's and flame's tile caches are now warm
    rows += [Row("flame_readme_warm", "readme", "the same command again (warm compile and tile caches)",
                flame_readme(steps), steps, 420)]
    # the same command on HF's Llama (documents through transformers' attention interface)
    # (group "probe": a measurement of a setting, not a command of the README)
    rows += [Row("flame_readme_llama", "probe", "fla-org/flame README command with configs/llama_340M.json (HF Llama)",
                 flame_readme(target_steps, "llama_340M"), target_steps, 420)]
    # flame's own README: the 7B transformer under a 16 GiB GPU budget (the TOML's batch and schedule)
    # and with 18 GiB, the README's option for a host with less memory (one micro-batch a step)
    for gib, name in (("16", "readme_7B_offload"), ("18", "readme_7B_offload_18GiB")):
        rows.append(Row(name, "readme", "flame README: transformer_7B, --offload.enable auto "
                        f"--offload.gpu_memory_gib {gib} (fla.toml's 8 x 2048, eager)",
                        ["--job.config_file", TOML, "--model.config", _cfg("transformer_7B"),
                         "--offload.enable", "auto", "--offload.gpu_memory_gib", gib,
                         "--model.tokenizer_path", TOKENIZER, "--training.dataset", CORPUS,
                         "--training.steps", str(steps), *TOML_TOTAL_STEPS, "--metrics.log_freq", "1",
                         "--checkpoint.no-enable-checkpoint", "--checkpoint.no-export-hf"], steps, 480))
    for name, cfg in [("vanilla", "vanilla_transformer_340M"), ("softpick", "softpick_transformer_340M"),
                      ("rectified", "rectified_transformer_340M"), ("scaled_softpick", "scaled_softpick_transformer_340M")]:
        # the issue's target: softpick and rectified at >= 0.9x the same model with torch SDPA
        target = ("paper_sdpa", 0.9) if name in ("softpick", "rectified") else (None, None)
        n = target_steps if target[0] else steps
        rows.append(Row(f"paper_{name}", "paper", f"softpick paper: {cfg}, 16 x 4096, compile",
                        softpick_paper(_cfg(cfg), n), n, 300, reference=target[0], target_ratio=target[1]))
    rows.append(Row("paper_sdpa", "paper", "softpick paper command on softpick_transformer_340M with attn_impl sdpa (speed reference)",
                    softpick_paper(_cfg("softpick_transformer_340M"), target_steps), target_steps, 300,
                    config_edit={"attn_impl": "sdpa"}))
    rows.append(Row("paper_softpick_eager", "paper", "softpick paper: softpick_transformer_340M, 16 x 4096, no compile",
                    softpick_paper(_cfg("softpick_transformer_340M"), steps, compile_=False), steps, 300))
    for impl in ATTN_IMPLS:
        for comp in (True, False):
            # the naive reference keeps (batch, heads, T, T) float32 scores per layer: full AC holds one layer's
            ac = ("--activation_checkpoint.mode", "full") if impl == "naive" else ()
            args = config_run(_cfg("softpick_transformer_340M"), steps, 4, 4096, ac)
            if not comp:
                args.remove("--training.compile")
            rows.append(Row(f"attn_{impl}{'' if comp else '_eager'}", "attn",
                            f"340M transformer, attn_impl {impl}, 4 x 4096{', full AC' if ac else ''}, "
                            f"{'compile' if comp else 'eager'}", args, steps, 240, config_edit={"attn_impl": impl}))
    for name in CONFIGS_UP_TO_1B:
        big = name.endswith("1B")
        family = name.split("_")[0]
        torch_path = family in TORCH_PATH_FAMILIES
        batch = 2 if torch_path else 4 if big else 8
        extra = ("--activation_checkpoint.mode", "full") if big or torch_path else ()
        compile_ = family not in ("mamba", "samba")  # see TORCH_PATH_FAMILIES
        args = config_run(_cfg(name), steps, batch, 2048, extra)
        if not compile_:
            args.remove("--training.compile")
        what = f"{name}, {batch} x 2048{', full AC' if extra else ''}, {'compile' if compile_ else 'eager'}"
        if torch_path:
            what += " (FLA's torch path with flame's chunked scans: mamba_ssm/causal_conv1d absent)"
        rows.append(Row(f"config_{name}", "configs", what, args, steps, 540 if family in FLA_KERNEL_FAMILIES else 300,
                        seed=PAIR_SEED if name == "transformer_1B" else ""))
    # SFT against pretraining at the same model and batch shape (tokens/s over all positions, and trained ones)
    sft_data = ",".join(os.path.join(SFT_SAMPLE, f"{n}.jsonl") for n in ("chat", "alpaca", "sharegpt"))
    varlen = ("--activation_checkpoint.mode", "full", "--training.varlen", "--training.context_len", "2048")
    rows.append(Row("sft_pretrain_transformer_1B", "sft", "transformer_1B, 4 x 2048 varlen, compile: pretraining "
                    "(reference for the SFT row)", config_run(_cfg("transformer_1B"), steps, 4, 2048, varlen),
                    steps, 300))
    rows.append(Row("sft_transformer_1B", "sft", "transformer_1B, 4 x 2048 varlen, compile: --training.sft on the "
                    "bundled sample", config_run(_cfg("transformer_1B"), steps, 4, 2048,
                                                 (*varlen, "--training.sft", "--training.dataset", sft_data)),
                    steps, 300, reference="sft_pretrain_transformer_1B", target_ratio=0.9))
    rows += lora_rows(steps) + muon_rows(muon_steps or MUON_STEPS)
    # the 7B rows run the first steps of the TOML's schedule at lr 3e-4: with a warmup of a few
    # steps (1e-3 or 3e-4) their losses rose from initialization
    for name in CONFIGS_7B:
        rows.append(Row(f"config_{name}_offload", "offload", f"{name}, 2 x 2048, lr 3e-4 with the TOML's schedule, "
                        "--offload.enable auto",
                        config_run(_cfg(name), steps, 2, 2048, ("--offload.enable", "auto",
                                                                 "--activation_checkpoint.mode", "full"), lr="3e-4",
                                   schedule=TOML_SCHEDULE), steps, 540 if name.startswith("gla") else 420))
    # the offload engine against the resident run at a real size: the same command from the same
    # initial weights, losses side by side
    rows.append(Row("config_transformer_1B_offload", "offload", "transformer_1B, 4 x 2048, full AC, compile, "
                    "--offload.enable on --offload.gpu_memory_gib 12 (the loss curve of config_transformer_1B)",
                    config_run(_cfg("transformer_1B"), steps, 4, 2048,
                               ("--activation_checkpoint.mode", "full", "--offload.enable", "on",
                                "--offload.gpu_memory_gib", "12")), steps, 420,
                    reference="config_transformer_1B", plot_with="config_transformer_1B", seed=PAIR_SEED))
    return rows


# LoRA on Llama-3-8B's shape: 4 x 8192 tokens a step in both rows (the offload planner picks its
# micro-batch among the divisors of the batch within 16 GiB)
LORA_8B = os.path.join(ROOT, "benchmarks/configs/llama3_8B.json")
LORA_SEQ, LORA_SEQS_PER_STEP = 8192, 4
# the resident run's micro-batch: float32 base (30 GiB, cast under autocast), full AC keeps one bf16
# block input per layer (2 GiB per 8K tokens), the loss is chunked over the 128K vocabulary
LORA_RESIDENT_MICRO_BATCH = 4


def lora_rows(steps: int) -> list[Row]:
    lora = ("--lora.rank", "16", "--lora.alpha", "32")
    acc = LORA_SEQS_PER_STEP // LORA_RESIDENT_MICRO_BATCH
    resident = Row("lora_8B_resident", "lora", f"Llama-3-8B shape, LoRA rank 16, base on the GPU (float32, "
                   f"bf16 autocast), {LORA_RESIDENT_MICRO_BATCH} x {LORA_SEQ} x {acc} accumulation, full AC, compile",
                   config_run(LORA_8B, steps, LORA_RESIDENT_MICRO_BATCH, LORA_SEQ,
                              (*lora, "--offload.enable", "off", "--activation_checkpoint.mode", "full",
                               "--training.gradient_accumulation_steps", str(acc))),
                   steps, 480)
    offloaded = Row("lora_8B_offload", "lora", f"the same LoRA run, {LORA_SEQS_PER_STEP} x {LORA_SEQ} a step, "
                    "bf16 base streamed from host memory (the planner picks micro-batch and recompute): "
                    "--offload.enable on --offload.gpu_memory_gib 16",
                    config_run(LORA_8B, steps, LORA_SEQS_PER_STEP, LORA_SEQ,
                               (*lora, "--offload.enable", "on", "--offload.gpu_memory_gib", "16")),
                    steps, 480, reference=resident.name, target_ratio=0.6)
    return [resident, offloaded]


# Muon against AdamW on the 340M transformer: a fixed step count (loss curves, not --steps) at
# 8 x 4096 tokens a step: ~0.2 s a step at the 340M's ~160K tokens/s on an H100, so a row is
# about a minute of steps after its ~1 minute start
MUON_STEPS = 300


def muon_rows(n_steps: int = MUON_STEPS) -> list[Row]:
    def run(name: str) -> list[str]:
        return config_run(_cfg("transformer_340M"), n_steps, 8, 4096, ("--optimizer.name", name))

    adamw = Row("muon_adamw_340M", "muon", f"transformer_340M, 8 x 4096, compile, {n_steps} steps: AdamW "
                "(reference for the Muon row)", run("AdamW"), n_steps, 240)
    muon = Row("muon_340M", "muon", "the same run with --optimizer.name Muon (equal tokens)", run("Muon"),
               n_steps, 240, reference=adamw.name, target_ratio=0.9, plot_with=adamw.name)
    return [adamw, muon]


def _model_config(args: list[str]) -> str:
    return args[args.index("--model.config") + 1]


def _with_config(args: list[str], path: str) -> list[str]:
    out = list(args)
    out[out.index("--model.config") + 1] = path
    return out


def metric_lines(path: str) -> list[dict]:
    """Every record of a metrics.jsonl, skipping a line being written."""
    if not os.path.isfile(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                continue
    return out


def records(path: str) -> list[dict]:
    """The step records (those with a loss) of a metrics.jsonl."""
    return [rec for rec in metric_lines(path) if "loss" in rec]


def run_in_group(cmd: list[str], env: dict, log_path: str, cap_s: float, started=None,
                 exit_wait_s: float = GROUP_EXIT_WAIT_S) -> tuple:
    """Run ``cmd`` in its own process group, stdout and stderr into ``log_path``, killed (the whole
    group: a launcher and its workers) after ``cap_s`` seconds, then wait up to ``exit_wait_s`` for
    the group to be gone. ``started()`` is polled until it says True (e.g. the first step is
    logged). Returns (exit code or "timeout", wall seconds, seconds until ``started`` said True or
    None)."""
    start = time.perf_counter()
    first = None
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rc = None
        while rc is None:
            time.sleep(0.5)
            rc = proc.poll()
            if first is None and started is not None and started():
                first = time.perf_counter() - start
            if rc is None and time.perf_counter() - start > cap_s:
                # flame's launcher forwards SIGUSR1 to its workers, which print their threads'
                # stacks: where a row that ran out of time was
                os.killpg(proc.pid, signal.SIGUSR1)
                time.sleep(STACK_DUMP_WAIT_S)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "timeout"
    wall = time.perf_counter() - start
    _wait_for_group_exit(proc.pid, exit_wait_s)
    return rc, wall, first


def row_time(cap_s: float, left_s: float) -> tuple[float, float]:
    """A row's wall cap and its wait for the group's exit within ``left_s`` seconds of the call's
    budget: the wait comes out of the budget, so a row killed at its cap still returns (and its
    result is written) before the budget ends."""
    cap = min(cap_s, left_s - 10.0)
    return cap, max(5.0, min(GROUP_EXIT_WAIT_S, left_s - cap - 5.0))


def cut_by_budget(res: dict, cap_s: float, given_s: float) -> dict:
    """A row stopped because the call's budget ended before its own cap is not a verdict on the
    row: it is recorded as not run (the status table keeps the row's earlier result), with what
    it reached."""
    if res.get("exit") == "timeout" and given_s < cap_s - 1:  # row_time's cap is a float
        res = dict(res, exit="not run", reason=f"the call's budget ended it after {given_s:.0f} s of its {cap_s:.0f} s cap")
    return res


def _wait_for_group_exit(pgid: int, limit_s: float) -> None:
    """Wait until no process of group ``pgid`` is left: a killed worker can take minutes to exit
    while its pinned host memory is released, and the next row must not start beside it."""
    end = time.perf_counter() + limit_s
    while time.perf_counter() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        except PermissionError:  # a member this user may not signal: it exists all the same
            pass
        time.sleep(0.5)
    print(f"warning: processes of group {pgid} still alive {limit_s:.0f} s after the row ended", flush=True)


def gpu_slots(parallel: int) -> tuple[list, int]:
    """One CUDA_VISIBLE_DEVICES value per concurrent row, and how many rows share a GPU: with at
    least ``parallel`` GPUs every row has its own (tokens/s stay a speed measurement), with fewer
    they are dealt round-robin. Every row sees one GPU, so ``train.sh`` runs it on one GPU whatever
    the machine has; on CPU the slots are None."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d for d in visible.split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    if not ids:
        return [None] * parallel, parallel
    return [ids[i % len(ids)] for i in range(parallel)], -(-parallel // len(ids))


_seed_lock = threading.Lock()


def without_offload(args: list[str]) -> list[str]:
    """A command's arguments less its ``--offload.*`` options (and their values)."""
    out, skip = [], False
    for a in args:
        if skip and not a.startswith("--"):
            skip = False
            continue
        skip = a.startswith("--offload.")
        if not skip:
            out.append(a)
    return out


def checkpoints_on(args: list[str]) -> list[str]:
    """A row's arguments with checkpoints enabled (the rows turn them off)."""
    return [a for a in args if a != "--checkpoint.no-enable-checkpoint"] + ["--checkpoint.enable_checkpoint"]


def seed_folder(runs: str, row: Row) -> str:
    return os.path.join(runs, f"seed_{row.seed}")


def seed_args(row: Row, folder: str) -> list[str]:
    """The command that writes ``row``'s seed into ``folder``: the row's, less offload, making only
    the step-0 checkpoint."""
    return [*checkpoints_on(without_offload(row.args)), "--offload.enable", "off",
            "--checkpoint.create_seed_checkpoint", "--job.dump_folder", folder]


def seed_checkpoint(row: Row, runs: str, env: dict, cap_s: float, exit_wait_s: float) -> tuple[str, str | None]:
    """(the step-0 folder of ``row.seed``, None), made on first use this call by the row's command
    without offload and with ``--checkpoint.create_seed_checkpoint`` within ``cap_s``; or ("", why
    it failed)."""
    folder = seed_folder(runs, row)
    step0 = os.path.join(folder, "checkpoint", "step-0")
    with _seed_lock:
        if not os.path.isdir(step0):
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
            cmd = ["bash", os.path.join(ROOT, "train.sh"), *seed_args(row, folder)]
            rc, _, _ = run_in_group(cmd, env, os.path.join(folder, "console.log"), cap_s, exit_wait_s=exit_wait_s)
            if rc != 0 or not os.path.isdir(step0):
                return "", f"seed checkpoint {row.seed}: exit {rc} (see {folder}/console.log)"
    return step0, None


def seeded(args: list[str], step0: str) -> list[str]:
    """A row's arguments that start from the seed at ``step0`` (checkpoints on to load it; the
    last step saves the model only)."""
    return checkpoints_on(args) + ["--checkpoint.initial_load_path", step0, "--checkpoint.interval", "1000000",
                                   "--checkpoint.last_save_model_only"]


def run_row(row: Row, runs: str, cap_s: float, gpu: str | None = None, exit_wait_s: float = GROUP_EXIT_WAIT_S) -> dict:
    dump = os.path.join(runs, row.name)
    shutil.rmtree(dump, ignore_errors=True)
    os.makedirs(dump)
    args = list(row.args)
    if row.config_edit:
        with open(_model_config(args)) as f:
            cfg = json.load(f)
        cfg.update(row.config_edit)
        path = os.path.join(dump, "model_config.json")
        with open(path, "w") as f:
            json.dump(cfg, f, indent=1)
        args = _with_config(args, path)
    env = dict(os.environ, TORCH_LOGS="recompiles", PYTHON=sys.executable, PYTHONUNBUFFERED="1", **row.env)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if row.seed:  # made within the row's cap, which keeps what is left
        t = time.perf_counter()
        step0, problem = seed_checkpoint(row, runs, env, cap_s, exit_wait_s)
        if problem:
            return {"row": row.name, "group": row.group, "what": row.what, "exit": problem}
        cap_s -= time.perf_counter() - t
        args = seeded(args, step0)
    args += ["--job.dump_folder", dump]
    cmd = ["bash", os.path.join(ROOT, "train.sh"), *args]
    log_path = os.path.join(dump, "console.log")
    metrics = os.path.join(dump, "metrics.jsonl")
    rc, wall, first_step_s = run_in_group(cmd, env, log_path, cap_s, lambda: bool(records(metrics)), exit_wait_s)
    with open(log_path, errors="replace") as f:
        console = f.read()
    recs = records(metrics)
    half = recs[len(recs) // 2:] if len(recs) >= 2 else recs
    tps = [r["tokens_per_second"] for r in half if r.get("tokens_per_second")]
    trained = [r["trained_tokens_per_second"] for r in half if r.get("trained_tokens_per_second")]
    out = {
        "row": row.name, "group": row.group, "what": row.what, "exit": rc, "wall_s": round(wall, 1),
        "first_step_s": None if first_step_s is None else round(first_step_s, 1),
        "steps_logged": len(recs),
        "tokens_per_second": round(statistics.median(tps)) if tps else None,
        # SFT rows: the same median over the trained (assistant) tokens
        "trained_tokens_per_second": round(statistics.median(trained)) if trained else None,
        "peak_reserved_gib": round(max((r.get("memory_peak_gib", 0.0) for r in recs), default=0.0), 2) or None,
        "loss_first": recs[0]["loss"] if recs else None,
        "loss_last": recs[-1]["loss"] if recs else None,
        "recompiles": len(re.findall(r"Recompiling function", console)),
        "step_times_s": [round(r.get("step_time", 0.0), 3) for r in recs],
        "loss_curve": [[r.get("step"), r["loss"]] for r in recs],
        "dump": dump,
        "command": "bash train.sh " + " ".join(args),
        # the command that made the seed checkpoint the row started from (Row.seed)
        "seed_command": "bash train.sh " + " ".join(seed_args(row, seed_folder(runs, row))) if row.seed else None,
        "config_edit": row.config_edit,
    }
    if rc != 0:
        lines = [l for l in console.splitlines() if l.strip()]
        errs = [l for l in lines if "flame: error" in l or "Error" in l or "error:" in l]
        out["error_tail"] = "\n".join((errs[-6:] if errs else []) + lines[-25:])[-4000:]
        if rc == "timeout":
            out["stacks_at_timeout"] = dumped_stacks(console) or dumped_stacks(rank_stderr(dump))
    return out


def rank_stderr(dump: str) -> str:
    """The workers' own stderr files under the run's ``logs`` folder (torchrun's per-rank
    redirection). A worker writes them itself, so a stack dump lands there even when the console,
    which reaches us through torchrun and the launcher, is cut off by the kill that follows."""
    text = []
    for path in sorted(glob.glob(os.path.join(dump, "logs", "*", "attempt_*", "*", "stderr.log"))):
        try:
            with open(path, errors="replace") as f:
                text.append(f.read())
        except OSError:
            continue
    return "\n".join(text)


def dumped_stacks(console: str, limit: int = 12000) -> str | None:
    """The thread stacks a row's workers printed when it was stopped at its cap (faulthandler's
    dump, from its first "Thread 0x..." line; the first `limit` characters), or None."""
    at = re.search(r"^.*(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", console, re.M)
    if at is None:
        return None
    text = console[at.start():]
    return text if len(text) <= limit else text[:limit] + "\n..."


def versions() -> dict:
    out = {}
    for mod in ("torch", "triton", "fla", "transformers", "torchtitan", "tilelang"):
        try:
            m = __import__(mod)
            out[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # recorded, not fatal
            out[mod] = f"missing ({type(e).__name__})"
    return out


def device_info() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "count": 0}
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}


def commit(root: str = ROOT) -> str:
    """The commit whose files ran: HEAD, or, where the files differ from it (the device's copy of
    a working tree carries the landed main's .git), "HEAD+tree T" with T the git tree hash of the
    files as they are (tracked and untracked, less the ignored): `git rev-parse C^{tree}` gives T
    for the commit C that holds them."""
    if os.environ.get("FLAME_COMMIT"):
        return os.environ["FLAME_COMMIT"]

    def git(*args, env=None) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True,
                              env=env).stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        with tempfile.TemporaryDirectory() as tmp:
            env = dict(os.environ, GIT_INDEX_FILE=os.path.join(tmp, "index"))
            git("read-tree", "HEAD", env=env)
            git("add", "-A", env=env)
            tree = git("write-tree", env=env)
        return head if tree == git("rev-parse", "HEAD^{tree}") else f"{head}+tree {tree}"
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_markdown(json_path: str, md: str) -> None:
    """The table next to its JSON (same name, .md), and on stdout."""
    with open(os.path.splitext(json_path)[0] + ".md", "w") as f:
        f.write(md + "\n")
    print(md)


def ratios(rows: list[Row], results: list[dict]) -> list[dict]:
    """Each row with a reference: its tokens/s over the reference row's, when both passed."""
    tps = {r["row"]: r.get("tokens_per_second") for r in results if r.get("exit") == 0}  # passes only
    curves = {r["row"]: r.get("loss_curve") for r in results}
    out = []
    for row in rows:
        if row.reference and tps.get(row.name) and tps.get(row.reference):
            ratio = tps[row.name] / tps[row.reference]
            out.append({"row": row.name, "reference": row.reference, "ratio": round(ratio, 3),
                        "target_ratio": row.target_ratio,
                        "met": None if row.target_ratio is None else ratio >= row.target_ratio,
                        "loss_max_abs_diff": loss_gap(curves.get(row.name), curves.get(row.reference))})
    return out


def loss_gap(curve: list | None, reference: list | None) -> float | None:
    """The largest |loss - reference loss| over the steps both logged (None: nothing in common)."""
    ref = dict(map(tuple, reference or []))
    gaps = [abs(loss - ref[step]) for step, loss in curve or [] if step in ref]
    return round(max(gaps), 4) if gaps else None


def plot_pairs(rows: list[Row], results: list[dict], out_json: str) -> list[str]:
    """``python -m flame.plot`` of each row and its ``plot_with`` row (both dumps present), written
    next to the result JSON; returns the files written."""
    dumps = {r["row"]: r.get("dump") for r in results}
    written = []
    for row in rows:
        pair = [dumps.get(row.plot_with), dumps.get(row.name)] if row.plot_with else []
        if not pair or not all(d and os.path.isfile(os.path.join(d, "metrics.jsonl")) for d in pair):
            continue
        target = f"{os.path.splitext(out_json)[0]}_{row.name}.png"
        proc = subprocess.run([sys.executable, "-m", "flame.plot", *pair, "--out", target],
                              capture_output=True, text=True, cwd=ROOT)
        got = [l.split("wrote ", 1)[1] for l in proc.stdout.splitlines() if l.startswith("wrote ")]
        if proc.returncode == 0 and got:
            written.append(got[0])
        else:
            print(f"plot of {row.name} failed: {proc.stderr.strip()[-500:]}", flush=True)
    return written


def markdown(doc: dict) -> str:
    d = doc["device"]
    head = (f"{d['name']} x{d['count']}; " + ", ".join(f"{k} {v}" for k, v in doc["versions"].items())
            + f"; commit {doc['commit'][:10]}; {doc['date'][:10]}; {doc['steps']} steps a row")
    if d["count"] > 1 and all(r.get("rows_sharing_gpu") == 1 for r in doc["results"] if r.get("exit") != "not run"):
        head += "; each row on one GPU of its own (CUDA_VISIBLE_DEVICES)"
    lines = [head, "", "| row | what | exit | first step s | tokens/s | peak reserved GiB | loss first -> last | recompiles |",
             "|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if r.get("exit") == "not run":
            lines.append(f"| {r['row']} | {r['what']} | not run ({r['reason']}) | | | | | |")
            continue
        loss = "-" if r["loss_first"] is None else f"{r['loss_first']:.2f} -> {r['loss_last']:.2f}"
        fmt = lambda v, f: "-" if v is None else format(v, f)
        tps = fmt(r['tokens_per_second'], ',')
        if r.get("rows_sharing_gpu", 1) > 1 and r['tokens_per_second'] is not None:
            tps += f" (GPU shared by {r['rows_sharing_gpu']} rows)"
        lines.append(f"| {r['row']} | {r['what']} | {r['exit']} | {fmt(r['first_step_s'], '.0f')} | "
                     f"{tps} | {fmt(r['peak_reserved_gib'], '.1f')} | {loss} | {r['recompiles']} |")
    if doc.get("ratios"):
        lines.append("")
    for q in doc.get("ratios", []):
        line = f"- {q['row']}: {q['ratio']:.2f}x the tokens/s of {q['reference']} ({(q['ratio'] - 1) * 100:+.0f}%"
        if q["target_ratio"] is not None:
            line += f"; target >= {q['target_ratio']}x, {'met' if q['met'] else 'NOT met'}"
        line += ")"
        if q.get("loss_max_abs_diff") is not None:
            line += f"; losses differ by at most {q['loss_max_abs_diff']} over the steps both logged"
        lines.append(line)
    for r in doc["results"]:
        if r.get("trained_tokens_per_second"):
            lines.append(f"- {r['row']}: {r['trained_tokens_per_second']:,} trained (loss) tokens/s of "
                         f"{r['tokens_per_second']:,} tokens/s")
    for path in doc.get("plots", []):
        lines.append(f"- plot: {os.path.basename(path)}")
    return "\n".join(lines)


def latest_results(paths: list[str]) -> dict[str, tuple[dict, dict, str]]:
    """Row name -> (its latest result, that file's document, the file's name) over the result
    files `paths`, by their dates; a row not run in a later file keeps its earlier result."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append((path, json.load(f)))
    latest = {}
    for path, doc in sorted(docs, key=lambda pd: pd[1]["date"]):
        for r in doc["results"]:
            if r.get("exit") != "not run":
                latest[r["row"]] = (r, doc, os.path.basename(path))
    return latest


def passed(row: Row, latest: dict[str, tuple[dict, dict, str]]) -> bool:
    """A pass: the row's latest result exited 0 and, for a row with a target ratio, met it (the
    ratio is taken in that result's file)."""
    result, doc, _ = latest.get(row.name, ({}, {}, ""))
    if result.get("exit") != 0:
        return False
    return row.target_ratio is None or any(x["row"] == row.name and x.get("met") for x in doc.get("ratios", []))


def still_to_pass(rows: list[Row], paths: list[str], every_row: list[Row]) -> list[Row]:
    """Those of `rows` whose latest result in `paths` is not a pass (`passed`), in their order,
    after the reference rows they need from `every_row` (a ratio compares rows of one call)."""
    latest = latest_results(paths)
    todo = [r for r in rows if not passed(r, latest)]
    refs = {r.reference for r in todo if r.reference} - {r.name for r in todo}
    return [r for r in every_row if r.name in refs] + todo


def longest_first(rows: list[Row], paths: list[str]) -> list[Row]:
    """`rows` by their latest wall time in `paths`, longest first (rows without one first, in
    their order): rows on several GPUs then end close together."""
    latest = latest_results(paths)
    wall = {name: r.get("wall_s") or 0.0 for name, (r, _, _) in latest.items()}
    return sorted(rows, key=lambda r: -wall.get(r.name, float("inf")))


def status(paths: list[str], rows: list[Row]) -> str:
    """Every row's latest result over the result files `paths` (by their dates; a row not run in
    a later file keeps its earlier result), with the file and commit it came from; a pass as
    `passed` says (a row under its speed target is a fail); rows no file ran are listed as such;
    probe rows (measurements of a setting) are left out. Markdown."""
    rows = [r for r in rows if r.group != "probe"]
    latest = latest_results(paths)
    lines = ["| row | group | exit | tokens/s | peak reserved GiB | loss first -> last | device | commit | file |",
             "|---|---|---|---|---|---|---|---|---|"]
    counts = {"pass": 0, "fail": 0, "never run": 0}
    for row in rows:
        if row.name not in latest:
            counts["never run"] += 1
            lines.append(f"| {row.name} | {row.group} | never run | | | | | | |")
            continue
        r, doc, name = latest[row.name]
        counts["pass" if passed(row, latest) else "fail"] += 1
        loss = "-" if r.get("loss_first") is None else f"{r['loss_first']:.2f} -> {r['loss_last']:.2f}"
        tps = "-" if r.get("tokens_per_second") is None else f"{r['tokens_per_second']:,}"
        mem = "-" if r.get("peak_reserved_gib") is None else f"{r['peak_reserved_gib']:.1f}"
        exit_cell = r["exit"] if r["exit"] != 0 or passed(row, latest) else f"0, under its {row.target_ratio}x target"
        lines.append(f"| {row.name} | {row.group} | {exit_cell} | {tps} | {mem} | {loss} | {doc['device']['name']} | "
                     f"{doc['commit'][:7]} | {name} |")
    return "\n".join([", ".join(f"{v} {k}" for k, v in counts.items()) + f" of {len(rows)} rows", ""] + lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?")
    ap.add_argument("--rows", default="", help="comma list of row names (default: all of --groups)")
    ap.add_argument("--groups", default="readme,paper",
                    help="comma list: smoke, readme, paper, attn, configs, sft, lora, muon, offload")
    ap.add_argument("--steps", type=int, default=20, help="steps a row (not the muon rows: --muon_steps)")
    ap.add_argument("--muon_steps", type=int, default=MUON_STEPS,
                    help="steps of the two muon rows (loss curves over a few hundred steps; fewer for a speed check)")
    ap.add_argument("--budget_s", type=float, default=540, help="stop starting rows after this many seconds")
    ap.add_argument("--runs", default=os.environ.get("FLAME_RUNS", "/tmp/flame_acceptance"))
    ap.add_argument("--parallel", type=int, default=1,
                    help="rows run at once, each on its own GPU where the machine has enough (else they share "
                         "GPUs: pass/fail and memory only, tokens/s then are shared)")
    ap.add_argument("--not_passed_in", nargs="+", metavar="JSON", default=[],
                    help="run only the chosen rows whose latest result in these files is not a pass "
                         "(e.g. one device's result files), with the reference row of each")
    ap.add_argument("--longest_first", nargs="+", metavar="JSON", default=[],
                    help="run the chosen rows longest first by their latest wall time in these files "
                         "(with --parallel, the GPUs then finish close together)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--markdown", metavar="JSON")
    ap.add_argument("--status", nargs="+", metavar="JSON",
                    help="every row's latest result over these result files (e.g. one device's), as a table")
    a = ap.parse_args()
    if a.markdown:
        with open(a.markdown) as f:
            print(markdown(json.load(f)))
        return 0
    rows = all_rows(a.steps, a.muon_steps)
    if a.status:
        print(status(a.status, rows))
        return 0
    if a.list:
        for r in rows:
            print(f"{r.group:<8} {r.name:<40} {r.what}")
        return 0
    if not a.out:
        ap.error("OUT.json is required")
    names = [n for n in a.rows.split(",") if n]
    groups = set(g for g in a.groups.split(",") if g)
    known = {r.name for r in rows}
    unknown = [n for n in names if n not in known]
    if unknown:
        ap.error(f"unknown rows {unknown}; --list shows them")
    by_name = {r.name: r for r in rows}
    # --rows run in the order given (e.g. a warm-cache row after the row that fills the cache)
    chosen = [by_name[n] for n in dict.fromkeys(names)] if names else [r for r in rows if r.group in groups]
    if a.not_passed_in:
        chosen = still_to_pass(chosen, a.not_passed_in, rows)
    if a.longest_first:
        chosen = longest_first(chosen, a.longest_first)
    doc = {"what": "flame acceptance: user command lines through train.sh", "device": device_info(),
           "versions": versions(), "commit": commit(), "steps": a.steps,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "command": " ".join(sys.argv),
           "env": {k: v for k, v in os.environ.items() if k.startswith(("FLAME_", "FLA_", "TRITON_"))},
           "results": []}
    t0 = time.perf_counter()
    lock = threading.Lock()

    slots, sharing = gpu_slots(max(1, min(a.parallel, len(chosen))))
    free = queue.Queue()
    for slot in slots:
        free.put(slot)

    def run_one(row: Row, shared: int) -> dict | None:
        left = a.budget_s - (time.perf_counter() - t0)
        if left < 60:
            return None
        gpu = free.get()
        try:
            print(f"== {row.name} (GPU {gpu}): {row.what}", flush=True)
            cap, exit_wait = row_time(row.cap_s, left)
            res = cut_by_budget(run_row(row, a.runs, cap, gpu, exit_wait), row.cap_s, cap)
        finally:
            free.put(gpu)
        res["rows_sharing_gpu"] = shared
        res["gpu"] = gpu
        return res

    def record(row: Row, res: dict | None) -> None:
        with lock:
            if res is None:
                res = {"row": row.name, "group": row.group, "what": row.what, "exit": "not run",
                       "reason": "out of the call's time budget"}
            doc["results"] = [r for r in doc["results"] if r["row"] != row.name] + [res]
            print(json.dumps({k: v for k, v in res.items() if k not in ("command", "step_times_s", "loss_curve")}),
                  flush=True)
            with open(a.out, "w") as f:
                json.dump(doc, f, indent=1)

    if a.parallel > 1:
        # each row is written as it ends (a call stopped early keeps the rows that finished); where
        # several rows share a GPU (their tokens/s are not a speed measurement), a row that fails
        # there runs again alone, so a failure in the table is the row's own
        with concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
            futures = {pool.submit(run_one, r, sharing): r for r in chosen}
            done = []
            for fut in concurrent.futures.as_completed(futures):
                row = futures[fut]
                try:
                    res = fut.result()
                except Exception as e:  # the harness's own failure on one row: the others still get written
                    res = {"row": row.name, "group": row.group, "what": row.what, "exit": f"harness error: {e!r}"}
                record(row, res)
                done.append((row, res))
        for row, res in done:
            if res is not None and res["exit"] not in (0, "not run") and res.get("rows_sharing_gpu", 1) > 1:
                record(row, run_one(row, 1) or res)
    else:
        for row in chosen:
            record(row, run_one(row, 1))
    order = {r.name: i for i, r in enumerate(chosen)}
    doc["results"].sort(key=lambda r: order[r["row"]])
    doc["ratios"] = ratios(chosen, doc["results"])
    doc["plots"] = plot_pairs(chosen, doc["results"], a.out)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    write_markdown(a.out, markdown(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
