"""Token cross-entropy summed over a micro-batch; the trainer divides by the step's token count."""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of CE over targets != IGNORE_INDEX, computed in float32 whatever the logits dtype."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


_COMPILED = None


def uses_compiled_loss(compile_enabled: bool, device_type: str) -> bool:
    """The trainer runs the plain loss through torch.compile: with ``compile.enable``, on a GPU."""
    return bool(compile_enabled) and device_type == "cuda"


def compiled_cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``cross_entropy_sum`` through torch.compile (as torchtitan compiles its loss): the float32
    upcast, log-softmax and gather fuse, instead of float32 copies of the whole logits in eager."""
    global _COMPILED
    if _COMPILED is None:
        _COMPILED = torch.compile(cross_entropy_sum)
    return _COMPILED(logits, labels)
