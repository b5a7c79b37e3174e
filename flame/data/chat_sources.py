"""Sources of conversations (``training.sft``): the map-style and streaming sources of
:mod:`flame.data.sources`, reading whole rows and rendering them with :class:`flame.data.chat.ChatRenderer`.

A row that gives no trainable conversation (see :func:`flame.data.chat.messages_of`) is a bad row
under ``training.bad_document_policy``: counted per source, the first one logged with its file and
row, skipped (or the run stops under 'error'). The decision depends only on the row, so a resumed
run skips the same rows.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from flame.data.chat import BadConversation, ChatRenderer
from flame.data.documents import BadRows
from flame.data.sources import MapSource, StreamSource


def _conversations(rows: list[dict], row_ids: list[int], chat: ChatRenderer,
                   bad_rows: BadRows) -> list[tuple[Any, bool]]:
    out: list[tuple[Any, bool]] = []
    for row, i in zip(rows, row_ids):
        try:
            out.append((chat.row(row), False))
        except BadConversation as e:
            bad_rows.reject(i, f"{e}")
            out.append((None, True))
    return out


class ChatMapSource(MapSource):
    """A map-style dataset of conversation rows."""

    def __init__(self, *args: Any, chat: ChatRenderer, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chat = chat

    def _read(self, indices: np.ndarray) -> list[tuple[Any, bool]]:
        idx = [int(i) for i in np.asarray(indices).tolist()]
        order = sorted(range(len(idx)), key=idx.__getitem__)  # Arrow reads ascending indices faster
        cols = self.dataset[[idx[k] for k in order]]
        rows: list[dict] = [{}] * len(idx)
        for j, k in enumerate(order):
            rows[k] = {c: v[j] for c, v in cols.items()}
        return _conversations(rows, idx, self.chat, self.bad_rows)


class ChatStreamSource(StreamSource):
    """A streaming dataset of conversation rows."""

    def __init__(self, *args: Any, chat: ChatRenderer, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.chat = chat

    def raw(self) -> Iterator[dict]:
        # ``iter`` (not ``__iter__``): flame assigns rows to consumers itself (see StreamSource.raw).
        for batch in self.dataset.iter(batch_size=256):
            cols = list(batch)
            for j in range(len(batch[cols[0]])):
                yield {c: batch[c][j] for c in cols}

    def size(self, item: Any) -> int:
        return len(str(item))

    def _convert(self, items: list[Any], rows: list[int]) -> list[tuple[Any, bool]]:
        return _conversations(items, rows, self.chat, self.bad_rows)
