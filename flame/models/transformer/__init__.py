"""flame's transformer family (model_type "transformer"): FLA-compatible configs, no flash_attn.

Importing this module registers the classes with transformers' Auto classes (``exist_ok=True``),
replacing FLA's "transformer" registration (FLA's own module is imported first so that its
registration cannot run later and win).
"""
import fla.models.transformer  # noqa: F401  (register FLA first; ours below replaces it)
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from flame.models.transformer.configuration import TransformerConfig, load_config
from flame.models.transformer.modeling import (
    TransformerBlock,
    TransformerForCausalLM,
    TransformerModel,
    TransformerPreTrainedModel,
    mlp_intermediate_size,
)

AutoConfig.register(TransformerConfig.model_type, TransformerConfig, exist_ok=True)
AutoModel.register(TransformerConfig, TransformerModel, exist_ok=True)
AutoModelForCausalLM.register(TransformerConfig, TransformerForCausalLM, exist_ok=True)

__all__ = [
    "TransformerBlock",
    "TransformerConfig",
    "TransformerForCausalLM",
    "TransformerModel",
    "TransformerPreTrainedModel",
    "load_config",
    "mlp_intermediate_size",
]
