"""Pre-tokenized corpus format: memory-mapped token shards with document boundaries.

A folder holds ``flame_tokens.json`` (metadata) and, per shard, ``shard-NNNNN.bin`` (the token ids
of its documents back to back, uint16 when the vocabulary fits, else uint32; no BOS/EOS: the loader
adds them per its boundary policy) and ``shard-NNNNN.idx.npy`` (int64 offsets, one more than the
number of documents). Reading a document is one slice of a memory map: nothing is loaded up front.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import numpy as np

META = "flame_tokens.json"
FORMAT = "flame-tokens"
VERSION = 1


def is_token_folder(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, META))


class ShardWriter:
    """Append documents (token id sequences); a new shard starts every ``shard_tokens`` tokens."""

    def __init__(self, folder: str | os.PathLike, vocab_size: int, shard_tokens: int = 1 << 28):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(np.uint16 if vocab_size <= (1 << 16) else np.uint32)
        self.shard_tokens = shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._file = None
        self._offsets: list[int] = []

    def _open(self) -> None:
        n = len(self.shards)
        name = f"shard-{n:05d}"
        self._name = name
        self._file = open(self.folder / f"{name}.bin", "wb")
        self._offsets = [0]

    def _close_shard(self) -> None:
        if self._file is None:
            return
        self._file.close()
        np.save(self.folder / f"{self._name}.idx.npy", np.asarray(self._offsets, dtype=np.int64))
        self.shards.append({"tokens": f"{self._name}.bin", "offsets": f"{self._name}.idx.npy",
                            "num_docs": len(self._offsets) - 1, "num_tokens": self._offsets[-1]})
        self._file = None

    def add(self, docs: Iterable[Iterable[int]]) -> None:
        for doc in docs:
            if self._file is None:
                self._open()
            arr = np.asarray(doc, dtype=self.dtype)
            self._file.write(arr.tobytes())
            self._offsets.append(self._offsets[-1] + len(arr))
            if self._offsets[-1] >= self.shard_tokens:
                self._close_shard()

    def close(self, **info: Any) -> dict[str, Any]:
        self._close_shard()
        meta = {"format": FORMAT, "version": VERSION, "dtype": self.dtype.name,
                "num_docs": sum(s["num_docs"] for s in self.shards),
                "num_tokens": sum(s["num_tokens"] for s in self.shards),
                "shards": self.shards, **info}
        # Written last: a folder without it is an interrupted run, never read as a corpus.
        with open(self.folder / META, "w") as f:
            json.dump(meta, f, indent=2)
        return meta


class ShardReader:
    """Random access to the documents of a token folder (memory-mapped, opened lazily per process)."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        with open(self.folder / META) as f:
            self.meta = json.load(f)
        if self.meta.get("format") != FORMAT:
            raise ValueError(f"{folder}: not a {FORMAT} folder")
        self.dtype = np.dtype(self.meta["dtype"])
        counts = [s["num_docs"] for s in self.meta["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.num_docs = int(self.starts[-1])
        self._maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getstate__(self) -> dict:
        # Memory maps are reopened in each DataLoader worker rather than pickled.
        d = dict(self.__dict__)
        d["_maps"] = {}
        return d

    def _shard(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        if i not in self._maps:
            s = self.meta["shards"][i]
            offsets = np.load(self.folder / s["offsets"], mmap_mode="r")
            size = os.path.getsize(self.folder / s["tokens"])
            tokens = (np.memmap(self.folder / s["tokens"], dtype=self.dtype, mode="r")
                      if size else np.zeros(0, dtype=self.dtype))
            self._maps[i] = (tokens, offsets)
        return self._maps[i]

    def _span(self, index: int) -> tuple[np.ndarray, int, int]:
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        tokens, offsets = self._shard(shard)
        local = index - int(self.starts[shard])
        return tokens, int(offsets[local]), int(offsets[local + 1])

    def doc(self, index: int) -> np.ndarray:
        tokens, a, b = self._span(index)
        return np.asarray(tokens[a:b], dtype=np.int64)

    def doc_length(self, index: int) -> int:
        _tokens, a, b = self._span(index)
        return b - a

    def lengths(self) -> np.ndarray:
        return np.concatenate([np.diff(np.asarray(self._shard(i)[1])) for i in range(len(self.meta["shards"]))])
