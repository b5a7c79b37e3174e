"""Device dispatch: replace FLA entry points by wrappers that pick the torch path for CPU tensors.

A wrapper looks at the first tensor among the call's arguments: on CPU (or meta) it calls flame's
torch implementation, on any other device it calls the original FLA function unchanged. Wrappers carry
``__flame_cpu_original__`` so that patching twice is a no-op (idempotence) and so that tests can
reach the original.
"""
from __future__ import annotations

import functools
import sys
from typing import Callable

import torch

MARK = '__flame_cpu_original__'


def first_tensor(args, kwargs) -> torch.Tensor | None:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


# devices whose tensors take flame's torch implementations: CPU, and meta, where they also give the
# shapes, saved tensors and FLOPs the offload planner measures (Triton cannot run there)
TORCH_PATH_DEVICES = ('cpu', 'meta')


def is_cpu_call(args, kwargs) -> bool:
    t = first_tensor(args, kwargs)
    return t is not None and t.device.type in TORCH_PATH_DEVICES


_caller_autocast: list = []  # autocast dtype (or None) of the callers of the running CPU fallbacks


def caller_autocast_dtype() -> torch.dtype | None:
    """Inside a CPU fallback: the autocast dtype its caller ran under (None without autocast). FLA's
    fused ops with a matmul (norm + linear, swiglu + linear) compute it in that dtype, as here."""
    return _caller_autocast[-1] if _caller_autocast else None


def make_dispatcher(original: Callable, cpu_impl: Callable, skip_self: bool = False) -> Callable:
    """Wrap ``original`` so CPU calls go to ``cpu_impl``; ``skip_self`` for methods (self is a Module)."""
    @functools.wraps(original)
    def dispatcher(*args, **kwargs):
        probe = args[1:] if skip_self else args
        if is_cpu_call(probe, kwargs):
            # Triton kernels ignore autocast; so do their replacements (they manage dtypes themselves
            # and keep the recurrences in float32)
            outer = torch.get_autocast_dtype('cpu') if torch.is_autocast_enabled('cpu') else None
            _caller_autocast.append(outer)
            try:
                with torch.autocast('cpu', enabled=False):
                    return cpu_impl(*args, **kwargs)
            finally:
                _caller_autocast.pop()
        return original(*args, **kwargs)

    setattr(dispatcher, MARK, original)
    dispatcher.__flame_cpu_impl__ = cpu_impl
    return dispatcher


def _fla_modules():
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == 'fla' or name.startswith('fla.'))]


def rebind_everywhere(replace: Callable) -> int:
    """Every binding in loaded ``fla.*`` modules and their dict registries (upper-case names such as
    ``ACT2FN``) whose value ``replace`` maps to another object is rebound to it. Returns the count."""
    count = 0
    for mod in _fla_modules():
        d = getattr(mod, '__dict__', {})
        for attr, val in list(d.items()):
            new = replace(val)
            if new is not val:
                setattr(mod, attr, new)
                count += 1
            elif isinstance(val, dict) and attr.isupper():
                for key, item in list(val.items()):
                    new = replace(item)
                    if new is not item:
                        val[key] = new
                        count += 1
    return count


def patch_function_everywhere(home_module: str, name: str, cpu_impl: Callable) -> int:
    """Replace ``home_module.name`` and every alias of the same object in loaded ``fla.*`` modules
    (layers do ``from fla.ops.gla import chunk_gla``, so the name is bound in many namespaces) and in
    dict registries such as ``ACT2FN``. Returns the number of bindings replaced."""
    return sum(patch_functions_everywhere([(home_module, name, cpu_impl)]).values())


def patch_functions_everywhere(patches, model=None) -> dict:
    """`patch_function_everywhere` for every ``(home_module, name, cpu_impl)`` in one pass over the
    loaded modules (one pass per function took seconds at every trainer start), and over the
    attributes of ``model``'s submodules when given. Returns ``{home.name: bindings replaced}`` for
    the names that had any."""
    table, names = {}, {}
    for home_module, name, cpu_impl in patches:
        home = sys.modules.get(home_module)
        if home is None:
            __import__(home_module)
            home = sys.modules[home_module]
        current = getattr(home, name)
        original = getattr(current, MARK, current)
        table[id(original)] = (original, current if hasattr(current, MARK) else make_dispatcher(original, cpu_impl))
        names[id(original)] = f'{home_module}.{name}'
    counts: dict = {}

    def replace(v):
        hit = table.get(id(v))
        if hit is None or hit[0] is not v:
            return v
        counts[names[id(v)]] = counts.get(names[id(v)], 0) + 1
        return hit[1]

    rebind_everywhere(replace)
    if model is not None:
        _rebind_instances(model, replace)
    return counts


def _rebind_instances(model, replace: Callable) -> None:
    """Attributes of ``model``'s submodules that ``replace`` maps to another object, rebound."""
    for module in model.modules():
        for attr, val in list(vars(module).items()):
            if callable(val) and not isinstance(val, torch.nn.Module):
                new = replace(val)
                if new is not val:
                    setattr(module, attr, new)


def unpatch_everywhere() -> int:
    """Every dispatcher in loaded ``fla.*`` modules and registries back to its original."""
    return rebind_everywhere(lambda v: getattr(v, MARK) if hasattr(v, MARK) else v)


def patch_method(cls: type, name: str, cpu_impl: Callable) -> None:
    """Replace ``cls.name`` (a method whose first argument is self) by a device dispatcher."""
    current = cls.__dict__[name]
    if hasattr(current, MARK):
        return
    setattr(cls, name, make_dispatcher(current, cpu_impl, skip_self=True))


def unpatch_method(cls: type, name: str) -> None:
    current = cls.__dict__[name]
    if hasattr(current, MARK):
        setattr(cls, name, getattr(current, MARK))
