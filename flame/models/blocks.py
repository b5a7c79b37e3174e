"""Find the repeated decoder blocks of any HF/FLA causal LM.

Activation checkpointing, per-block compile, FSDP2 wrapping and the offload engine all work
block by block; models name their block list differently (``model.layers``,
``backbone.layers``, ``transformer.h``), so the list is found structurally: the
``nn.ModuleList`` with the most parameters whose children share one class (or two, for hybrids),
unless the model's package named its block class with ``flame.models.register_block_class``
(then the list of blocks of that class).
"""

from torch import nn

# wrapper modules inserted by activation checkpointing, torch.compile and FSDP: not part of a
# parameter's state-dict name (torch.distributed.checkpoint's get_model_state_dict drops them too)
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def clean_name(name: str) -> str:
    """A module/parameter name without the wrapper parts: its state-dict key."""
    return ".".join(p for p in name.split(".") if p not in WRAPPER_PARTS)


def _largest_block_list(model: nn.Module, max_classes: int) -> tuple[str, nn.Module, str, nn.ModuleList]:
    """(parent name, parent, attribute, blocks) of the ``nn.ModuleList`` with the most parameters
    among those whose children (unwrapped) have at most `max_classes` classes (of the registered
    block class, when the model type has one)."""
    from flame.models.registry import BLOCK_CLASSES

    wanted = BLOCK_CLASSES.get(getattr(getattr(model, "config", None), "model_type", None))
    best = None
    for parent_name, parent in model.named_modules():
        for attr, child in parent.named_children():
            if not isinstance(child, nn.ModuleList) or len(child) == 0:
                continue
            # wrapped blocks (checkpoint/compile) still count by their inner class
            classes = {type(_unwrap(b)) for b in child}
            if len(classes) > max_classes or (wanted and {c.__name__ for c in classes} != {wanted}):
                continue
            size = sum(p.numel() for p in child.parameters())
            if best is None or size > best[0]:
                best = (size, parent_name, parent, attr, child)
    if best is None:
        which = f"of registered block class {wanted!r} " if wanted else ""
        raise ValueError(f"{type(model).__name__}: no nn.ModuleList {which}of decoder blocks found")
    return best[1:]


def find_block_list(model: nn.Module, max_classes: int = 2) -> tuple[nn.Module, str, nn.ModuleList]:
    """Return ``(parent, attribute, blocks)`` for the model's decoder block list. Up to two block
    classes by default (hybrid models interleave two kinds of block); ``max_classes=1`` asks for
    identical blocks, as the offload planner's cost model assumes."""
    _, parent, attr, blocks = _largest_block_list(model, max_classes)
    return parent, attr, blocks


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """``(dotted name, blocks)`` of the model's list of identical decoder blocks (the offload
    engine's and its cost tracing's units, named ``f"{name}.{i}"``)."""
    parent_name, _, attr, blocks = _largest_block_list(model, max_classes=1)
    return f"{parent_name}.{attr}" if parent_name else attr, blocks


def _unwrap(module: nn.Module) -> nn.Module:
    while True:
        inner = getattr(module, "_checkpoint_wrapped_module", None) or getattr(module, "_orig_mod", None)
        if inner is None:
            return module
        module = inner
