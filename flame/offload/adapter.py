"""Present an OffloadEngine to the trainer as torchtitan expects optimizers and model state.

- ``OffloadOptimizers`` is what the LR scheduler, the checkpoint manager and the training step
  talk to, with the calls of torch optimizers (``step()``, ``zero_grad()``, ``state_dict()``,
  ``load_state_dict()``) plus ``clip_grad_norm_(max_norm)`` where a plain run calls torch's:
  it iterates over one parameter-less "lr holder" optimizer that torchtitan's LambdaLR drives,
  steps the engine with the holder's current lr, and saves/loads the engine's optimizer state
  (DCP-flattened names, as a non-offloaded run writes them).
- ``EngineModelState`` replaces the checkpoint manager's model entry: the master weights live in
  the engine (host or GPU), under the names ``model.state_dict()`` uses.
"""

from collections import Counter

import torch
from torch.distributed.checkpoint.stateful import Stateful


class OffloadOptimizers(Stateful):
    def __init__(self, engine, lr: float, num_groups: int):
        self.engine = engine
        # LambdaLR needs a torch optimizer; this one holds only the schedule's lr, with as many
        # groups as the plain optimizer has so that LR-scheduler checkpoints are interchangeable
        groups = [{"params": [torch.zeros(1, requires_grad=True)]} for _ in range(num_groups)]
        self.lr_holder = torch.optim.SGD(groups, lr=lr)
        self.optimizers = [self.lr_holder]
        # a speculative CPU step (during the backward) takes the lr the schedule has set for this step
        engine.optimizer.next_lr = lambda: self.lr
        self._last_logged = Counter()  # the speculation counts at the last log_metrics()

    def __iter__(self):
        return iter(self.optimizers)

    def __len__(self):
        return 1

    @property
    def writes_state_in_backward(self) -> bool:
        """In-place speculative CPU steps (Plan.speculative_redo False) update the master weights
        and moments during the backward, before step(): a checkpoint's staging must be done first."""
        o = self.engine.optimizer
        return o.speculative and not o.redo

    @property
    def lr(self) -> float:
        return self.lr_holder.param_groups[0]["lr"]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The step's global grad norm, after the last backward, once a step (the engine's one
        host sync); the next step() clips the grads to `max_norm` (0: no clipping)."""
        return self.engine.clip_grad_norm_(max_norm)

    def step(self) -> None:
        """Step every unit at the schedule's current lr (host units on the CPU worker)."""
        self.engine.step(lr=self.lr)
        # a no-op (its placeholder has no grad) that tells the LR scheduler its optimizer stepped
        self.lr_holder.step()

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def log_metrics(self) -> dict:
        """Metrics of the steps since the last call, for the trainer's log line: with speculative
        CPU steps, how many host-unit updates were kept, redone and undone."""
        if not self.engine.optimizer.speculative:
            return {}
        counts = self.engine.optimizer.speculations.copy()
        last, self._last_logged = self._last_logged, counts
        return {f"offload/speculative_{k}": counts[k] - last[k] for k in ("kept", "redone", "undone")}

    def state_dict(self) -> dict:
        sd = self.engine.optimizer_state_dict()
        # LambdaLR records the peak lr in every param group; a plain run's checkpoint has it too
        initial = self.lr_holder.param_groups[0].get("initial_lr", self.lr)
        for key in [k for k in sd if k.startswith("param_groups.") and k.endswith(".lr")]:
            # a plain optimizer's groups hold the lr of the *next* step (the scheduler already
            # stepped); the engine's hold the last one used
            sd[key] = self.lr
            sd[key[: -len(".lr")] + ".initial_lr"] = initial
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        self.engine.load_optimizer_state_dict(state_dict)
        lrs = [v for k, v in state_dict.items() if k.startswith("param_groups.") and k.endswith(".lr")]
        if lrs:  # the schedule's position is restored by its own state; the current lr lives here
            for group in self.lr_holder.param_groups:
                group["lr"] = float(lrs[0])


class EngineModelState(Stateful):
    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        return self.engine.model_state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        keys = self.engine.model_state_keys()  # no gathering of the sharded masters
        self.engine.load_model_state_dict({k: state_dict[k] for k in keys if k in state_dict})
