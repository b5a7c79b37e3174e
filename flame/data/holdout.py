"""Held-out validation documents for sources without a validation split.

When validation is on, ``validation.dataset`` is not set and a training source has no validation
split (local files, token folders, hub or saved datasets with only a training split), validation
reads a held-out share of that source's documents and training skips them. Document ``i`` (its
row in the source's stored order) is held out when a hash of ``i`` falls below
``validation.holdout_fraction``; row 0 is always held out, so even a tiny source has one. The
choice depends on nothing but the row, so it is the same on every rank, worker count and resume.
"""

from __future__ import annotations

import numpy as np

from flame.data.permute import key_of, mix64

_KEY = np.uint64(key_of(0x686F6C646F7574))  # fixed: the held-out set must not move with the seed


def held_out(rows: np.ndarray, fraction: float) -> np.ndarray:
    """Which of ``rows`` are held out (bool array)."""
    rows = np.asarray(rows, dtype=np.int64)
    h = mix64(rows.astype(np.uint64) ^ _KEY)
    threshold = np.uint64(min(int(fraction * 2.0 ** 64), 2 ** 64 - 1))
    return (h < threshold) | (rows == 0)


def held_out_rows(num_docs: int, fraction: float, chunk: int = 1 << 22) -> np.ndarray:
    """The held-out rows of a source of ``num_docs`` documents, ascending."""
    parts = []
    for a in range(0, num_docs, chunk):
        rows = np.arange(a, min(a + chunk, num_docs), dtype=np.int64)
        parts.append(rows[held_out(rows, fraction)])
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
