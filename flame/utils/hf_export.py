"""Export flame/torchtitan checkpoints as Hugging Face folders, and import HF weights as DCP.

Checkpoint layout (torchtitan 0.2.2 ``CheckpointManager``): a DCP folder ``<dump>/checkpoint/step-N``
whose top-level keys are the model's ``state_dict()`` keys (``ModelWrapper`` flattens the model state
into the top level), next to ``optimizer``, ``lr_scheduler``, ``dataloader`` and ``train_state``
entries (nested, stored as ``optimizer.state...`` etc.). ``step-0`` and final "model only" saves
hold the model keys alone.

``export_hf`` reads only the model's keys: it builds the model on the meta device to learn its keys
and shapes, checks them against the DCP metadata, and loads one output shard at a time, so neither
the optimizer state nor the whole model needs to fit in RAM. Output is written to a temporary
sibling folder and renamed into place at the end, so a failed export leaves nothing loadable.
Files and folders get the modes the process umask gives (as ``open``/``mkdir`` would).

What the folder holds depends on the family (``plan_export``), so that it loads without flame:

* flame's ``transformer`` whose blocks are exactly Llama's (``flame.utils.export_llama``):
  ``LlamaForCausalLM`` (llama config, renamed weights), loadable with plain transformers;
* FLA families: FLA's own config and weights, loadable after ``import fla``;
* HF families (llama, qwen3, ...): as they are;
* everything else (softpick-family or windowed transformers, custom models): the config and weights
  plus the modeling code (``auto_map``, ``flame.utils.remote_code``), loadable with
  ``trust_remote_code=True``; when the code cannot be bundled, the folder loads only where the
  model's package is importable (a warning says so).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flame.errors import ConfigError

logger = logging.getLogger('flame.export')

DTYPES = {'float32': torch.float32, 'fp32': torch.float32, 'bfloat16': torch.bfloat16, 'bf16': torch.bfloat16,
          'float16': torch.float16, 'fp16': torch.float16}
DEFAULT_SHARD = '5GB'


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def parse_size(size: int | str) -> int:
    """Bytes from an int or a string like '5GB', '500MB', '2GiB'."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r'\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*', str(size), re.IGNORECASE)
    if not m:
        raise ConfigError(f"max_shard_size {size!r} is not a size like '5GB' or 500000000")
    unit = (m.group(2) or 'B').upper()
    base = 1024 if 'I' in unit else 1000
    power = {'B': 0, 'K': 1, 'M': 2, 'G': 3, 'T': 4}[unit[0]]
    return int(float(m.group(1)) * base ** power)


def register_families() -> None:
    """Make every family flame trains known to transformers' Auto classes."""
    try:
        import flame  # noqa: F401  (its __init__ registers FLA, flame's transformer, custom_models)
    except ImportError:
        import fla  # noqa: F401


def load_config(model_config):
    """A ``PretrainedConfig`` from a config object, a JSON file or an HF folder."""
    from transformers import AutoConfig, PretrainedConfig
    if isinstance(model_config, PretrainedConfig):
        return model_config
    register_families()
    path = str(model_config)
    if not os.path.exists(path):
        raise ConfigError(f"model config {path!r} does not exist")
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"model config {path!r} cannot be read: {str(e).splitlines()[0]}") from None


def _meta_model(config):
    from transformers import AutoModelForCausalLM

    from flame.models.flops import _attention_buildable
    register_families()
    with torch.device('meta'), _attention_buildable():
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def model_keys(config, model=None) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Keys to export -> (shape, dtype), from a meta-device build (`model`, when the caller has one).

    Parameters shared by several names (tied embeddings) are listed once, under the name HF keeps
    (the first registered: the input embedding), as ``save_pretrained`` does.
    """
    model = model if model is not None else _meta_model(config)
    keys = {}
    sd_keys = set(model.state_dict().keys())
    for name, p in model.named_parameters():  # remove_duplicate=True drops tied aliases
        keys[name] = (p.shape, p.dtype)
    for name, b in model.named_buffers():
        if name in sd_keys:
            keys[name] = (b.shape, b.dtype)
    return keys


def _dcp_metadata(path: str):
    from torch.distributed.checkpoint import FileSystemReader
    if not os.path.isfile(os.path.join(path, '.metadata')):
        raise ConfigError(f"{path!r} is not a DCP checkpoint (no .metadata file)")
    return FileSystemReader(path).read_metadata().state_dict_metadata


def _plan_shards(keys: dict, dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    shards, cur, size = [], [], 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    for name, (shape, _) in keys.items():
        nbytes = shape.numel() * itemsize
        if cur and size + nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(name)
        size += nbytes
    if cur:
        shards.append(cur)
    return shards


def _read_from_dcp(path: str, names: list[str], metadata) -> dict[str, torch.Tensor]:
    """Load just ``names`` from the DCP folder (DCP reads only the requested keys)."""
    import torch.distributed.checkpoint as dcp
    sd = {n: torch.empty(metadata[n].size, dtype=metadata[n].properties.dtype) for n in names}
    with warnings.catch_warnings():
        # a single-process read is the intent here; DCP warns about it on every call
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(sd, checkpoint_id=path)
    return sd


def _check_against_metadata(keys: dict, metadata, path: str) -> None:
    missing = [k for k in keys if k not in metadata]
    if missing:
        raise ConfigError(f"checkpoint {path!r} lacks {len(missing)} model key(s) of this config, "
                          f"e.g. {missing[0]!r}: wrong --config for this checkpoint?")
    for k, (shape, _) in keys.items():
        got = getattr(metadata[k], 'size', None)
        if got is None or tuple(got) != tuple(shape):
            raise ConfigError(f"checkpoint key {k!r} has shape {tuple(got) if got is not None else '?'}, "
                              f"the config expects {tuple(shape)}: wrong --config for this checkpoint?")


@dataclass
class ExportPlan:
    """What goes into the folder: ``config`` (written as config.json), weight names renamed by
    ``rename``, modeling files ``code`` (name -> source). ``kind``: llama | fla | hf | remote | package."""
    kind: str
    config: Any
    rename: Callable[[str], str] = lambda k: k
    code: dict[str, str] = field(default_factory=dict)
    note: str = ''


# flame-side speed switches of the transformer config that call FLA's fused kernels on GPU; the
# exported modeling code runs the same math in torch
_FUSE_FLAGS = ('fuse_norm', 'fuse_swiglu', 'fuse_cross_entropy', 'fuse_linear_cross_entropy')


def _copy_config(config):
    return config.__class__.from_dict(config.to_dict())


def _remote_plan(config, note: str) -> ExportPlan:
    from transformers import AutoModel, AutoModelForCausalLM

    from flame.utils.remote_code import BundleError, bundle
    config = _copy_config(config)
    classes = {'AutoConfig': type(config)}
    for auto in (AutoModel, AutoModelForCausalLM):
        try:
            classes[auto.__name__] = auto._model_mapping[type(config)]
        except KeyError:
            pass
    top = type(config).__module__.split('.')[0]
    try:
        code, auto_map = bundle(classes, (top,))
    except BundleError as e:
        return ExportPlan('package', config, note=f"{note}; its modeling code cannot be bundled ({e}): the folder "
                                                  f"loads only where package {top!r} is importable")
    if getattr(config, 'model_type', None) == 'transformer':
        from flame.models.attention.registry import get_backend
        for flag in _FUSE_FLAGS:
            if hasattr(config, flag):
                setattr(config, flag, False)
        # FLA's parallel_attn is plain softmax attention: SDPA computes the same without FLA
        impl = config.attn_impl
        swap = lambda n: 'sdpa' if get_backend(n).impl == 'fla' else n  # noqa: E731
        config.attn_impl = [swap(n) for n in impl] if isinstance(impl, list) else swap(impl)
    config.auto_map = auto_map
    config.architectures = [classes['AutoModelForCausalLM'].__name__] if 'AutoModelForCausalLM' in classes else None
    return ExportPlan('remote', config, code=code, note=f"{note}; exported with its modeling code "
                                                       f"(load with trust_remote_code=True)")


def plan_export(config) -> ExportPlan:
    """How ``config``'s family is exported so that it loads without flame (see the module doc)."""
    from flame.utils.export_llama import llama_config, llama_key, llama_mismatches
    source = type(config).__module__.split('.')[0]
    if config.model_type == 'transformer' and source == 'flame':
        why = llama_mismatches(config)
        if not why:
            return ExportPlan('llama', llama_config(config), rename=llama_key, note='exported as LlamaForCausalLM')
        return _remote_plan(config, f"flame transformer with {', '.join(why)} has no standard equivalent")
    if source == 'fla':
        config = _copy_config(config)
        from transformers import AutoModelForCausalLM
        cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
        if cls is not None:
            config.architectures = [cls.__name__]
        return ExportPlan('fla', config, note="FLA model (load after 'import fla')")
    if source == 'transformers':
        return ExportPlan('hf', _copy_config(config))
    return _remote_plan(config, f"model_type {config.model_type!r} is not part of transformers or FLA")


def _umask_modes() -> tuple[int, int]:
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask, 0o666 & ~mask


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor from a live (sharded) model gathered whole; any other tensor as it is."""
    return t.full_tensor() if hasattr(t, 'full_tensor') else t


def apply_umask(folder: str) -> None:
    """mkdtemp makes 0700 folders and safetensors 0600 files: give them what the umask allows."""
    dir_mode, file_mode = _umask_modes()
    for root, _, files in os.walk(folder):
        os.chmod(root, dir_mode)
        for f in files:
            os.chmod(os.path.join(root, f), file_mode)


def _load_tokenizer(tokenizer):
    if not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    from transformers import AutoTokenizer

    from flame.data.options import looks_like_a_local_path
    name = str(tokenizer)
    if not os.path.isdir(name) and looks_like_a_local_path(name):
        raise ConfigError(f"tokenizer {name!r}: no such folder")
    try:
        # a hub id from the local cache only, as in training: flame never downloads
        return AutoTokenizer.from_pretrained(name, local_files_only=not os.path.isdir(name))
    except (OSError, ValueError) as e:
        raise ConfigError(f"tokenizer {str(tokenizer)!r} cannot be loaded: {str(e).splitlines()[0]}") from None


def _save_tokenizer(tokenizer, out: str) -> None:
    if tokenizer is not None:
        _load_tokenizer(tokenizer).save_pretrained(out)


def export_hf(model_state_dict_or_checkpoint_dir: dict[str, torch.Tensor] | str, model_config, tokenizer,
              out_dir: str, dtype: str | torch.dtype = 'bfloat16', max_shard_size: int | str = DEFAULT_SHARD,
              overwrite: bool = False, lora=None, adapter_dir: str | None = None,
              base_model: str | None = None) -> str:
    """Write an HF folder (safetensors weights, config.json, tokenizer) to ``out_dir``.

    Args:
        model_state_dict_or_checkpoint_dir: a model state dict (full tensors; extra keys are ignored)
            or a DCP checkpoint folder (``<dump>/checkpoint/step-N``).
        model_config: ``PretrainedConfig``, JSON file or HF folder describing the model.
        tokenizer: tokenizer object, path/name for ``AutoTokenizer``, or None.
        dtype: dtype of the exported weights (the config records it).
        max_shard_size: bytes or '5GB'-style string; above it, weights are split into
            ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.
        overwrite: replace an existing ``out_dir`` (only after the new export is complete).
        lora: the run's ``[lora]`` section (rank, alpha, dropout) when the weights hold LoRA adapters
            (``<layer>.lora_A``/``lora_B`` keys): they are merged into their base weights
            (``flame.lora.export``); adapters without it are an error.
        adapter_dir: with ``lora``, also write the adapters alone there in PEFT's format, recording
            ``base_model`` as their base.
    Returns:
        ``out_dir``. Raises ``ConfigError`` (one line) on bad input.
    """
    from safetensors.torch import save_file

    config = load_config(model_config)
    dtype = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConfigError(f"output folder {out_dir!r} exists and is not empty (--overwrite replaces it)")
    meta_model = _meta_model(config)
    keys = model_keys(config, meta_model)
    plan = plan_export(config)

    from flame.lora.export import adapted_weights, adapter_keys, merge_weight
    from flame.lora.layer import is_adapter_key

    from_dcp = not isinstance(model_state_dict_or_checkpoint_dir, dict)
    if from_dcp:
        ckpt = str(model_state_dict_or_checkpoint_dir)
        if not os.path.isdir(ckpt):
            raise ConfigError(f"checkpoint folder {ckpt!r} does not exist")
        metadata = _dcp_metadata(ckpt)
        _check_against_metadata(keys, metadata, ckpt)
        from flame.components.checkpoint import saved_model_keys
        names = set(meta_model.state_dict())  # tied aliases too: the checkpoint holds them
        extra = [k for k in saved_model_keys(metadata) if k not in names and not is_adapter_key(k)]
        if extra:
            raise ConfigError(f"checkpoint {ckpt!r} holds {len(extra)} model key(s) this config lacks, "
                              f"e.g. {extra[0]!r}: wrong --config for this checkpoint?")
        present = metadata
    else:
        sd = model_state_dict_or_checkpoint_dir
        meta = {k: type('M', (), {'size': tuple(v.shape)}) for k, v in sd.items()}
        _check_against_metadata(keys, meta, '<state dict>')
        present = sd
    adapted = set(adapted_weights(k for k in present if is_adapter_key(k)))
    if adapted and lora is None:
        raise ConfigError(f"the weights hold LoRA adapters (e.g. on {sorted(adapted)[0]!r}) but no LoRA rank/alpha "
                          f"is known to merge them (the run's job_config.json has no lora section)")
    scale = lora.alpha / lora.rank if adapted else 0.0
    if adapter_dir is not None and adapted:
        from flame.lora.export import write_peft_adapters
        names = [a for w in adapted for a in adapter_keys(w)]
        adapters = _read_from_dcp(ckpt, names, metadata) if from_dcp else {k: sd[k] for k in names}
        linears = [k[: -len('.weight')] for k, (shape, _) in keys.items() if k.endswith('.weight') and len(shape) == 2]
        write_peft_adapters(adapters, lora, linears, plan.rename, adapter_dir, dtype, base_model)
        logger.info(f"flame: wrote the LoRA adapters in PEFT's format to {adapter_dir}")

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.tmp-', dir=parent)
    try:
        shards = _plan_shards(keys, dtype, max_bytes)
        n = len(shards)
        weight_map, total = {}, 0
        for i, names in enumerate(shards):
            fname = 'model.safetensors' if n == 1 else f'model-{i + 1:05d}-of-{n:05d}.safetensors'
            extra = [a for k in names if k in adapted for a in adapter_keys(k)]
            part = _read_from_dcp(ckpt, names + extra, metadata) if from_dcp else {k: sd[k] for k in names + extra}
            tensors = {}
            for k in names:
                t = whole(part[k])
                if k in adapted:  # W + alpha/rank * B @ A
                    a, b = (whole(part[x]) for x in adapter_keys(k))
                    t = merge_weight(t, a, b, scale)
                t = t.detach().to('cpu', dtype if t.is_floating_point() else t.dtype).contiguous()
                tensors[plan.rename(k)] = t
                total += t.numel() * t.element_size()
                weight_map[plan.rename(k)] = fname
            save_file(tensors, os.path.join(tmp, fname), metadata={'format': 'pt'})
            del part, tensors
        if n > 1:
            with open(os.path.join(tmp, 'model.safetensors.index.json'), 'w') as f:
                json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
        out_config = plan.config  # a copy: the caller's config is not changed
        out_config.dtype = dtype
        out_config.save_pretrained(tmp)
        for name, text in plan.code.items():
            with open(os.path.join(tmp, name), 'w') as f:
                f.write(text)
        _save_tokenizer(tokenizer, tmp)
        apply_umask(tmp)
        if os.path.exists(out_dir):
            old = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.old-', dir=parent)
            os.rename(out_dir, os.path.join(old, 'x'))
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if plan.note:
        logger.info(f"flame: {out_dir}: {plan.note}")
        if plan.kind == 'package':
            logger.warning(f"flame: {plan.note}")
    return out_dir


def hf_to_dcp(hf_dir: str, checkpoint_dir: str, dtype: str | torch.dtype = 'float32') -> list[str]:
    """Save an HF model's weights as a model-only DCP checkpoint (``step-0`` layout).

    Keys are ``get_model_state_dict(model)``'s, which is what torchtitan's ``ModelWrapper`` saves
    and loads, so the folder works as ``checkpoint.initial_load_path`` (model only) or as
    ``<dump>/checkpoint/step-0`` of a run that resumes. Weights are stored in ``dtype``
    (float32: the trainer's master weights). Returns the saved keys.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from transformers import AutoModelForCausalLM

    from flame.components.checkpoint import record_folder

    register_families()
    dtype = parse_dtype(dtype)
    if not os.path.isdir(hf_dir) or not os.path.isfile(os.path.join(hf_dir, 'config.json')):
        raise ConfigError(f"{hf_dir!r} is not a Hugging Face model folder (no config.json)")
    checkpoint_dir = os.path.abspath(checkpoint_dir)
    if os.path.exists(checkpoint_dir) and os.listdir(checkpoint_dir):
        raise ConfigError(f"checkpoint folder {checkpoint_dir!r} exists and is not empty")
    from flame.models.cpu import install_attention_standins
    install_attention_standins()  # hybrids check for flash-attn at construction
    from transformers.utils import logging as hf_logging
    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report: the mismatches are one line below
    hf_logging.disable_progress_bar()
    try:
        # safetensors only (a pickle runs code: docs/training.md, "Security"), as model.init_from
        model, info = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, use_safetensors=True,
                                                           output_loading_info=True, ignore_mismatched_sizes=True)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load the HF model in {hf_dir!r}: {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    # from_pretrained initializes the tensors the files lack (or hold in another shape) at random and
    # drops those the model lacks: each is an error, as with model.init_from
    problems = [f"tensor {k} of this model is not in the weights" for k in sorted(info.get('missing_keys') or ())]
    problems += [f"tensor {k} of the weights is not in this model" for k in sorted(info.get('unexpected_keys') or ())]
    problems += [f"tensor {k} is {list(saved)} in the weights, {list(wanted)} in this model"
                 for k, saved, wanted in sorted(info.get('mismatched_keys') or ())]
    if problems:
        raise ConfigError(f"{hf_dir!r}: {problems[0]} ({len(problems)} such; config.json and the weights disagree)")
    state = get_model_state_dict(model)
    parent = os.path.dirname(checkpoint_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(checkpoint_dir)}.tmp-', dir=parent)
    try:
        dcp.save(state, checkpoint_id=tmp)
        record_folder(tmp)  # complete: a run resumes from it without the "no completion record" warning
        if os.path.exists(checkpoint_dir):
            os.rmdir(checkpoint_dir)  # empty, checked above
        os.rename(tmp, checkpoint_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return list(state)


def _read_job_config(dump: str) -> dict[str, Any]:
    """``<dump>/job_config.json`` parsed; {} if the file is absent."""
    path = os.path.join(dump, 'job_config.json')
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path!r} is not valid JSON: {e}") from None


def resolve_job_config(dump: str) -> dict[str, Any]:
    """What an export needs from ``<dump>/job_config.json`` (nested or dotted keys): ``config``
    (model.config), ``tokenizer`` (model.tokenizer_path), ``vocab_multiple`` and ``module``
    (model.module); {} if the file is absent."""
    data = _read_job_config(dump)
    model = data.get('model', {}) if isinstance(data.get('model'), dict) else {}

    def get(key):
        return model.get(key, data.get(f'model.{key}'))

    out = {'config': get('config'), 'tokenizer': get('tokenizer_path'), 'vocab_multiple': get('vocab_multiple'),
           'module': get('module')}
    return {k: v for k, v in out.items() if v}


def run_lora_config(dump: str):
    """The ``[lora]`` section of the run in ``dump`` (from ``job_config.json``) when it trained with
    LoRA (rank > 0), else None."""
    from flame.lora.config import Lora

    section = _read_job_config(dump).get('lora') or {}
    lora = Lora(**{k: v for k, v in section.items() if k in Lora.__dataclass_fields__})
    return lora if lora.rank > 0 else None


def run_model_config(dump: str, config: str | None = None, tokenizer: str | None = None):
    """The model config a run trained, rebuilt from ``<dump>/job_config.json`` as the trainer built
    it: its ``model.module`` imported, the vocabulary raised to the tokenizer's size
    (``model.vocab_multiple``). ``config`` / ``tokenizer`` override the saved paths.
    Returns ``(PretrainedConfig, tokenizer path or None)``."""
    from flame.models.build import fit_vocab
    from flame.models.registry import import_model_modules

    saved = resolve_job_config(dump)
    config = config or saved.get('config')
    if not config:
        raise ConfigError(f"no model config: {os.path.join(dump, 'job_config.json')!r} is absent or has no "
                          f"model.config; pass --config")
    register_families()
    import_model_modules(saved.get('module'))
    config = load_config(config)
    tokenizer = tokenizer or saved.get('tokenizer')
    if tokenizer:
        config = _copy_config(config)
        fit_vocab(config, len(_load_tokenizer(tokenizer)), int(saved.get('vocab_multiple') or 64))
    return config, tokenizer
