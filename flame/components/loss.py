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
