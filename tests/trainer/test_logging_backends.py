"""TensorBoard and W&B (offline) from one CPU run: files under the dump folder, a full console line."""

import glob
import os
import re

import pytest

from tests.trainer.helpers import losses, run_job


def test_tensorboard_and_wandb_offline_write_under_the_dump_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # a dependency of flame; the GPU machine's carried wheels lack it
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    dump = str(tmp_path / "run")
    proc = run_job(1, dump, "--training.steps", "3", "--checkpoint.no-enable",
                   "--metrics.enable_tensorboard", "--metrics.enable_wandb")

    events = glob.glob(os.path.join(dump, "tb", "*", "events.out.tfevents.*"))
    assert len(events) == 1, os.listdir(dump)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(events[0])
    acc.Reload()
    logged = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert [s for s, _ in logged] == [1, 2, 3]
    assert [v for _, v in logged] == pytest.approx(losses(dump), rel=1e-6)

    runs = glob.glob(os.path.join(dump, "**", "offline-run-*", "run-*.wandb"), recursive=True)
    assert len(runs) == 1 and os.path.getsize(runs[0]) > 0, runs

    out = proc.stdout + proc.stderr
    line = [l for l in out.splitlines() if re.search(r"step\s+3/3", l)]
    assert line, out[-3000:]
    assert re.search(r"loss\s+\d+\.\d+.*lr [\d.e+-]+.*tok/s [\d,]+.*eta \d+:\d\d:\d\d", line[0]), line[0]


def test_profiling_writes_a_trace_of_the_chosen_step_on_cpu(tmp_path):
    """torchtitan's profiler lists GPU activity even without a GPU (torch.profiler refuses that):
    on CPU the trainer profiles the CPU only, on torchtitan's schedule and in its folder layout. The
    run's end stops the profiler in the next cycle's warmup (step 3): no trace for that."""
    import json

    dump = str(tmp_path / "run")
    run_job(1, dump, "--training.steps", "3", "--checkpoint.no-enable", "--profiling.enable_profiling",
            "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1")
    traces = sorted(glob.glob(os.path.join(dump, "profile_trace", "iteration_*", "rank0_trace.json")))
    assert [os.path.basename(os.path.dirname(t)) for t in traces] == ["iteration_2"], traces
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    assert any(str(e.get("name", "")).startswith("ProfilerStep#") for e in events)
    assert any("aten::mm" == e.get("name") or "aten::addmm" == e.get("name") for e in events)


def test_profiling_warns_when_the_run_ends_before_the_first_trace(caplog):
    import logging
    from types import SimpleNamespace

    import torch

    from flame.components.profiling import training_profiler

    cfg = SimpleNamespace(enable_profiling=True, save_traces_folder="profile_trace", profile_freq=512,
                          profiler_warmup=3, profiler_active=1)
    with caplog.at_level(logging.WARNING, logger="flame.components.profiling"):
        with training_profiler(cfg, global_step=0, base_folder="/nonexistent", device=torch.device("cpu"),
                               last_step=100) as prof:
            assert prof is not None
    assert "profiling.profile_freq 512: this run ends at step 100, before its first trace (step 512)" in caplog.text
    cfg.enable_profiling = False
    with training_profiler(cfg, global_step=0, base_folder="/nonexistent", device=torch.device("cpu"),
                           last_step=100) as prof:
        assert prof is None


def test_startup_split_adds_up(monkeypatch):
    from flame.utils import startup

    monkeypatch.delenv("FLAME_LAUNCH_TIME", raising=False)
    assert startup.startup_split(now=100.0) is None and startup.seconds_since_launch() is None
    monkeypatch.setenv("FLAME_LAUNCH_TIME", "10.0")
    monkeypatch.setenv("FLAME_WORKER_START", "18.5")
    monkeypatch.setattr(startup, "_IMPORTS_DONE", 30.0)
    assert startup.startup_split(now=42.25) == ("32.2 s since train.sh started (launcher and torchrun 8.5 s, "
                                                "imports 11.5 s, setup 12.2 s)")
    monkeypatch.setenv("FLAME_WORKER_START", "not a time")  # the total alone
    assert startup.startup_split(now=42.25) == "32.2 s since train.sh started"


def test_peak_flops_without_lspci_has_no_warning(monkeypatch, caplog):
    """Without lspci torchtitan warns on every run before using the device name; flame drops that
    one warning and keeps the value."""
    import logging
    import shutil

    from torchtitan.tools.utils import get_peak_flops

    from flame.train import peak_flops

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/nonexistent")  # no lspci for torchtitan's subprocess either
    with caplog.at_level(logging.WARNING):
        got = peak_flops("NVIDIA H100 80GB HBM3")
    assert "lspci" not in caplog.text
    assert got == get_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert "lspci" in caplog.text  # torchtitan's own call still warns: the filter is gone afterwards


@pytest.mark.parametrize("extra, fragment", [
    ([], "profiling.enable_memory_snapshot: snapshots record CUDA allocations; this run is on cpu"),
    (["--profiling.profile_freq", "0"], "profiling.profile_freq 0: memory snapshots"),
    (["--offload.enable", "on", "--training.compile"], "with offload.enable on and training.compile"),
])
def test_memory_snapshot_mistakes_are_one_line_errors(tmp_path, extra, fragment):
    import torch

    if torch.cuda.is_available() and "cpu" in fragment:
        pytest.skip("on a GPU machine the run is on cuda")
    from tests.trainer.helpers import run_python, tiny_job

    proc = run_python(["-m", "flame.train", *tiny_job(str(tmp_path / "run"), "--training.steps", "2"),
                       "--profiling.enable_memory_snapshot", *extra])
    errors = [l for l in proc.stderr.splitlines() if l.startswith("flame: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and fragment in errors[0], proc.stderr[-3000:]


def test_memory_snapshot_on_gpu_every_freq_steps_and_at_an_oom(tmp_path):
    """A snapshot every profile_freq steps and one at the step that ran out of memory (a GPU cap
    far below the model's needs), each readable by benchmarks/memory_snapshot.py."""
    import subprocess
    import sys

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from tests.trainer.helpers import ROOT, run_python, tiny_job

    dump = str(tmp_path / "run")
    proc = run_python(["-m", "flame.train", *tiny_job(dump, "--training.steps", "2", "--checkpoint.no-enable"),
                       "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pickles = glob.glob(os.path.join(dump, "memory_snapshot", "iteration_*", "rank0_memory_snapshot.pickle"))
    assert [os.path.basename(os.path.dirname(p)) for p in pickles] == ["iteration_2"], pickles
    summary = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/memory_snapshot.py"), pickles[0]],
                             capture_output=True, text=True)
    assert summary.returncode == 0 and "GiB allocated in" in summary.stdout, summary.stderr[-2000:]
    # a step that runs out of memory: the exit snapshot (torchtitan names it after the step before)
    from tests.trainer.helpers import train_in_process

    def run_out_of_memory(trainer):
        def step(data_iter):
            raise torch.OutOfMemoryError("CUDA out of memory (raised by the test)")
        trainer.train_step = step

    dump = str(tmp_path / "oom")
    with pytest.raises(torch.OutOfMemoryError):
        train_in_process([*tiny_job(dump, "--training.steps", "2", "--checkpoint.no-enable"),
                          "--profiling.enable_memory_snapshot", "--profiling.profile_freq", "2"], run_out_of_memory)
    assert glob.glob(os.path.join(dump, "memory_snapshot", "iteration_0_exit", "rank0_memory_snapshot.pickle"))
