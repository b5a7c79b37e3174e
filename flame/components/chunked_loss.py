"""Output projection + cross-entropy in token chunks, never holding the whole [tokens, vocab] logits.

With a 128K vocabulary the float32 logits of a 16K-token micro-batch are 8.4 GB, and eager
cross-entropy keeps the log-softmax for the backward on top of that. Here the head matmul, the
log-sum-exp and both gradients are computed chunk by chunk in the forward (the loss is the last
op of the graph, so its incoming gradient is a scalar that only rescales them); the backward
multiplies the stored gradients by that scalar. Extra memory inside the forward: one [chunk, vocab]
float32 tensor (the logits, turned into the softmax and then the logits' gradient in place) beside
an input-dtype [chunk, vocab] tensor (the logits before, the gradient's copy after), and a float32 accumulator of the head's weight gradient; until the backward, the
hidden-state and weight gradients (in their own dtypes).
Same FLOPs as the unchunked head (three matmuls per token).

`install_chunked_head(model)` makes a model's output Linear compute the loss when given labels
through `chunked_head_loss(...)`; outside that context it is the ordinary Linear, so generation,
validation, probes and exports see real logits. The loss is computed inside the head module's
forward, so FSDP2's unshard/reshard hooks and the offload engine's hooks see an ordinary call.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from flame.components.loss import IGNORE_INDEX
from flame.errors import ConfigError


class _LinearCrossEntropySum(torch.autograd.Function):
    """sum over valid tokens of CE(hidden @ weight.T + bias, labels); gradients made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk):
        want = ctx.needs_input_grad
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for checks
        loss = torch.zeros((), device=hidden.device, dtype=acc)
        dh = torch.empty_like(hidden) if want[0] else None
        dw = torch.zeros(weight.shape, device=weight.device, dtype=acc) if want[1] else None
        db = torch.zeros(weight.shape[0], device=weight.device, dtype=acc) if want[2] and bias is not None else None
        for lo in range(0, n, chunk):
            h, y = hidden[lo:lo + chunk], labels[lo:lo + chunk]
            valid = y != IGNORE_INDEX
            safe = torch.where(valid, y, 0)
            # the logits in `acc`, then softmax in place: one [chunk, vocab] tensor in `acc` beside
            # the input-dtype logits while they convert (log_softmax(..., dtype=acc) of bf16 logits
            # holds a converted copy and its output at once)
            z = F.linear(h, weight, bias).to(acc)
            top = z.amax(dim=-1, keepdim=True)
            picked = z.gather(1, safe[:, None]) - top
            total = z.sub_(top).exp_().sum(dim=-1, keepdim=True)
            loss -= torch.where(valid, (picked - total.log()).squeeze(1), 0.0).sum()
            if dh is None and dw is None and db is None:
                continue
            # d(sum CE)/dz = softmax(z) - onehot(label), in place; ignored tokens' rows are zeroed
            # through the small tensors they meet (hidden rows, dh rows), not a [chunk, vocab] pass
            g = z.div_(total)
            g.scatter_add_(1, safe[:, None], -valid[:, None].to(g.dtype))
            gc = g.to(hidden.dtype)
            del z, g
            keep = valid[:, None].to(hidden.dtype)
            if dh is not None:
                # a plain matmul (not out=): under autocast it runs in the autocast dtype
                dh[lo:lo + chunk] = gc @ weight.to(hidden.dtype)
                dh[lo:lo + chunk].mul_(keep)
            if dw is not None:
                _add_weight_grad(dw, gc, h * keep)
            if db is not None:
                db += torch.where(valid[:, None], gc, 0).to(acc).sum(0)
            del gc, keep  # not alive beside the next chunk's logits
        # kept for the backward in the parameters' dtype (what their grads are): the float32
        # accumulators live only until here
        dw = dw.to(weight.dtype) if dw is not None else None
        db = db.to(bias.dtype) if db is not None else None
        ctx.save_for_backward(*(t if t is not None else torch.empty(0) for t in (dh, dw, db)))
        ctx.has = (dh is not None, dw is not None, db is not None)
        return loss

    @staticmethod
    def backward(ctx, gout):
        grads = [t * gout.to(t.dtype) if has else None for t, has in zip(ctx.saved_tensors, ctx.has)]
        return (*grads, None, None)


def _add_weight_grad(dw: torch.Tensor, g: torch.Tensor, h: torch.Tensor) -> None:
    """dw += g.T @ h, with dw in a wider dtype than g and h (float32 for bf16) on every backend."""
    if dw.dtype == g.dtype:
        dw.addmm_(g.t(), h)
    elif dw.is_cuda:
        # one GEMM that reads and writes the float32 accumulator in its epilogue
        torch.addmm(dw, g.t(), h, out_dtype=dw.dtype, out=dw)
    else:
        # CPU has no mixed-dtype addmm: vocabulary row blocks, each no larger than one chunk's
        # logits (a whole [vocab, hidden] product in the input dtype plus its float32 copy would be
        # 3x the head's size in temporaries)
        rows = max(1, g.shape[0] * dw.shape[0] // dw.shape[1])
        for r in range(0, dw.shape[0], rows):
            dw[r:r + rows] += (g[:, r:r + rows].t() @ h).to(dw.dtype)


def linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             labels: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """Sum of token cross-entropies of ``hidden @ weight.T (+ bias)`` over labels != IGNORE_INDEX,
    computed ``chunk_tokens`` tokens at a time (float32 log-sum-exp whatever the input dtype)."""
    if chunk_tokens <= 0:
        raise ConfigError(f"training.loss_chunk_tokens {chunk_tokens}: must be positive")
    return _LinearCrossEntropySum.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias,
                                        labels.reshape(-1), int(chunk_tokens))


def _head_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    labels = self._flame_chunk_labels
    if labels is None:
        return F.linear(x, self.weight, self.bias)
    if x.shape[:-1] != labels.shape:
        raise ValueError(f"chunked loss: head input {tuple(x.shape)} does not match labels {tuple(labels.shape)} "
                         "(does the model slice its hidden states before the head?)")
    loss = linear_cross_entropy_sum(x, self.weight, self.bias, labels, self._flame_chunk_tokens)
    self._flame_chunk_loss = loss
    return loss


# training.loss_chunk_tokens = -1 (auto): the chunked loss when the float32 logits of one micro-batch
# would exceed this many bytes, or,
# where the device's memory is known, this share of it: below that the compiled plain loss is faster
# than the chunked one and fits
AUTO_CHUNK_ABOVE_BYTES = 2**30
AUTO_CHUNK_MEMORY_SHARE = 1 / 8
# the eager (uncompiled) plain loss holds about this many float32-logit-sized tensors at once: the
# bf16 logits, their float32 upcast and the float32 log-softmax; the compiled loss fuses them
EAGER_LOSS_COPIES = 3
# and chunks whose float32 logits take about this many bytes: 4096 tokens at a 32K vocabulary, 1024 at
# 128K (the chunked loss is as fast as the plain one at these sizes)
AUTO_CHUNK_BYTES = 2**29


def auto_chunk_tokens(vocab: int) -> int:
    """The chunk of ``loss_chunk_tokens = -1``: the largest power of two of tokens whose float32 logits
    fit in ``AUTO_CHUNK_BYTES`` (at least 128)."""
    n = max(1, AUTO_CHUNK_BYTES // (4 * vocab))
    return max(128, 1 << (n.bit_length() - 1))


def choose_loss_chunk_tokens(model: nn.Module, tokens: int, tensor_parallel: bool,
                             memory_bytes: int | None = None, compiled_loss: bool = False) -> tuple[int, str]:
    """``training.loss_chunk_tokens = -1``: ``(chunk tokens or 0 for the plain loss, the log line)``
    for a model whose micro-batches hold ``tokens`` tokens (checked before the model is materialized).
    ``memory_bytes``: the device memory the run may use (GPU size or offload budget), when known;
    ``compiled_loss``: the plain loss would run compiled (fused), else eagerly (`EAGER_LOSS_COPIES`)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return 0, f"loss: plain logits + cross-entropy (the output layer is {type(head).__name__}, not a plain nn.Linear)"
    if tensor_parallel:
        return 0, "loss: plain logits + cross-entropy (the chunked loss needs a whole output layer; tensor parallelism is on)"
    vocab = head.out_features
    gib = tokens * vocab * 4 / 2**30
    limit = AUTO_CHUNK_ABOVE_BYTES if not memory_bytes else max(AUTO_CHUNK_ABOVE_BYTES,
                                                                 int(memory_bytes * AUTO_CHUNK_MEMORY_SHARE))
    copies = 1 if compiled_loss or not memory_bytes else EAGER_LOSS_COPIES
    if copies * tokens * vocab * 4 <= limit:
        return 0, (f"loss: plain logits + cross-entropy (float32 logits of {gib:.2f} GiB per micro-batch"
                   f"{'' if copies == 1 else f', x{copies} uncompiled'}, at most {limit / 2**30:.1f} GiB)")
    chunk = auto_chunk_tokens(vocab)
    return chunk, (f"loss: chunked head+loss, {chunk}-token chunks (logits of {gib:.1f} GiB"
                   f"{'' if copies == 1 else f', x{copies} uncompiled'} would not be materialized; "
                   "training.loss_chunk_tokens=0 for the plain loss)")


def uninstall_chunked_head(head: nn.Linear) -> None:
    """Undo `install_chunked_head`: the ordinary Linear forward again."""
    head.__dict__.pop("forward", None)
    for name in ("_flame_chunk_labels", "_flame_chunk_tokens", "_flame_chunk_loss"):
        head.__dict__.pop(name, None)


def install_chunked_head(model: nn.Module, chunk_tokens: int) -> nn.Linear:
    """Let the model's output Linear compute the chunked loss (see module doc). Returns the head."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        raise ConfigError(f"training.loss_chunk_tokens {chunk_tokens}: the model's output layer is "
                          f"{type(head).__name__}, not a plain nn.Linear")
    if chunk_tokens <= 0:
        raise ConfigError(f"training.loss_chunk_tokens {chunk_tokens}: must be positive")
    head._flame_chunk_labels = None
    head._flame_chunk_tokens = int(chunk_tokens)
    head._flame_chunk_loss = None
    head.forward = types.MethodType(_head_forward, head)
    return head


@contextlib.contextmanager
def chunked_head_loss(head: nn.Linear, labels: torch.Tensor):
    """Inside: the head returns the summed loss for ``labels`` (same layout as its input tokens)."""
    head._flame_chunk_labels = labels
    head._flame_chunk_loss = None
    try:
        yield head
    finally:
        head._flame_chunk_labels = None


def take_chunked_loss(head: nn.Linear, model_output: torch.Tensor) -> torch.Tensor:
    """The loss the head computed in the last forward, checked to be what the model returned (a
    model that rescales or caps its logits after the head cannot use the chunked loss)."""
    loss = head._flame_chunk_loss
    head._flame_chunk_loss = None
    if loss is None or model_output is not loss:
        raise ConfigError("training.loss_chunk_tokens: the model does not return its output layer's result "
                          "unchanged (logit scaling/capping after the head); set training.loss_chunk_tokens=0")
    return loss
