"""``model.init_from``: start training from the weights of a Hugging Face model folder.

The folder (or a hub id resolved in the local Hugging Face cache, never downloaded) must hold
safetensors weights: ``model.safetensors.index.json`` and its shards, else ``model.safetensors``,
else every ``*.safetensors`` file; pickle files (``.bin``) are refused. Every tensor of the model
(parameters and persistent buffers; tied parameters count once, under any of their names) must be
in the files with its shape, and every tensor of the files must be in the model, else one line
names the tensor and both shapes (exit 2). A flame ``transformer`` also finds its tensors under
the ``LlamaForCausalLM`` names its own HF export writes (``flame.utils.export_llama.llama_key``).

Loading runs after the model is built and parallelized, one tensor at a time: each rank reads the
whole tensor and keeps its part (a DTensor -- FSDP2 or tensor-parallel shard -- through
``distribute_tensor`` with ``src_data_rank=None``, which slices locally without communication), so
memory holds one extra tensor at most. With the offload engine the engine's
``load_model_state_dict`` copies the slices each rank owns into its master weights. A run that
resumes from its own checkpoint ignores ``init_from`` (one log line).
"""

from __future__ import annotations

import contextlib
import json
import os
import re

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.tools.logging import logger

from flame.errors import ConfigError
from flame.lora.layer import is_adapter_key
from flame.models.blocks import clean_name

OPTION = "model.init_from"
_PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


# -- the folder -----------------------------------------------------------------------------
def resolve_folder(value: str) -> str:
    """A local folder, or the snapshot folder of a hub id in the local Hugging Face cache."""
    if os.path.isdir(value):
        # absolute: the PEFT export records it as base_model_name_or_path, read from other directories
        return os.path.abspath(value)
    if os.path.exists(value):
        raise ConfigError(f"{OPTION} {value!r}: not a folder (give the model's folder or a hub id)")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(value, local_files_only=True)
    except (OSError, ValueError):
        raise ConfigError(f"{OPTION} {value!r}: no such folder, and no such model in the local Hugging Face "
                          "cache (flame does not download it: fetch it first, e.g. with `hf download`)") from None


def follow_init_from(cfg, cli_keys: set[str]) -> None:
    """Resolve ``model.init_from`` to a folder; ``model.config`` and ``model.tokenizer_path`` become
    the folder's when the command line gives ``init_from`` without them (or they are unset)."""
    m = cfg.model
    if not m.init_from:
        return
    m.init_from = resolve_folder(m.init_from)
    refuse_adapter_folder(m.init_from)
    refuse_dump_folder(m.init_from)
    if cfg.checkpoint.initial_load_path:
        raise ConfigError(f"{OPTION} and checkpoint.initial_load_path {cfg.checkpoint.initial_load_path!r} both name "
                          "starting weights; give one")
    from_cli = "model.init_from" in cli_keys
    if "model.config" not in cli_keys and (from_cli or not m.config):
        if not os.path.isfile(os.path.join(m.init_from, "config.json")):
            raise ConfigError(f"{OPTION} {m.init_from!r}: no config.json (pass --model.config)")
        m.config = m.init_from
    has_tokenizer = any(os.path.isfile(os.path.join(m.init_from, n)) for n in _TOKENIZER_FILES)
    if has_tokenizer and "model.tokenizer_path" not in cli_keys and (from_cli or not m.tokenizer_path):
        m.tokenizer_path = m.init_from


def refuse_adapter_folder(folder: str, option: str = OPTION) -> None:
    """A PEFT LoRA folder (flame's ``DUMP/hf_adapter``) holds adapters, not a model: one line says
    which folder to give instead."""
    from flame.lora.export import ADAPTER_CONFIG

    if os.path.isfile(os.path.join(folder, "config.json")) or not os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)):
        return
    base = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        with open(os.path.join(folder, ADAPTER_CONFIG)) as f:
            base = json.load(f).get("base_model_name_or_path")
    raise ConfigError(f"{option} {folder!r}: holds LoRA adapters ({ADAPTER_CONFIG}), not a model; {option} needs "
                      "the base model's folder: the merged export (DUMP/hf next to DUMP/hf_adapter) or the base "
                      f"model's Hugging Face folder{f' ({base})' if isinstance(base, str) and base else ''}")


def is_dump_folder(folder: str) -> bool:
    """A run's dump folder: the trainer's job_config.json or a checkpoint folder in it."""
    return os.path.isfile(os.path.join(folder, "job_config.json")) or os.path.isdir(os.path.join(folder, "checkpoint"))


def refuse_dump_folder(folder: str) -> None:
    """A run's dump folder (its checkpoints, job_config.json) is not a model folder: one line names
    its Hugging Face export, or the converter that makes one."""
    if os.path.isfile(os.path.join(folder, "config.json")) or not is_dump_folder(folder):
        return
    hf = os.path.join(folder, "hf")
    instead = (f"give its Hugging Face export {hf!r}" if os.path.isfile(os.path.join(hf, "config.json")) else
               f"export a checkpoint first (python -m flame.utils.convert_dcp_to_hf --path {folder} --step N) "
               f"and give {hf!r}")
    raise ConfigError(f"{OPTION} {folder!r} is a run's dump folder, not a model folder: {instead} "
                      "(to continue that run instead, use --job.dump_folder)")


def weight_files(folder: str) -> list[str]:
    """The safetensors files holding the model (see the module doc), or a one-line error."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{OPTION}: {index} is unreadable ({type(e).__name__})") from None
        missing = [n for n in names if not os.path.isfile(os.path.join(folder, n))]
        if missing:
            raise ConfigError(f"{OPTION}: {os.path.join(folder, missing[0])} (listed in {index}) is missing")
        return [os.path.join(folder, n) for n in names]
    if os.path.isfile(os.path.join(folder, "model.safetensors")):
        return [os.path.join(folder, "model.safetensors")]
    files = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    if files:
        return [os.path.join(folder, n) for n in files]
    pickles = sorted(n for n in os.listdir(folder) if n.endswith(_PICKLES))
    if pickles:
        raise ConfigError(f"{OPTION} {folder!r}: holds only pickle weights ({pickles[0]}); flame reads safetensors "
                          "only (re-save the model with save_pretrained(..., safe_serialization=True))")
    raise ConfigError(f"{OPTION} {folder!r}: no *.safetensors weights in it")


# -- matching the model ---------------------------------------------------------------------
def model_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """(every state-dict name, tensor) of each parameter and persistent buffer, tied ones once.
    LoRA adapters are left out: no base checkpoint has them, and they keep their initialization."""
    by_id: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if is_adapter_key(name):
            continue
        by_id.setdefault(id(t), ([], t))[0].append(clean_name(name))
    return list(by_id.values())


def _file_key(names: list[str], shapes: dict) -> str | None:
    from flame.utils.export_llama import llama_key

    for name in names:
        if name in shapes:
            return name
    for name in names:
        if llama_key(name) in shapes:
            return llama_key(name)
    return None


def match(model: nn.Module, shapes: dict[str, tuple], folder: str) -> list[tuple[list[str], torch.Tensor, str]]:
    """(names, model tensor, file key) for every model tensor, or a one-line error naming the first
    tensor that is missing, unexpected, or of another shape."""
    pairs, used = [], set()
    for names, t in model_tensors(model):
        key = _file_key(names, shapes)
        if key is None:
            raise ConfigError(f"{OPTION} {folder!r}: tensor {names[0]} {list(t.shape)} of this model is not in the "
                              "checkpoint (another architecture?)")
        if tuple(shapes[key]) != tuple(t.shape):
            raise ConfigError(f"{OPTION} {folder!r}: tensor {key} is {list(shapes[key])} in the checkpoint, "
                              f"{list(t.shape)} in this model{_vocab_hint(model, t, shapes[key])}")
        pairs.append((names, t, key))
        used.add(key)
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None) or []
    extra = [k for k in shapes if k not in used and not any(re.search(p, k) for p in ignored)]
    if extra:
        raise ConfigError(f"{OPTION} {folder!r}: tensor {extra[0]} {list(shapes[extra[0]])} of the checkpoint is not "
                          f"in this model (another architecture?)")
    return pairs


def _vocab_hint(model: nn.Module, t: torch.Tensor, file_shape) -> str:
    ends = [getattr(model, f, lambda: None)() for f in ("get_input_embeddings", "get_output_embeddings")]
    if any(m is not None and getattr(m, "weight", None) is t for m in ends) and tuple(file_shape[1:]) == tuple(t.shape[1:]):
        return (" (the vocabulary differs: model.vocab_size is raised to the tokenizer's length rounded up to "
                "model.vocab_multiple; use the checkpoint's own tokenizer)")
    return ""


# -- loading --------------------------------------------------------------------------------
class _SafetensorsReader:
    """Name -> tensor over the safetensors files, read on access (one tensor at a time)."""

    def __init__(self, files: list[str], stack: contextlib.ExitStack):
        from safetensors import safe_open

        self.where, self.shapes = {}, {}
        for path in files:
            try:
                f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
                raise ConfigError(f"{OPTION}: {path} is not a readable safetensors file ({e})") from None
            for key in f.keys():
                self.where[key] = f
                self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.where[key].get_tensor(key)


class _ByModelName:
    """The mapping the offload engine loads from: every model name -> its file tensor."""

    def __init__(self, reader: _SafetensorsReader, pairs):
        self.reader = reader
        self.key = {name: key for names, _, key in pairs for name in names}

    def __contains__(self, name) -> bool:
        return clean_name(name) in self.key

    def __getitem__(self, name) -> torch.Tensor:
        return self.reader[self.key[clean_name(name)]]


@torch.no_grad()
def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    src = src.to(dtype=dst.dtype)
    if isinstance(dst, DTensor):
        src = distribute_tensor(src.to(dst.to_local().device), dst.device_mesh, dst.placements, src_data_rank=None)
    else:
        src = src.to(dst.device)
    dst.copy_(src)


def load_init_from(trainer, resumed: bool) -> None:
    """Load ``model.init_from`` into ``trainer``'s model (or its offload engine) unless it resumed."""
    folder = trainer.cfg.model.init_from
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if resumed:
        if rank0:
            logger.info(f"{OPTION} {folder}: ignored, the run resumes from its own checkpoint (step {trainer.step})")
        return
    files = weight_files(folder)
    with contextlib.ExitStack() as stack:
        reader = _SafetensorsReader(files, stack)
        pairs = match(trainer.model, reader.shapes, folder)
        # with offload the weights live outside the model's parameters (the engine's masters), the
        # buffers stay in the model
        weights = trainer.parts.weights
        buffers = {id(b) for b in trainer.model.buffers()}
        for names, t, key in pairs:
            if weights is None or id(t) in buffers:
                _copy_into(t, reader[key])
        if weights is not None:
            weights.load_state_dict(_ByModelName(reader, [p for p in pairs if id(p[1]) not in buffers]))
        dtypes = sorted({str(reader.where[k].get_slice(k).get_dtype()) for _, _, k in pairs})
    if rank0:
        logger.info(f"{OPTION} {folder}: loaded {len(pairs)} tensors ({', '.join(dtypes)}) from {len(files)} "
                    f"safetensors file(s)")
