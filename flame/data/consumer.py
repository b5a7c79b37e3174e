"""One consumer (a rank's worker): draws documents from its shares of the sources, mixes them,
adds boundary tokens and cuts its token stream into batches. Its whole state is a few integers
per source (see :meth:`Consumer.state`), advanced before each batch is handed out.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np

from flame.data.documents import Doc
from flame.data.layout import Layout
from flame.data.packing import pack_batch, pack_conversations
from flame.data.permute import Permutation, key_of, uniforms
from flame.data.tokenizer import Boundary
from flame.errors import ConfigError

FETCH_DOCS = 32  # documents read and tokenized together (batched tokenization), fewer when they are long
FETCH_BYTES = 1 << 20  # raw bytes read ahead at most beyond the first document of a fetch


class MapShare:
    """Consumer v's share of a map-style source: stream positions v, v+V, ... through the layout."""

    def __init__(self, source: Any, layout: Layout, v: int, V: int, seed: int, index: int, shuffle: bool,
                 taken: int):
        self.source, self.layout, self.v, self.V = source, layout, v, V
        self.seed, self.index, self.shuffle = seed, index, shuffle
        self.taken = taken  # share entries handed out so far
        self._queue: list[tuple[Any, bool, int, tuple[int, int]]] = []
        self._perms: dict[int, Permutation] = {}

    def _doc_indices(self, ordinals: np.ndarray) -> np.ndarray:
        n = self.source.num_docs
        epochs, within = ordinals // n, ordinals % n
        if not self.shuffle:
            return within
        out = np.empty_like(within)
        for e in np.unique(epochs):
            e = int(e)
            if e not in self._perms:
                # A new order every epoch, seeded by the seed, the source and the epoch.
                self._perms = {e: Permutation(n, key_of(self.seed, self.index, e))}
            sel = epochs == e
            out[sel] = self._perms[e](within[sel])
        return out

    def next(self) -> tuple[Any, bool, int, tuple[int, int]]:
        """(document body or None when skipped, whether the row was bad, tokens already emitted,
        (document index, epoch))."""
        if not self._queue:
            ordinals, offsets = self.layout.share(self.v, self.V, self.taken, FETCH_DOCS)
            indices = self._doc_indices(ordinals)
            # Long documents (or a small source whose fetch would repeat them epoch after epoch) are
            # read a few at a time: memory follows FETCH_BYTES, not FETCH_DOCS x document length.
            k = self.source.fetch_count(indices)
            ordinals, offsets, indices = ordinals[:k], offsets[:k], indices[:k]
            docs = self.source.fetch(indices)
            epochs = (ordinals // self.source.num_docs).tolist()
            self._queue = [(body, bad, off, ident) for (body, bad), off, ident
                           in zip(docs, offsets.tolist(), zip(indices.tolist(), epochs))][::-1]
        self.taken += 1
        return self._queue.pop()

    def untake(self) -> None:
        """Step back over the last document (used to re-read a partial document on resume)."""
        self.taken -= 1
        self._queue.clear()


class StreamShare:
    """Consumer v's share of a streaming source: items whose index (from ``base``) is v mod V.

    Items are read in stored order and shuffled within consecutive blocks of ``block`` items
    (keyed by seed, source, epoch and block number), so any position is reproduced by re-reading
    its block: the state is (epoch, position), never the buffer's content.
    """

    def __init__(self, source: Any, v: int, V: int, seed: int, index: int, shuffle: bool, block: int,
                 epoch: int, pos: int, base: int):
        self.source, self.v, self.V = source, v, V
        self.seed, self.index, self.shuffle, self.block = seed, index, shuffle, block
        self.epoch, self.pos, self.base = epoch, pos, base  # pos: next item index to consider
        self.last = pos  # index of the item handed out last
        self._it: Iterator[tuple[int, int, int, int, Any]] | None = None
        self._queue: list[tuple[int, int, int, int, Any, bool]] = []

    def _epoch_items(self, epoch: int) -> Iterator[tuple[int, int, Any]]:
        """(position in the shuffled epoch, position in stored order, item)."""
        buf: list[Any] = []
        nblock = 0
        index = 0

        def flush():
            nonlocal index, nblock
            order = (Permutation(len(buf), key_of(self.seed, self.index, epoch, nblock))(np.arange(len(buf)))
                     if self.shuffle and len(buf) > 1 else range(len(buf)))
            first = nblock * self.block
            for i in order:
                yield index, first + int(i), buf[int(i)]
                index += 1
            nblock += 1

        for item in self.source.raw():
            buf.append(item)
            if len(buf) == self.block:
                yield from flush()
                buf = []
        if buf:
            yield from flush()

    def _mine(self, epoch: int, pos: int, base: int) -> Iterator[tuple[int, int, int, int, Any]]:
        while True:
            seen = False
            for idx, stored, item in self._epoch_items(epoch):
                seen = True
                if idx >= pos and (idx - base) % self.V == self.v:
                    yield epoch, base, idx, stored, item
            if not seen:
                raise ConfigError(f"training.dataset: {self.source.name!r} is empty (0 documents)")
            epoch, pos, base = epoch + 1, 0, 0

    def next(self) -> tuple[Any, bool, int, tuple[int, int]]:
        if not self._queue:
            if self._it is None:
                self._it = self._mine(self.epoch, self.pos, self.base)
            got, size = [], 0
            while len(got) < FETCH_DOCS and size <= FETCH_BYTES:
                got.append(next(self._it))
                size += self.source.size(got[-1][4])
            docs = self.source.convert([g[4] for g in got], [g[3] for g in got])
            self._queue = [(*g[:4], *d) for g, d in zip(got, docs)][::-1]
        # The position follows the documents handed out, not the read-ahead.
        self.epoch, self.base, self.last, stored, body, bad = self._queue.pop()
        self.pos = self.last + 1
        return body, bad, 0, (stored, self.epoch)

    def rewind(self, index: int) -> None:
        """Make the next document the one at ``index`` of the current epoch (partial-doc resume)."""
        self.pos = index
        self._it = None
        self._queue.clear()


class Consumer:
    def __init__(self, sources: Sequence[Any], layouts: Sequence[Layout | None], streams: Sequence[dict | None],
                 opts: Any, boundary: Boundary, v: int, V: int, gen: int, state: dict | None):
        self.opts, self.boundary, self.v, self.V, self.gen = opts, boundary, v, V, gen
        self.sources = sources
        st = state or {}
        n = len(sources)
        self.draws = int(st.get("draws", 0))
        self.tokens = [int(x) for x in st.get("tokens", [0] * n)]
        self.bad = [int(x) for x in st.get("bad", [0] * n)]  # bad rows met (skipped or replaced)
        self.batches = int(st.get("batches", 0))
        taken = st.get("taken", [0] * n)
        spos = st.get("stream", [None] * n)
        self.shares: list[Any] = []
        for i, src in enumerate(sources):
            if src.streaming:
                s0 = spos[i] or {"epoch": streams[i]["epoch"], "pos": streams[i]["base"], "base": streams[i]["base"]}
                self.shares.append(StreamShare(src, v, V, opts.seed, i, opts.shuffle, opts.shuffle_buffer_size,
                                               int(s0["epoch"]), int(s0["pos"]), int(s0["base"])))
            else:
                self.shares.append(MapShare(src, layouts[i], v, V, opts.seed, i, opts.shuffle, int(taken[i])))
        self.cum = np.cumsum(np.asarray(opts.probs, dtype=np.float64))
        self.cum[-1] = 1.0
        self._u = np.zeros(0)
        self._u_start = 0
        # The current document: its tokens (with boundary tokens), source and tokens already emitted.
        self.doc: Doc | None = None
        self.doc_src = -1
        self.doc_pos = 0
        self.doc_ident = (-1, -1)
        # Debug/test aid: (source, document index, epoch, first, end) of every emitted token range.
        self.trace: list[tuple[int, ...]] | None = [] if opts.extra.get("trace") else None
        cur = st.get("cur")
        if cur is not None:
            s, offset = int(cur[0]), int(cur[1])
            share = self.shares[s]
            if share.__class__ is MapShare:
                share.untake()
            else:
                share.rewind(int(cur[2]))
            body, _bad, start, ident = share.next()  # counted when it was first taken
            self._load_doc(s, body, start, ident, extra_offset=offset)

    # -- mixing ---------------------------------------------------------------------------------
    def _pick_source(self) -> int:
        if len(self.sources) == 1:
            return 0
        if self.opts.mix_by == "tokens":
            # Largest deficit against the target shares (deterministic given the token counts).
            share = np.asarray(self.tokens, dtype=np.float64) / np.asarray(self.opts.probs)
            return int(np.argmin(share))
        if not (self._u_start <= self.draws < self._u_start + len(self._u)):
            self._u_start = self.draws
            self._u = uniforms(key_of(self.opts.seed, 0x6D6978, self.gen, self.v), self.draws, 1024)
        u = self._u[self.draws - self._u_start]
        self.draws += 1
        return int(np.searchsorted(self.cum, u, side="right").clip(0, len(self.cum) - 1))

    def _load_doc(self, s: int, body: Any, start_offset: int, ident: tuple[int, int], extra_offset: int = 0):
        self.doc = Doc(body, self.boundary.bos, self.boundary.eos)
        self.doc_src = s
        self.doc_ident = ident
        # A resumed partial document continues after the tokens that were emitted already.
        self.doc_pos = max(int(start_offset), int(extra_offset))

    def _next_doc(self) -> None:
        skipping: dict[int, int] = {}  # source -> epoch of its first skipped row in this call
        while True:
            s = self._pick_source()
            body, bad, offset, ident = self.shares[s].next()
            self.bad[s] += int(bad)
            if body is None:
                # A skipped row (bad, or held out for validation): the draw and the share position are
                # spent, like any document's. Two epochs of nothing but skips would never end.
                if ident[1] >= skipping.setdefault(s, ident[1]) + 2:
                    raise ConfigError(f"training.dataset: every document of {self.sources[s].name!r} is skipped "
                                      "(not valid UTF-8, or held out for validation)")
                continue
            self._load_doc(s, body, offset, ident)
            if self.doc.at(self.doc_pos):
                return
            # An empty document without boundary tokens (or fully emitted before a resize) adds nothing.

    # -- streaming tokens into rows ---------------------------------------------------------------
    def _fill(self, out: np.ndarray, starts: list[int], src_ids: np.ndarray | None) -> None:
        """Fill out (T + 1) from the stream: consume T tokens and peek the last one."""
        need = len(out)
        i = 0
        while i < need:
            if self.doc is None or not self.doc.at(self.doc_pos):
                self._next_doc()
            if self.doc_pos == 0:
                starts.append(i)
            piece, first = self.doc.piece, self.doc.start
            n = min(need - i, first + len(piece) - self.doc_pos)
            out[i:i + n] = piece[self.doc_pos - first:self.doc_pos - first + n]
            if src_ids is not None:
                src_ids[i:i + n] = self.doc_src
            consumed = min(n, need - 1 - i)  # the last window token is peeked, not consumed
            if consumed > 0:
                self.tokens[self.doc_src] += consumed
                if self.trace is not None:
                    self.trace.append((self.doc_src, *self.doc_ident, self.doc_pos, self.doc_pos + consumed))
            self.doc_pos += consumed
            i += n
            if consumed < n:
                break

    def state(self) -> dict:
        taken, stream = [], []
        for sh in self.shares:
            if isinstance(sh, MapShare):
                taken.append(sh.taken)
                stream.append(None)
            else:
                taken.append(0)
                stream.append({"epoch": sh.epoch, "pos": sh.pos, "base": sh.base})
        cur = None
        # The current document was taken but not fully emitted (possibly only peeked at).
        if self.doc is not None and self.doc.at(self.doc_pos):
            sh = self.shares[self.doc_src]
            cur = [self.doc_src, self.doc_pos, sh.last if isinstance(sh, StreamShare) else -1]
        return {"v": self.v, "taken": taken, "stream": stream, "cur": cur, "draws": self.draws,
                "tokens": list(self.tokens), "bad": list(self.bad), "batches": self.batches}

    def batches_iter(self, with_sources: bool = False) -> Iterator[dict]:
        B, T = self.opts.batch_size, self.opts.seq_len
        while True:
            windows = np.empty((B, T + 1), dtype=np.int64)
            src = np.empty((B, T + 1), dtype=np.int64) if with_sources else None
            starts: list[list[int]] = []
            for b in range(B):
                row_starts: list[int] = []
                self._fill(windows[b], row_starts, src[b] if src is not None else None)
                starts.append(row_starts)
            if self.trace is not None:
                batch_trace, self.trace = self.trace, []
            batch = pack_batch(windows, starts, varlen=self.opts.varlen, context_len=self.opts.context_len,
                               mask_cross_document_labels=self.opts.mask_cross_document_labels)
            if src is not None:
                import torch

                # Source of each target token (for per-source validation loss).
                batch["_source_ids"] = torch.from_numpy(src[:, 1:].copy())
            if self.trace is not None:
                batch["_trace"] = batch_trace
            self.batches += 1
            # State advanced before the batch leaves: resuming from it never replays this batch.
            batch["_state"] = self.state()
            yield batch


class ConversationConsumer(Consumer):
    """A consumer of conversations (``training.sft``): rows of whole conversations instead of windows of
    a token stream. With varlen, conversations are placed back to back while they fit (the one that does
    not fit opens the next row); without it, a row holds one conversation. The rest of a row is padding.
    A conversation is never split, so the state's current document is one waiting for the next row
    (offset 0), and resuming re-reads it like a partial document."""

    def __init__(self, *args, pad_id: int, **kwargs):
        self.pad_id = pad_id
        super().__init__(*args, **kwargs)

    def _load_doc(self, s: int, body: Any, start_offset: int, ident: tuple[int, int], extra_offset: int = 0):
        self.doc = body  # a flame.data.chat.Conversation (truncated by its source)
        self.doc_src = s
        self.doc_ident = ident
        self.doc_pos = max(int(start_offset), int(extra_offset))

    def _fill_row(self, T: int) -> list[tuple[Any, int]]:
        """(conversation, source) pairs of the next row."""
        convs, used = [], 0
        while used < T:
            if self.doc is None or not self.doc.at(self.doc_pos):
                self._next_doc()
            n = len(self.doc)
            if convs and (not self.opts.varlen or used + n > T):
                break  # waits for the next row
            convs.append((self.doc, self.doc_src))
            self.tokens[self.doc_src] += n
            if self.trace is not None:
                self.trace.append((self.doc_src, *self.doc_ident, 0, n))
            self.doc_pos = n
            used += n
        return convs

    def batches_iter(self, with_sources: bool = False) -> Iterator[dict]:
        import torch

        B, T = self.opts.batch_size, self.opts.seq_len
        while True:
            rows = [self._fill_row(T) for _ in range(B)]
            batch = pack_conversations([[c for c, _ in row] for row in rows], T, self.pad_id,
                                       varlen=self.opts.varlen, context_len=self.opts.context_len)
            if with_sources:
                # Source of each target (padding: 0; its labels are ignored).
                src = np.zeros((B, T), dtype=np.int64)
                for b, row in enumerate(rows):
                    at = 0
                    for conv, s in row:
                        src[b, at:at + len(conv)] = s
                        at += len(conv)
                batch["_source_ids"] = torch.from_numpy(src)
            if self.trace is not None:
                batch["_trace"], self.trace = self.trace, []
            self.batches += 1
            batch["_state"] = self.state()
            yield batch
