"""Values some FLA models set only in their constructors, and a guard that nothing stays uninitialized.

flame builds every model on the meta device and materializes it with ``to_empty``: whatever a
constructor wrote into a parameter is gone, and only the model's ``_init_weights`` runs again.
Where FLA's ``_init_weights`` does not cover a parameter, the constructor's value is restored
here (same formulas as FLA's constructors):
- Samba's Mamba mixers: ``A_log = log(1..state_size)`` per channel, ``D = 1`` and the time-step
  bias ``dt_proj.bias = softplus^-1(dt)`` with dt log-uniform in [1e-3, 1e-1] (floor 1e-4), the
  Mamba constructor's defaults that Samba builds its mixers with. (FLA's Mamba models
  initialize these in ``_init_weights``; Samba's only marks them.)
- HGRN2's ``lower_bounds``: zeros.

`check_initialized` runs after a NaN fill + the model's init + these rules: a parameter that is
still NaN was initialized by nothing, and training from garbage is refused with its name.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from flame.errors import ConfigError

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 1e-1, 1e-4  # fla.layers.mamba.Mamba's constructor defaults


def assign_full(p: torch.Tensor, full: torch.Tensor) -> None:
    """p <- full, also when p is a sharded DTensor (each rank keeps its slice)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    full = full.to(dtype=p.dtype)
    if isinstance(p, DTensor):
        p.copy_(distribute_tensor(full.to(p.to_local().device), p.device_mesh, p.placements))
    else:
        p.copy_(full.to(p.device))


def _mamba_mixer(m: nn.Module) -> None:
    n, c = m.ssm_state_size, m.intermediate_size
    a = torch.arange(1, n + 1, dtype=torch.float32)[None, :].expand(c, -1)
    assign_full(m.A_log, torch.log(a))
    assign_full(m.D, torch.ones(c))
    dt = torch.exp(torch.rand(c) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
    assign_full(m.dt_proj.bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus


@torch.no_grad()
def restore_constructor_values(model: nn.Module) -> None:
    # by config, not class name: FSDP2 renames the class (FSDPSambaForCausalLM)
    samba = getattr(getattr(model, "config", None), "model_type", None) == "samba"
    for module in model.modules():
        kinds = {c.__name__ for c in type(module).__mro__}  # FSDP2 subclasses what it wraps
        if samba and "Mamba" in kinds and hasattr(module, "A_log"):
            _mamba_mixer(module)
        elif "HGRN2Model" in kinds and isinstance(getattr(module, "lower_bounds", None), torch.Tensor):
            assign_full(module.lower_bounds, torch.zeros(module.lower_bounds.shape))


@torch.no_grad()
def fill_nan(model: nn.Module) -> None:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            t.fill_(float("nan"))


def check_initialized(model: nn.Module) -> None:
    """One-line error naming the first floating-point parameter or buffer still NaN (this rank's shard)."""
    from torch.distributed.tensor import DTensor

    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if not t.is_floating_point():
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        if local.numel() and torch.isnan(local).any():
            raise ConfigError(f"{type(model).__name__}: parameter {name!r} is not initialized by the model's "
                              "_init_weights and flame has no rule for it (flame/models/constructor_init.py)")
