"""Config of flame's transformer: FLA's TransformerConfig (JSON-compatible) plus attention backends."""
from __future__ import annotations

import json
import os

from fla.models.transformer.configuration_transformer import TransformerConfig as FLATransformerConfig

from flame.errors import ConfigError
from flame.models.attention.registry import resolve_layer_backends
from flame.ops.attention.utils import MAX_HEAD_DIM, MIN_HEAD_DIM

REQUIRED_JSON_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_heads", "vocab_size")


class TransformerConfig(FLATransformerConfig):
    """FLA's ``TransformerConfig`` plus

    attn_impl:       backend name, or a list with one name per layer (default "sdpa"); the softpick
                     paper's names (parallel_softpick_attn, naive_scaled_attn, ...) are accepted
    softpick_eps:    eps of the softpick denominator (default 1e-6)
    attn_scale_init: initial per-head scale of scalable-softmax backends (default 0.3)
    """

    model_type = "transformer"

    def __init__(
        self,
        attn_impl: str | list[str] = "sdpa",
        softpick_eps: float = 1e-6,
        attn_scale_init: float = 0.3,
        **kwargs,
    ):
        self.attn_impl = list(attn_impl) if isinstance(attn_impl, (list, tuple)) else attn_impl
        self.softpick_eps = softpick_eps
        self.attn_scale_init = attn_scale_init
        super().__init__(**kwargs)
        self.validate_flame()

    def validate_flame(self) -> None:
        """One-line ConfigError for values flame's model cannot build."""
        for name in ("hidden_size", "num_hidden_layers", "num_heads", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} {value!r}: must be a whole number >= 1")
        if self.hidden_act != "swish":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported by flame's transformer (use 'swish')")
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ConfigError(f"num_heads {self.num_heads} is not divisible by num_kv_heads {kv}")
        if getattr(self, "attnres_block_size", None) is not None:
            raise ConfigError("attnres_block_size is not supported by flame's transformer")
        backends = resolve_layer_backends(self.attn_impl, self.num_hidden_layers)
        head_dim = self.hidden_size // self.num_heads
        for b in backends:
            if b.needs_kernel_head_dim and not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM):
                raise ConfigError(f"head dim {head_dim} is not supported by attn_impl {b.name!r} "
                                  f"(needs {MIN_HEAD_DIM}..{MAX_HEAD_DIM})")
            if self.window_size is not None and b.impl in ("triton", "flex"):
                raise ConfigError(f"window_size is not supported by attn_impl {b.name!r}")

    @property
    def layer_backends(self):
        return resolve_layer_backends(self.attn_impl, self.num_hidden_layers)


def check_required_fields(data: dict, where: str) -> None:
    """A transformer JSON without one of its core fields is a ConfigError naming them."""
    missing = [k for k in REQUIRED_JSON_FIELDS if k not in data]
    if missing:
        raise ConfigError(f"{where} lacks field(s) {', '.join(missing)}")


def load_config(path: str | os.PathLike, **overrides) -> TransformerConfig:
    """Read a transformer JSON config; a missing core field or a bad value is a one-line ConfigError."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"model config {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {str(path)!r} is not valid JSON: {e}") from None
    check_required_fields(data, f"model config {str(path)!r}")
    if data["model_type"] != TransformerConfig.model_type:
        raise ConfigError(f"model config {str(path)!r} has model_type {data['model_type']!r}, expected 'transformer'")
    data.update(overrides)
    data.pop("model_type")
    return TransformerConfig(**data)
