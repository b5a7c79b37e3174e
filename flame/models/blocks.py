"""Find the repeated decoder blocks of any HF/FLA causal LM.

Activation checkpointing, per-block compile, FSDP2 wrapping and the offload engine all work
block by block; models name their block list differently (``model.layers``,
``backbone.layers``, ``transformer.h``), so the list is found structurally: the largest
``nn.ModuleList`` whose children share one class, unless the model's package named its block class
with ``flame.models.register_block_class`` (then the list of blocks of that class).
"""

from torch import nn


def find_block_list(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """Return ``(parent, attribute, blocks)`` for the model's decoder block list."""
    from flame.models.registry import BLOCK_CLASSES

    wanted = BLOCK_CLASSES.get(getattr(getattr(model, "config", None), "model_type", None))
    best = None
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            # wrapped blocks (checkpoint/compile) still count by their inner class
            classes = {type(_unwrap(b)) for b in child}
            if len(classes) > 2 or (wanted and {c.__name__ for c in classes} != {wanted}):
                continue
            size = sum(p.numel() for p in child.parameters())
            if best is None or size > best[0]:
                best = (size, parent, attr, child)
    if best is None:
        which = f"of registered block class {wanted!r} " if wanted else ""
        raise ValueError(f"{type(model).__name__}: no nn.ModuleList {which}of decoder blocks found")
    return best[1], best[2], best[3]


def _unwrap(module: nn.Module) -> nn.Module:
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if inner is None:
            return module
        module = inner
