"""LoRA adapters out of a state dict or DCP checkpoint: merged into their base weights (the HF export),
or alone in PEFT's format.

An adapted layer ``X`` has the keys ``X.weight`` (frozen base), ``X.lora_A`` (rank x in) and
``X.lora_B`` (out x rank); merged, ``X.weight = W + alpha/rank * B @ A`` (computed in float32).
PEFT's files name the same tensors ``base_model.model.<X>.lora_A.weight`` / ``...lora_B.weight``,
with ``<X>`` the module path in the exported model (the export's renaming applied).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def adapter_keys(weight_key: str) -> tuple[str, str]:
    """The A and B keys of the adapter on ``<layer>.weight``."""
    prefix = weight_key[: -len(".weight")]
    return f"{prefix}.lora_A", f"{prefix}.lora_B"


def adapted_weights(keys) -> list[str]:
    """The ``<layer>.weight`` keys that have an adapter among ``keys``."""
    keys = set(keys)
    return [k[: -len(".lora_A")] + ".weight" for k in sorted(keys) if k.endswith(".lora_A")
            and k[: -len(".lora_A")] + ".lora_B" in keys]


def merge_weight(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W + scale * B @ A`` in float32."""
    return weight.float() + scale * (b.float() @ a.float())


def peft_target_modules(adapted: list[str], all_linears: list[str]) -> list[str] | str:
    """PEFT's ``target_modules``: the layer names when every linear of those names is adapted, else a
    regex of the exact module paths (PEFT full-matches a string against each module's name)."""
    import re

    leaves = sorted({m.rsplit(".", 1)[-1] for m in adapted})
    covered = {m for m in all_linears if m.rsplit(".", 1)[-1] in leaves}
    if covered == set(adapted):
        return leaves
    return "|".join(re.escape(m) for m in sorted(adapted))


def write_peft_adapters(adapters: dict[str, torch.Tensor], lora, linear_names: list[str], rename, out_dir: str,
                        dtype: torch.dtype, base_model: str | None = None) -> str:
    """Write ``adapters`` (``X.lora_A``/``X.lora_B`` -> tensor, flame's keys) as a PEFT LoRA folder.

    ``lora``: rank, alpha and dropout (the ``[lora]`` section); ``linear_names``: every linear of
    the exported model (for ``target_modules``); ``rename``: flame's key -> the exported model's
    (``<layer>.weight`` keys); ``base_model``: recorded as ``base_model_name_or_path``.
    """
    from safetensors.torch import save_file

    from flame.utils.hf_export import apply_umask, whole

    tensors, adapted = {}, []
    for w in adapted_weights(adapters):
        path = rename(w)[: -len(".weight")]
        adapted.append(path)
        a, b = adapter_keys(w)
        for key, part in ((a, "lora_A"), (b, "lora_B")):
            t = whole(adapters[key])
            tensors[f"base_model.model.{path}.{part}.weight"] = t.detach().to("cpu", dtype).contiguous()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": peft_target_modules(adapted, [rename(n + ".weight")[: -len(".weight")] for n in linear_names]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model,
    }
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            json.dump(config, f, indent=2)
        apply_umask(tmp)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
