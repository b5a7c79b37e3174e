"""flame's causal-LM transformer: FLA's parameter layout, no flash_attn, selectable attention backends.

State-dict keys equal FLA's ``TransformerForCausalLM`` (model.embeddings, model.layers.N.attn_norm,
.attn.{q,k,v,o}_proj, .mlp_norm, .mlp.{gate,up,down}_proj, model.norm, lm_head), plus
``attn.ssmax_scale`` for scaled backends.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel

from flame.models.attention import FlameAttention, HeadRMSNorm, rotary_cos_sin
from flame.models.attention.dispatch import reads_max_seqlen, uses_flex_varlen, varlen_block_mask
from flame.models.transformer.configuration import TransformerConfig
from flame.ops.attention import positions_from_cu_seqlens
from flame.ops.swiglu import swiglu_linear

# the outputs' cache field: `cache` in newer transformers 5 releases (`past_key_values` still works there,
# with a deprecation warning), `past_key_values` before
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


class RMSNorm(nn.Module):
    """RMSNorm; FLA's fused Triton kernel on CUDA when ``fuse`` is set, float32 torch otherwise."""

    def __init__(self, dim: int, eps: float = 1e-6, elementwise_affine: bool = True, fuse: bool = False):
        super().__init__()
        self.dim, self.eps, self.fuse = dim, eps, fuse
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fuse and x.is_cuda:
            from fla.modules.norm.layernorm import rms_norm

            return rms_norm(x, self.weight, None, eps=self.eps)
        w = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), (self.dim,), w, self.eps).to(x.dtype)


def mlp_intermediate_size(hidden_size: int, hidden_ratio: int | None, intermediate_size: int | None) -> int:
    """FLA's GatedMLP sizing: 2/3 * ratio * hidden, rounded up to a multiple of 256."""
    if intermediate_size is not None:
        return intermediate_size
    ratio = 4 if hidden_ratio is None else hidden_ratio
    return 256 * ((int(hidden_size * ratio * 2 / 3) + 255) // 256)


class GatedMLP(nn.Module):

    def __init__(self, hidden_size: int, intermediate_size: int, fuse_swiglu: bool = False):
        super().__init__()
        self.fuse_swiglu = fuse_swiglu
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.fuse_swiglu and x.is_cuda:
            from fla.modules.activations import swiglu_linear as fla_swiglu_linear

            return fla_swiglu_linear(gate, up, self.down_proj.weight, self.down_proj.bias)
        down = self.down_proj
        if type(down) is nn.Linear and down.bias is None and not (down._forward_pre_hooks or down._forward_hooks):
            return swiglu_linear(gate, up, down.weight)
        # a wrapped projection (LoRA) or one with hooks (tensor parallelism turns its input into a
        # DTensor in a pre-hook) keeps its own call
        return down(F.silu(gate) * up)


class TransformerBlock(GradientCheckpointingLayer):

    def __init__(self, config: TransformerConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        norm = dict(eps=config.norm_eps, elementwise_affine=config.elementwise_affine, fuse=config.fuse_norm)
        self.attn_norm = RMSNorm(config.hidden_size, **norm)
        self.attn = FlameAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            backend=config.layer_backends[layer_idx],
            qkv_bias=config.qkv_bias,
            qk_norm=config.qk_norm,
            window_size=config.window_size,
            softpick_eps=config.softpick_eps,
            scale_init=config.attn_scale_init,
            layer_idx=layer_idx,
        )
        self.mlp_norm = RMSNorm(config.hidden_size, **norm)
        self.mlp = GatedMLP(
            config.hidden_size,
            mlp_intermediate_size(config.hidden_size, config.hidden_ratio, config.intermediate_size),
            fuse_swiglu=config.fuse_swiglu,
        )

    def forward(self, hidden_states: torch.Tensor, **attn_kwargs):
        attn_out, weights, _ = self.attn(self.attn_norm(hidden_states), **attn_kwargs)
        hidden_states = hidden_states + attn_out
        hidden_states = hidden_states + self.mlp(self.mlp_norm(hidden_states))
        return hidden_states, weights


class TransformerPreTrainedModel(PreTrainedModel):
    config_class = TransformerConfig
    config: TransformerConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerBlock"]
    _supports_cache_class = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, (RMSNorm, HeadRMSNorm)):
            if module.weight is not None:
                nn.init.ones_(module.weight)
        elif isinstance(module, FlameAttention):
            module.reset_extra_parameters()

    @torch.no_grad()
    def reset_parameters_for_training(self) -> None:
        """(Re-)initialise every parameter, e.g. after a meta-device build and ``to_empty``.

        Clears transformers' ``_is_hf_initialized`` marks (set on modules built on meta), applies
        ``_init_weights`` to every module and re-ties the embeddings when configured.
        """
        for m in self.modules():
            if hasattr(m, "_is_hf_initialized"):
                m._is_hf_initialized = False
            for p in m.parameters(recurse=False):
                if hasattr(p, "_is_hf_initialized"):
                    p._is_hf_initialized = False
            self._init_weights(m)
        if self.config.tie_word_embeddings:
            self.tie_weights()


class TransformerModel(TransformerPreTrainedModel):

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([TransformerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps,
                            elementwise_affine=config.elementwise_affine, fuse=config.fuse_norm)
        self.head_dim = config.hidden_size // config.num_heads
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embeddings

    def set_input_embeddings(self, value):
        self.embeddings = value

    def _positions(self, B, T, device, position_ids, cu_seqlens, attention_mask, past_len):
        if position_ids is not None:
            return position_ids.to(device).long().expand(B, T)
        if cu_seqlens is not None:
            return positions_from_cu_seqlens(cu_seqlens.to(device), B * T).view(B, T)
        if attention_mask is not None and past_len + T == attention_mask.shape[-1]:
            pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
            return pos[:, -T:]
        return (torch.arange(T, device=device) + past_len)[None].expand(B, T)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        max_seqlen: int | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        if past_key_values is None:  # transformers >= 5.24 passes the KV cache as `cache`
            past_key_values = kwargs.get("cache")
        if inputs_embeds is None:
            inputs_embeds = self.embeddings(input_ids)
        B, T = inputs_embeds.shape[:2]
        use_cache = use_cache if use_cache is not None else (self.config.use_cache and not self.training)
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        block_mask = None
        if cu_seqlens is not None:
            if past_len:
                raise ValueError("cu_seqlens cannot be combined with a non-empty KV cache")
            if max_seqlen is None and any(reads_max_seqlen(l.attn.backend, inputs_embeds, l.attn.head_dim) for l in self.layers):
                max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
            if any(uses_flex_varlen(l.attn.backend, inputs_embeds, l.attn.window_size, l.attn.head_dim) for l in self.layers):
                # once per forward, outside the (compiled) blocks
                block_mask = varlen_block_mask(B * T, cu_seqlens, inputs_embeds.device)
        positions = self._positions(B, T, inputs_embeds.device, position_ids, cu_seqlens, attention_mask, past_len)
        rotary = None
        if self.config.rope_theta is not None:
            rotary = rotary_cos_sin(positions, self.head_dim, self.config.rope_theta)
        attn_kwargs = dict(
            rotary=rotary, positions=positions, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            attention_mask=attention_mask, past_key_values=past_key_values, use_cache=use_cache,
            output_attentions=bool(output_attentions), block_mask=block_mask,
        )
        hidden_states = inputs_embeds
        all_hidden, all_attn = [], []
        for layer in self.layers:
            if output_hidden_states:
                all_hidden.append(hidden_states)
            hidden_states, weights = layer(hidden_states, **attn_kwargs)
            if output_attentions:
                all_attn.append(weights)
        hidden_states = self.norm(hidden_states)
        if output_hidden_states:
            all_hidden.append(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_attn) if output_attentions else None,
            **{_CACHE_FIELD: past_key_values if use_cache else None},
        )


class TransformerForCausalLM(TransformerPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: TransformerConfig):
        super().__init__(config)
        self.model = TransformerModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embeddings

    def set_input_embeddings(self, value):
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        labels: torch.LongTensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cu_seqlens=cu_seqlens,
            past_key_values=past_key_values if past_key_values is not None else kwargs.get("cache"),
            inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states,
            max_seqlen=kwargs.get("max_seqlen"),
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        loss, logits = None, None
        if labels is not None:
            # predict token t+1 at position t; the last position has no target
            targets = torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), -100)], dim=1)
            targets = targets.to(hidden.device)
            if self.config.fuse_linear_cross_entropy and hidden.is_cuda:
                from fla.modules import FusedLinearCrossEntropyLoss

                loss = FusedLinearCrossEntropyLoss()(hidden, targets, self.lm_head.weight, self.lm_head.bias)
            else:
                logits = self.lm_head(hidden)
                if self.config.fuse_cross_entropy and logits.is_cuda:
                    from fla.modules import FusedCrossEntropyLoss

                    loss = FusedCrossEntropyLoss(inplace_backward=True)(
                        logits.view(-1, logits.shape[-1]), targets.view(-1))
                else:
                    loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        else:
            logits = self.lm_head(hidden)
        return CausalLMOutputWithPast(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions,
            **{_CACHE_FIELD: getattr(out, _CACHE_FIELD)},
        )
