"""The offload plan: where every block's state and activations live, with the prediction it was
chosen by. The one contract between the planner (which writes it) and the runtime (which
executes it); saved and loaded as JSON (`offload.save_plan`, `offload.plan`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from flame.errors import ConfigError
from flame.offload.planner.budgets import GiB
from flame.offload.planner.cost_model import effective_accs


@dataclass
class Plan:
    layer_modes: list[str]
    layer_acts: list[str]
    outer_mode: str
    prefetch_depth: int
    micro_batch: int
    seq_len: int
    rounds: int
    cpu_threads: int
    dtypes: dict
    gpu_budget_bytes: int
    host_budget_bytes: int
    predicted: dict = field(default_factory=dict)
    binding: str = ""
    layer_gpu_acc: list[bool] = field(default_factory=list)
    """Per block: with rounds > 1, a host block's grads accumulate in a GPU buffer over the rounds
    and go to the host once a step (else every round, added on the CPU). Missing: host."""
    outer_gpu_acc: bool = False
    world: int = 1
    """Data-parallel ranks the plan was made for (host state sharded over them; bytes per rank)."""
    node_ranks: int = 1
    """Of those, the ranks on one machine: their CPU optimizers run at once on its cores."""
    activation_offload: bool = False
    """Whether the solver could choose to offload blocks' activations (offload.activation_offload);
    the calibration's re-solve keeps the same choice."""
    selective_recompute: bool = True
    """Whether the solver could choose selective recompute (offload.selective_recompute)."""
    speculative_step: bool = False
    """Host units start their CPU AdamW as their grads land in the backward, unclipped
    (offload.speculative_step)."""
    speculative_redo: bool = True
    """With speculative_step: the run may have to redo a speculative update (it clips by the grad
    norm, or skips non-finite steps), so the update goes into a spare set of master and moments
    (its host memory counted by the cost model). False (no clipping, no skipping): into the state
    itself, no spare."""
    checkpoint_offload: bool = False
    """Whether the solver could keep recomputed blocks' inputs in host memory (activation mode
    recompute_host; offload.checkpoint_offload); the calibration's re-solve keeps the same choice."""
    layer_numel: list[int] = field(default_factory=list)
    """Per block, the parameters of the model the plan was made for (a LoRA base's: the frozen
    ones, without the adapters); a replayed plan must be for them. Empty: a file written before."""

    @property
    def offloads(self) -> bool:
        return self.outer_mode != "gpu" or any(m != "gpu" for m in self.layer_modes)

    def unit_accs(self) -> list[bool]:
        """GPU grad accumulation of every unit, outer first, as the engine runs it."""
        return effective_accs([self.outer_mode] + self.layer_modes, [self.outer_gpu_acc] + self.layer_gpu_acc, self.rounds)

    def save(self, path: str) -> None:
        try:
            with open(path, "w") as f:
                json.dump(asdict(self), f, indent=1)
        except OSError as e:
            raise ConfigError(f"offload.save_plan={path!r}: cannot write it ({e.strerror})") from None

    def summary(self) -> str:
        """One line: the shape the plan was made for and what it predicted."""
        pr = self.predicted
        parts = [f"{len(self.layer_modes)} blocks, micro-batch {self.micro_batch}x{self.seq_len}, "
                 f"{self.rounds} round(s)/step"]
        if "step_s" in pr:
            parts.append(f"predicted step {pr['step_s'] * 1e3:.1f} ms")
        for key, what in (("peak_gpu_bytes", "peak GPU"), ("peak_host_bytes", "host")):
            if key in pr:
                parts.append(f"{what} {pr[key] / GiB:.2f} GiB")
        return ", ".join(parts)

    def check_shape(self, path: str, step_sequences: int, seq_len: int) -> None:
        """A replayed plan must be for the run's sequences: its memory and time are for that shape."""
        if self.seq_len != seq_len:
            raise ConfigError(f"offload.plan={path!r}: made for sequences of {self.seq_len} tokens, the run has "
                              f"training.seq_len {seq_len}")
        if self.micro_batch * self.rounds != step_sequences:
            raise ConfigError(f"offload.plan={path!r}: made for {self.micro_batch} x {self.rounds} sequences a "
                              f"step (micro-batch x rounds), the run has {step_sequences} (training.batch_size "
                              "x gradient_accumulation_steps)")

    def check_blocks(self, path: str, layer_numel: list[int]) -> None:
        """A replayed plan places one mode per block, its memory and time for the blocks it was made
        for: it must be for the model's number of blocks and their parameters (`layer_numel`)."""
        if len(self.layer_modes) != len(layer_numel):
            raise ConfigError(f"offload.plan={path!r}: made for {len(self.layer_modes)} blocks, the model has "
                              f"{len(layer_numel)}")
        for i, (planned, has) in enumerate(zip(self.layer_numel, layer_numel)):
            if planned != has:
                raise ConfigError(f"offload.plan={path!r}: made for another model (block {i} of {planned:,} "
                                  f"parameters, the model's has {has:,}; model.config)")

    def check_options(self, path: str, off, redo: bool) -> None:
        """A replayed plan runs with the dtypes, the CPU step and the decisions it was made with: an
        `offload` option asking for others (dtypes, speculative step, prefetch depth, CPU threads,
        micro-batch, the planner's choices, an override the plan does not follow) would be ignored,
        so it is an error naming both. `redo`: whether
        this run may redo a speculative step (`speculative_redo`)."""
        for key in ("compute", "master", "grad", "moment"):
            if self.dtypes.get(key) != getattr(off, f"{key}_dtype"):
                raise ConfigError(f"offload.plan={path!r}: made for offload.{key}_dtype {self.dtypes.get(key)}, "
                                  f"the run has {getattr(off, f'{key}_dtype')}")
        if self.speculative_step != off.speculative_step:
            raise ConfigError(f"offload.plan={path!r}: made {'with' if self.speculative_step else 'without'} "
                              f"offload.speculative_step, the run has it {'on' if off.speculative_step else 'off'}")
        if self.speculative_step and self.speculative_redo != redo:
            raise ConfigError(f"offload.plan={path!r}: made for a run that "
                              f"{'may' if self.speculative_redo else 'can never'} redo a speculative step; this run "
                              f"{'may' if redo else 'can never'} (training.max_norm > 0 or training.skip_nan_inf: it may)")
        # what the planner decides: given (not 0 / its default) they must be the plan's decisions
        for name, planned in (("prefetch_depth", self.prefetch_depth), ("cpu_threads", self.cpu_threads),
                              ("micro_batch_tokens", self.micro_batch * self.seq_len)):
            if getattr(off, name) and getattr(off, name) != planned:
                raise ConfigError(f"offload.plan={path!r}: made for offload.{name} {planned}, the run has "
                                  f"{getattr(off, name)}")
        for name in ("activation_offload", "selective_recompute", "checkpoint_offload"):
            if getattr(off, name) != getattr(self, name):
                raise ConfigError(f"offload.plan={path!r}: made {'with' if getattr(self, name) else 'without'} "
                                  f"offload.{name}, the run has it {'on' if getattr(off, name) else 'off'}")
        from flame.offload.planner.solver import _parse_overrides

        for item in off.overrides:
            ov = _parse_overrides([item], len(self.layer_modes))
            modes, acts = ov["fixed"]["mode"], ov["fixed"]["act"]
            if any(self.layer_modes[i] != m for i, m in modes.items()) or \
                    any(self.layer_acts[i] != a for i, a in acts.items()) or \
                    ov["glob"].get("prefetch", self.prefetch_depth) != self.prefetch_depth or \
                    ov["glob"].get("outer", self.outer_mode) != self.outer_mode:
                raise ConfigError(f"offload.plan={path!r}: does not follow offload.overrides entry {item!r} "
                                  "(a replayed plan is run as it is; drop the entry or plan again without "
                                  "offload.plan)")

    @staticmethod
    def load(path: str) -> "Plan":
        try:
            with open(path) as f:
                return Plan(**json.load(f))
        except FileNotFoundError:
            raise ConfigError(f"offload.plan={path!r}: file not found") from None
        except OSError as e:  # a directory, a file this user may not read
            raise ConfigError(f"offload.plan={path!r}: cannot read it ({e.strerror})") from None
        except (ValueError, TypeError) as e:
            raise ConfigError(f"offload.plan={path!r}: not a plan file ({e})") from None
