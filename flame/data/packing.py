"""Turning windows of a consumer's token stream into a batch.

Each row is a window of T + 1 consecutive stream tokens; the next row starts at the last token of
this one (rows overlap by one token, so every token is an input once and no token is only a
target). ``input_ids = window[:T]`` and ``labels = window[1:]``. ``starts`` lists the window
positions where a document begins (known from document lengths, never from BOS/EOS).

Varlen: positions restart at every document start, at every row start, and after every
``context_len`` tokens of the same piece; ``cu_seqlens`` has a boundary at each restart, over the
flattened B*T tokens (row boundaries are always boundaries, so rows never attend to each other).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

IGNORE_INDEX = -100


def row_pieces(T: int, starts: Sequence[int], context_len: int) -> np.ndarray:
    """Piece boundaries of one row: sorted offsets starting at 0 and ending at T."""
    resets = sorted({0, *(int(s) for s in starts if 0 < s < T)})
    bounds = []
    for a, b in zip(resets, resets[1:] + [T]):
        bounds.extend(range(a, b, context_len))
    bounds.append(T)
    return np.asarray(bounds, dtype=np.int64)


def pack_batch(windows: np.ndarray, starts: Sequence[Sequence[int]], *, varlen: bool, context_len: int,
               mask_cross_document_labels: bool) -> dict[str, torch.Tensor]:
    B, T1 = windows.shape
    T = T1 - 1
    win = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    input_ids = win[:, :T].clone()
    labels = win[:, 1:].clone()
    if mask_cross_document_labels:
        for b, row_starts in enumerate(starts):
            # The target at t crosses a boundary when position t + 1 begins a document.
            cross = [s - 1 for s in row_starts if 1 <= s <= T]
            if cross:
                labels[b, cross] = IGNORE_INDEX
    batch = {"input_ids": input_ids, "labels": labels}
    if varlen:
        cu = [np.zeros(1, dtype=np.int64)]
        pos = np.empty((B, T), dtype=np.int64)
        for b, row_starts in enumerate(starts):
            bounds = row_pieces(T, row_starts, context_len)
            lengths = np.diff(bounds)
            # Position = index within the piece: arange minus the start of the piece it falls in.
            pos[b] = np.arange(T) - np.repeat(bounds[:-1], lengths)
            cu.append(bounds[1:] + b * T)
        batch["cu_seqlens"] = torch.from_numpy(np.concatenate(cu)).to(torch.int32)
        batch["position_ids"] = torch.from_numpy(pos)
    return batch
