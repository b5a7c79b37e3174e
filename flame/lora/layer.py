"""LoRA layers: ``y = x W^T + b + alpha/rank * dropout(x) A^T B^T`` with W and b frozen.

``apply_lora`` swaps the targeted ``nn.Linear`` layers of a (meta) model for ``LoRALinear``, which
keeps the base layer's own ``weight``/``bias`` Parameters under the same state-dict keys and adds
``lora_A`` (rank x in) and ``lora_B`` (out x rank) next to them. It runs on the meta model before
parallelization (FSDP2 must see the adapters when it shards the blocks); weights loaded by key
afterwards (a checkpoint, an HF folder) land in the frozen base unchanged, and the adapter keys
``<layer>.lora_A`` / ``<layer>.lora_B`` are the only new ones (`is_adapter_key`).

The adapters are initialized by ``init_adapters`` (called by ``flame.models.build.init_weights``):
A uniform in +-1/sqrt(in) (nn.Linear's kaiming-uniform default), B zero, so the adapted model starts
as the base model. A is drawn from a generator seeded by the run seed and the layer's name, so its
values do not depend on sharding and the model's own init consumes the same random stream as
without LoRA (the base weights of a seeded run equal those of a run without LoRA).
"""

from __future__ import annotations

import fnmatch
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from flame.errors import ConfigError
from flame.models.blocks import clean_name

ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRALinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trainable low-rank update (an ``nn.Linear`` itself, so code that
    initializes or inspects linears by type still sees the base layer)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.rank, self.alpha = rank, alpha
        self.scale = alpha / rank
        kw = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, rank, **kw))
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + update * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, alpha={self.alpha}"


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key is a LoRA adapter's (not in any base checkpoint)."""
    return key.endswith(ADAPTER_SUFFIXES)


def _matches(pattern: str, name: str) -> bool:
    if "." in pattern:
        return fnmatch.fnmatchcase(name, pattern)
    return fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], pattern)


def lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    """(clean name, layer) of every LoRA layer of the model."""
    return [(clean_name(n), m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]


def apply_lora(model: nn.Module, cfg) -> str:
    """Freeze every parameter and put adapters on the targeted linears of the decoder blocks.

    ``cfg``: the ``[lora]`` section. Returns a log line. A user pattern (one not in the default
    list) that matches no linear is a ConfigError, as is a target set that matches nothing.
    """
    from flame.lora.config import DEFAULT_TARGETS
    from flame.models.blocks import find_block_list

    patterns = [p for p in cfg.targets if p]
    _, _, blocks = find_block_list(model)
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear) and id(m) in in_blocks]
    chosen = [(n, m) for n, m in linears if any(_matches(p, clean_name(n)) for p in patterns)]
    leaves = sorted({clean_name(n).rsplit(".", 1)[-1] for n, _ in linears})
    for p in patterns:
        if p not in DEFAULT_TARGETS and not any(_matches(p, clean_name(n)) for n, _ in linears):
            raise ConfigError(f"lora.targets {p!r} matches no linear layer of the decoder blocks "
                              f"(their names: {', '.join(leaves)})")
    if not chosen:
        raise ConfigError(f"lora.targets {','.join(patterns)!r} match no linear layer of the decoder blocks "
                          f"(their names: {', '.join(leaves)})")
    for p in model.parameters():
        p.requires_grad_(False)
    unfused = set()
    for name, linear in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, LoRALinear(linear, cfg.rank, cfg.alpha, cfg.dropout))
        # fused SwiGLU kernels read down_proj.weight directly and would skip the adapter
        if attr == "down_proj" and getattr(parent, "fuse_swiglu", False):
            parent.fuse_swiglu = False
            unfused.add(type(parent).__name__)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    kinds = sorted({clean_name(n).rsplit(".", 1)[-1] for n, _ in chosen})
    line = (f"LoRA rank {cfg.rank} alpha {cfg.alpha:g} on {len(chosen)} linears ({', '.join(kinds)}): "
            f"{trainable:,} trainable of {total:,} parameters; the rest is frozen")
    if unfused:
        line += f" ({', '.join(sorted(unfused))}: fused SwiGLU off, it bypasses down_proj)"
    return line


def _adapter_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int | None = None) -> None:
    """A uniform in +-1/sqrt(in_features) from a per-layer generator, B zero (see the module doc)."""
    from flame.models.constructor_init import assign_full

    for name, layer in lora_layers(model):
        gen = torch.Generator().manual_seed(_adapter_seed(seed or 0, name))
        bound = 1.0 / math.sqrt(layer.in_features)
        a = torch.empty(layer.lora_A.shape).uniform_(-bound, bound, generator=gen)
        assign_full(layer.lora_A, a)
        assign_full(layer.lora_B, torch.zeros(layer.lora_B.shape))
