"""Run flame jobs and torchrun scripts in processes of their own, as a user would (their ranks forked
from a warm interpreter: ``tests/trainer/job_server.py``)."""

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time

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
    """``torchrun --nproc_per_node nproc *target``: each rank with the environment torchrun gives it,
    forked from a warm interpreter (``_JobServer``) where the job's environment allows; the output
    is the ranks' in rank order."""
    if torch.cuda.is_available() and torch.cuda.device_count() < nproc:
        # on a GPU machine each rank takes its own device (NCCL refuses two ranks on one GPU)
        pytest.skip(f"{nproc} ranks need {nproc} CUDA devices, this machine has {torch.cuda.device_count()}")
    env = dict(os.environ, **JOB_ENV)
    port = str(free_port())
    ranks = [dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                  GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=port) for r in range(nproc)]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port", port]
    return _JOB_SERVER.run(target, ranks, timeout, launcher=launcher)


class _JobServer:
    """One warm ``tests.trainer.job_server`` per test process (see its docstring), started on first use.

    A job goes to it only when its environment is the one the test session started with (plus
    ``JOB_ENV``) apart from the per-job names below: anything a test changed (``monkeypatch.setenv``)
    may be read at import time, so such a job starts a fresh interpreter instead.
    ``FLAME_TEST_FRESH_INTERPRETERS=1`` sends every job there, as does a machine with CUDA."""

    PER_JOB = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
               "PYTEST_CURRENT_TEST"}

    def __init__(self, env: dict):
        self.proc = None
        self.shared_env = self._shared(env)

    def _shared(self, env: dict) -> dict:
        return {k: v for k, v in env.items() if k not in self.PER_JOB}

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None

    def _read(self, deadline: float | None) -> dict | None:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([self.proc.stdout], [], [], wait)[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the job server exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, target: list[str], ranks: list[dict], timeout: float,
            launcher: list[str] | None = None) -> subprocess.CompletedProcess:
        """``python *target`` (a ``-m module`` or a script) in ROOT, one process per environment in
        ``ranks``, as subprocess.run reports it. Where the server cannot take the job, one rank runs
        as ``python *target`` and several under ``launcher`` (torchrun, which makes their environments)."""
        cmd = [sys.executable, *target] if len(ranks) == 1 else [*launcher, *target]
        # on a CUDA machine the server's imports (FLA's) initialize CUDA, which a forked child cannot use
        if (os.environ.get("FLAME_TEST_FRESH_INTERPRETERS") == "1" or torch.cuda.is_available()
                or any(self._shared(env) != self.shared_env for env in ranks)
                or not (target[0] == "-m" or target[0].endswith(".py"))):
            env = ranks[0] if len(ranks) == 1 else self._shared(ranks[0])
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.trainer.job_server"], cwd=ROOT,
                                         env=self.shared_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        with tempfile.TemporaryDirectory(prefix="flame-job-") as tmp:
            files = [(os.path.join(tmp, f"stdout{r}"), os.path.join(tmp, f"stderr{r}")) for r in range(len(ranks))]
            for path in (p for pair in files for p in pair):
                open(path, "w").close()
            request = {"target": target, "cwd": ROOT,
                       "ranks": [{"env": env, "stdout": out, "stderr": err} for env, (out, err) in zip(ranks, files)]}
            try:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
                pids = self._read(None)["pids"]
                reply = self._read(time.monotonic() + timeout)
                if reply is None:
                    for pid in pids:
                        os.kill(pid, signal.SIGKILL)
                    self._read(None)
            except BaseException:  # interrupted mid-job: the next job gets a new server, not this one's reply
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                raise
            stdout = "".join(open(out).read() for out, _ in files)
            stderr = "".join(open(err).read() for _, err in files)
        if reply is None:
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)


# what every job gets on top of the session's environment
JOB_ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH}
_JOB_SERVER = _JobServer(dict(os.environ, **JOB_ENV))
atexit.register(_JOB_SERVER.close)


def run_python(target: list[str], env: dict | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    """``python *target`` in ROOT (``env``: the session's environment plus ``JOB_ENV``), from the warm interpreter."""
    return _JOB_SERVER.run(target, [dict(os.environ, **JOB_ENV) if env is None else env], timeout)


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
    closed Trainer. ``before_train(trainer)`` may wrap its methods first. The process's environment
    is restored afterwards: the trainer's setup sets variables (torchtitan's flight-recorder
    settings, ...) that a later `bash train.sh` of this process would inherit, also when the run is
    a module's fixture (conftest's per-test restore starts after those)."""
    from flame.config.manager import FlameConfigManager
    from flame.train import Trainer

    saved = dict(os.environ)
    try:
        trainer = Trainer(FlameConfigManager().parse_args(args))
        try:
            if before_train is not None:
                before_train(trainer)
            trainer.train()
        finally:
            trainer.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    finally:
        os.environ.clear()
        os.environ.update(saved)
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
