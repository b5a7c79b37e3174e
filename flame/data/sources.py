"""Opening the entries of ``training.dataset`` as sources of documents (token id arrays).

A map-style source gives random access (``num_docs``, ``fetch(indices)``); a streaming source
gives an ordered iterator per epoch. Text is tokenized here, in whichever process calls ``fetch``
(the DataLoader workers), batched; ``input_ids`` columns and token folders are read as they are.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from typing import Any, Iterator, Sequence

import numpy as np

from flame.data.documents import BadRows, RowLocator, tokenize_texts
from flame.data.holdout import held_out, held_out_rows
from flame.data.options import SourceSpec, missing_local_source
from flame.data.shards import ShardReader, is_token_folder
from flame.errors import ConfigError, first_line

_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".txt": "text", ".arrow": "arrow",
             ".csv": "csv"}
_BUILDER_NAMES = set(_BUILDERS.values())
TEXT_COLUMNS = ("text", "content")
VALIDATION_SPLITS = ("validation", "valid", "val", "test")


def _builder_for(files: Sequence[str], what: str) -> str:
    exts = set()
    for f in files:
        name = f[:-3] if f.endswith((".gz", ".zst", ".bz2", ".xz")) else f
        exts.add(os.path.splitext(name)[1].lower())
    builders = {_BUILDERS.get(e) for e in exts}
    if len(builders) != 1 or None in builders:
        raise ConfigError(f"{what}: cannot tell the format of {list(files)[:3]} (use parquet, json/jsonl, txt or arrow)")
    return builders.pop()


def _expand(pattern: str, what: str) -> list[str]:
    files = sorted(glob.glob(pattern, recursive=True)) if any(c in pattern for c in "*?[") else [pattern]
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        raise ConfigError(f"{what}: {pattern!r} matches no file")
    return files


def _load_error(spec: SourceSpec, e: Exception) -> ConfigError:
    msg = first_line(e)
    if e.__cause__ is not None:
        # datasets' DatasetGenerationError says only "An error occurred while generating the
        # dataset"; its cause says what (a JSONL line that is not JSON: "JSON parse error ... in row 1")
        msg = f"{msg}: {first_line(e.__cause__)}"
    if not os.path.exists(spec.path) and spec.path not in _BUILDER_NAMES:
        return ConfigError(
            f"training.dataset: {spec.path!r} is not a local path and could not be read from the local "
            f"Hugging Face cache{f' (training.dataset_name {spec.name!r})' if spec.name else ''}; offline machines "
            f"need it cached first, e.g. with datasets.load_dataset on a connected machine: {msg}"
        )
    return ConfigError(f"training.dataset: {spec.path!r} could not be loaded: {msg}")


def source_files(spec: SourceSpec) -> tuple[str | None, list[str]]:
    """(builder, files) when the entry names local files (``data_files`` or a file/glob), else (None, [])."""
    path = spec.path
    if spec.data_files:
        files = [f for p in spec.data_files.split(";") for f in _expand(p.strip(), "training.data_files")]
        return (path if path in _BUILDER_NAMES else _builder_for(files, "training.data_files")), files
    if os.path.isfile(path) or any(c in path for c in "*?["):
        files = _expand(path, "training.dataset")
        return _builder_for(files, "training.dataset"), files
    return None, []


def _check_text_files(name: str, files: list[str], policy: str) -> tuple[list[str], int]:
    """(the .txt files to read, how many are bad): datasets decodes them while loading (no row to
    skip later), so bad ones are found here, one file (one document) at a time."""
    keep, bad_files = [], 0
    for f in files:
        with open(f, "rb") as fh:
            raw = fh.read()
        text, bad = BadRows(RowLocator(name, "text", [f], None), policy).decode(raw, 0)
        bad_files += bad
        if text is not None:
            keep.append(f)
    if not keep:
        raise ConfigError(f"training.dataset: every file of {files[:3]} is skipped as not valid UTF-8")
    return keep, bad_files


def open_hf(spec: SourceSpec, split: str, streaming: bool, role: str, bad_document_policy: str = "skip",
            files: tuple[str | None, list[str]] | None = None) -> Any:
    """Open one entry with ``datasets`` (map-style Dataset or IterableDataset); ``files``: the
    entry's (builder, files) when the caller resolved them already."""
    import datasets

    kwargs: dict[str, Any] = {}
    path = spec.path
    if files is None:
        builder, files = source_files(spec)
        if builder == "text":
            files, _bad = _check_text_files(spec.path, files, bad_document_policy)
    else:
        builder, files = files
    if builder is not None:
        path, kwargs["data_files"], split = builder, files, "train"
    elif missing_local_source(path):
        raise ConfigError(f"training.dataset: {path!r} does not exist")
    if path == "text":
        kwargs["sample_by"] = "document"  # one document per .txt file
        if "data_files" in kwargs and bad_document_policy == "replace":
            kwargs["encoding_errors"] = "replace"
    if os.path.isdir(path) and (os.path.isfile(os.path.join(path, "dataset_dict.json"))
                                or os.path.isfile(os.path.join(path, "state.json"))):
        with _load_errors(spec):
            ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[_pick_split(list(ds.keys()), split, role, spec)]
        return ds.to_iterable_dataset() if streaming else ds
    if builder is not None and not streaming:
        _announce_long_load(spec, files)
    hub = not os.path.exists(path) and path not in _BUILDER_NAMES
    # Hub ids are read from the local cache (no download, no network retries) unless streaming.
    with _load_errors(spec), _hub_offline() if hub and not streaming else contextlib.nullcontext():
        return _load(datasets, path, spec, split, streaming, role, kwargs)


# local files from this size on are announced before datasets converts them (its progress bars are
# off while a source loads, see _quiet_load)
ANNOUNCE_BYTES = 1 << 30


def _announce_long_load(spec: SourceSpec, files: list[str]) -> None:
    total = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    if total >= ANNOUNCE_BYTES:
        from torchtitan.tools.logging import logger

        logger.info(f"dataloader: {spec.path}: converting {total / (1 << 30):.1f} GiB of files into datasets' cache "
                    "(once: a later run with the same files reads the cache; --training.streaming reads them as they are)")


@contextlib.contextmanager
def _load_errors(spec: SourceSpec):
    """datasets' errors while reading ``spec`` (loading it, or a stream's first row) as one ConfigError."""
    try:
        with _quiet_load():
            yield
    except ConfigError:
        raise
    except StopIteration:
        raise ConfigError(f"training.dataset: {spec.path!r} is empty (0 documents)") from None
    except (FileNotFoundError, ConnectionError, OSError, ValueError) as e:
        raise _load_error(spec, e) from None
    except Exception as e:  # datasets raises many types (DatasetNotFoundError, HfHubHTTPError, ...)
        if type(e).__module__.startswith(("datasets", "huggingface_hub", "requests", "httpx")):
            raise _load_error(spec, e) from None
        raise


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def _quiet_load():
    """datasets' progress bars off and its log records held back while a source loads (shown once it
    has loaded): a source that fails to load (a JSONL line that is not JSON), or loads but lacks the
    columns flame reads, is then flame's one error line alone, not after datasets' ERROR lines
    (which say what that line says) and "Generating train split" bars."""
    import datasets.utils.logging as dlog

    lib = dlog.get_logger()  # "datasets": its modules' loggers propagate to it
    held = _Held()
    saved = lib.handlers, lib.propagate, dlog.is_progress_bar_enabled()
    lib.handlers, lib.propagate = [held], False
    dlog.disable_progress_bar()
    try:
        yield
    finally:
        lib.handlers, lib.propagate = saved[0], saved[1]
        if saved[2]:
            dlog.enable_progress_bar()
    for record in held.records:  # loaded: its warnings are worth seeing
        lib.handle(record)


@contextlib.contextmanager
def _hub_offline():
    import datasets.config
    import huggingface_hub.constants as hc

    saved = (datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE)
    datasets.config.HF_HUB_OFFLINE = hc.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hc.HF_HUB_OFFLINE = saved


def _load(datasets: Any, path: str, spec: SourceSpec, split: str, streaming: bool, role: str, kwargs: dict) -> Any:
    if role == "validation" and "data_files" not in kwargs:
        names = datasets.get_dataset_split_names(path, spec.name, data_dir=spec.data_dir)
        split = _pick_split(list(names) or [split], split, role, spec)
    return datasets.load_dataset(path, spec.name, data_dir=spec.data_dir, split=split,
                                 streaming=streaming, **kwargs)


def _pick_split(available: list[str], wanted: str, role: str, spec: SourceSpec) -> str:
    if wanted in available:
        return wanted
    if role == "validation" and not spec.split:
        for alt in VALIDATION_SPLITS:
            if alt in available:
                return alt
    raise ConfigError(f"training.dataset_split: {wanted!r} is not a split of {spec.path!r} (it has {available})")


def has_validation_split(spec: SourceSpec) -> bool:
    """Whether the entry offers a validation split (local files and token folders never do)."""
    import json

    builder, _files = source_files(spec)
    if builder is not None or (os.path.isdir(spec.path) and is_token_folder(spec.path)):
        return False
    dd = os.path.join(spec.path, "dataset_dict.json")
    if os.path.isdir(spec.path) and (os.path.isfile(dd) or os.path.isfile(os.path.join(spec.path, "state.json"))):
        splits = json.load(open(dd)).get("splits", []) if os.path.isfile(dd) else []
        return any(s in splits for s in VALIDATION_SPLITS)
    import datasets

    hub = not os.path.exists(spec.path)
    try:
        with _hub_offline() if hub else contextlib.nullcontext():
            names = datasets.get_dataset_split_names(spec.path, spec.name, data_dir=spec.data_dir)
    except Exception:  # not readable here: open_hf reports it with the source's name
        return False
    return any(s in names for s in VALIDATION_SPLITS)


def pick_column(columns: Sequence[str], text_column: str | None, where: str) -> tuple[str, bool]:
    """(column, is_token_ids)."""
    if text_column:
        if text_column not in columns:
            raise ConfigError(f"training.text_column: {text_column!r} is not a column of {where} (columns: {list(columns)})")
        return text_column, text_column == "input_ids"
    if "input_ids" in columns:
        return "input_ids", True
    for c in TEXT_COLUMNS:
        if c in columns:
            return c, False
    raise ConfigError(
        f"training.text_column: {where} has no 'text', 'content' or 'input_ids' column (columns: {list(columns)}); "
        "set training.text_column"
    )


class Tokenize:
    """Batched text -> token ids (no special tokens: boundaries are added by the packer)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tokenizer(list(texts), add_special_tokens=False, return_attention_mask=False)["input_ids"]
        return [np.asarray(x, dtype=np.int64) for x in ids]


FETCH_BYTES = 1 << 20  # raw bytes (text) or 4 x tokens read ahead at most, beyond the first document


def _is_text(t: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _tokenize_decoded(decoded: list[tuple[str | None, bool]], tokenize: Tokenize) -> list[tuple[Any, bool]]:
    """Per row (its text, or None for a skipped row; whether it was bad) -> (token ids or a
    :class:`LongText`, or None; whether it was bad): the kept texts are tokenized in one call."""
    keep = [k for k, (text, _) in enumerate(decoded) if text is not None]
    docs: list[Any] = [None] * len(decoded)
    for k, d in zip(keep, tokenize_texts([decoded[k][0] for k in keep], tokenize)):
        docs[k] = d
    return [(d, bad) for d, (_, bad) in zip(docs, decoded)]


class _ArrowColumn:
    """Rows of one column of a (memory-mapped) Arrow table: sizes from the offsets, raw bytes per row,
    without converting whole batches to Python (which fails on invalid UTF-8 and copies every row)."""

    def __init__(self, column: Any):
        import pyarrow as pa

        self.chunks = [c for c in column.chunks if len(c)]
        self.starts = np.cumsum([0] + [len(c) for c in self.chunks])
        t = column.type
        self.sized = (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                      or pa.types.is_large_binary(t) or pa.types.is_list(t) or pa.types.is_large_list(t))
        self.wide = pa.types.is_large_string(t) or pa.types.is_large_binary(t) or pa.types.is_large_list(t)
        self._offsets: dict[int, np.ndarray] = {}

    def _locate(self, i: int) -> tuple[int, int]:
        c = int(np.searchsorted(self.starts, i, side="right") - 1)
        return c, i - int(self.starts[c])

    def size(self, i: int) -> int:
        """Bytes (text) or items (lists) of row i; 0 when unknown."""
        if not self.sized:
            return 0
        c, j = self._locate(i)
        if c not in self._offsets:
            chunk = self.chunks[c]
            dtype = np.int64 if self.wide else np.int32
            offsets = np.frombuffer(chunk.buffers()[1], dtype=dtype)
            self._offsets[c] = offsets[chunk.offset:chunk.offset + len(chunk) + 1]
        off = self._offsets[c]
        return int(off[j + 1] - off[j])

    def raw(self, i: int) -> bytes | None:
        c, j = self._locate(i)
        buf = self.chunks[c][j].as_buffer()
        return None if buf is None else buf.to_pybytes()


class MapSource:
    """A map-style ``datasets.Dataset`` (text or ``input_ids``) or a token folder."""

    streaming = False

    def __init__(self, name: str, dataset: Any = None, column: str | None = None, token_ids: bool = False,
                 reader: ShardReader | None = None, tokenize: Tokenize | None = None,
                 bad_rows: BadRows | None = None, rows: np.ndarray | None = None, exclude: float = 0.0,
                 columns: Sequence[str] | None = None):
        """``rows``: read only these rows of the dataset/folder (held-out validation documents);
        ``exclude``: skip the rows held out at this fraction (training beside such a validation);
        ``columns``: the columns kept when rows are read whole (``column`` sizes the read-ahead)."""
        self.name = name
        self.reader = reader
        self.column = column
        self.token_ids = token_ids
        self.tokenize = tokenize
        self.bad_rows = bad_rows
        self.dataset = dataset.select_columns(list(columns or [column])) if dataset is not None else None
        self.rows = None
        if rows is not None and self.dataset is not None:
            self.dataset = self.dataset.select(rows)
        elif rows is not None:
            self.rows = np.asarray(rows, dtype=np.int64)
        self.exclude = exclude
        total = reader.num_docs if reader is not None else len(dataset)
        self.excluded = held_out_rows(total, exclude) if exclude else None
        if self.dataset is not None and getattr(self.dataset, "_indices", None) is not None:
            self.dataset = self.dataset.flatten_indices()  # rows read straight from the Arrow table below
        self.num_docs = (len(self.rows) if self.rows is not None else reader.num_docs) if reader is not None \
            else len(self.dataset)
        if self.num_docs == 0:
            raise ConfigError(f"training.dataset: {name!r} is empty (0 documents)")
        if self.excluded is not None and len(self.excluded) >= self.num_docs:
            raise ConfigError(
                f"training.dataset: {name!r} has {self.num_docs} document(s), all held out for validation "
                "(validation.holdout_fraction); give validation.dataset or more documents")
        self._arrow: _ArrowColumn | None = None
        self._text = False
        if self.dataset is not None:
            col = self.dataset.data.table.column(column)
            self._text = not token_ids and _is_text(col.type)
            self._arrow = _ArrowColumn(col)

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_arrow"] = None  # rebuilt in each DataLoader worker (holds Arrow buffers)
        return d

    def _column(self) -> _ArrowColumn:
        if self._arrow is None:
            self._arrow = _ArrowColumn(self.dataset.data.table.column(self.column))
        return self._arrow

    def fetch_count(self, indices: np.ndarray) -> int:
        """How many of ``indices`` to read now: up to FETCH_BYTES beyond the first (at least one)."""
        total = 0
        for k, i in enumerate(np.asarray(indices).tolist()):
            if self.reader is not None:
                size = int(self.reader.doc_length(self._row(i))) * 4
            else:
                size = self._column().size(int(i)) * (1 if self._text else 4)
            total += size
            if k > 0 and total > FETCH_BYTES:
                return k
        return len(indices)

    def _row(self, i: int) -> int:
        return int(self.rows[int(i)]) if self.rows is not None else int(i)

    def fetch(self, indices: np.ndarray) -> list[tuple[Any, bool]]:
        """Per index: (token ids, a :class:`LongText`, or None for a skipped row; whether it was bad)."""
        if self.excluded is not None:
            # Held-out rows are never read (nor counted as bad): validation reads them.
            keep = ~np.isin(np.asarray(indices, dtype=np.int64), self.excluded)
            got = iter(self._read(np.asarray(indices)[keep]) if keep.any() else [])
            return [next(got) if k else (None, False) for k in keep.tolist()]
        return self._read(indices)

    def _read(self, indices: np.ndarray) -> list[tuple[Any, bool]]:
        if self.reader is not None:
            return [(self.reader.doc(self._row(i)), False) for i in indices]
        if self._text:
            decoded = [self.bad_rows.decode(self._column().raw(int(i)), int(i)) for i in np.asarray(indices).tolist()]
            return _tokenize_decoded(decoded, self.tokenize)
        # Read in sorted order (Arrow is faster on ascending indices), then restore the request order.
        order = np.argsort(indices, kind="stable")
        rows = self.dataset[[int(i) for i in np.asarray(indices)[order]]][self.column]
        if self.token_ids:
            docs = [np.asarray(r, dtype=np.int64) for r in rows]
        else:
            docs = tokenize_texts([str(r) if r is not None else "" for r in rows], self.tokenize)
        out: list[Any] = [None] * len(docs)
        for pos, d in zip(order, docs):
            out[pos] = (d, False)
        return out


class StreamSource:
    """A streaming ``datasets.IterableDataset``: read in order, never downloaded as a whole."""

    streaming = True
    num_docs = None

    def __init__(self, name: str, dataset: Any, column: str, token_ids: bool, tokenize: Tokenize | None,
                 bad_rows: BadRows | None = None, exclude: float = 0.0, columns: Sequence[str] | None = None):
        self.name = name
        self.exclude = exclude  # skip the rows held out for validation at this fraction
        self.dataset = dataset.select_columns(list(columns or [column]))
        self.column = column
        self.token_ids = token_ids
        self.tokenize = tokenize
        self.bad_rows = bad_rows

    def raw(self) -> Iterator[Any]:
        """The source's items in their stored order (one epoch); text as raw UTF-8 bytes."""
        import pyarrow as pa

        # ``iter`` (not ``__iter__``): inside a DataLoader worker, ``__iter__`` would hand this worker
        # only some of the files, while flame assigns documents to consumers itself. Arrow batches:
        # converting them to Python would fail on the first invalid UTF-8 byte.
        for batch in self.dataset.with_format("arrow").iter(batch_size=256):
            col = batch.column(self.column)
            if _is_text(col.type):
                col = col.cast(pa.large_binary())
            yield from col.to_pylist()

    def size(self, item: Any) -> int:
        return len(item) * (4 if self.token_ids else 1) if item is not None else 0

    def convert(self, items: list[Any], rows: list[int]) -> list[tuple[Any, bool]]:
        if self.exclude:
            held = held_out(np.asarray(rows, dtype=np.int64), self.exclude).tolist()
            keep = [k for k, h in enumerate(held) if not h]
            got = iter(self._convert([items[k] for k in keep], [rows[k] for k in keep]))
            return [(None, False) if h else next(got) for h in held]
        return self._convert(items, rows)

    def _convert(self, items: list[Any], rows: list[int]) -> list[tuple[Any, bool]]:
        if self.token_ids:
            return [(np.asarray(x if x is not None else [], dtype=np.int64), False) for x in items]
        decoded = [self.bad_rows.decode(x, row) if isinstance(x, (bytes, type(None))) else (str(x), False)
                   for x, row in zip(items, rows)]
        return _tokenize_decoded(decoded, self.tokenize)


def open_source(spec: SourceSpec, tokenizer: Any, text_column: str | None, streaming: bool,
                role: str = "train", bad_document_policy: str = "skip", holdout_fraction: float = 0.0,
                validation_from_training: bool = False, chat: Any = None) -> MapSource | StreamSource:
    """``holdout_fraction`` > 0: without a validation split, training skips (and validation reads)
    the held-out documents (see :mod:`flame.data.holdout`). ``chat``: a
    :class:`flame.data.chat.ChatRenderer`; the rows are conversations (``training.sft``)."""
    holdout = False
    if role == "validation" and validation_from_training:
        if has_validation_split(spec):
            spec = SourceSpec(spec.path, spec.name, None, spec.data_dir, spec.data_files)
        elif holdout_fraction > 0:
            holdout, role = True, "train"
        else:
            raise ConfigError(
                f"validation.holdout_fraction: 0 and training source {spec.path!r} has no validation split; "
                "set validation.dataset or a holdout fraction > 0 (validation never reads training data)")
    exclude = holdout_fraction if role == "train" and not holdout and holdout_fraction > 0 \
        and not has_validation_split(spec) else 0.0
    split = spec.split or ("validation" if role == "validation" else "train")
    tokenize = Tokenize(tokenizer)
    if os.path.isdir(spec.path) and is_token_folder(spec.path):
        if chat is not None:
            raise ConfigError(f"training.sft: {spec.path!r} is a pre-tokenized folder; SFT reads conversation "
                              "rows (chat, alpaca or sharegpt) from JSONL, parquet or Hugging Face datasets")
        if text_column and text_column != "input_ids":
            raise ConfigError(f"training.text_column: {text_column!r} is not a column of {spec.path!r} (a "
                              "pre-tokenized folder holds input_ids only)")
        # Token folders are random access already; streaming adds nothing, so they are read map-style.
        if streaming:
            from torchtitan.tools.logging import logger

            logger.info(f"dataloader: {spec.path} is a pre-tokenized folder: read map-style (random access), "
                        "not streamed")
        reader = ShardReader(spec.path)
        vocab = int(reader.meta.get("tokenizer", {}).get("vocab_size", 0) or 0)
        if vocab > len(tokenizer):
            raise ConfigError(
                f"training.dataset: {spec.path!r} was tokenized with a vocabulary of {vocab} tokens, "
                f"larger than this tokenizer's {len(tokenizer)}"
            )
        if holdout:
            rows = held_out_rows(reader.num_docs, holdout_fraction)
            _log_holdout(spec.path, len(rows), reader.num_docs, holdout_fraction)
            return MapSource(spec.path, reader=reader, rows=rows)
        return MapSource(spec.path, reader=reader, exclude=exclude)
    builder, files = source_files(spec)
    bad_files = 0
    if builder == "text":
        files, bad_files = _check_text_files(spec.path, files, bad_document_policy)
    ds = open_hf(spec, split, streaming, role, bad_document_policy, files=(builder, files))
    num_rows = None if streaming else len(ds)
    bad_rows = BadRows(RowLocator(spec.path, builder, files, num_rows), bad_document_policy, found_at_open=bad_files)
    if streaming:
        columns = list(ds.column_names or [])
        if not columns:
            with _load_errors(spec):
                first = next(iter(ds), None)
            if first is None:
                raise ConfigError(f"training.dataset: {spec.path!r} is empty (0 documents)")
            columns = list(first.keys())
        if chat is not None:
            from flame.data.chat import format_columns
            from flame.data.chat_sources import ChatStreamSource

            keep = format_columns(columns, repr(spec.path))
            return ChatStreamSource(spec.path, ds, keep[0], False, None, bad_rows, exclude=exclude, columns=keep,
                                    chat=chat)
        column, ids = pick_column(columns, text_column, repr(spec.path))
        return StreamSource(spec.path, ds, column, ids, tokenize, bad_rows, exclude=exclude)
    rows = None
    if holdout:
        rows = held_out_rows(len(ds), holdout_fraction)
        _log_holdout(spec.path, len(rows), len(ds), holdout_fraction)
    if chat is not None:
        from flame.data.chat import format_columns
        from flame.data.chat_sources import ChatMapSource

        keep = format_columns(ds.column_names, repr(spec.path))
        return ChatMapSource(spec.path, dataset=ds, column=keep[0], bad_rows=bad_rows, rows=rows, exclude=exclude,
                             columns=keep, chat=chat)
    column, ids = pick_column(ds.column_names, text_column, repr(spec.path))
    return MapSource(spec.path, dataset=ds, column=column, token_ids=ids, tokenize=tokenize, bad_rows=bad_rows,
                     rows=rows, exclude=exclude)


def _log_holdout(name: str, k: int, n: int, fraction: float) -> None:
    from torchtitan.tools.logging import logger

    logger.info(f"validation: {name!r} has no validation split; validating on {k} of its {n} documents, held out "
                f"by a hash of their row (validation.holdout_fraction={fraction}) and excluded from training")
