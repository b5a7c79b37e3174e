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
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Any

import torch

from flame.errors import ConfigError

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


def model_keys(config) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Keys to export -> (shape, dtype), from a meta-device build.

    Parameters shared by several names (tied embeddings) are listed once, under the name HF keeps
    (the first registered: the input embedding), as ``save_pretrained`` does.
    """
    from transformers import AutoModelForCausalLM

    from flame.models.flops import _attention_buildable
    register_families()
    with torch.device('meta'), _attention_buildable():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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


def _save_tokenizer(tokenizer, out: str) -> None:
    if tokenizer is None:
        return
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer))
        except (OSError, ValueError) as e:
            raise ConfigError(f"tokenizer {str(tokenizer)!r} cannot be loaded: {str(e).splitlines()[0]}") from None
    tokenizer.save_pretrained(out)


def export_hf(model_state_dict_or_checkpoint_dir: dict[str, torch.Tensor] | str, model_config, tokenizer,
              out_dir: str, dtype: str | torch.dtype = 'bfloat16', max_shard_size: int | str = DEFAULT_SHARD,
              overwrite: bool = False) -> str:
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
    Returns:
        ``out_dir``. Raises ``ConfigError`` (one line) on bad input.
    """
    from safetensors.torch import save_file

    config = load_config(model_config)
    dtype = parse_dtype(dtype)
    max_bytes = parse_size(max_shard_size)
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise ConfigError(f"output folder {out_dir!r} exists and is not empty (pass overwrite to replace it)")
    keys = model_keys(config)

    from_dcp = not isinstance(model_state_dict_or_checkpoint_dir, dict)
    if from_dcp:
        ckpt = str(model_state_dict_or_checkpoint_dir)
        if not os.path.isdir(ckpt):
            raise ConfigError(f"checkpoint folder {ckpt!r} does not exist")
        metadata = _dcp_metadata(ckpt)
        _check_against_metadata(keys, metadata, ckpt)
    else:
        sd = model_state_dict_or_checkpoint_dir
        meta = {k: type('M', (), {'size': tuple(v.shape)}) for k, v in sd.items()}
        _check_against_metadata(keys, meta, '<state dict>')

    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(out_dir)}.tmp-', dir=parent)
    try:
        shards = _plan_shards(keys, dtype, max_bytes)
        n = len(shards)
        weight_map, total = {}, 0
        for i, names in enumerate(shards):
            fname = 'model.safetensors' if n == 1 else f'model-{i + 1:05d}-of-{n:05d}.safetensors'
            part = _read_from_dcp(ckpt, names, metadata) if from_dcp else {k: sd[k] for k in names}
            tensors = {}
            for k in names:
                t = part[k]
                if hasattr(t, 'full_tensor'):  # a DTensor from a live (sharded) model
                    t = t.full_tensor()
                tensors[k] = t.detach().to('cpu', dtype if t.is_floating_point() else t.dtype).contiguous()
                total += tensors[k].numel() * tensors[k].element_size()
                weight_map[k] = fname
            save_file(tensors, os.path.join(tmp, fname), metadata={'format': 'pt'})
            del part, tensors
        if n > 1:
            with open(os.path.join(tmp, 'model.safetensors.index.json'), 'w') as f:
                json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
        config = config.__class__.from_dict(config.to_dict())  # do not mutate the caller's config
        config.dtype = dtype
        config.save_pretrained(tmp)
        _save_tokenizer(tokenizer, tmp)
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
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"cannot load the HF model in {hf_dir!r}: {str(e).splitlines()[0]}") from None
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


def resolve_job_config(dump: str) -> dict[str, Any]:
    """``model.config`` and ``model.tokenizer_path`` from ``<dump>/job_config.json`` (nested or
    dotted keys), or {} if the file is absent."""
    path = os.path.join(dump, 'job_config.json')
    if not os.path.isfile(path):
        return {}
    try:
        data = json.load(open(path))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path!r} is not valid JSON: {e}") from None
    model = data.get('model', {}) if isinstance(data.get('model'), dict) else {}
    out = {'config': model.get('config', data.get('model.config')),
           'tokenizer': model.get('tokenizer_path', data.get('model.tokenizer_path'))}
    return {k: v for k, v in out.items() if v}
