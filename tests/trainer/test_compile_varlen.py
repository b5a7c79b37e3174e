"""Varlen training with per-block torch.compile compiles once: the number of documents (the length of
cu_seqlens) changes from step to step, and no block is compiled again after the first step."""

import os

import pytest
import torch

from tests.trainer.helpers import ROOT, tiny_job, train_in_process


@pytest.mark.parametrize("family", ["transformer_tiny", "llama"])
def test_no_recompilation_after_the_first_step(tmp_path, family):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    graphs, docs = [], []

    def watch(trainer):
        step, forward = trainer.train_step, trainer.forward_loss_sum

        def counted_step(data_iter):
            step(data_iter)
            graphs.append(counters["stats"]["unique_graphs"])

        def recorded_forward(batch):
            docs.append(batch["cu_seqlens"].numel())
            return forward(batch)

        trainer.train_step, trainer.forward_loss_sum = counted_step, recorded_forward

    # aot_eager: dynamo and AOTAutograd decide every recompilation; inductor's code generation is
    # not needed to see them and takes minutes on CPU
    args = tiny_job(str(tmp_path / family), "--training.steps", "4", "--training.batch_size", "2",
                    "--training.seq_len", "64", "--training.varlen", "--training.context_len", "32",
                    "--training.compile", "--compile.backend", "aot_eager", "--checkpoint.no-enable-checkpoint",
                    config=os.path.join(ROOT, "configs/debug", f"{family}.json"))
    try:
        train_in_process(args, before_train=watch)
    finally:
        torch._dynamo.reset()
    assert len(set(docs)) > 1, f"every step had the same number of documents {docs}: nothing to recompile for"
    assert graphs[0] > 0, "nothing was compiled"
    assert graphs == [graphs[0]] * len(graphs), f"graphs compiled after each step {graphs} (documents {docs})"
