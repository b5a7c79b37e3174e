"""Run flame jobs and torchrun scripts as subprocesses, as a user would."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOML = os.path.join(ROOT, "flame/models/fla.toml")
TINY_LLAMA = os.path.join(ROOT, "tests/assets/tiny_llama.json")
TOKENIZER = os.path.join(ROOT, "flame/assets/tokenizer")
CORPUS = os.path.join(ROOT, "flame/assets/sample_corpus")
# the checkout first, then whatever the caller had (packages installed with --target on the GPU machine)
PYTHONPATH = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, target: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        # on a GPU machine each rank takes its own device (NCCL refuses two ranks on one GPU)
        pytest.skip(f"{nproc} ranks need {nproc} CUDA devices, this machine has {torch.cuda.device_count()}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=PYTHONPATH)
    if nproc == 1:
        # one rank needs no launcher: the worker alone, with the environment torchrun would give it
        # (saves the agent's interpreter and torch import, a few seconds per job on 2 cores); the
        # multi-rank jobs keep going through torchrun
        cmd = [sys.executable, *target]
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(free_port()), *target]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def tiny_job(dump: str, *extra: str, config: str = TINY_LLAMA, precision: str | None = "float32") -> list[str]:
    """A few-second CPU job on the bundled corpus and tokenizer (``precision`` None: the TOML's)."""
    return [
        "--job.config_file", TOML, "--job.dump_folder", dump,
        "--model.config", config, "--model.tokenizer_path", TOKENIZER,
        "--training.dataset", CORPUS, "--training.batch_size", "4", "--training.seq_len", "64",
        "--training.num_workers", "0",
        *(["--training.mixed_precision_param", precision] if precision else []),
        "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
        "--checkpoint.no-export-hf", "--offload.enable", "off", *extra,
    ]


def train_in_process(args: list[str], before_train=None):
    """Parse ``args`` (e.g. from `tiny_job`) and train in this process (one rank, gloo); returns the
    closed Trainer. ``before_train(trainer)`` may wrap its methods first."""
    from flame.config.manager import FlameConfigManager
    from flame.train import Trainer

    trainer = Trainer(FlameConfigManager().parse_args(args))
    try:
        if before_train is not None:
            before_train(trainer)
        trainer.train()
    finally:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


def run_job(nproc: int, dump: str, *extra: str, config: str = TINY_LLAMA, timeout: int = 300):
    proc = torchrun(nproc, ["-m", "flame.train", *tiny_job(dump, *extra, config=config)], timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def metrics(dump: str) -> list[dict]:
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(dump: str) -> list[float]:
    return [r["loss"] for r in metrics(dump) if "loss" in r]
