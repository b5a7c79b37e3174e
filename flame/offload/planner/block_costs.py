"""Per-block costs of a model at one micro-batch: the numbers the cost model plans with
(measured by `flame.offload.measure.tracing`, completed by the block calibration)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace


@dataclass
class UnitCosts:
    name: str
    kind: str
    """'layer' (streamable decoder block) or 'outer' (embeddings, final norm, head, loss)."""
    numel: int
    param_roles: dict[str, int]
    """numel per parameter role (last module name, e.g. q_proj, gate_proj, input_layernorm)."""
    fwd_gemm_flops: float
    fwd_attn_flops: float
    """Useful (causal) attention FLOPs of the forward."""
    act_keep_bytes: int
    """Bytes saved for backward when the block keeps its activations (weights excluded)."""
    act_recompute_bytes: int
    """Bytes kept when the block is fully recomputed (its tensor inputs)."""
    max_saved_bytes: int
    """Largest single saved tensor (bounds the backward's transient gradient buffers)."""
    bwd_in_fwd_gemm_flops: float = 0.0
    """Of bwd_gemm_flops, what the forward already runs (the chunked loss's head dX and dW):
    timed in the forward phase, not in the backward."""
    timed_s: list[float] | None = None
    """[forward, backward] seconds of this unit at this micro-batch, timed on the device before the
    run (measure.calibration.measure_block_fudges times the outer: its loss runs far below GEMM rate). When
    set, the cost model uses them instead of FLOPs at the profile's rate."""
    act_select_bytes: int | None = None
    """Bytes kept under selective recompute (runtime.selective): the block's inputs and the outputs
    of its matmuls and attention. None: not measured (the mode is not offered)."""
    act_offload_bytes: int | None = None
    """Bytes copied to the host when the block's activations are offloaded: every distinct saved
    floating-point tensor (views copied compactly, so views of one base count each), weights
    excluded (runtime.activations). None: act_keep_bytes."""
    bwd_peak_bytes: int | None = None
    """GPU bytes a recomputed block's backward adds on top of its input (recomputed activations,
    gradient buffers), measured on the device before the run (measure.calibration.measure_block_fudges);
    when set, the cost model uses it instead of act_keep_bytes + 2 x max_saved_bytes."""
    frozen_numel: int = 0
    """Of numel, the parameters that take no gradient (a LoRA base): they need their compute copy
    only, no gradient, master copy or optimizer moments, and no weight-gradient matmul."""

    head_numel: int = 0
    """Of an outer unit's trainable numel, the output head's weight when it is a parameter of its
    own (untied from the input embedding): the loss's backward delivers its grad first, so with
    speculative steps its CPU step starts at the backward's start (runtime.gradients: early
    pieces). 0: tied, frozen, or none."""

    @property
    def trainable_numel(self) -> int:
        return self.numel - self.frozen_numel

    @property
    def bwd_gemm_flops(self) -> float:
        # dX and dW each cost one forward matmul; frozen weights need no dW (their share of the
        # forward matmuls taken as their share of the unit's weights, exact for matmul weights)
        frozen = self.frozen_numel / self.numel if self.numel else 0.0
        return (2.0 - frozen) * self.fwd_gemm_flops

    @property
    def bwd_attn_flops(self) -> float:
        # flash backward: 5 matmuls of the score size vs 2 in the forward
        return 2.5 * self.fwd_attn_flops


@dataclass
class ModelCosts:
    micro_batch: int
    seq_len: int
    units: list[UnitCosts]
    layer_class: str
    extra: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def layers(self) -> list[UnitCosts]:
        return [u for u in self.units if u.kind == "layer"]

    @property
    def outer(self) -> UnitCosts:
        return next(u for u in self.units if u.kind == "outer")

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "ModelCosts":
        d = dict(d)
        d["units"] = [UnitCosts(**u) for u in d["units"]]
        return ModelCosts(**d)


def adapters_with_outer(costs: ModelCosts) -> ModelCosts:
    """The costs as the engine runs a model with frozen blocks (a LoRA base): every block's
    trainable parameters (its adapters) live in one resident unit on the GPU, not with their
    block, so they are counted with the outer unit (exact when the outer unit is on the GPU) and
    each block is its frozen base alone. The adapters' FLOPs stay with their blocks (their weight
    grads, a fraction of a percent of the block's, are dropped with the block's trainable share).
    Costs without frozen blocks are returned as they are."""
    moved = sum(u.trainable_numel for u in costs.layers if u.frozen_numel)
    if not moved:
        return costs
    units = [replace(u, numel=u.frozen_numel) if u.kind == "layer" and u.frozen_numel else u for u in costs.units]
    units = [replace(u, numel=u.numel + moved) if u.kind == "outer" else u for u in units]
    return replace(costs, units=units)
