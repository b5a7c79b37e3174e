"""TensorBoard and W&B (offline) from one CPU run: files under the dump folder, a full console line."""

import glob
import os
import re

import pytest

from tests.trainer.helpers import losses, run_job


def test_tensorboard_and_wandb_offline_write_under_the_dump_folder(tmp_path, monkeypatch):
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
    on CPU the trainer profiles the CPU only, on torchtitan's schedule and in its folder layout."""
    import json

    dump = str(tmp_path / "run")
    run_job(1, dump, "--training.steps", "2", "--checkpoint.no-enable", "--profiling.enable_profiling",
            "--profiling.profile_freq", "2", "--profiling.profiler_warmup", "1", "--profiling.profiler_active", "1")
    traces = sorted(glob.glob(os.path.join(dump, "profile_trace", "iteration_*", "rank0_trace.json")))
    assert [os.path.basename(os.path.dirname(t)) for t in traces] == ["iteration_2"], traces
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    assert any(str(e.get("name", "")).startswith("ProfilerStep#") for e in events)
    assert any("aten::mm" == e.get("name") or "aten::addmm" == e.get("name") for e in events)
