"""The ``[lora]`` config section (low-rank adapters on a frozen base model)."""

from __future__ import annotations

from dataclasses import dataclass, field

# the attention and MLP projections of HF Llama/Qwen, FLA's layers (g_proj: their output gate)
# and flame's transformer
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class Lora:
    rank: int = 0
    """Rank of the adapters; 0: LoRA off (full training). A rank > 0 freezes every weight of the
    model and trains only the adapters ``W + alpha/rank * B @ A`` on the ``targets``."""

    alpha: float = 16.0
    """The adapters' output is scaled by ``alpha / rank`` (PEFT's ``lora_alpha``)."""

    dropout: float = 0.0
    """Dropout on the input of A while training (PEFT's ``lora_dropout``), in [0, 1)."""

    targets: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """``nn.Linear`` layers of the decoder blocks that get adapters, comma-separated: a name without a
    dot matches the layer's own name (``q_proj``), one with a dot is a glob over its full name
    (``model.layers.1*.mlp.*``). The default (the attention and MLP projections of HF Llama/Qwen,
    FLA models and flame's transformer) may name layers a model lacks; a pattern you give must
    match something."""

    export_adapters: bool = False
    """Also write the adapters alone in PEFT's format (``adapter_config.json`` +
    ``adapter_model.safetensors``) to ``<export folder>_adapter`` (``DUMP/hf_adapter``) next to
    every Hugging Face export; the export itself always holds the merged weights."""
