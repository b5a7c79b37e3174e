"""flame's custom model zoo: importing this package registers its models with transformers' Auto classes.

Each sub-package defines a config class, a causal-LM class and calls ``register`` below. The
import works from any working directory once the repository root is on ``sys.path`` (flame's
``__init__`` imports this package). See README.md, "Add your own model".
"""
from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM


def register(config_cls, model_cls=None, causal_lm_cls=None) -> None:
    """Register a family with the Auto classes; re-importing (or a second call) is harmless."""
    try:
        AutoConfig.register(config_cls.model_type, config_cls)
    except ValueError:  # already registered by an earlier import
        pass
    for auto, cls in ((AutoModel, model_cls), (AutoModelForCausalLM, causal_lm_cls)):
        if cls is not None:
            try:
                auto.register(config_cls, cls)
            except ValueError:
                pass


from custom_models.retention import RetentionLMConfig, RetentionLMForCausalLM, RetentionLMModel  # noqa: E402

register(RetentionLMConfig, RetentionLMModel, RetentionLMForCausalLM)

__all__ = ['RetentionLMConfig', 'RetentionLMForCausalLM', 'RetentionLMModel', 'register']
