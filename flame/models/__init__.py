"""Model families: building, blocks, FLOPs, and the registration API for models from outside flame
(``register_block_class``, ``register_mixer``, ``Mixer``; see custom_models/README.md)."""
from flame.models.registry import Mixer, register_block_class, register_mixer

__all__ = ["Mixer", "register_block_class", "register_mixer"]
