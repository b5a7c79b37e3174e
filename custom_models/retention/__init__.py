"""A RetNet-like causal LM: multi-head retention (fixed per-head decay) + SwiGLU MLP."""
from custom_models.retention.configuration import RetentionLMConfig
from custom_models.retention.modeling import RetentionLMForCausalLM, RetentionLMModel

__all__ = ['RetentionLMConfig', 'RetentionLMForCausalLM', 'RetentionLMModel']
