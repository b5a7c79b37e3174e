"""FSDP2 and DDP on 2 gloo ranks give the single-process gradients (global-token normalization)."""

import os

import pytest

from tests.trainer.helpers import ROOT, TINY_LLAMA, torchrun


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_rank_gradients_match_single_process(mode):
    script = os.path.join(ROOT, "tests/trainer/scripts/grad_parity.py")
    proc = torchrun(2, [script, mode, TINY_LLAMA], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("worst relative grad error") == 2
