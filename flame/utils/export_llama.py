"""flame's ``transformer`` as a plain ``LlamaForCausalLM`` when its blocks compute exactly what Llama's do.

A flame transformer block is pre-norm RMSNorm -> causal softmax attention with rotate-half rotary
-> residual -> RMSNorm -> SwiGLU -> residual, which is Llama's block, unless a config feature
changes the math. ``llama_mismatches`` lists those features; only a config with none of them is
exported as Llama (the others go out with their own modeling code, see ``flame.utils.remote_code``).
"""
from __future__ import annotations

import re

LAYER_RENAMES = (
    ('.attn_norm.', '.input_layernorm.'),
    ('.mlp_norm.', '.post_attention_layernorm.'),
    ('.attn.', '.self_attn.'),
)


def llama_mismatches(config) -> list[str]:
    """Why ``config`` (flame's TransformerConfig) is not exactly a Llama; empty when it is."""
    from flame.models.transformer.configuration import TransformerConfig

    if not isinstance(config, TransformerConfig):
        return [f"model_type {config.model_type!r} is not flame's transformer"]
    why = []
    for i, b in enumerate(config.layer_backends):
        # every impl of plain softmax (sdpa, flex, fla, triton, naive) computes the same attention
        if b.rows != 'softmax' or b.scaled:
            why.append(f"layer {i} uses attn_impl {b.name!r} (not plain softmax)")
            break
    if config.qk_norm:
        why.append("qk_norm")
    if config.qkv_bias:
        why.append("qkv_bias (Llama's attention_bias also biases o_proj)")
    if config.window_size is not None:
        why.append(f"window_size {config.window_size}")
    if config.rope_theta is None:
        why.append("no rotary embedding (rope_theta null)")
    if not config.elementwise_affine:
        why.append("norms without weights (elementwise_affine false)")
    if (config.hidden_size // config.num_heads) % 2:
        why.append("odd head dim")
    if config.hidden_act != 'swish':
        why.append(f"hidden_act {config.hidden_act!r}")
    return why


def llama_config(config):
    """The ``LlamaConfig`` of a Llama-equivalent flame transformer config."""
    from transformers import LlamaConfig

    from flame.models.transformer.modeling import mlp_intermediate_size

    return LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=mlp_intermediate_size(config.hidden_size, config.hidden_ratio, config.intermediate_size),
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads or config.num_heads,
        head_dim=config.hidden_size // config.num_heads,
        hidden_act='silu',
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        rms_norm_eps=config.norm_eps,
        use_cache=True,
        pad_token_id=config.pad_token_id,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters={'rope_type': 'default', 'rope_theta': float(config.rope_theta)},
        attention_bias=False,
        attention_dropout=0.0,
        mlp_bias=False,
        architectures=['LlamaForCausalLM'],
    )


def llama_key(name: str) -> str:
    """flame transformer state-dict key -> LlamaForCausalLM key."""
    if name == 'model.embeddings.weight':
        return 'model.embed_tokens.weight'
    if re.match(r'model\.layers\.\d+\.', name):
        for old, new in LAYER_RENAMES:
            name = name.replace(old, new, 1) if old in name else name
    return name
