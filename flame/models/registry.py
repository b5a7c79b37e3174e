"""Facts about the model families flame trains, in one place.

For each family: what its layers' token mixers are (softmax attention, a linear-attention kind or an
SSM) and their per-head dimensions, read from a transformers config. ``flame.models.flops`` turns
these into FLOPs; tests and docs use ``FAMILIES`` to know what is covered where.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from flame.errors import ConfigError


@dataclass(frozen=True)
class Family:
    """kind: 'softmax' (all layers attention), 'linear' (linear attention / SSM), 'hybrid'.
    cpu: whether the family runs on CPU (FLA families through flame.models.cpu)."""
    kind: str
    cpu: bool
    source: str  # 'fla', 'hf', 'flame', 'custom' or 'user' (registered by model.module)


FAMILIES: dict[str, Family] = {
    'gla': Family('linear', True, 'fla'),
    'delta_net': Family('linear', True, 'fla'),
    'gated_deltanet': Family('linear', True, 'fla'),
    'gsa': Family('linear', True, 'fla'),
    'hgrn2': Family('linear', True, 'fla'),
    'mamba': Family('linear', True, 'fla'),
    'mamba2': Family('linear', True, 'fla'),
    'samba': Family('hybrid', True, 'fla'),
    'transformer': Family('softmax', True, 'flame'),
    'llama': Family('softmax', True, 'hf'),
    'qwen3': Family('softmax', True, 'hf'),
    'retention_lm': Family('linear', True, 'custom'),
}


@dataclass(frozen=True)
class Mixer:
    """The token mixer of one layer.

    kind:   'softmax' | 'gla' (diagonal-decay linear attention, also HGRN2 and Mamba2's SSD) |
            'delta' (delta rule, gated or not) | 'gsa' | 'mamba' (selective scan)
    heads:  heads of the recurrence / attention (value heads for grouped-value delta rules)
    dk, dv: per-head key and value dims (for 'mamba': dk = state size, dv = 1, heads = d_inner)
    window: sliding window of softmax attention, None for full causal attention
    slots:  GSA's number of memory slots
    """
    kind: str
    heads: int
    dk: int
    dv: int
    window: int | None = None
    slots: int = 0


def _attn_layers(config) -> tuple[set, dict]:
    """FLA's hybrid spec: ``config.attn = {'layers': [...], 'num_heads', 'window_size', ...}``."""
    attn = getattr(config, 'attn', None)
    if not attn:
        return set(), {}
    if isinstance(attn, (list, tuple)):  # a list of specs, each with its own 'layers'
        layers, first = set(), {}
        for spec in attn:
            layers |= set(spec.get('layers', ()))
            first = first or spec
        return layers, first
    return set(attn.get('layers', ())), attn


def _softmax_mixer(config, spec: dict | None = None, window=None) -> Mixer:
    spec = spec or {}
    heads = spec.get('num_heads') or getattr(config, 'num_attention_heads', None) or getattr(config, 'num_heads')
    hd = getattr(config, 'head_dim', None) if not spec else None
    hd = hd or config.hidden_size // heads
    return Mixer('softmax', heads, hd, hd, window=window)


def _native_mixer(config, mt: str) -> Mixer:
    d = config.hidden_size
    if mt == 'gla':
        h = config.num_heads
        return Mixer('gla', h, round(d * config.expand_k) // h, round(d * config.expand_v) // h)
    if mt == 'delta_net':
        h = config.num_heads
        return Mixer('delta', h, round(d * config.expand_k) // h, round(d * config.expand_v) // h)
    if mt == 'gated_deltanet':
        hv = getattr(config, 'num_v_heads', None) or config.num_heads
        return Mixer('delta', hv, config.head_dim, int(config.head_dim * config.expand_v))
    if mt == 'gsa':
        h = config.num_heads
        dk = round(d * getattr(config, 'expand_k', 1)) // h
        dv = round(d * getattr(config, 'expand_v', 1)) // h
        return Mixer('gsa', h, dk, dv, slots=config.num_slots or dk)
    if mt == 'hgrn2':
        h = config.num_heads
        return Mixer('gla', h, config.expand_ratio, d // h)
    if mt in ('mamba', 'samba'):
        return Mixer('mamba', config.expand * d, config.state_size, 1)
    if mt == 'mamba2':
        heads = config.expand * d // config.head_dim
        return Mixer('gla', heads, config.state_size, config.head_dim)
    if mt == 'retention_lm':
        h = config.num_heads
        return Mixer('gla', h, d // h, d // h)
    raise ConfigError(f"flame does not know the token mixer of model_type {mt!r} "
                      f"(register it: flame.models.register_mixer)")


# -- models from outside flame: registered by the user's package (see custom_models/README.md) --

BLOCK_CLASSES: dict[str, str] = {}
MIXERS: dict[str, Callable] = {}
ENTRY_POINT_GROUP = 'flame.models'


def register_block_class(model_type: str, class_name: str) -> None:
    """Tell flame the class name of ``model_type``'s repeated decoder block (FSDP, activation
    checkpointing, per-block compile and the offload engine work block by block). Without it
    flame takes the largest ``nn.ModuleList`` of one class."""
    BLOCK_CLASSES[model_type] = class_name


def register_mixer(model_type: str, mixer: Callable, kind: str = 'linear') -> None:
    """``mixer(config) -> Mixer | list[Mixer]``: the token mixer of ``model_type``'s layers (one for
    all layers, or one per layer), for FLOPs counting and the offload planner.
    kind: 'softmax' | 'linear' | 'hybrid'."""
    if kind not in ('softmax', 'linear', 'hybrid'):
        raise ConfigError(f"register_mixer kind {kind!r} is not one of softmax, linear, hybrid")
    MIXERS[model_type] = mixer
    FAMILIES.setdefault(model_type, Family(kind, True, 'user'))


def import_model_modules(modules: list[str] | str | None) -> None:
    """Import the packages named by ``model.module`` (they register their configs and models with
    transformers' Auto classes and call the functions above), then the ``flame.models`` entry points
    of installed packages. Idempotent (Python caches imports)."""
    if isinstance(modules, str):
        modules = [m for m in modules.split(',') if m.strip()]
    for name in modules or ():
        name = name.strip()
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                raise ConfigError(f"model.module {name!r} cannot be imported: no module named {e.name!r} "
                                  f"(is its folder on PYTHONPATH or the working directory?)") from None
            raise ConfigError(f"model.module {name!r} cannot be imported: it needs {e.name or str(e)!r}, which "
                              "is not installed") from None
        except SyntaxError as e:
            raise ConfigError(f"model.module {name!r} cannot be imported: {e.msg} ({e.filename}, line {e.lineno})") from None
    from importlib.metadata import entry_points
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        ep.load()


def layer_mixers(config) -> list[Mixer]:
    """Per-layer mixers of a transformers config (FLA, flame, HF llama/qwen3-like, custom_models,
    models registered with ``register_mixer``)."""
    mt = config.model_type
    n = config.num_hidden_layers
    if mt in MIXERS:
        got = MIXERS[mt](config)
        got = list(got) if isinstance(got, (list, tuple)) else [got] * n
        if len(got) != n or not all(isinstance(m, Mixer) for m in got):
            raise ConfigError(f"the mixer registered for model_type {mt!r} must return a Mixer or {n} Mixers")
        return got
    fam = FAMILIES.get(mt)
    if mt == 'transformer':
        return [_softmax_mixer(config, window=getattr(config, 'window_size', None))] * n
    if fam is None or fam.source == 'hf':
        if not hasattr(config, 'num_attention_heads'):
            raise ConfigError(f"flame does not know the token mixer of model_type {mt!r} "
                              f"(register it: flame.models.register_mixer)")
        types = getattr(config, 'layer_types', None) or ['full_attention'] * n
        sliding = getattr(config, 'sliding_window', None)
        if not getattr(config, 'use_sliding_window', True):
            sliding = None
        return [_softmax_mixer(config, window=sliding if t == 'sliding_attention' else None) for t in types]
    attn_layers, spec = _attn_layers(config)
    native = _native_mixer(config, mt)
    return [_softmax_mixer(config, spec, window=spec.get('window_size')) if i in attn_layers else native
            for i in range(n)]
