"""Config of the RetNet-like example model."""
from __future__ import annotations

from transformers import PretrainedConfig


class RetentionLMConfig(PretrainedConfig):
    """hidden_size / num_heads: the retention heads (key and value head dim = hidden_size // num_heads);
    intermediate_size: SwiGLU width (default: 8/3 * hidden rounded up to 256);
    decay_base: head h decays with gamma_h = 1 - 2 ** -(decay_base + h * decay_step), RetNet's schedule
    spread over the heads."""

    model_type = 'retention_lm'
    keys_to_ignore_at_inference = ['past_key_values']

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 1024, num_hidden_layers: int = 24,
                 num_heads: int = 8, intermediate_size: int | None = None, rms_norm_eps: float = 1e-6,
                 decay_base: float = 5.0, decay_step: float | None = None, initializer_range: float = 0.02,
                 tie_word_embeddings: bool = False, bos_token_id: int = 1, eos_token_id: int = 2,
                 pad_token_id: int | None = None, use_cache: bool = False, **kwargs):
        if hidden_size % num_heads:
            from flame.errors import ConfigError
            raise ConfigError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        if intermediate_size is None:
            intermediate_size = 256 * -(-int(hidden_size * 8 / 3) // 256)
        self.intermediate_size = intermediate_size
        self.rms_norm_eps = rms_norm_eps
        self.decay_base = decay_base
        # RetNet spreads log2(1 - gamma) over [-5, -9] for any number of heads
        self.decay_step = decay_step if decay_step is not None else (4.0 / max(num_heads - 1, 1))
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)
