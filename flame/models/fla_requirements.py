"""What an FLA model needs from the machine it trains on, checked before anything is compiled.

FLA refuses its Triton path for the gated ``chunk_bwd_dqkwg`` (the backward of every layer that
passes a gate ``g`` to it) on Hopper GPUs with Triton >= 3.4 and < 3.7.1, whose results there are
wrong, and runs FLA's tilelang backend instead when the ``tilelang`` package is usable. Without it
the run fails in its first backward, after minutes of compiling; the trainer asks first.
"""

from __future__ import annotations

import importlib

import torch

# FLA layers whose backward runs the gated chunk_bwd_dqkwg: (module, class)
GATED_BACKWARD_LAYERS = (
    ("fla.layers.gated_deltanet", "GatedDeltaNet"),
    ("fla.layers.comba", "Comba"),
    ("fla.layers.mom", "MomAttention"),
    ("fla.layers.precond_gated_deltanet", "PrecondGatedDeltaNet"),
    ("fla.layers.simple_gla", "SimpleGatedLinearAttention"),
    ("fla.layers.yoco", "YOCOGatedRetention"),
)


def _gated_backward_classes() -> tuple[type, ...]:
    classes = []
    for module, name in GATED_BACKWARD_LAYERS:
        try:
            classes.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # an FLA without that layer: nothing of it to find
            continue
    return tuple(classes)


def gated_backward_blocked() -> bool:
    """FLA on this machine would refuse the gated backward: a Hopper GPU, a Triton in FLA's refused
    range, and no usable tilelang backend."""
    import fla.utils
    from fla.backends import TileLangBackend

    if not (fla.utils.IS_NVIDIA_HOPPER and fla.utils.TRITON_ABOVE_3_4_0 and not fla.utils.TRITON_ABOVE_3_7_1):
        return False
    return not (TileLangBackend.is_available() and TileLangBackend().is_enabled())


def missing_backend(model: torch.nn.Module, device: torch.device) -> str | None:
    """Why ``model`` cannot train on ``device`` with the FLA installed here, or None."""
    if device.type != "cuda":
        return None
    classes = _gated_backward_classes()
    layers = sorted({type(m).__name__ for m in model.modules() if classes and isinstance(m, classes)})
    if not layers or not gated_backward_blocked():
        return None
    import triton

    return (f"the model's {', '.join(layers)} layers need FLA's tilelang backend on this Hopper GPU with "
            f"triton {triton.__version__} (FLA refuses its Triton path for their backward with triton >= 3.4 "
            f"and < 3.7.1): pip install tilelang (with nvcc on the PATH), or use triton >= 3.7.1")
