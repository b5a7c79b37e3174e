"""flame's data pipeline: sources -> per-consumer document shares -> packed batches.

Public API used by the trainer: :func:`build_tokenizer`, :func:`build_dataloader`. See
``flame/data/README_SECTION.md`` for the user-facing description and guarantees.
"""

from __future__ import annotations

from flame.data.builder import build_dataloader, build_dataloader_from_options
from flame.data.options import DataOptions, options_for_test, options_from_job_config
from flame.data.tokenizer import build_tokenizer, load_tokenizer
from flame.data.validation import SourceLossMeter

__all__ = [
    "DataOptions",
    "SourceLossMeter",
    "build_dataloader",
    "build_dataloader_from_options",
    "build_tokenizer",
    "load_tokenizer",
    "options_for_test",
    "options_from_job_config",
]
