"""Selective recompute (the plan's activation mode "selective"): a block runs under torch's
non-reentrant checkpoint with a selective-checkpoint policy that keeps the outputs of its matmuls
and attention and recomputes everything else (norms, rotary embeddings, activation functions,
elementwise products) in the backward. The expensive ops run once; the memory kept is their
outputs plus the block's inputs, between keeping everything and recomputing everything."""

from __future__ import annotations

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten
# ops whose outputs are kept: the GEMMs and the fused attention kernels (those a backend provides)
SAVED_OPS = frozenset(getattr(_aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(_aten, name))


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint(fn, *args, **kwargs):
    """fn(*args, **kwargs) with only its matmul and attention outputs kept for the backward."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, _policy),
                      **kwargs)
