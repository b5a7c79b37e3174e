"""Document-masked (varlen) attention for Hugging Face transformer models.

HF's SDPA/eager paths see a packed row of documents as one sequence, so attention would
cross document boundaries. flame registers an attention function with transformers'
``AttentionInterface`` that forwards to flame's attention dispatch with ``cu_seqlens``
(passed by the trainer as a model kwarg, which HF hands down to every attention call).
"""

from transformers import AttentionInterface

from flame.models.attention.dispatch import attention
from flame.models.attention.registry import get_backend

NAME = "flame_varlen"


def flame_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is None:
        raise ValueError("flame_varlen attention needs cu_seqlens (set by the trainer with training.varlen)")
    if dropout:
        raise ValueError("flame_varlen attention does not support attention dropout")
    # HF: [B, H, T, D]; flame's dispatch: [B, T, H, D]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    window = getattr(module, "sliding_window", None)
    # max_seqlen: the trainer's bound on document length (else varlen_attn syncs to compute it)
    out, _ = attention(q, k, v, get_backend("sdpa"), scale=scaling, cu_seqlens=cu_seqlens,
                       max_seqlen=kwargs.get("max_seqlen"), window_size=window)
    return out, None


AttentionInterface.register(NAME, flame_varlen_attention)


def uses_native_varlen(model_config) -> bool:
    """FLA and flame models take ``cu_seqlens`` themselves; HF models need flame's attention."""
    from transformers import AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping.get(type(model_config), None)
    module = getattr(cls, "__module__", "") or ""
    return not module.startswith("transformers.")
