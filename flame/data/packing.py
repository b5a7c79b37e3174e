"""Turning windows of a consumer's token stream into a batch.

Each row is a window of T + 1 consecutive stream tokens; the next row starts at the last token of
this one (rows overlap by one token, so every token is an input once and no token is only a
target). ``input_ids = window[:T]`` and ``labels = window[1:]``. ``starts`` lists the window
positions where a document begins (known from document lengths, never from BOS/EOS).

Varlen: positions restart at every document start, at every row start, and after every
``context_len`` tokens of the same piece; ``cu_seqlens`` has a boundary at each restart, over the
flattened B*T tokens (row boundaries are always boundaries, so rows never attend to each other).

SFT rows (:func:`pack_conversations`) hold whole conversations instead of a window of the stream.
"""

from __future__ import annotations

from typing import Any, Sequence

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
        batch.update(varlen_fields(starts, B, T, context_len))
    return batch


def varlen_fields(starts: Sequence[Sequence[int]], B: int, T: int, context_len: int) -> dict[str, torch.Tensor]:
    """``cu_seqlens`` (int32, over the flattened B*T tokens) and ``position_ids`` of rows whose
    pieces begin at ``starts`` (and at every row start and every ``context_len`` tokens)."""
    cu = [np.zeros(1, dtype=np.int64)]
    pos = np.empty((B, T), dtype=np.int64)
    for b, row_starts in enumerate(starts):
        bounds = row_pieces(T, row_starts, context_len)
        lengths = np.diff(bounds)
        # Position = index within the piece: arange minus the start of the piece it falls in.
        pos[b] = np.arange(T) - np.repeat(bounds[:-1], lengths)
        cu.append(bounds[1:] + b * T)
    return {"cu_seqlens": torch.from_numpy(np.concatenate(cu)).to(torch.int32),
            "position_ids": torch.from_numpy(pos)}


def pack_conversations(rows: Sequence[Sequence[Any]], T: int, pad_id: int, *, varlen: bool,
                       context_len: int) -> dict[str, torch.Tensor]:
    """SFT rows: each row holds whole conversations (:class:`flame.data.chat.Conversation`, each at
    most T tokens) back to back, then padding (label -100). Every conversation carries its own shifted
    labels, so nothing is predicted across conversations; with ``varlen`` every conversation (and the
    padding) is its own piece of ``cu_seqlens``, without it a row holds one conversation."""
    B = len(rows)
    input_ids = np.full((B, T), pad_id, dtype=np.int64)
    labels = np.full((B, T), IGNORE_INDEX, dtype=np.int64)
    starts: list[list[int]] = []
    for b, convs in enumerate(rows):
        at, row_starts = 0, []
        for conv in convs:
            n = len(conv)
            input_ids[b, at:at + n] = conv.ids
            labels[b, at:at + n] = conv.labels()
            row_starts.append(at)
            at += n
        if at < T:
            row_starts.append(at)  # the padding is a piece of its own
        starts.append(row_starts)
    batch = {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels)}
    if varlen:
        batch.update(varlen_fields(starts, B, T, context_len))
    return batch
