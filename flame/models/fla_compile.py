"""FLA layers under per-block ``torch.compile``: one graph for all identical blocks.

FLA 0.6's layers look up their cache slot with ``require_cache_layer_idx(self, past_key_values)``,
which reads ``self.layer_idx`` even when there is no cache. Dynamo treats an int attribute of a
module as a constant and guards on its value, so every block of the same class fails the previous
block's guard and is compiled again, until the recompile limit sends the rest to eager. Training
passes no cache, so the index is read only when a cache is given: the guard disappears and the
blocks share one compiled graph. The replacement returns what the original returns whenever a
cache is present.

Some layers also branch on the index itself (HGRN2's lower bound skips layer 0). For those, Dynamo
is told to treat int attributes of modules like other ints (``allow_unspec_int_on_nn_module``):
the first block compiles with its value, the next one once more with the index dynamic, and every
later block reuses that graph. Attributes equal across blocks (head counts, sizes) never change, so
they stay constants.
"""
from __future__ import annotations

import functools
import logging
import sys

import torch
from torch import nn

from flame.models.cpu.patch import rebind_everywhere

logger = logging.getLogger(__name__)

MARK = "__flame_lazy_layer_idx__"


def _lazy(original):
    @functools.wraps(original)
    def require_cache_layer_idx(module, past_key_values):
        if past_key_values is None:
            return None
        return original(module, past_key_values)

    setattr(require_cache_layer_idx, MARK, original)
    return require_cache_layer_idx


def has_fla_modules(model: nn.Module) -> bool:
    return any(type(m).__module__.split(".", 1)[0] == "fla" for m in model.modules())


def prepare_fla_for_compile(model: nn.Module) -> None:
    """Before per-block compilation of a model with FLA layers (nothing for other models): the
    cache-lazy layer index and Dynamo's unspecialized module ints (see the module doc)."""
    if not has_fla_modules(model):
        return
    replaced = lazy_cache_layer_idx()
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    logger.info("FLA layers: per-block compile with a cache-lazy layer index (%d bindings) and dynamic module "
                "ints, so identical blocks share their graphs", replaced)


def lazy_cache_layer_idx() -> int:
    """Rebind FLA's ``require_cache_layer_idx`` (every alias in loaded ``fla.*`` modules) to the
    cache-lazy version; a no-op when FLA is not loaded or has no such function, and when done
    before. Returns the number of bindings replaced."""
    utils = sys.modules.get("fla.layers.utils")
    current = getattr(utils, "require_cache_layer_idx", None)
    if current is None or hasattr(current, MARK):
        return 0
    lazy = _lazy(current)
    return rebind_everywhere(lambda v: lazy if v is current else v)
