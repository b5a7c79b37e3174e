"""Build a causal LM from a JSON config on the meta device, then materialize and init it.

The order matters for large models: meta build -> parallelize (shard) -> ``to_empty`` on the
device -> the model's own ``_init_weights`` run on the (possibly sharded) parameters.
"""

import json
import logging
import math
import os

import torch
from torch import nn

from flame.errors import ConfigError, first_line

logger = logging.getLogger(__name__)


def register_model_families(modules: list[str] | str | None = None) -> None:
    """Make FLA, flame's own and ``custom_models`` architectures known to the Auto classes, then
    the user's: the packages named by ``model.module`` and the ``flame.models`` entry points."""
    import flame  # noqa: F401  (its __init__ registers everything in the tree)
    from flame.models.registry import import_model_modules

    import_model_modules(modules)


def load_model_config(path: str, modules: list[str] | str | None = None):
    """The model's config from a JSON file or a model folder; a bad file, a field name that is a
    near miss of one the config takes, or (flame's transformer) a missing core field is a ConfigError."""
    from transformers import AutoConfig

    register_model_families(modules)
    if not os.path.exists(path):
        raise ConfigError(f"model.config {path!r}: no such file")
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError, AssertionError, json.JSONDecodeError) as e:
        raise ConfigError(f"model.config {path!r}: {first_line(e)}") from None
    check_config_fields(path, config)
    return config


def _config_json(path: str) -> dict:
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def config_fields(config) -> set[str]:
    """The field names ``config``'s class takes: its constructors' parameters over the class
    hierarchy, dataclass fields, attribute aliases and the base config's own fields."""
    import dataclasses
    import inspect

    from transformers import PreTrainedConfig

    known = set(PreTrainedConfig().to_dict()) | set(getattr(config, "attribute_map", {}) or {})
    skip = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for cls in type(config).__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None:
            known |= {n for n, p in inspect.signature(init).parameters.items() if p.kind not in skip}
        if dataclasses.is_dataclass(cls):
            known |= {f.name for f in dataclasses.fields(cls)}
    return known - {"self"}


def check_config_fields(path: str, config) -> None:
    import difflib

    data = _config_json(path)
    known = config_fields(config)
    # transformers keeps any field it does not take as a plain attribute, so a misspelled one
    # (num_head) would leave the intended field at its default without a word
    for key in data:
        if key in known or key.startswith("_"):
            continue
        near = difflib.get_close_matches(key, sorted(known - set(data)), n=1, cutoff=0.85)
        if near:
            where = f"model.config {path!r}: field {key!r} is not one that {type(config).__name__} takes"
            if os.path.isdir(path):  # a model folder's config.json (often downloaded): said, not refused
                logger.warning(f"{where} (did you mean {near[0]!r}?); it is kept as an attribute and unused")
            else:
                raise ConfigError(f"{where}; did you mean {near[0]!r}?")
    from flame.models.transformer.configuration import TransformerConfig, check_required_fields

    if isinstance(config, TransformerConfig) and data:
        check_required_fields(data, f"model.config {path!r}")


def fit_vocab(model_config, tokenizer_len: int, multiple: int) -> int:
    """Raise vocab_size to cover every tokenizer id, rounded up to ``multiple``; never shrink it."""
    current = int(model_config.vocab_size)
    if tokenizer_len <= current:
        return current
    new = int(math.ceil(tokenizer_len / multiple) * multiple) if multiple > 1 else tokenizer_len
    model_config.vocab_size = new
    return new


def build_meta_model(model_config, varlen: bool = False) -> nn.Module:
    """The model with every parameter on the meta device, in float32 master precision.

    With ``varlen`` an HF model gets flame's document-masked attention (FLA and flame models
    read ``cu_seqlens`` themselves).
    """
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if varlen:
        from flame.models.hf_attention import NAME, uses_native_varlen

        if not uses_native_varlen(model_config):
            kwargs["attn_implementation"] = NAME
    # transformers 5 honours `torch_dtype`/`dtype` from the JSON; master weights are fp32.
    model_config.dtype = torch.float32
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32, **kwargs)
    except ImportError as e:
        raise ConfigError(f"model type {model_config.model_type!r}: {str(e).splitlines()[0]}") from None
    except (AssertionError, ValueError, TypeError, KeyError) as e:
        # the model's constructor refused a value of its config (FLA asserts on head sizes and modes)
        raise ConfigError(f"model type {model_config.model_type!r}: the model cannot be built from its config: "
                          f"{type(e).__name__}: {first_line(e)}") from None
    return model


def check_position_limit(model: nn.Module, model_config, positions: int, option: str) -> None:
    """Refuse sequences longer than ``max_position_embeddings`` where that breaks or silently changes
    the model: a learned position table (GPT-2's ``wpe``, OPT's ``embed_positions``) has no row past
    it, and transformers' ``dynamic`` RoPE rescales every frequency once a sequence exceeds it (a
    prefix then computes differently than alone, so training and inference disagree). Plain,
    linear, yarn and llama3 RoPE (HF llama/qwen3, FLA attention, flame's transformer) compute any
    position, so longer sequences are left to the user there."""
    limit = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(limit, int) or positions <= limit:
        return
    rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    # one spec, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}})
    specs = [rope, *rope.values()] if isinstance(rope, dict) else []
    rope_types = {spec.get("rope_type", spec.get("type")) for spec in specs if isinstance(spec, dict)}
    where = f"max_position_embeddings {limit} of model.config"
    if "dynamic" in rope_types:
        raise ConfigError(f"{option} {positions} is larger than the {where}: its 'dynamic' RoPE rescales the "
                          f"frequencies of every position for longer sequences; use at most {limit} or raise "
                          "max_position_embeddings")
    inputs = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module is not inputs and limit <= module.num_embeddings <= limit + 2:
            raise ConfigError(f"{option} {positions} is larger than the {where}: the learned position table "
                              f"{name} has no row past position {module.num_embeddings - 1}")


def _clear_init_marks(model: nn.Module) -> None:
    # transformers marks modules built on meta as initialized; the real init must run again.
    for module in model.modules():
        if hasattr(module, "_is_hf_initialized"):
            module._is_hf_initialized = False
        for t in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            if hasattr(t, "_is_hf_initialized"):
                t._is_hf_initialized = False


@torch.no_grad()
def init_weights(model: nn.Module, seed: int | None = None) -> None:
    """Run the model's own initialization on materialized (possibly sharded) parameters."""
    from flame.models.constructor_init import check_initialized, fill_nan, restore_constructor_values

    _clear_init_marks(model)
    fill_nan(model)  # whatever no init below touches shows up in check_initialized
    if seed is not None:
        torch.manual_seed(seed)
    if hasattr(model, "init_weights"):
        model.init_weights()
    else:  # plain nn.Module from custom code
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    restore_constructor_values(model)
    from flame.lora.layer import init_adapters

    init_adapters(model, seed)  # LoRA layers, if any: their own generator, after the model's init
    check_initialized(model)


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    total = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if exclude_embeddings and isinstance(model.get_submodule(name.rsplit(".", 1)[0]), nn.Embedding):
            continue
        total += p.numel()
    return total
