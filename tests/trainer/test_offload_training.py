"""The trainer with the offload engine (blocks streamed from host, CPU AdamW) matches a plain
run on CPU, and checkpoints move between offloaded and plain runs."""

import os

import pytest

from tests.trainer.helpers import ROOT, losses, run_job

PROFILE = os.path.join(ROOT, "flame/offload/profiles/h100_80gb_measured.json")
OFFLOAD = ["--offload.enable", "on", "--offload.profile", PROFILE,
           "--offload.overrides", "weights[*]=host"]
# eps 1e-8: with flame's default 1e-15 the first Adam steps move every weight by +-lr, so float-rounding
# differences in near-zero gradients flip whole steps and hide real mismatches
COMMON = ["--lr_scheduler.total_steps", "6", "--checkpoint.interval", "3", "--optimizer.implementation", "for-loop",
          "--optimizer.eps", "1e-8"]


def test_offloaded_run_matches_plain_and_checkpoints_cross_over(tmp_path):
    plain, off, cross = (str(tmp_path / n) for n in ("plain", "off", "cross"))
    run_job(1, plain, "--training.steps", "6", *COMMON)
    run_job(1, off, "--training.steps", "6", *COMMON, *OFFLOAD)
    lp, lo = losses(plain), losses(off)
    assert lo == pytest.approx(lp, rel=1e-4, abs=1e-4), (lp, lo)
    # offloaded run saves step 3; a plain run resumes it and continues the same sequence
    run_job(1, cross, "--training.steps", "3", *COMMON, *OFFLOAD)
    run_job(1, cross, "--training.steps", "6", *COMMON, "--offload.enable", "off")
    assert losses(cross) == pytest.approx(lp, rel=1e-4, abs=1e-4)


def test_plain_checkpoint_resumes_with_offload(tmp_path):
    plain, cross = str(tmp_path / "plain"), str(tmp_path / "cross")
    run_job(1, plain, "--training.steps", "6", *COMMON)
    run_job(1, cross, "--training.steps", "3", *COMMON)
    run_job(1, cross, "--training.steps", "6", *COMMON, *OFFLOAD)
    assert losses(cross) == pytest.approx(losses(plain), rel=1e-4, abs=1e-4)
