"""The data options, read once from a job config and checked (one-line ConfigError per bad value)."""

from __future__ import annotations

import glob
import math
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

from flame.errors import ConfigError

BOUNDARY_POLICIES = ("auto", "bos", "eos", "bos_eos", "none")
BAD_DOCUMENT_POLICIES = ("skip", "replace", "error")
MIX_BY = ("documents", "tokens")


@dataclass(frozen=True)
class SourceSpec:
    """One entry of ``training.dataset`` with its per-entry options."""

    path: str
    name: str | None = None
    split: str | None = None
    data_dir: str | None = None
    data_files: str | None = None


@dataclass(frozen=True)
class DataOptions:
    sources: tuple[SourceSpec, ...]
    probs: tuple[float, ...]
    batch_size: int
    seq_len: int
    varlen: bool = False
    context_len: int = 2048
    text_column: str | None = None
    streaming: bool = False
    shuffle: bool = True
    shuffle_buffer_size: int = 10000
    mix_by: str = "documents"
    boundary_policy: str = "auto"
    mask_cross_document_labels: bool = False
    bad_document_policy: str = "skip"
    # Rows are conversations (chat, alpaca, sharegpt) trained on their assistant tokens (flame.data.chat).
    sft: bool = False
    # > 0: sources without a validation split hold out this share of documents for validation
    # (excluded from training; see flame.data.holdout).
    holdout_fraction: float = 0.0
    # Validation only: the sources are the training sources (validation.dataset not set).
    validation_from_training: bool = False
    seed: int = 0
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    # "validation" loaders read held-out splits, never shuffle and keep no checkpoint state.
    split_role: str = "train"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate(self)


def looks_like_a_local_path(name: str) -> bool:
    """A name that cannot be a Hugging Face hub id ("name" or "org/name"): it starts like a path,
    has more than one "/", or ends in a file extension."""
    return (name.startswith((".", "/", "~")) or name.count("/") > 1
            or os.path.splitext(name)[1].lower() in (".json", ".jsonl", ".parquet", ".txt", ".csv", ".arrow", ".gz"))


def missing_local_source(dataset: str | None) -> str | None:
    """The first comma entry of a ``dataset`` option that names a local path (or glob) with nothing
    there; hub ids are left to the loader. Checked before any process starts."""
    for entry in str(dataset or "").split(","):
        path = os.path.expanduser(entry.strip())
        if not path or not looks_like_a_local_path(path):
            continue
        if not (glob.glob(path) if glob.has_magic(path) else os.path.exists(path)):
            return entry.strip()
    return None


def _split_list(value: str | None, what: str, n: int | None) -> list[str | None]:
    """Split a comma list; empty entries mean "default". A single entry applies to every source;
    otherwise the length must be n when n is given."""
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return [None] * (n or 0)
    items = value if isinstance(value, (list, tuple)) else str(value).split(",")
    items = [(s.strip() or None) if s is not None else None for s in items]
    if n is not None and len(items) == 1:
        return items * n
    if n is not None and len(items) != n:
        raise ConfigError(
            f"training.{what}: {value!r} has {len(items)} entries but training.dataset has {n}; "
            "give one entry for all datasets or one per dataset (empty entries allowed)"
        )
    return items


def parse_sources(
    dataset: str | None,
    dataset_name: str | None = None,
    dataset_split: str | None = None,
    data_dir: str | None = None,
    data_files: str | None = None,
    *,
    field_prefix: str = "training",
) -> tuple[SourceSpec, ...]:
    if dataset is None or not str(dataset).strip():
        raise ConfigError(f"{field_prefix}.dataset: {dataset!r} is empty; name at least one data source")
    # "~" starts no hub id: a home-relative path, expanded here as the check before the launch does
    paths = [os.path.expanduser(p.strip()) for p in str(dataset).split(",")]
    if any(not p for p in paths):
        raise ConfigError(f"{field_prefix}.dataset: {dataset!r} has an empty entry")
    n = len(paths)
    names = _split_list(dataset_name, "dataset_name", n)
    splits = _split_list(dataset_split, "dataset_split", n)
    dirs = _split_list(data_dir, "data_dir", n)
    files = _split_list(data_files, "data_files", n)
    return tuple(
        SourceSpec(path=p, name=a, split=b, data_dir=c, data_files=d)
        for p, a, b, c, d in zip(paths, names, splits, dirs, files)
    )


def normalize_probs(probs: Sequence[float] | str | None, n: int) -> tuple[float, ...]:
    if probs is None or (isinstance(probs, (list, tuple)) and len(probs) == 0):
        return tuple([1.0 / n] * n)
    if isinstance(probs, str):
        try:
            probs = [float(x) for x in probs.split(",")]
        except ValueError:
            raise ConfigError(f"training.data_probs: {probs!r} is not a comma list of numbers") from None
    probs = [float(p) for p in probs]
    if len(probs) != n:
        raise ConfigError(
            f"training.data_probs: {probs} has {len(probs)} entries but training.dataset has {n}"
        )
    for p in probs:
        if not (p > 0) or math.isinf(p):
            raise ConfigError(f"training.data_probs: {p} in {probs} is not a positive finite number")
    total = sum(probs)
    return tuple(p / total for p in probs)


def validate(o: DataOptions) -> None:
    if o.seq_len < 2:
        raise ConfigError(f"training.seq_len: {o.seq_len} must be at least 2")
    if o.batch_size < 1:
        raise ConfigError(f"training.batch_size: {o.batch_size} must be at least 1")
    if o.varlen:
        if o.context_len < 1:
            raise ConfigError(f"training.context_len: {o.context_len} must be at least 1")
        if o.context_len > o.seq_len:
            raise ConfigError(
                f"training.context_len: {o.context_len} exceeds training.seq_len {o.seq_len} in varlen mode"
            )
    if o.boundary_policy not in BOUNDARY_POLICIES:
        raise ConfigError(f"training.boundary_policy: {o.boundary_policy!r} is not one of {BOUNDARY_POLICIES}")
    if o.sft and o.boundary_policy != "auto":
        # the chat template adds the special tokens of a conversation: the policy would be ignored
        raise ConfigError(f"training.boundary_policy: {o.boundary_policy!r} with training.sft: the chat template "
                          "adds a conversation's special tokens (drop the option)")
    if o.bad_document_policy not in BAD_DOCUMENT_POLICIES:
        raise ConfigError(
            f"training.bad_document_policy: {o.bad_document_policy!r} is not one of {BAD_DOCUMENT_POLICIES}")
    if not (0.0 <= o.holdout_fraction < 1.0):
        raise ConfigError(f"validation.holdout_fraction: {o.holdout_fraction} must be in [0, 1)")
    if o.mix_by not in MIX_BY:
        raise ConfigError(f"training.mix_by: {o.mix_by!r} is not one of {MIX_BY}")
    if o.num_workers < 0:
        raise ConfigError(f"training.num_workers: {o.num_workers} must be >= 0")
    if o.prefetch_factor is not None and o.prefetch_factor < 1:
        raise ConfigError(f"training.prefetch_factor: {o.prefetch_factor} must be >= 1")
    if o.shuffle_buffer_size < 1:
        raise ConfigError(f"training.shuffle_buffer_size: {o.shuffle_buffer_size} must be >= 1")
    if len(o.probs) != len(o.sources):
        raise ConfigError(f"training.data_probs: {list(o.probs)} does not match {len(o.sources)} sources")


def _get(section: Any, name: str, default: Any = None) -> Any:
    return getattr(section, name, default) if section is not None else default


def _or_default(value: Any, default: Any) -> Any:
    """``value`` unless unset (None); a 0 stays 0, for the checks to refuse it."""
    return default if value is None else value


def options_from_job_config(job_config: Any, split: str = "train") -> DataOptions:
    """Read flame's ``training.*`` (and ``validation.*`` for split="validation") fields."""
    t = job_config.training
    v = _get(job_config, "validation")
    batch_size = _get(t, "local_batch_size") or _get(t, "batch_size") or 8
    seed = _get(t, "seed")
    if seed is None:
        seed = _get(_get(job_config, "debug"), "seed")
    common = dict(
        varlen=bool(_get(t, "varlen", False)),
        context_len=int(_get(t, "context_len", 2048) or 2048),
        text_column=_get(t, "text_column"),
        mix_by=_get(t, "mix_by", "documents") or "documents",
        boundary_policy=_get(t, "boundary_policy", "auto") or "auto",
        mask_cross_document_labels=bool(_get(t, "mask_cross_document_labels", False)),
        bad_document_policy=_get(t, "bad_document_policy", "skip") or "skip",
        sft=bool(_get(t, "sft", False)),
        seed=int(seed or 0),
        num_workers=int(_get(t, "num_workers", 0) or 0),
        prefetch_factor=_get(t, "prefetch_factor"),
        pin_memory=bool(_get(t, "pin_memory", False)),
        persistent_workers=bool(_get(t, "persistent_workers", False)),
    )
    # Held-out validation documents come out of the training sources only when validation (or the
    # research probes, which read the first validation batch) runs on the training sources (no
    # validation.dataset) and holdout is on.
    val_dataset = _get(v, "dataset_path") or _get(v, "dataset")
    reads_held_out = _get(v, "enable", False) or (_get(_get(job_config, "probes"), "interval", 0) or 0) > 0
    holdout = float(_get(v, "holdout_fraction", 0.0) or 0.0) if reads_held_out and not val_dataset else 0.0
    if split == "train":
        sources = parse_sources(
            _get(t, "dataset"),
            _get(t, "dataset_name"),
            _get(t, "dataset_split"),
            _get(t, "data_dir"),
            _get(t, "data_files"),
        )
        return DataOptions(
            sources=sources,
            probs=normalize_probs(_get(t, "data_probs"), len(sources)),
            batch_size=int(batch_size),
            seq_len=int(_get(t, "seq_len", 2048)),
            streaming=bool(_get(t, "streaming", False)),
            shuffle_buffer_size=int(_or_default(_get(t, "shuffle_buffer_size"), 10000)),
            holdout_fraction=holdout,
            **common,
        )
    if split != "validation":
        raise ConfigError(f"split: {split!r} is not 'train' or 'validation'")
    if val_dataset:
        sources = parse_sources(val_dataset, field_prefix="validation")
    else:
        # The validation split of each training source, or (without one) its held-out documents.
        sources = parse_sources(_get(t, "dataset"), _get(t, "dataset_name"), _get(t, "dataset_split"),
                                _get(t, "data_dir"), _get(t, "data_files"))
        if holdout == 0.0:
            holdout = float(_get(v, "holdout_fraction", 0.0) or 0.0)
    # Unset (None): the training batch size and sequence length.
    seq_len = int(_or_default(_get(v, "seq_len"), _get(t, "seq_len", 2048)))
    common["context_len"] = min(common["context_len"], seq_len)
    # Validation is a fixed, ordered pass in the main process (it is small and must be identical
    # from one evaluation to the next).
    common.update(num_workers=0, prefetch_factor=None, persistent_workers=False)
    return DataOptions(
        sources=sources,
        probs=tuple([1.0 / len(sources)] * len(sources)),
        batch_size=int(_or_default(_get(v, "local_batch_size"), batch_size)),
        seq_len=seq_len,
        streaming=False,
        shuffle=False,
        split_role="validation",
        holdout_fraction=0.0 if val_dataset else holdout,
        validation_from_training=not val_dataset,
        **common,
    )


def options_for_test(**kw: Any) -> DataOptions:
    """Build options from keyword arguments (tests, benchmarks, scripts)."""
    dataset = kw.pop("dataset")
    sources = parse_sources(
        dataset,
        kw.pop("dataset_name", None),
        kw.pop("dataset_split", None),
        kw.pop("data_dir", None),
        kw.pop("data_files", None),
    )
    probs = normalize_probs(kw.pop("data_probs", None), len(sources))
    kw.setdefault("batch_size", 2)
    kw.setdefault("seq_len", 16)
    return DataOptions(sources=sources, probs=probs, **kw)
