"""Training FLOPs per token, for TFLOPS / MFU reporting.

    flops_per_token(model_config, seq_len, context_len=None) -> {'total', 'dense', 'attention'}

All numbers are *training* FLOPs per token (forward + backward = 3 x forward; a multiply-add is 2
FLOPs), per replica of the model.

dense
    ``6 * P`` with ``P`` the parameters that take part in matmuls per token: every parameter except
    the input embedding table (a lookup), plus the lm_head matmul (``vocab * hidden``) when it is tied
    to the embedding. Counted on a meta-device build of the model, so it is exact for any family
    (norm weights, biases, conv taps are included; their cost is negligible or ~2 FLOPs per weight).

attention (sequence mixing that has no parameters), per layer, 3 x the forward cost:
    softmax attention:  ``2 * H * (d_qk + d_v) * L``, ``L`` the mean number of keys a query sees:
                        ``(S + 1) / 2`` for causal attention over ``S`` tokens, and
                        ``(w (w + 1) / 2 + (S - w) w) / S`` with a sliding window ``w < S``.
                        ``S = min(context_len, seq_len)`` (documents packed with varlen attention
                        attend only inside their document; pass the mean document length).
                        With d_qk = d_v = d_h and no window this is the usual
                        ``6 * 2 * n_layers * H * d_h * S / 2`` per token for the whole model.
    diagonal-decay linear attention (GLA, HGRN2, Mamba2's SSD, RetNet-like), chunked form with
                        chunk ``C`` (FLA: 64): ``H * (4 d_k d_v + C (d_k + d_v))``: the per-chunk
                        state update and the inter-chunk read (2 d_k d_v each) plus the causal half
                        of the intra-chunk scores and their product with the values.
    delta rule (DeltaNet, Gated DeltaNet), chunked WY form: ``H * (6 d_k d_v + C (3 d_k + 2 d_v) + C^2 / 3)``
                        (the extra ``2 d_k d_v`` is the correction ``W S``; the ``C^2 / 3`` the
                        per-chunk triangular solve).
    GSA: two diagonal-decay passes, ``(d_k x M)`` then ``(M x d_v)`` with ``M`` slots.
    Mamba selective scan: ``6 * N`` per inner channel (discretized input, state update, readout).
    Elementwise work (gates, exp, softmax, norms) is not counted, as usual for MFU.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from functools import lru_cache

from flame.models.registry import Mixer, layer_mixers

FLA_CHUNK = 64


def _import_families() -> None:
    import fla  # noqa: F401
    for name in ('flame.models.transformer', 'custom_models'):
        try:
            __import__(name)
        except ImportError:
            pass


@contextmanager
def _attention_buildable():
    """FLA's softmax-attention layer refuses to be *constructed* without flash-attn; counting
    parameters on the meta device runs nothing, so lend it a placeholder for the build only."""
    import fla.layers.attn as attn
    missing = getattr(attn, 'flash_attn_func', None) is None
    if missing:
        attn.flash_attn_func = _no_flash_attn
    try:
        yield
    finally:
        if missing and attn.flash_attn_func is _no_flash_attn:
            attn.flash_attn_func = None


def _no_flash_attn(*args, **kwargs):
    raise ImportError("flash-attn is not installed")


@lru_cache(maxsize=64)
def _param_counts(config_json: str, model_type: str) -> tuple[int, int, int]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _import_families()
    cfg = AutoConfig.for_model(model_type, **{k: v for k, v in json.loads(config_json).items() if k != 'model_type'})
    with torch.device('meta'), _attention_buildable():
        model = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())  # shared (tied) parameters count once
    emb = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    tied = out is not None and out.weight is emb
    lm_head = out.weight.numel() if out is not None else 0
    return total, emb.numel(), lm_head if tied else 0


def param_counts(model_config) -> dict:
    """``{'total', 'embedding', 'matmul'}``: unique parameters, input-embedding table, and parameters
    that do matmul work per token (``total - embedding`` + the lm_head if it is tied)."""
    total, emb, tied_head = _param_counts(model_config.to_json_string(use_diff=False), model_config.model_type)
    return {'total': total, 'embedding': emb, 'matmul': total - emb + tied_head}


def _mean_keys(seq: int, window: int | None) -> float:
    if window is None or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


def mixer_forward_flops(m: Mixer, seq: int, chunk: int = FLA_CHUNK, causal: bool = True) -> float:
    """Forward FLOPs per token of one layer's parameter-free sequence mixing (see module doc).

    ``causal=False`` counts softmax attention over all ``seq`` keys, which is what a dense-mask
    kernel (SDPA with an explicit mask, as measured by FlopCounterMode) performs.
    """
    if m.kind == 'softmax':
        keys = _mean_keys(seq, m.window) if causal else float(seq)
        return 2 * m.heads * (m.dk + m.dv) * keys
    if m.kind == 'gla':
        return m.heads * (4 * m.dk * m.dv + chunk * (m.dk + m.dv))
    if m.kind == 'delta':
        return m.heads * (6 * m.dk * m.dv + chunk * (3 * m.dk + 2 * m.dv) + chunk * chunk / 3)
    if m.kind == 'gsa':
        s = m.slots
        return m.heads * (4 * m.dk * s + chunk * (m.dk + s) + 4 * s * m.dv + chunk * (s + m.dv))
    if m.kind == 'mamba':
        return m.heads * 6 * m.dk
    raise ValueError(f"unknown mixer kind {m.kind!r}")


def forward_flops_per_token(model_config, seq_len: int, context_len: int | None = None,
                            chunk: int = FLA_CHUNK, causal: bool = True) -> dict:
    """Forward-only FLOPs per token: ``{'total', 'dense', 'attention'}`` (the training numbers / 3)."""
    seq = min(seq_len, context_len) if context_len else seq_len
    dense = 2 * param_counts(model_config)['matmul']
    attn = sum(mixer_forward_flops(m, seq, chunk, causal) for m in layer_mixers(model_config))
    return {'total': dense + attn, 'dense': dense, 'attention': attn}


def flops_per_token(model_config, seq_len: int, context_len: int | None = None, frozen_base: bool = False,
                    adapter_params: int = 0) -> dict:
    """Training FLOPs per token (forward + backward), ``{'total', 'dense', 'attention'}``, as floats.

    ``seq_len``: training sequence length; ``context_len``: mean attended context when documents are
    packed with varlen attention (defaults to ``seq_len``). The trainer's MFU is
    ``tokens_per_second * total / peak_flops``.

    A trained matmul weight costs 6 FLOPs per parameter and token: 2 forward, 2 for the input's
    gradient, 2 for its own. ``frozen_base`` (LoRA): the model's weights get no gradient, so its
    matmuls cost 4, and ``adapter_params`` trained adapter weights add 6 each.
    """
    fwd = forward_flops_per_token(model_config, seq_len, context_len)
    out = {k: 3.0 * v for k, v in fwd.items()}
    if frozen_base:
        out["dense"] = 2.0 * fwd["dense"] + 6.0 * adapter_params
        out["total"] = out["dense"] + out["attention"]
    return out
