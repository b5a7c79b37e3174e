"""Per-block costs traced from the real model, not declared by hand.

One forward+backward of the model (on the meta device for shapes only, or on a real device)
runs under a FLOP counter and saved-tensor hooks. Forward pre/post hooks on every block tell
which block is running, so every saved tensor and every FLOP is charged to its block; whatever
runs outside the blocks (embeddings, final norm, head, loss) is the unit "outer". Works for any
HF/FLA causal LM whose blocks are the largest ModuleList of same-class children
(`flame.models.blocks.find_blocks`).

Attention: on meta, torch's SDPA decomposes to a dense T x T score matrix, which flash kernels
never store. During measurement SDPA is replaced by a stand-in with flash attention's saved set
(q, k, v, out, fp32 logsumexp) and its useful FLOPs are counted separately (causal: half the
dense score matrix). FLA's Triton kernels cannot run on meta: `model_costs` measures FLA models
with flame's torch implementations standing in.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from flame.components.chunked_loss import chunked_head_loss, install_chunked_head, take_chunked_loss
from flame.errors import ConfigError
from flame.models.blocks import find_blocks
from flame.models.cpu import cpu_fallbacks
from flame.offload.planner.block_costs import ModelCosts, UnitCosts
from flame.offload.runtime.selective import SAVED_OPS


class _FlashLike(torch.autograd.Function):
    """Stand-in for SDPA during measurement: flash attention's outputs and saved tensors."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _CompiledCrossEntropySum(torch.autograd.Function):
    """The memory of the compiled loss (``flame.components.loss.compiled_cross_entropy_sum``):
    inductor fuses the float32 upcast, log-softmax and gather, so the backward keeps the logits as
    they are (not a float32 log-softmax of them) and two float32 values a row, and writes the
    logits' gradient in their dtype."""

    @staticmethod
    def forward(ctx, logits, labels):
        rows = torch.empty(2, logits.shape[0], 1, dtype=torch.float32, device=logits.device)
        ctx.save_for_backward(logits, labels, rows[0], rows[1])
        return logits.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(ctx.saved_tensors[0]), None


class _Recorder:
    def __init__(self, model: nn.Module, blocks: nn.ModuleList):
        self.blocks = blocks
        self.current = "outer"
        self.param_ids = {id(p) for p in model.parameters()}
        self.saved: dict[str, dict[int, int]] = {}
        self.views: dict[str, dict[tuple, int]] = {}  # distinct floating-point saved tensors
        self.selected: dict[str, int] = {}  # output bytes of the ops selective recompute keeps
        self.max_saved: dict[str, int] = {}
        self.inputs: dict[str, int] = {}
        self.attn: dict[str, float] = {}
        self.keep = []  # keeps saved tensors alive so id() stays unique during measurement

    def pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if id(base) not in self.param_ids and id(t) not in self.param_ids:
            self.keep.append(base)
            nb = base.numel() * base.element_size()
            self.saved.setdefault(self.current, {})[id(base)] = nb
            self.max_saved[self.current] = max(self.max_saved.get(self.current, 0), nb)
            if t.is_floating_point():
                key = (id(base), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
                self.views.setdefault(self.current, {})[key] = t.numel() * t.element_size()
        return t

    def sdpa(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        b, h, tq, d = q.shape
        tk = k.shape[-2]
        # useful FLOPs: QK^T and PV, 2*tq*tk*d each; causal LMs mask half of the scores
        causal = 0.5 if (is_causal or attn_mask is not None) and tq == tk else 1.0
        self.attn[self.current] = self.attn.get(self.current, 0.0) + 4.0 * b * h * tq * tk * d * causal
        # a fused attention kernel's outputs (kept by selective recompute): out and the fp32 logsumexp
        self.select(q.numel() * q.element_size() + b * h * tq * 4)
        return _FlashLike.apply(q, k, v)

    def select(self, nbytes: int) -> None:
        self.selected[self.current] = self.selected.get(self.current, 0) + nbytes


class _SelectedOutputs(TorchDispatchMode):
    """Charges the outputs of the ops selective recompute keeps (matmuls) to the running block."""

    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in SAVED_OPS and self.rec.current != "outer":
            self.rec.select(sum(t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor)))
        return out


def _role(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[-1]


def _head_numel(model: nn.Module) -> int:
    """Elements of the output head's weight when it is trained and not the input embedding's."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    w = getattr(head, "weight", None)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(w, nn.Parameter) or not w.requires_grad or w is getattr(emb, "weight", None):
        return 0
    return w.numel()


def measure_costs(model: nn.Module, micro_batch: int, seq_len: int, loss: bool = True,
                  loss_chunk_tokens: int = 0, compiled_loss: bool = False) -> ModelCosts:
    """Run one fwd+bwd of `model` (any device, meta included) and charge costs to blocks.

    `loss_chunk_tokens` > 0: the loss is the chunked head + cross-entropy the trainer runs with
    ``training.loss_chunk_tokens`` (its saved gradients are measured like any saved tensor; the
    per-chunk float32 logits, which live only inside its forward, go to ``extra``). Else
    `compiled_loss`: the plain loss as the trainer compiles it (with ``compile.enable`` on a GPU),
    whose saved tensors are not eager cross-entropy's."""
    blocks_name, blocks = find_blocks(model)
    rec = _Recorder(model, blocks)
    names = [f"{blocks_name}.{i}" for i in range(len(blocks))]
    handles = []

    def pre(i):
        def hook(mod, args, kwargs):
            rec.current = names[i]
            tens = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
            # full recompute keeps the block's floating-point tensor inputs
            rec.inputs[names[i]] = sum(a.numel() * a.element_size() for a in tens if a.is_floating_point() and a.requires_grad)

        return hook

    def post(mod, args, out):
        rec.current = "outer"

    for i, b in enumerate(blocks):
        handles.append(b.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(b.register_forward_hook(post))
    dev = next(model.parameters()).device
    ids = torch.zeros((micro_batch, seq_len), dtype=torch.long, device=dev)
    head = install_chunked_head(model, loss_chunk_tokens) if loss and loss_chunk_tokens else None
    chunked = chunked_head_loss(head, ids) if head is not None else contextlib.nullcontext()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = rec.sdpa
    fc = FlopCounterMode(display=False)
    try:
        with fc, _SelectedOutputs(rec), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            # HF's no-cache path inspects position ids (data-dependent, impossible on meta), so
            # ask for a cache: it only holds references to k/v, no extra saved tensors
            with chunked:
                try:
                    out = model(ids, use_cache=True)
                except TypeError:
                    out = model(ids)
            logits = out.logits if hasattr(out, "logits") else out
            if head is not None:
                val = take_chunked_loss(head, logits)
            elif loss and compiled_loss:
                val = _CompiledCrossEntropySum.apply(logits.flatten(0, 1), ids.flatten(0, 1))
            elif loss:
                val = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten(0, 1), reduction="sum")
            else:
                val = logits.float().sum()
        fwd_counts = fc.get_flop_counts()
    finally:
        torch.nn.functional.scaled_dot_product_attention = sdpa
        for h in handles:
            h.remove()
    del val, logits, out
    rec.keep.clear()

    def flops_of(prefix_key: str) -> float:
        for k, v in fwd_counts.items():
            if k.endswith("." + prefix_key) or k == prefix_key:
                return float(sum(v.values()))
        return 0.0

    total = float(sum(fwd_counts.get("Global", {}).values()))
    units = []
    layer_flops = 0.0
    for i, b in enumerate(blocks):
        n = names[i]
        roles: dict[str, int] = {}
        for pn, p in b.named_parameters():
            roles[_role(pn)] = roles.get(_role(pn), 0) + p.numel()
        f = flops_of(n)
        layer_flops += f
        units.append(UnitCosts(n, "layer", sum(p.numel() for p in b.parameters()), roles, f, rec.attn.get(n, 0.0),
                               sum(rec.saved.get(n, {}).values()), rec.inputs.get(n, 0), rec.max_saved.get(n, 0),
                               act_select_bytes=rec.inputs.get(n, 0) + rec.selected.get(n, 0),
                               act_offload_bytes=sum(rec.views.get(n, {}).values()),
                               frozen_numel=sum(p.numel() for p in b.parameters() if not p.requires_grad)))
    block_ids = {id(p) for p in blocks.parameters()}
    roles = {}
    numel = frozen = 0
    seen = set()
    for pn, p in model.named_parameters():
        if id(p) in block_ids or id(p) in seen:
            continue
        seen.add(id(p))
        roles[_role(pn)] = roles.get(_role(pn), 0) + p.numel()
        numel += p.numel()
        frozen += 0 if p.requires_grad else p.numel()
    act = sum(rec.saved.get("outer", {}).values())
    outer_flops = total - layer_flops
    head_bwd = 0.0
    if head is not None:
        # the chunked loss runs the head's two backward matmuls inside its forward: counted as
        # backward FLOPs (backward = 2 x forward), timed in the forward
        head_bwd = 2 * 2.0 * micro_batch * seq_len * head.weight.numel()
        outer_flops -= head_bwd
    units.append(UnitCosts("outer", "outer", numel, roles, outer_flops, rec.attn.get("outer", 0.0), act, act,
                           rec.max_saved.get("outer", 0), head_bwd, frozen_numel=frozen, head_numel=_head_numel(model)))
    extra = {}
    if head is not None:
        # inside the chunked forward, on top of the float32 weight-grad accumulator: per chunk its
        # float32 log-probabilities (the logits' gradient in place) and their compute-dtype copy
        # (the input-dtype logits before them are no larger; CPU's weight-grad row blocks neither),
        # and at the end the accumulator's copy in the weight's dtype when that is narrower
        c = min(loss_chunk_tokens, micro_batch * seq_len)
        w, acc = head.weight.element_size(), max(head.weight.element_size(), 4)
        final_copy = head.weight.numel() * w if w != acc else 0
        extra = {"loss_chunk_tokens": loss_chunk_tokens,
                 "loss_chunk_transient_bytes": head.weight.numel() * acc
                 + max(c * head.out_features * (acc + w), final_copy)}
    return ModelCosts(micro_batch, seq_len, units, type(blocks[0]).__name__, extra)


def model_costs(config, dtype, micro_batches, seq_len: int, loss_chunk_tokens: int = 0,
                lora=None, compiled_loss: bool = False) -> dict[int, ModelCosts]:
    """Costs of a model config at each micro-batch (sequences), measured on the meta device, with
    the adapters of `lora` (the ``[lora]`` section, rank > 0: a frozen base) when given. FLA's
    Triton ops cannot run on meta: flame's torch implementations stand in during the measurement
    (their saved tensors and FLOPs approximate the kernels'; the block calibration and the in-run
    calibration correct time, the logged peak shows the memory error).

    A model of identical blocks is traced at two blocks and the block's costs repeated (see
    `repeated_block_costs`): its costs are the same, in a fraction of the time."""
    def build(cfg):
        meta = meta_model(cfg, dtype=dtype)
        if lora is not None:
            from flame.lora import apply_lora

            apply_lora(meta, lora)
        return meta

    def trace(meta, mb):
        return measure_costs(meta, mb, seq_len, loss_chunk_tokens=loss_chunk_tokens, compiled_loss=compiled_loss)

    with cpu_fallbacks():
        try:
            full = build(config)
            full_blocks = find_blocks(full)
            shallow_config = _two_block_config(config, full_blocks[1])
            shallow = build(shallow_config) if shallow_config else None
            out = {}
            for mb in micro_batches:
                costs = repeated_block_costs(trace(shallow, mb), full_blocks) if shallow else None
                out[mb] = costs or trace(full, mb)
            return out
        except (RuntimeError, NotImplementedError, ValueError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            # Mamba/Mamba2's torch paths mix float32 and the weights' dtype: they measure in float32
            hint = "; try --offload.compute_dtype float32" if dtype != torch.float32 else ""
            raise ConfigError(f"offload: the costs of model type {getattr(config, 'model_type', '?')!r} cannot be "
                              f"measured on the meta device in {dtype} ({first}){hint}") from None


def _block_signature(block: nn.Module) -> tuple:
    return (tuple((name, type(m).__name__) for name, m in block.named_modules()),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in block.named_parameters()))


def _two_block_config(config, blocks: nn.ModuleList):
    """The config with two blocks when every one of `blocks` (the model built from it) is the same
    and nothing in the config varies by layer (a per-layer list such as ``layer_types``), else None."""
    n = getattr(config, "num_hidden_layers", None)
    if n != len(blocks) or n <= 2 or len({_block_signature(b) for b in blocks}) != 1:
        return None
    if any(isinstance(v, (list, tuple)) and len(v) == n for v in config.to_dict().values()):
        return None
    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = 2
    return shallow


def repeated_block_costs(costs: ModelCosts, full_blocks: tuple[str, nn.ModuleList]) -> ModelCosts | None:
    """The costs of a model of ``len(full_blocks)`` identical blocks from a trace of two of them,
    or None when the two traced blocks' costs differ (a block that depends on its position)."""
    a, b = costs.layers
    if dataclasses.replace(a, name=b.name) != b:
        return None
    name, blocks = full_blocks
    layers = [dataclasses.replace(b, name=f"{name}.{i}") for i in range(len(blocks))]
    return dataclasses.replace(costs, units=layers + [u for u in costs.units if u.kind != "layer"])


def meta_model(config, dtype=torch.bfloat16) -> nn.Module:
    """Build an HF/FLA causal LM from a config on the meta device (no memory, for costs)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
