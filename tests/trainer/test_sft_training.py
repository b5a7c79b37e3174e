"""SFT through the trainer: the loss is normalized by the assistant tokens of the whole step, the
loss falls on the bundled sample, and a resumed run continues the exact loss sequence."""

import copy
import os
import re
import subprocess
import sys

import torch

from tests.trainer.helpers import PYTHONPATH, ROOT, TINY_LLAMA, losses, metrics, tiny_job, train_in_process

SAMPLE = os.path.join(ROOT, "flame/assets/sft_sample")
DATA = ",".join(os.path.join(SAMPLE, f"{n}.jsonl") for n in ("chat", "alpaca", "sharegpt"))


def test_loss_is_normalized_by_assistant_tokens_over_accumulation(tmp_path):
    dump = str(tmp_path / "run")
    seen: dict = {}

    def capture(trainer):
        seen["init"] = copy.deepcopy(trainer.model.state_dict())
        next_batches = trainer.next_batches

        def record(it):
            seen["batches"] = next_batches(it)
            return seen["batches"]

        trainer.next_batches = record

    args = tiny_job(dump, "--training.sft", "--training.dataset", DATA, "--training.seq_len", "96",
                    "--training.batch_size", "2", "--training.gradient_accumulation_steps", "2",
                    "--training.steps", "1", "--checkpoint.no-enable")
    trainer = train_in_process(args, before_train=capture)
    model = trainer.model
    model.load_state_dict(seen["init"])
    total, count, positions = torch.zeros((), dtype=torch.float64), 0, 0
    with torch.no_grad():
        for batch in seen["batches"]:
            logp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.double(), dim=-1)
            for row_logp, row_labels in zip(logp, batch["labels"]):
                for t, y in enumerate(row_labels.tolist()):
                    if y != -100:
                        total -= row_logp[t, y]
                        count += 1
            positions += batch["input_ids"].numel()
    assert 0 < count < positions / 2  # most positions (prompts, template, padding) are not trained
    rec = [r for r in metrics(dump) if "loss" in r][0]
    assert abs(rec["loss"] - float(total / count)) < 1e-5, (rec["loss"], float(total / count))
    # tokens/s on the trained tokens and on all positions, over the same interval
    assert abs(rec["trained_tokens_per_second"] / rec["tokens_per_second"] - count / positions) < 1e-9


def test_train_sh_sft_loss_falls_and_resumes_exactly(tmp_path):
    common = ["--model.config", TINY_LLAMA, "--training.sft", "--training.dataset", DATA, "--training.varlen",
              "--training.seq_len", "128", "--training.context_len", "64", "--training.batch_size", "4",
              "--optimizer.lr", "3e-3", "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.total_steps", "16",
              "--training.mixed_precision_param", "float32", "--metrics.log_freq", "1", "--checkpoint.interval", "8",
              "--checkpoint.no-export-hf"]
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    full = str(tmp_path / "full")
    proc = subprocess.run(["bash", "train.sh", *common, "--training.steps", "16", "--job.dump_folder", full],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ls = losses(full)
    assert len(ls) == 16 and sum(ls[-4:]) / 4 < sum(ls[:4]) / 4 - 1.0, ls
    assert "trained tok/s" in proc.stdout + proc.stderr
    # a routine run prints no library noise: torchtitan's NCCL variable override, torchdata's deprecation
    for noise in ("will be overridden", "is deprecated"):
        assert noise not in proc.stdout + proc.stderr, noise
    # where start-up went, from train.sh's start: launcher, imports, setup
    assert re.search(r"Start-up: [\d.]+ s since train.sh started \(launcher and torchrun [\d.]+ s, imports [\d.]+ s, "
                     r"setup [\d.]+ s\)", proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
    split = str(tmp_path / "split")
    # in this process (no start-up cost); the same job as train.sh's, stopped at step 8 and relaunched
    base = tiny_job(split, *common)
    train_in_process([*base, "--training.steps", "8"])
    train_in_process([*base, "--training.steps", "16"])  # resumes from the checkpoint of step 8
    assert losses(split) == ls
