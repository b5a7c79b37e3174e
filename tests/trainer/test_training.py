"""End-to-end CPU runs of the real trainer (gloo): loss, parallel, resume, accumulation, NaN skips."""

import json
import os

import pytest

from tests.trainer.helpers import CORPUS, ROOT, losses, metrics, run_job, run_python, tiny_job, torchrun


def test_single_process_trains_and_writes_outputs(tmp_path):
    dump = str(tmp_path / "run")
    proc = run_job(1, dump, "--training.steps", "16", "--checkpoint.interval", "8", "--checkpoint.keep_latest_k", "1",
                   "--validation.enable", "--validation.dataset", CORPUS, "--validation.steps", "2",
                   "--validation.interval", "8")
    val = [r for r in metrics(dump) if "validation/loss" in r]
    assert [r["step"] for r in val] == [8, 16] and val[1]["validation/loss"] < val[0]["validation/loss"]
    assert "validation/sample_corpus/ppl" in val[0]
    ls = losses(dump)
    assert len(ls) == 16 and sum(ls[-4:]) / 4 < sum(ls[:4]) / 4 - 0.3, ls
    rec = [r for r in metrics(dump) if "loss" in r][-1]
    for key in ("grad_norm", "lr", "tokens_per_second", "tflops", "data_loading_pct", "step_time"):
        assert key in rec
    assert sorted(os.listdir(os.path.join(dump, "checkpoint"))) == ["step-16"]  # keep_latest_k 1
    resolved = json.load(open(os.path.join(dump, "job_config.json")))
    assert resolved["training"]["local_batch_size"] == 4
    # the end-of-run summary: printed once by rank 0 and written as DUMP/summary.json
    summary = json.load(open(os.path.join(dump, "summary.json")))
    assert summary["final_train_loss"] == ls[-1] and summary["validation_loss"] == val[-1]["validation/loss"]
    assert (summary["steps"], summary["validation_step"], summary["tokens_seen"]) == (16, 16, 16 * 4 * 64)
    assert summary["tokens_per_second"] == pytest.approx(summary["tokens_this_launch"] / summary["train_time_s"])
    assert summary["checkpoint"] == os.path.join(dump, "checkpoint", "step-16") and summary["hf_export"] is None
    assert summary["metrics_jsonl"] == os.path.join(dump, "metrics.jsonl") and summary["host_memory_peak_gib"] > 0
    console = proc.stdout + proc.stderr
    assert console.count("run summary:") == 1 and f"final train loss {ls[-1]:.4f}" in " ".join(console.split())


def test_two_ranks_fsdp_trains(tmp_path):
    dump = str(tmp_path / "run")
    run_job(2, dump, "--training.steps", "10", "--checkpoint.interval", "100")
    ls = losses(dump)
    assert len(ls) == 10 and ls[-1] < ls[0] - 0.3, ls


def test_resume_continues_the_exact_loss_sequence(tmp_path):
    common = ["--lr_scheduler.total_steps", "8", "--checkpoint.interval", "4"]
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    run_job(1, full, "--training.steps", "8", *common)
    run_job(1, split, "--training.steps", "4", *common)  # stops after saving step 4
    run_job(1, split, "--training.steps", "8", *common)  # relaunch: resumes from step-4
    assert losses(split) == losses(full)


def test_a_resume_with_more_steps_follows_the_new_schedule_from_its_first_step(tmp_path):
    """The optimizer's checkpoint holds the old schedule's lr; the first resumed step runs at the new
    schedule's (as a run of the new length would at that step), not at the old one's."""
    common = ["--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1"]
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    run_job(1, full, "--training.steps", "6", *common)
    run_job(1, split, "--training.steps", "4", *common)
    run_job(1, split, "--training.steps", "6", *common)

    def lr_at(dump):
        return {r["step"]: r["lr"] for r in metrics(dump) if "lr" in r}

    assert [lr_at(split)[s] for s in (5, 6)] == pytest.approx([lr_at(full)[s] for s in (5, 6)], rel=1e-6)


def test_gradient_accumulation_equals_larger_batch(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_job(1, a, "--training.steps", "3", "--training.batch_size", "4", "--checkpoint.no-enable-checkpoint",
            "--checkpoint.no-enable", "--optimizer.implementation", "for-loop")
    run_job(1, b, "--training.steps", "3", "--training.batch_size", "2", "--training.gradient_accumulation_steps", "2",
            "--checkpoint.no-enable-checkpoint", "--checkpoint.no-enable", "--optimizer.implementation", "for-loop")
    la, lb = losses(a), losses(b)
    assert la == pytest.approx(lb, rel=1e-5, abs=1e-5), (la, lb)


def test_skip_nan_inf_skips_and_counts(tmp_path):
    script = os.path.join(ROOT, "tests/trainer/scripts/skip_nan.py")
    args = tiny_job(str(tmp_path / "run"), "--training.steps", "4", "--training.skip_nan_inf", "--checkpoint.no-enable-checkpoint", "--checkpoint.no-enable")
    proc = torchrun(1, [script, *args])
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "untouched" in proc.stdout and "skipped_steps=1" in proc.stdout


def _flame(*args):
    return run_python(["-m", "flame.train", *args])


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--training.batchsize", "2"], "did you mean 'training.batch_size'"),
        (["--model.tokenizer_path", "/no/such/tokenizer"], "/no/such/tokenizer"),
        (["--job.dump_folder", "/proc/flame-cannot-write"], "job.dump_folder"),
        (["--training.data_parallel_shard_degree", "3"], "world size 1"),
        (["--training.global_batch_size", "6"], "training.global_batch_size 6"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(tmp_path, extra, fragment):
    proc = _flame(*tiny_job(str(tmp_path / "run"), "--training.steps", "2"), *extra)
    assert proc.returncode != 0
    errors = [l for l in proc.stderr.splitlines() if l.startswith("flame: error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr[-3000:]
    assert not os.path.exists(tmp_path / "run" / "checkpoint")


def test_the_schedule_follows_a_checkpoint_of_another_group_count():
    """A run resumed under another layout (tensor parallel splits DTensors into groups of their own)
    has another number of param groups than the checkpoint's schedule: with one lr it continues;
    with different lrs per group it is a one-line error, not a crash at the first scheduler step."""
    import types

    import torch

    from flame.components.optimizer import lr_at_loaded_step
    from flame.errors import ConfigError

    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    opt = torch.optim.SGD([{"params": [p]} for p in params], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))
    sched.load_state_dict({**sched.state_dict(), "base_lrs": [0.1, 0.1, 0.1], "last_epoch": 3})
    lr_at_loaded_step(types.SimpleNamespace(schedulers=[sched]))
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 / 4] * 2)
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1 / 5] * 2)
    sched.load_state_dict({**sched.state_dict(), "base_lrs": [0.1, 0.2, 0.1]})
    with pytest.raises(ConfigError, match="3 parameter groups with different learning rates and this run has 2"):
        lr_at_loaded_step(types.SimpleNamespace(schedulers=[sched]))


def test_a_resume_runs_with_this_runs_optimizer_settings():
    """The checkpoint's optimizer state holds the saving run's group settings (lr, weight decay,
    betas, Adam's decoupled_weight_decay) and its schedule the old peak lr: a resume with other
    --optimizer.* values runs with them instead of silently keeping the saved ones."""
    import types

    import torch

    from flame.components.optimizer import group_settings, lr_at_loaded_step

    def build(cls, lr, weight_decay):
        p = torch.nn.Parameter(torch.zeros(2))
        opt = cls([{"params": [p]}], lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (step + 1))

    saved_opt, saved_sched = build(torch.optim.AdamW, 3e-3, 0.01)
    for _ in range(3):
        saved_sched.step()
    opt, sched = build(torch.optim.Adam, 1e-3, 0.5)
    schedulers = types.SimpleNamespace(schedulers=[sched])
    settings = group_settings(schedulers)
    opt.load_state_dict(saved_opt.state_dict())
    sched.load_state_dict(saved_sched.state_dict())
    lr_at_loaded_step(schedulers, settings)
    group = opt.param_groups[0]
    assert group["lr"] == pytest.approx(1e-3 / 4) and group["weight_decay"] == 0.5
    assert group["decoupled_weight_decay"] is False  # Adam, as asked, not the saved AdamW
    sched.step()
    assert group["lr"] == pytest.approx(1e-3 / 5)
