"""Process life of a job: one trainer per dump folder, no orphans after kill -9, one line per failure,
SIGTERM saves and resumes exactly, NaN/Inf stops before saving, a finished run is not redone.

The trainer's own behaviour runs in-process (``flame.train.main``); only what belongs to the launcher
(``train.sh``: lock, process tree, console) starts subprocesses.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.trainer.helpers import PYTHONPATH, ROOT, free_port, losses, tiny_job

TRAIN_SH = os.path.join(ROOT, "train.sh")
SMALL = ["--training.batch_size", "2", "--training.seq_len", "32", "--metrics.log_freq", "1"]


@pytest.fixture
def run_main(monkeypatch, capfd):
    """``flame.train.main`` in this process on a fresh port; returns (exit code, flame's stderr lines, stdout)."""
    from flame import train

    def run(dump, *extra):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        capfd.readouterr()
        code = train.main(tiny_job(dump, *SMALL, *extra))
        out, err = capfd.readouterr()
        return code, [l for l in err.splitlines() if l.startswith("flame:")], out

    return run


def _steps_saved(dump):
    folder = os.path.join(dump, "checkpoint")
    return sorted(int(n.split("-")[1]) for n in os.listdir(folder)) if os.path.isdir(folder) else []


def test_sigterm_saves_mid_interval_and_resumes_exactly(tmp_path, run_main, monkeypatch):
    from flame import train

    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    common = ["--training.steps", "6", "--checkpoint.interval", "100", "--checkpoint.export-hf"]
    assert run_main(full, *common)[0] == 0

    original = train.Trainer.train_step

    def signalled_at_step_3(self, data_iter):
        original(self, data_iter)
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(train.Trainer, "train_step", signalled_at_step_3)
    code, lines, _ = run_main(split, *common)
    monkeypatch.setattr(train.Trainer, "train_step", original)
    assert code == 128 + signal.SIGTERM
    assert lines[-1] == "flame: stopped at step 3 (SIGTERM); relaunch the same command to resume", lines
    assert _steps_saved(split) == [3] and not os.path.exists(os.path.join(split, "hf"))
    assert signal.getsignal(signal.SIGTERM) is not None  # main() put the previous handler back

    assert run_main(split, *common)[0] == 0
    assert losses(split) == losses(full) and len(losses(full)) == 6

    # a finished run relaunched: no step trained, no second export
    records, hf_time = len(losses(split)), os.path.getmtime(os.path.join(split, "hf"))
    code, _, out = run_main(split, *common)
    assert code == 0 and "flame: already finished at step 6" in out
    assert len(losses(split)) == records and os.path.getmtime(os.path.join(split, "hf")) == hf_time


def test_nan_stops_with_exit_3_before_saving(tmp_path, run_main):
    dump = str(tmp_path / "run")
    code, lines, _ = run_main(dump, "--optimizer.lr", "1e6", "--training.no-skip_nan_inf", "--training.steps", "12",
                           "--checkpoint.interval", "1", "--checkpoint.export-hf")
    assert code == 3 and len(lines) == 1 and lines[0].startswith("flame: stopped: non-finite"), lines
    stopped_at = int(lines[0].split(" at step ")[1].split(";")[0])
    assert stopped_at < 12 and max(_steps_saved(dump), default=0) < stopped_at
    assert not os.path.exists(os.path.join(dump, "hf"))


def test_max_consecutive_skips_stops(tmp_path, run_main):
    dump = str(tmp_path / "run")
    code, lines, _ = run_main(dump, "--optimizer.lr", "1e6", "--training.skip_nan_inf", "--training.max_consecutive_skips",
                           "2", "--training.steps", "30", "--checkpoint.no-enable")
    assert code == 3 and len(lines) == 1 and "more than training.max_consecutive_skips 2" in lines[0], lines
    skipped = [r for r in map(json.loads, open(os.path.join(dump, "metrics.jsonl"))) if "loss" in r]
    assert skipped and len(skipped) < 30


# -- the launcher ------------------------------------------------------------------------------
def _train_sh(dump, *extra, **kw):
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, NGPU="1", OMP_NUM_THREADS="1", PYTHON=sys.executable)
    env.pop("MASTER_PORT", None)
    return subprocess.Popen(["bash", TRAIN_SH, "--job.dump_folder", dump, *SMALL, "--checkpoint.no-export-hf", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def _processes_mentioning(text):
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signals and /proc are Linux")
def test_launcher_lock_side_by_side_and_kill9(tmp_path):
    a, c = str(tmp_path / "a"), str(tmp_path / "c")
    job_a = _train_sh(a, "--training.steps", "100000", "--checkpoint.no-enable", start_new_session=True)
    try:
        deadline = time.time() + 240
        while not os.path.exists(os.path.join(a, "metrics.jsonl")):
            assert job_a.poll() is None and time.time() < deadline, job_a.communicate()[1][-3000:]
            time.sleep(0.5)
        # SIGUSR1 to the whole job: the workers print their stacks, and nothing stops
        os.killpg(job_a.pid, signal.SIGUSR1)
        started_c = time.time()
        job_c = _train_sh(c, "--training.steps", "3")  # its own dump folder and port, next to a
        job_b = _train_sh(a, "--training.steps", "3")  # same dump folder: refused
        _, err_b = job_b.communicate(timeout=240)
        assert job_b.returncode == 2 and len(err_b.splitlines()) == 1, err_b
        assert err_b.startswith("flame: error:") and f"in use by PID {job_a.pid} " in err_b, err_b
        _, err_c = job_c.communicate(timeout=300)
        assert job_c.returncode == 0 and err_c == "", err_c
        assert len(losses(c)) == 3 and job_a.poll() is None
        # the summary's wall time counts from train.sh's start: imports and setup included
        with open(os.path.join(c, "summary.json")) as f:
            summary = json.load(f)
        assert summary["train_time_s"] + 1.0 < summary["wall_time_s"] < time.time() - started_c, summary
    finally:
        os.killpg(job_a.pid, signal.SIGKILL)
    out_a, err_a = job_a.communicate(timeout=30)
    assert "(most recent call first):" in out_a + err_a, (out_a + err_a)[-3000:]
    deadline = time.time() + 10
    while _processes_mentioning(a) and time.time() < deadline:
        time.sleep(0.2)
    assert _processes_mentioning(a) == []


def test_launcher_user_error_in_worker_is_one_line(tmp_path):
    bad = tmp_path / "model.json"
    bad.write_text(json.dumps({"model_type": "no_such_family", "vocab_size": 10}))
    job = _train_sh(str(tmp_path / "run"), "--model.config", str(bad))
    out, err = job.communicate(timeout=300)
    assert job.returncode == 2, (out[-2000:], err)
    assert len(err.splitlines()) == 1 and err.startswith(f"flame: error: model.config {str(bad)!r}"), err
    assert "ChildFailedError" not in out + err


def test_outcome_folders_of_launchers_that_are_gone_are_removed(tmp_path):
    """A launcher killed with -9 leaves its outcome folder (in /dev/shm); the next launch removes the
    folders whose launcher is gone and keeps those of live ones."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flame_launch", os.path.join(ROOT, "flame", "launch.py"))
    launch = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(launch)
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = tmp_path / f"flame-outcome-{gone.pid}-abc"
    live = tmp_path / f"flame-outcome-{os.getpid()}-def"
    for d in (dead, live):
        d.mkdir()
    launch._remove_orphaned_outcome_dirs(str(tmp_path))
    assert not dead.exists() and live.exists()


@pytest.mark.parametrize("name,value,says", [
    ("NGPU", "abc", "expected a whole number >= 1"), ("NGPU", "0", "expected a whole number >= 1"),
    ("NNODE", "two", "expected a whole number >= 1"), ("MASTER_PORT", "abc", "expected a whole number >= 1"),
    ("MASTER_PORT", "70000", "at most 65535"), ("NODE_RANK", "1", "must be below NNODE=1"),
    ("LOG_RANK", "x", "rank numbers separated by commas"), ("PYTHON", "/no/such/python", "no such executable"),
    ("FLAME_SHUTDOWN_TIMEOUT", "abc", "expected a whole number >= 0"),
    ("LOG_RANK", "0,5", "no local rank 5; this job runs 1 process(es) a node"),   # else a silent console
])
def test_a_bad_launcher_variable_is_one_line_before_anything_starts(tmp_path, name, value, says):
    """train.sh's environment (NGPU, NNODE, NODE_RANK, MASTER_PORT, LOG_RANK, PYTHON): a value torchrun
    or the shell cannot take is one `flame: error:` line naming it, exit 2, and no dump folder."""
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, PYTHON=sys.executable)
    env[name] = value
    dump = tmp_path / "run"
    job = subprocess.run(["bash", TRAIN_SH, "--job.dump_folder", str(dump)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert job.returncode == 2, (job.stdout[-2000:], job.stderr)
    assert job.stderr.startswith(f"flame: error: {name}=") and says in job.stderr, job.stderr
    assert len(job.stderr.splitlines()) == 1 and not dump.exists()


def test_an_interpreter_without_flame_s_dependencies_is_one_line(tmp_path):
    """train.sh run by a python that cannot import flame's dependencies (e.g. the environment not
    activated): one `flame: error:` line naming the interpreter and the missing module, exit 2."""
    bare = tmp_path / "python-without-site-packages"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, PYTHON=str(bare), NGPU="1")
    job = subprocess.run(["bash", TRAIN_SH, "--job.dump_folder", str(tmp_path / "run")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert job.returncode == 2, (job.stdout[-2000:], job.stderr[-2000:])
    assert len(job.stderr.splitlines()) == 1, job.stderr
    assert job.stderr.startswith(f"flame: error: {bare} cannot import flame's dependencies (ModuleNotFoundError: ")


def test_full_disk_during_a_save_is_one_line(tmp_path, run_main, monkeypatch):
    import errno

    from torch.distributed.checkpoint import filesystem

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "run" / "checkpoint" / "step-2"))

    monkeypatch.setattr(filesystem, "_write_item", no_space)
    code, lines, _ = run_main(str(tmp_path / "run"), "--training.steps", "4", "--checkpoint.interval", "2")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("flame: error: the disk is full") and str(tmp_path / "run" / "checkpoint") in lines[0]


def test_overrides_apply_on_top_of_the_default_job():
    from flame.config.manager import FlameConfigManager
    from flame.launch import default_job, job_args

    cfg = FlameConfigManager().parse_args(job_args(["--training.steps", "20", "--job.dump_folder", "/tmp/x"]))
    assert (cfg.training.steps, cfg.job.dump_folder) == (20, "/tmp/x")
    assert cfg.model.config == os.path.join(ROOT, "configs/debug/transformer_tiny.json")  # the rest is the default job
    assert cfg.optimizer.lr == float(default_job()[default_job().index("--optimizer.lr") + 1])
    own = ["--job.config_file", "my.toml", "--training.steps", "3"]
    assert job_args(own) == own  # a user TOML replaces the default job


def test_launcher_help_keeps_the_named_job_file(monkeypatch, tmp_path):
    """`bash train.sh --job.config_file X --help` lists X's values, as `python -m flame.train` does."""
    from flame import launch

    execs = []

    def fake_exec(file, args, env):
        execs.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(launch.os, "execvpe", fake_exec)
    argv = ["--job.config_file", str(tmp_path / "job.toml"), "--help"]
    with pytest.raises(SystemExit):
        launch.main(argv)
    assert execs and execs[0][1:3] == ["-m", "flame.train"] and execs[0][3:] == argv


def test_launcher_picks_the_line_that_explains_the_run():
    from flame.launch import Job, explain

    job = Job([], sys.executable, {})
    crash = dict(kind="crash", line="flame: crashed on rank 0: RuntimeError: peer gone", code=1, rank=0, time=2.0,
                 traceback="Traceback\n  ...\nRuntimeError: peer gone\n", log_dir="/d/logs/x/attempt_0/0")
    error = dict(kind="error", line="flame: error: bad value", code=2, rank=1, time=1.0)
    stopped = dict(kind="stopped", line="flame: stopped at step 4 (SIGTERM); relaunch ...", code=143, rank=0, time=1.0)
    assert explain(1, [crash, error], job, "") == (2, "flame: error: bad value")  # the cause, not its echo
    assert explain(1, [stopped], job, "") == (143, stopped["line"])
    code, text = explain(1, [crash], job, "")
    assert code == 1 and text.endswith("flame: crashed on rank 0: RuntimeError: peer gone\n"
                                       "full log: /d/logs/x/attempt_0/0/stderr.log") and "Traceback" in text
    job.torchrun_lines = ["torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to "
                          "the C10d store has failed. See inner exception for details.\n"]
    code, text = explain(1, [], job, "MASTER_ADDR=10.0.0.1 MASTER_PORT=29500")
    assert code == 2 and text.startswith("flame: error: rendezvous at MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 failed")
    assert explain(0, [], Job([], sys.executable, {}), "") == (0, "")
    # torchrun's record of a worker the kernel's OOM killer took
    job.torchrun_lines = ["E1126 15:44:30 api.py:874] failed (exitcode: -9) local_rank: 0 (pid: 123) of binary: python\n"]
    code, text = explain(1, [], job, "")
    assert code == 1 and text.startswith("flame: crashed: a worker was killed by SIGKILL (out of host memory?")
    assert "--offload.host_memory_gib" in text


def test_out_of_memory_under_offload_logs_the_engine_memory(tmp_path, run_main, monkeypatch, capfd):
    """A run under offload that runs out of device memory logs the engine's buffers next to the
    plan's before the crash is reported (the exception still propagates: an internal error)."""
    import torch

    from flame import train

    def oom(self, *a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(train.Trainer, "train_step", oom)
    with pytest.raises(torch.OutOfMemoryError):
        run_main(str(tmp_path / "run"), "--offload.enable", "on", "--offload.profile",
                 os.path.join(ROOT, "flame/offload/profiles/h100_80gb_measured.json"),
                 "--offload.overrides", "weights[*]=host")
    out, err = capfd.readouterr()
    line = [l for l in (out + err).splitlines() if "offload: GPU memory" in l]
    assert len(line) == 1 and "engine buffers: " in line[0] and "(planned " in line[0], out + err
