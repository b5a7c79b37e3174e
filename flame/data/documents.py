"""Documents as the packer consumes them: token ids made piece by piece, and rows that are not text.

Memory: a text longer than ``PIECE_CHARS`` characters is tokenized one piece at a time while its
tokens are emitted, so the loader holds the raw text and one piece of tokens, never the
tokenizer's working memory for the whole document. Pieces are cut at a space that stands between
two non-space characters: byte-level BPE tokenizers (GPT-2, Llama 3, Qwen, flame's bundled one)
split their input there before merging, so the ids equal those of the whole text. A stretch with
no such space is cut after its last newline, or else at exactly ``PIECE_CHARS`` characters; there
(and for tokenizers that pre-tokenize otherwise, e.g. SentencePiece with a dummy prefix) the ids
next to a cut can differ from whole-text tokenization. Cuts depend only on the text, so a resumed
run cuts, and therefore counts tokens, exactly as the first run did.

Bad rows: a text row that is not valid UTF-8 is skipped (default), decoded with U+FFFD
replacement characters, or stops the run with one line naming the file and row
(``training.bad_document_policy``). The decision depends only on the row's bytes, so skipping is
deterministic and a resumed run skips the same rows.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
from torchtitan.tools.logging import logger

from flame.errors import ConfigError

PIECE_CHARS = 1 << 16  # characters tokenized at once within a long document


def piece_bounds(text: str, size: int | None = None) -> Iterator[tuple[int, int]]:
    """(start, end) of the pieces of ``text``: at most ``size`` (PIECE_CHARS) characters each."""
    size = size or PIECE_CHARS
    start, n = 0, len(text)
    while n - start > size:
        lo, hi = start + size // 2, start + size
        cut = -1
        p = text.rfind(" ", lo, hi)
        while p > lo:
            if not text[p - 1].isspace() and not text[p + 1].isspace():
                cut = p  # the space starts the next piece, as it starts the next pre-token
                break
            p = text.rfind(" ", lo, p)
        if cut < 0:
            p = text.rfind("\n", lo, hi)
            cut = p + 1 if p >= 0 else hi
        yield start, cut
        start = cut
    yield start, n


class LongText:
    """A text tokenized lazily, piece by piece (iterating yields one id array per piece)."""

    def __init__(self, text: str, tokenize: Callable[[list[str]], list[np.ndarray]]):
        self.text = text
        self.tokenize = tokenize

    def __iter__(self) -> Iterator[np.ndarray]:
        for a, b in piece_bounds(self.text):
            yield self.tokenize([self.text[a:b]])[0]


def tokenize_texts(texts: Sequence[str], tokenize: Callable[[list[str]], list[np.ndarray]]) -> list[Any]:
    """Short texts tokenized together (one call), long ones wrapped in :class:`LongText`."""
    out: list[Any] = [None] * len(texts)
    short = [i for i, t in enumerate(texts) if len(t) <= PIECE_CHARS]
    for i, ids in zip(short, tokenize([texts[i] for i in short]) if short else []):
        out[i] = ids
    for i, t in enumerate(texts):
        if out[i] is None:
            out[i] = LongText(t, tokenize)
    return out


class Doc:
    """One document's tokens with its boundary tokens; only the piece being emitted is held."""

    def __init__(self, body: np.ndarray | Iterable[np.ndarray], bos: int | None, eos: int | None):
        head = np.asarray([bos] if bos is not None else [], dtype=np.int64)
        tail = np.asarray([eos] if eos is not None else [], dtype=np.int64)
        if isinstance(body, np.ndarray):
            self._pieces: Iterator[np.ndarray] = iter([np.concatenate([head, np.asarray(body, dtype=np.int64), tail])])
        else:
            self._pieces = (np.asarray(p, dtype=np.int64) for p in _chain(head, body, tail))
        self.start = 0  # token offset of the current piece in the document
        self.piece = np.zeros(0, dtype=np.int64)

    def at(self, pos: int) -> bool:
        """Make the piece holding token ``pos`` current (pos never goes back); False past the end."""
        while pos >= self.start + len(self.piece):
            nxt = next(self._pieces, None)
            if nxt is None:
                return False
            self.start += len(self.piece)
            self.piece = nxt
        return True


def _chain(head: np.ndarray, body: Iterable[np.ndarray], tail: np.ndarray) -> Iterator[np.ndarray]:
    if len(head):
        yield head
    for p in body:
        if len(p):
            yield p
    if len(tail):
        yield tail


# -- rows that are not valid text ------------------------------------------------------------------

def _open_any(path: str):
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(os.path.splitext(path)[1], open)
    return opener(path, "rb")


def _rows_of_file(path: str, builder: str) -> int | None:
    """Rows ``datasets`` makes of one file, where that is cheap to know (else None)."""
    if builder == "text":
        return 1  # flame reads .txt files one document per file
    if builder == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if builder == "json" and not path.endswith(".zst"):
        with _open_any(path) as f:
            return sum(1 for line in f if line.strip())
    return None


class RowLocator:
    """Names the file and row (counted from 1) of a source's row, for messages."""

    def __init__(self, name: str, builder: str | None, files: Sequence[str], num_rows: int | None):
        self.name, self.builder, self.files, self.num_rows = name, builder, list(files), num_rows
        self._starts: np.ndarray | None = None

    def __call__(self, row: int) -> str:
        if len(self.files) == 1:
            return f"{self.files[0]}, row {row + 1}"
        if self.files and self._starts is None:
            try:
                counts = [_rows_of_file(f, self.builder or "") for f in self.files]
            except OSError:
                counts = [None]
            ok = None not in counts and (self.num_rows is None or sum(counts) == self.num_rows)
            self._starts = np.cumsum([0, *counts]) if ok else np.zeros(0, dtype=np.int64)
        if self._starts is not None and len(self._starts) and row < self._starts[-1]:
            i = int(np.searchsorted(self._starts, row, side="right") - 1)
            return f"{self.files[i]}, row {row - int(self._starts[i]) + 1}"
        return f"{self.name}, row {row + 1}"


class BadRows:
    """Decodes one source's raw text rows under ``training.bad_document_policy``."""

    def __init__(self, locate: RowLocator, policy: str, found_at_open: int = 0):
        self.locate, self.policy = locate, policy
        # bad rows met before reading (.txt files are checked when opened): counted once, not saved
        self.found_at_open = found_at_open
        self._logged = False  # one log line per source and process; the consumers count them all

    def decode(self, raw: bytes | None, row: int) -> tuple[str | None, bool]:
        """(text or None when the row is skipped, whether the row was bad)."""
        if raw is None:
            return "", False
        try:
            return raw.decode("utf-8"), False
        except UnicodeDecodeError as e:
            where = f"{self.locate(row)}: byte {e.start} is not valid UTF-8"
            if self.policy == "error":
                raise ConfigError(f"training.bad_document_policy: 'error' stops at {where} "
                                  "(use 'skip' or 'replace' to train past such rows)") from None
            what = "skipped" if self.policy == "skip" else "decoded with U+FFFD replacement characters"
            self._log_first(where, what)
            if self.policy == "skip":
                return None, True
            return raw.decode("utf-8", errors="replace"), True

    def reject(self, row: int, reason: str) -> None:
        """A row that cannot be used at all (e.g. a conversation without an assistant turn): it is
        skipped under 'skip' and 'replace' (there is nothing to replace), and stops the run under 'error'."""
        where = f"{self.locate(row)}: {reason}"
        if self.policy == "error":
            raise ConfigError(f"training.bad_document_policy: 'error' stops at {where} "
                              "(use 'skip' to train past such rows)")
        self._log_first(where, "skipped")

    def _log_first(self, where: str, what: str) -> None:
        if not self._logged:
            self._logged = True
            logger.warning(f"dataloader: {where}; row {what} (training.bad_document_policy={self.policy!r}); "
                           f"further bad rows of {self.locate.name!r} are counted, not logged")
