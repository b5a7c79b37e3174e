"""RetNet-like model: retention is linear attention with a constant per-head decay,
``S_t = gamma_h S_{t-1} + k_t v_t^T``, ``o_t = S_t^T q_t``, followed by a per-head RMS norm and a
swish output gate (as in RetNet's gated multi-scale retention).

The sequence op dispatches by device: FLA's Triton ``chunk_simple_gla`` (with ``g_gamma``) on CUDA,
flame's torch chunked form elsewhere (CPU). No KV/recurrent cache: ``generate`` re-runs the prefix
(fine for the example's purpose; add a state cache for real inference).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput, CausalLMOutput

from custom_models.retention.configuration import RetentionLMConfig
from flame.models.cpu.recurrences import chunked_gated_linear_attention


def retention(q, k, v, log_gamma):
    """q, k, v ``[B, T, H, D]``; log_gamma ``[H]`` (< 0). Returns ``[B, T, H, D]``."""
    if q.is_cuda:
        from fla.ops.simple_gla import chunk_simple_gla
        o, _ = chunk_simple_gla(q, k, v, g_gamma=log_gamma.float())
        return o
    B, T, H, _ = q.shape
    gk = log_gamma.float().view(1, H, 1, 1).expand(B, H, T, k.shape[-1])
    o, _ = chunked_gated_linear_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), gk=gk,
                                          scale=q.shape[-1] ** -0.5)
    return o.transpose(1, 2).to(v.dtype)


class MultiScaleRetention(nn.Module):
    def __init__(self, config: RetentionLMConfig):
        super().__init__()
        d, h = config.hidden_size, config.num_heads
        self.num_heads, self.head_dim = h, d // h
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.g_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)
        self.head_norm = nn.RMSNorm(self.head_dim, eps=config.rms_norm_eps, elementwise_affine=False)
        exps = config.decay_base + config.decay_step * torch.arange(h, dtype=torch.float64)
        # a buffer, not a parameter: the decays are fixed; persistent so exports carry them
        self.register_buffer('log_gamma', torch.log1p(-torch.pow(2.0, -exps)).float(), persistent=True)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, self.num_heads, self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = self.head_norm(retention(q, k, v, self.log_gamma))
        return self.o_proj(o.reshape(B, T, -1) * F.silu(self.g_proj(x)))


class SwiGLU(nn.Module):
    def __init__(self, config: RetentionLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RetentionBlock(nn.Module):
    def __init__(self, config: RetentionLMConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn = MultiScaleRetention(config)
        self.mlp_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class RetentionLMPreTrainedModel(PreTrainedModel):
    config_class = RetentionLMConfig
    base_model_prefix = 'model'
    _no_split_modules = ['RetentionBlock']
    supports_gradient_checkpointing = False

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, 'bias', None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.RMSNorm) and module.weight is not None:
            nn.init.ones_(module.weight)
        elif isinstance(module, MultiScaleRetention):
            c = self.config
            exps = c.decay_base + c.decay_step * torch.arange(module.num_heads, dtype=torch.float64)
            with torch.no_grad():
                module.log_gamma.copy_(torch.log1p(-torch.pow(2.0, -exps)).float())


class RetentionLMModel(RetentionLMPreTrainedModel):
    def __init__(self, config: RetentionLMConfig):
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([RetentionBlock(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("RetentionLM does not support padding masks (pack sequences instead)")
        if kwargs.get('cu_seqlens') is not None:
            raise ValueError("RetentionLM does not support varlen (cu_seqlens) batches")
        x = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for layer in self.layers:
            x = layer(x)
        return BaseModelOutput(last_hidden_state=self.norm(x))


class RetentionLMForCausalLM(RetentionLMPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {'lm_head.weight': 'model.embeddings.weight'}

    def __init__(self, config: RetentionLMConfig):
        super().__init__(config)
        self.model = RetentionLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        # no cache: every step sees the whole prefix
        return {'input_ids': input_ids}

    def forward(self, input_ids=None, inputs_embeds=None, attention_mask=None, labels=None, **kwargs):
        hidden = self.model(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                            **kwargs).last_hidden_state
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            # next-token loss, as FLA's and HF's causal LMs compute it
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
