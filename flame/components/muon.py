"""Muon for the hidden matrices and AdamW for every other parameter, as one torch optimizer.

Muon (``torch.optim.Muon``): a momentum buffer ``B <- mu B + (1 - mu) G`` (torch's lerp form), the
Nesterov look-ahead ``U = (1 - mu) G + mu B``, then ``U`` replaced by an approximately orthogonal
matrix of the same shape (five quintic Newton-Schulz iterations in bfloat16) and applied with
decoupled weight decay: ``W <- W (1 - lr wd) - lr_adj NS(U)``. The orthogonalization is a property
of the whole matrix, so a sharded parameter (an FSDP2 or tensor-parallel DTensor) is gathered,
orthogonalized whole on every rank, and each rank keeps its own slice: the update equals the one
of a single device. torch's own Muon would orthogonalize whatever tensor it is given.

``lr_adj`` follows ``optimizer.muon_adjust_lr``: ``match_rms_adamw`` (default) scales the learning
rate by ``0.2 sqrt(max(A, B))`` for an ``A x B`` matrix, which gives the update the RMS of a typical
AdamW update, so AdamW's learning rate and weight decay carry over; ``original`` scales it by
``sqrt(max(1, A / B))`` and wants a larger rate (0.02 in the Muon write-up).

The step is batched: matrices of one shape, dtype and device are orthogonalized together (one
batched Newton-Schulz, a few kernels for the whole stack instead of ~20 per matrix) and the
momentum, weight decay and update run as ``torch._foreach_*`` ops over each such bucket. A
transformer holds a few hundred hidden matrices of three or four shapes, so a step launches a few
hundred kernels instead of thousands, and each batched matmul is large enough to fill a GPU. Formula and precision are those
of ``torch.optim.Muon`` matrix by matrix (on CPU the very same numbers; a GPU's batched matmuls may
round in another order).

Which parameters are "hidden matrices": 2-D parameters other than the input embeddings and the
output head. Norm scales, biases, convolution kernels (3-D), embeddings and the head go to AdamW.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import AdamW, Optimizer

from flame.errors import ConfigError

MUON_GROUP = "use_muon"  # marks the param groups Muon updates (saved with the optimizer state)


def hidden_matrices(model: nn.Module) -> set[int]:
    """ids of the parameters Muon updates: 2-D, neither an embedding table nor the output head."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        skip.add(id(head.weight))
    return {id(p) for p in model.parameters() if p.ndim == 2 and id(p) not in skip}


def _torch_muon():
    """torch's Muon class and its learning-rate rule (torch >= 2.9), or a one-line error."""
    try:
        from torch.optim._muon import _adjust_lr
        return torch.optim.Muon, _adjust_lr
    except (AttributeError, ImportError):
        raise ConfigError(f"optimizer.name Muon needs torch.optim.Muon (torch >= 2.9); this torch is "
                          f"{torch.__version__}") from None


# the most elements one batched Newton-Schulz stacks: a bucket of many large (or, for a sharded
# parameter, gathered) matrices is split, so the step's extra memory stays bounded by a few
# copies of this, whatever the model's size
BATCH_ELEMENTS = 1 << 26


def newton_schulz_batched(updates: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                          eps: float) -> torch.Tensor:
    """torch's ``_zeropower_via_newtonschulz`` applied to each matrix of a ``(batch, rows, cols)``
    stack at once, in bfloat16: every matrix divided by its own Frobenius norm (transposed when
    rows > cols), then ``X <- a X + (b A + c A A) X`` with ``A = X X^T``."""
    a, b, c = coefficients
    x = updates.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def orthogonalized(updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
    """Newton-Schulz of whole matrices of one shape and dtype, batched, returned in that dtype; a
    DTensor is gathered first and this rank's slice of the result is returned with the update's
    layout (``Replicate -> Shard`` redistribution only slices)."""
    sharded = isinstance(updates[0], DTensor)
    stack = torch.stack([u.full_tensor() for u in updates] if sharded else updates)
    whole = newton_schulz_batched(stack, group["ns_coefficients"], group["ns_steps"], group["eps"]).to(stack.dtype)
    if not sharded:
        return list(whole.unbind(0))
    out = []
    for u, full in zip(updates, whole.unbind(0)):
        mesh = u.device_mesh
        rep = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
        out.append(rep.redistribute(mesh, u.placements))
    return out


def _buckets(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters with a gradient, by (sharded, shape, dtype, device), each bucket cut into
    the fewest even pieces of at most ``BATCH_ELEMENTS`` elements (one matrix at least)."""
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_key.setdefault((isinstance(p, DTensor), tuple(p.shape), p.dtype, p.device), []).append(p)
    out = []
    for bucket in by_key.values():
        most = max(1, BATCH_ELEMENTS // bucket[0].numel())
        size = -(-len(bucket) // -(-len(bucket) // most))  # ceil(n / ceil(n / most)) <= most
        out += [bucket[i:i + size] for i in range(0, len(bucket), size)]
    return out


def _closure_loss(closure):
    """torch's optimizer contract: ``step(closure)`` re-evaluates the loss with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


@functools.cache
def _sharded_muon_class():
    base, adjust_lr = _torch_muon()

    class ShardedMuon(base):
        """torch.optim.Muon (same options, state and formula) whose orthogonalization sees whole
        matrices (see the module doc)."""

        @torch.no_grad()
        def step(self, closure=None):
            loss = _closure_loss(closure)
            for group in self.param_groups:
                lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
                for params in _buckets(group["params"]):
                    grads = [p.grad for p in params]
                    for p, g in zip(params, grads):
                        if "momentum_buffer" not in self.state[p]:  # torch's name: checkpoints interchange
                            self.state[p]["momentum_buffer"] = torch.zeros_like(g)
                    bufs = [self.state[p]["momentum_buffer"] for p in params]
                    torch._foreach_lerp_(bufs, grads, 1 - mu)
                    updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
                    orthos = orthogonalized(updates, group)
                    if wd != 0:
                        torch._foreach_mul_(params, 1 - lr * wd)
                    torch._foreach_add_(params, orthos, alpha=-adjust_lr(lr, group["adjust_lr_fn"], params[0].shape))
            return loss

    return ShardedMuon


class MuonWithAdamW(Optimizer):
    """One optimizer over two kinds of param groups: Muon's (``use_muon``) and AdamW's.

    A single torch optimizer keeps what the rest of the trainer assumes of one: the LR schedule
    scales every group's own peak rate, and DCP's ``get_optimizer_state_dict`` saves Muon's
    ``momentum_buffer`` and AdamW's moments under each parameter's name (sharded like the
    parameter), so a resume restores both exactly. The two inner optimizers share this one's
    ``state`` and group dicts.
    """

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon_kwargs: dict, adamw_kwargs: dict):
        for g in muon_groups:
            g[MUON_GROUP] = True
        for g in adamw_groups:
            g[MUON_GROUP] = False
        self.muon = _sharded_muon_class()(muon_groups, **muon_kwargs) if muon_groups else None
        self.adamw = AdamW(adamw_groups, **adamw_kwargs) if adamw_groups else None
        # AdamW's groups first: the first group's lr is the one the trainer logs (optimizer.lr)
        groups = [g for o in (self.adamw, self.muon) if o is not None for g in o.param_groups]
        super().__init__(groups, {})
        self._share()

    def _share(self) -> None:
        for inner, muon in ((self.muon, True), (self.adamw, False)):
            if inner is not None:
                inner.state = self.state
                inner.param_groups = [g for g in self.param_groups if g[MUON_GROUP] is muon]

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # replaces this optimizer's state and group dicts
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = _closure_loss(closure)
        for inner in (self.muon, self.adamw):
            if inner is not None:
                inner.step()
        return loss


def refuse_offloaded_muon(job_config) -> None:
    """For a run that offloads (the trainer's decision, or the calculator's plan): one error line
    when its optimizer is Muon."""
    if getattr(job_config.optimizer, "name", "AdamW") == "Muon":
        raise ConfigError(f"optimizer.name Muon with offload.enable {job_config.offload.enable}: the offload engine "
                          "steps its host weights with AdamW only; use optimizer.name AdamW, or offload.enable off")


def check_muon_options(cfg) -> None:
    """Muon's options, each named when wrong (no model or devices needed)."""
    o = cfg.optimizer
    if o.muon_lr is not None and o.muon_lr <= 0:
        raise ConfigError(f"optimizer.muon_lr {o.muon_lr}: must be > 0")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"optimizer.muon_momentum {o.muon_momentum}: must be in [0, 1)")
    if cfg.offload.enable == "on":
        refuse_offloaded_muon(cfg)
    _torch_muon()
