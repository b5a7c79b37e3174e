"""Checkpoint modes on CPU: async saves that resume exactly, seed checkpoints, refused combinations."""

import json
import os

from tests.trainer.helpers import TINY_LLAMA, losses, metrics, run_job, tiny_job, torchrun


def test_async_checkpoint_resumes_the_exact_loss_sequence(tmp_path):
    dump = str(tmp_path / "run")
    common = ["--lr_scheduler.total_steps", "8", "--checkpoint.interval", "4", "--checkpoint.async_mode", "async"]
    run_job(1, dump, "--training.steps", "6", *common)  # step 4 is saved in the background, step 6 at the end
    for step in ("step-4", "step-6"):
        assert os.path.isfile(os.path.join(dump, "checkpoint", step, ".metadata")), step
    first = {r["step"]: r["loss"] for r in metrics(dump) if "loss" in r}
    proc = run_job(1, dump, "--training.steps", "8", "--checkpoint.load_step", "4", *common)
    assert "Loading the checkpoint from" in proc.stdout + proc.stderr and "step-4" in proc.stdout + proc.stderr
    again = [r for r in metrics(dump) if "loss" in r]
    # each step once: the first run's records after step 4 gave way to the relaunch's
    assert [r["step"] for r in again] == [1, 2, 3, 4, 5, 6, 7, 8]
    # steps 5 and 6 after resuming from the async-written step 4 repeat the first run exactly
    assert [r["loss"] for r in again[:6]] == [first[s] for s in range(1, 7)]


def test_seed_checkpoint_is_where_a_later_run_starts(tmp_path):
    # the seed is made from a config with a 10x larger init (same shapes): a later run with the
    # normal config must train from those weights, not from its own init
    wide = tmp_path / "wide_init.json"
    wide.write_text(json.dumps(dict(json.load(open(TINY_LLAMA)), initializer_range=0.2)))
    seeded, reference = str(tmp_path / "seeded"), str(tmp_path / "reference")
    run_job(1, seeded, "--checkpoint.create_seed_checkpoint", config=str(wide))
    assert os.listdir(os.path.join(seeded, "checkpoint")) == ["step-0"]
    assert not os.path.exists(os.path.join(seeded, "metrics.jsonl"))  # no training step
    common = ["--training.steps", "3", "--checkpoint.interval", "100"]
    proc = run_job(1, seeded, *common)
    assert "step-0" in proc.stdout + proc.stderr
    run_job(1, reference, *common, config=str(wide))
    assert losses(seeded) == losses(reference)


def test_keep_latest_one_with_async_is_a_one_line_error(tmp_path):
    args = tiny_job(str(tmp_path / "run"), "--checkpoint.keep_latest_k", "1", "--checkpoint.async_mode", "async")
    proc = torchrun(1, ["-m", "flame.train", *args], timeout=120)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("flame: error:")]
    assert len(errors) == 1 and "keep_latest_k 1" in errors[0] and "async" in errors[0], proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "run" / "checkpoint")
