"""Checkpoint state of an OffloadEngine under the names of a non-offloaded run.

EngineStateDict, owned by the engine: the model's master weights (a frozen unit's compute copy)
under `model.state_dict()`'s names, the AdamW state (none for frozen units) flattened like
torch.distributed.checkpoint's get_optimizer_state_dict. With data
parallelism every rank returns full tensors (all-gathered unit by unit) and loads only the
slices it owns, so checkpoints move freely between offloaded, plain and 1-GPU runs.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flame.errors import ConfigError
from flame.models.blocks import clean_name
from flame.offload.runtime.collectives import all_gather_flat
from flame.offload.runtime.host_optimizer import HostOptimizer
from flame.offload.runtime.schedule import WeightSchedule
from flame.offload.runtime.streams import Streams
from flame.offload.runtime.units import Unit


class EngineStateDict:
    def __init__(self, model: nn.Module, units: list[Unit], fqns: dict[int, list[str]], schedule: WeightSchedule,
                 optimizer: HostOptimizer, streams: Streams, group, comm_device: torch.device):
        """`fqns`: id(parameter) -> every name of it. The caller waits for the engine's pending
        work (OffloadEngine.synchronize) before any method that reads or writes the state: this
        object holds no reference to the engine, so the engine is freed, without a cycle for the
        garbage collector, as soon as it is dropped."""
        self.model, self.units, self.fqns = model, units, fqns
        self.schedule, self.optimizer, self.streams = schedule, optimizer, streams
        self.group, self.comm_device = group, comm_device

    def _full(self, u: Unit, shard: torch.Tensor) -> torch.Tensor:
        """The whole unit's flat values from every rank's shard (all-gathered: a collective all
        ranks must enter, a transient of the full unit on the comm device and a full copy on the
        host of every rank); the shard itself when the unit is not sharded."""
        if not u.sharded:
            return shard
        out = torch.empty(u.padded_numel, dtype=shard.dtype, device=self.comm_device)
        all_gather_flat(out, shard.to(self.comm_device), self.group)
        return out[:u.numel].to(shard.device)

    def _load_shard(self, u: Unit, dst: torch.Tensor, sd: dict, key) -> None:
        """dst (the unit's master or a moment, this rank's shard) from the full tensors of a
        state dict: each parameter's owned slice; `key(fqn)` names the entry."""
        for (fqn, p), o in zip(u.params, u.offsets):
            ab = u.owned(o, p.numel())
            if ab is None:
                continue
            if key(fqn) not in sd:
                raise ConfigError(f"checkpoint: missing key {key(fqn)!r}")
            src = sd[key(fqn)].reshape(-1)[ab[0] - o:ab[1] - o]
            # the master may be the pinned compute copy and the source a GPU tensor
            self.streams.copy(dst, ab[0] - u.shard_start, ab[1] - u.shard_start, src, to_host=True, non_blocking=False)

    def _persistent_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The model's persistent buffers under their state-dict names (wrappers' parts dropped;
        their state-dict hooks strip some of them, so both sides are compared clean)."""
        persistent = {clean_name(k) for k in self.model.state_dict()}
        named = ((clean_name(name), b) for name, b in self.model.named_buffers())
        return [(name, b) for name, b in named if name in persistent]

    def model_state_keys(self) -> list[str]:
        """The names model_state_dict returns (no gathering)."""
        names = [name for u in self.units for _, p in u.params for name in self.fqns[id(p)]]
        return names + [name for name, _ in self._persistent_buffers()]

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights under the names `model.state_dict()` uses (tied names included). With
        data parallelism every rank returns the full tensors (all-gathered unit by unit)."""
        out = {}
        for u in self.units:
            for fqn, p, v in u.views(self._full(u, u.values())):
                for name in self.fqns[id(p)]:
                    out[name] = v
        out.update(self._persistent_buffers())
        return out

    def load_model_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """From full tensors (each rank copies the slices it owns)."""
        for u in self.units:
            for fqn, _ in u.params:
                if fqn not in sd:
                    raise ConfigError(f"checkpoint: missing key {fqn!r}")
            self._load_shard(u, u.values(), sd, lambda fqn: fqn)
            self.schedule.refresh_from_master(u, u.values())

    def optimizer_state_dict(self) -> dict:
        """Flattened like torch.distributed.checkpoint's get_optimizer_state_dict:
        state.<fqn>.{step,exp_avg,exp_avg_sq} and param_groups.<fqn>.<option>. With data
        parallelism the moments are all-gathered: every rank returns the full tensors."""
        out = {}
        for u in self.units:
            if u.frozen:  # frozen parameters have no optimizer state (as in a plain run)
                continue
            adamw = u.optimizer.adamw
            st = self.optimizer.state(u.optimizer)  # DCP loads into these: before the first step they must exist
            group = {k: v for k, v in adamw.param_groups[0].items() if k != "params"}
            full = {k: self._full(u, st[k]) for k in ("exp_avg", "exp_avg_sq") if k in st}
            for (fqn, p), o in zip(u.params, u.offsets):
                for k, flat in full.items():
                    out[f"state.{fqn}.{k}"] = flat[o:o + p.numel()].view(p.shape)
                if "step" in st:
                    out[f"state.{fqn}.step"] = st["step"]
                for k, v in group.items():
                    out[f"param_groups.{fqn}.{k}"] = v
                out[f"param_groups.{fqn}.weight_decay"] = (0.0 if fqn in self.optimizer.no_decay
                                                           else self.optimizer.weight_decay)
        return out

    def load_optimizer_state_dict(self, sd: dict) -> None:
        for u in self.units:
            if u.frozen:
                continue
            master, adamw = u.optimizer.master, u.optimizer.adamw
            fqn0 = u.params[0][0]
            if f"state.{fqn0}.exp_avg" not in sd:
                continue
            st = {"step": torch.as_tensor(sd[f"state.{fqn0}.step"], dtype=torch.float32).clone().reshape(())}
            for k in ("exp_avg", "exp_avg_sq"):
                flat = torch.zeros_like(master.data)  # this rank's shard, zero padding
                self._load_shard(u, flat, sd, lambda fqn: f"state.{fqn}.{k}")
                st[k] = flat
            adamw.state[master] = st
            for k in ("lr", "betas", "eps"):  # weight decay stays per parameter (see _decay)
                key = f"param_groups.{fqn0}.{k}"
                if key in sd:
                    adamw.param_groups[0][k] = sd[key]
