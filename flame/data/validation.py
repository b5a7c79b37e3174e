"""Held-out loss and perplexity per source.

Validation batches carry ``_source_ids`` [B, T]: the source index of each target token. The
trainer computes per-token losses (``reduction="none"``) and feeds them here::

    meter = SourceLossMeter(loader.source_names)
    for _ in range(steps):
        batch = next(it)
        logits = model(...)
        tok_loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(),
                                   ignore_index=-100, reduction="none").view_as(batch["labels"])
        meter.update(tok_loss, batch["labels"], batch["_source_ids"])
    metrics = meter.compute()  # {"validation/<source>/loss": ..., ".../ppl": ..., "validation/loss": ...}
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from flame.data.packing import IGNORE_INDEX


def source_keys(names: Sequence[str]) -> list[str]:
    """Metric names of sources: the last part of each path, with as many parent folders as it takes
    to tell sources apart (``a/val.jsonl``, ``b/val.jsonl``); a source listed twice gets ``#2``, ..."""
    parts = [[p for p in str(n).split("/") if p] or [str(n)] for n in names]
    depth = [1] * len(parts)
    while True:
        keys = ["/".join(p[-d:]) for p, d in zip(parts, depth)]
        clashing = [i for i, k in enumerate(keys) if keys.count(k) > 1 and depth[i] < len(parts[i])]
        if not clashing:
            break
        for i in clashing:
            depth[i] += 1
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        seen[k] = seen.get(k, 0) + 1
        if seen[k] > 1:
            keys[i] = f"{k}#{seen[k]}"
    return keys


class SourceLossMeter:
    def __init__(self, source_names: Sequence[str]):
        self.names = [str(n) for n in source_names]
        self.keys = source_keys(self.names)
        self.sums = torch.zeros(len(self.names), dtype=torch.float64)
        self.counts = torch.zeros(len(self.names), dtype=torch.float64)

    def update(self, token_loss: torch.Tensor, labels: torch.Tensor, source_ids: torch.Tensor) -> None:
        valid = (labels != IGNORE_INDEX).flatten().cpu()
        loss = token_loss.detach().flatten().double().cpu()[valid]
        src = source_ids.flatten().cpu()[valid]
        self.sums.index_add_(0, src, loss)
        self.counts.index_add_(0, src, torch.ones_like(loss))

    def compute(self, reduce: bool = True, prefix: str = "validation") -> dict[str, float]:
        sums, counts = self.sums.clone(), self.counts.clone()
        if reduce and dist.is_available() and dist.is_initialized():
            both = torch.stack([sums, counts])
            backend = dist.get_backend()
            if backend == "nccl":
                both = both.cuda()
            dist.all_reduce(both)
            sums, counts = both.cpu()[0], both.cpu()[1]
        out: dict[str, float] = {}
        for key, s, c in zip(self.keys, sums.tolist(), counts.tolist()):
            if c > 0:
                out[f"{prefix}/{key}/loss"] = s / c
                out[f"{prefix}/{key}/ppl"] = math.exp(min(s / c, 50.0))
        total_c = float(counts.sum())
        if total_c > 0:
            out[f"{prefix}/loss"] = float(sums.sum()) / total_c
            out[f"{prefix}/ppl"] = math.exp(min(out[f"{prefix}/loss"], 50.0))
        return out
