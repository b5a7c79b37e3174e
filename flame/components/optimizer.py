"""AdamW/Adam (or Muon with AdamW, ``flame.components.muon``) with parameter groups, in torchtitan's
OptimizersContainer (so DCP saves it)."""

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from flame.errors import ConfigError


def param_groups(model: nn.Module, weight_decay: float, no_decay: list[str], select=None) -> list[dict]:
    """Split trainable parameters (those ``select(param)`` accepts, when given) into decayed and
    non-decayed groups.

    1-D tensors (norm scales, biases) and names containing a ``no_decay`` substring
    (embeddings by default) get no weight decay: decaying them only hurts.
    """
    decay, skip = [], []
    patterns = [p for p in no_decay if p]
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} if "embed" in patterns else set()
    for name, p in model.named_parameters():
        if not p.requires_grad or (select is not None and not select(p)):
            continue
        if p.ndim < 2 or id(p) in embeddings or any(s in name.lower() for s in patterns):
            skip.append(p)
        else:
            decay.append(p)
    groups = []
    for params, wd in ((decay, weight_decay), (skip, 0.0)):
        for same_layout in by_layout(params).values():
            groups.append({"params": same_layout, "weight_decay": wd})
    return groups


def by_layout(tensors) -> dict:
    """Tensors grouped by device mesh (``None`` for plain tensors), in first-seen order.

    Fused/foreach kernels refuse a mix of plain tensors and DTensors; tensor parallelism without
    FSDP leaves the parameters outside the blocks (embeddings, norms, head) plain.
    """
    out: dict = {}
    for t in tensors:
        out.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return out


@torch.no_grad()
def clip_grad_norm_(params, max_norm: float, norm_type: float = 2.0, foreach: bool = True) -> torch.Tensor:
    """Total gradient norm over every layout group, reduced over the meshes; clips when
    ``max_norm > 0``. Returns a plain tensor."""
    params = [p for p in params if p.grad is not None]
    groups = by_layout(params)
    norms = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type, foreach=foreach)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = norms[0] if len(norms) == 1 else torch.nn.utils.get_total_norm(norms, norm_type)
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach)
    return total


class GroupedOptimizersContainer(OptimizersContainer):
    """One optimizer per model part, each with decay/no-decay groups (``make(model)`` builds it)."""

    def __init__(self, model_parts: list[nn.Module], make, kwargs: dict):
        self.model_parts = model_parts
        self.optimizers = [make(model) for model in model_parts]
        all_groups = [g for opt in self.optimizers for g in opt.param_groups]
        self._validate_length(len(model_parts))
        # Optimizer.__init__ sets up hooks and param_groups that the LR scheduler drives
        Optimizer.__init__(self, [dict(g) for g in all_groups], kwargs)


def build_optimizers(model_parts: list[nn.Module], optimizer_config, device: torch.device) -> GroupedOptimizersContainer:
    c = optimizer_config
    impl = c.implementation
    kwargs = {
        "lr": c.lr,
        "betas": (c.beta1, c.beta2),
        "eps": c.eps,
        "weight_decay": c.weight_decay,
        "fused": impl == "fused",
        "foreach": impl == "foreach",
    }
    if c.name == "Muon":
        from flame.components.muon import MuonWithAdamW, hidden_matrices

        muon_kwargs = {"lr": c.lr if c.muon_lr is None else c.muon_lr, "weight_decay": c.weight_decay,
                       "momentum": c.muon_momentum, "adjust_lr_fn": c.muon_adjust_lr}

        def make(model):
            hidden = hidden_matrices(model)
            return MuonWithAdamW(param_groups(model, c.weight_decay, c.no_weight_decay, lambda p: id(p) in hidden),
                                 param_groups(model, c.weight_decay, c.no_weight_decay, lambda p: id(p) not in hidden),
                                 muon_kwargs, kwargs)
    else:
        cls = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[c.name]

        def make(model):
            return cls(param_groups(model, c.weight_decay, c.no_weight_decay), **kwargs)
    return GroupedOptimizersContainer(model_parts, make, kwargs)


def group_settings(lr_schedulers) -> list[list[dict]]:
    """Every param group's settings but its parameters (lr, weight decay, betas, eps, ...) per
    scheduled optimizer: this run's, taken before a checkpoint replaces them (``lr_at_loaded_step``)."""
    return [[{k: v for k, v in g.items() if k != "params"} for g in s.optimizer.param_groups]
            for s in lr_schedulers.schedulers]


def lr_at_loaded_step(lr_schedulers, settings: list[list[dict]] | None = None) -> None:
    """Set every param group's lr to what this run's schedule gives at the step its schedulers were
    loaded at. A checkpoint's optimizer state holds the lr of the run that saved it; with the same
    schedule the value is the same, with another ``training.steps`` or schedule the first resumed
    step would otherwise run at the old schedule's lr and the next at the new one's.

    ``settings`` (``group_settings`` before the load): the checkpoint's group settings and peak
    lrs give way to this run's, so a resume with another ``optimizer.lr``, ``weight_decay``, betas,
    eps or ``name`` (Adam/AdamW) runs with them instead of silently keeping the saved ones."""
    for i, s in enumerate(lr_schedulers.schedulers):
        groups = s.optimizer.param_groups
        if settings is not None and len(settings[i]) == len(groups):
            for group, own in zip(groups, settings[i]):
                group.update(own)
            s.base_lrs = [g["initial_lr"] for g in groups]
        if len(s.base_lrs) != len(groups):
            # the parameters split into groups by layout too (tensor parallel DTensors apart from plain
            # tensors): a run resumed under another layout has another number of groups
            if len(set(s.base_lrs)) != 1:
                raise ConfigError(
                    f"the checkpoint's optimizer has {len(s.base_lrs)} parameter groups with different learning "
                    f"rates and this run has {len(groups)} (another tensor parallel degree?); resume with the "
                    "layout it was saved with, or start from its weights (--checkpoint.initial_load_path)")
            s.base_lrs = [s.base_lrs[0]] * len(groups)
        lrs = [base * fn(s.last_epoch) for base, fn in zip(s.base_lrs, s.lr_lambdas, strict=True)]
        for group, lr in zip(groups, lrs):
            group["lr"] = lr
        s._last_lr = lrs
