"""Building the loader from a job config (or from DataOptions directly)."""

from __future__ import annotations

from typing import Any

from flame.data.dataset import PackedDataset
from flame.data.loader import FlameDataLoader
from flame.data.options import DataOptions, options_from_job_config
from flame.data.sources import open_source
from flame.data.tokenizer import boundary_tokens, pad_token_id
from flame.errors import ConfigError


def build_dataloader_from_options(opts: DataOptions, tokenizer: Any, dp_rank: int = 0,
                                  dp_world_size: int = 1) -> FlameDataLoader:
    if not (0 <= dp_rank < dp_world_size):
        raise ConfigError(f"dp_rank: {dp_rank} is not in [0, {dp_world_size})")
    boundary = boundary_tokens(tokenizer, opts.boundary_policy)
    chat = None
    if opts.sft:
        from flame.data.chat import ChatRenderer

        # The longest conversation a row can hold: a varlen piece, else the row.
        chat = ChatRenderer(tokenizer, opts.context_len if opts.varlen else opts.seq_len)
    sources = [open_source(spec, tokenizer, opts.text_column, opts.streaming, opts.split_role,
                           opts.bad_document_policy, opts.holdout_fraction, opts.validation_from_training, chat)
               for spec in opts.sources]
    validation = opts.split_role == "validation"
    dataset = PackedDataset(opts, sources, boundary, dp_rank, dp_world_size, with_sources=validation,
                            pad_id=pad_token_id(tokenizer))
    kwargs: dict[str, Any] = {"num_workers": opts.num_workers, "pin_memory": opts.pin_memory}
    if opts.num_workers > 0:
        kwargs["persistent_workers"] = opts.persistent_workers
        if opts.prefetch_factor is not None:
            kwargs["prefetch_factor"] = opts.prefetch_factor
    loader = FlameDataLoader(dataset, dp_rank, dp_world_size, **kwargs)
    # Validation restarts from its first batch at every evaluation and keeps no checkpoint state.
    loader.track_state = not validation
    loader.source_names = [s.name for s in sources]
    return loader


def build_dataloader(job_config: Any, tokenizer: Any, dp_rank: int, dp_world_size: int,
                     split: str = "train") -> FlameDataLoader:
    """The loader for ``split`` ("train" or "validation") of this data-parallel rank."""
    return build_dataloader_from_options(options_from_job_config(job_config, split), tokenizer, dp_rank,
                                         dp_world_size)
