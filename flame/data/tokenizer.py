"""Loading the tokenizer and deciding which special tokens mark document boundaries.

Boundary policy (``training.boundary_policy``); the pipeline tokenizes with
``add_special_tokens=False`` and adds these itself, so every tokenizer behaves the same way:

- ``auto`` (default): BOS before each document when the tokenizer has a BOS distinct from its EOS,
  and EOS after each document. GPT-2 (BOS == EOS) and Qwen (no BOS) therefore get EOS only, which
  still separates documents; Llama-style tokenizers get both.
- ``bos``: BOS only (the tokenizer must have one). ``eos``: EOS only (must have one).
- ``bos_eos``: both (both must exist).
- ``none``: nothing is added (ids that already carry their markers).

Where documents begin and end is tracked from document lengths, never by searching for BOS/EOS,
so varlen boundaries and label masking are right under every policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from flame.errors import ConfigError


@dataclass(frozen=True)
class Boundary:
    bos: int | None
    eos: int | None

    @property
    def extra(self) -> int:
        return int(self.bos is not None) + int(self.eos is not None)


def boundary_tokens(tokenizer: Any, policy: str) -> Boundary:
    bos = getattr(tokenizer, "bos_token_id", None)
    eos = getattr(tokenizer, "eos_token_id", None)
    if policy == "none":
        return Boundary(None, None)
    if policy == "auto":
        if eos is None and bos is None:
            raise ConfigError(
                "training.boundary_policy: 'auto' needs a tokenizer with an EOS or BOS token; "
                "this one has neither (use 'none' only if your data already separates documents)"
            )
        if eos is None:
            return Boundary(bos, None)
        return Boundary(bos if bos is not None and bos != eos else None, eos)
    need_bos = policy in ("bos", "bos_eos")
    need_eos = policy in ("eos", "bos_eos")
    if need_bos and bos is None:
        raise ConfigError(f"training.boundary_policy: {policy!r} needs a BOS token; the tokenizer has none")
    if need_eos and eos is None:
        raise ConfigError(f"training.boundary_policy: {policy!r} needs an EOS token; the tokenizer has none")
    return Boundary(bos if need_bos else None, eos if need_eos else None)


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills the unused end of SFT rows (its labels are ignored): the tokenizer's pad
    token, else its EOS, else 0."""
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None:
            return int(value)
    return 0


def check_local_tokenizer_path(path: str | None) -> None:
    """A ``model.tokenizer_path`` that names a local folder (not a hub id) must exist: checked by
    train.sh before any process starts, and again where the tokenizer is loaded."""
    from flame.data.options import looks_like_a_local_path

    if path and not os.path.isdir(path) and looks_like_a_local_path(path):
        raise ConfigError(f"model.tokenizer_path: {path!r}: no such folder")


def load_tokenizer(path: str | None) -> Any:
    from transformers import AutoTokenizer

    if not path:
        raise ConfigError("model.tokenizer_path: not set; point it at a tokenizer folder (e.g. flame/assets/tokenizer)")
    check_local_tokenizer_path(path)
    try:
        if os.path.isdir(path):
            return AutoTokenizer.from_pretrained(path)
        # Hub id: only the local cache is consulted, so an offline machine gets a clear error.
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"model.tokenizer_path: {path!r} not found (no such folder and not in the local Hugging Face cache): "
            f"{str(e).splitlines()[0] if str(e) else type(e).__name__}"
        ) from None


def build_tokenizer(job_config: Any) -> Any:
    """The tokenizer named by ``model.tokenizer_path`` (a folder, or a hub id in the local cache)."""
    return load_tokenizer(getattr(job_config.model, "tokenizer_path", None))
