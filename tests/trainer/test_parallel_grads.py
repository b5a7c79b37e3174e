"""FSDP2/DDP on 2 gloo ranks and HSDP on 4 give the single-process gradients (global-token normalization)."""

import os

import pytest

from tests.trainer.helpers import ROOT, TINY_LLAMA, torchrun


@pytest.mark.parametrize("mode", ["fsdp", "ddp"])
def test_two_rank_gradients_match_single_process(mode):
    script = os.path.join(ROOT, "tests/trainer/scripts/grad_parity.py")
    proc = torchrun(2, [script, mode, TINY_LLAMA], timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("worst relative grad error") == 2
    assert proc.stdout.count("clipped grads match torch's clip") == 2


def test_hsdp_four_rank_gradients_match_single_process():
    # dp_replicate 2 x dp_shard 2 on gloo; ~25 s on 2 cores (4 processes of ~9 s imports each)
    script = os.path.join(ROOT, "tests/trainer/scripts/grad_parity.py")
    proc = torchrun(4, [script, "hsdp", TINY_LLAMA], timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("hsdp worst relative grad error") == 4
    assert proc.stdout.count("hsdp clipped grads match torch's clip") == 4
