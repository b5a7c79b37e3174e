"""HF models under training.varlen: flame's attention keeps documents apart."""

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import flame  # noqa: F401
from flame.models.hf_attention import NAME, uses_native_varlen
from tests.trainer.helpers import ROOT, TINY_LLAMA


def test_packed_documents_equal_separate_forwards():
    cfg = AutoConfig.from_pretrained(TINY_LLAMA)
    torch.manual_seed(0)
    packed_model = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation="sdpa").eval()
    ref.load_state_dict(packed_model.state_dict())
    lengths = [5, 1, 11, 7]
    docs = [torch.randint(0, cfg.vocab_size, (1, n)) for n in lengths]
    ids = torch.cat(docs, 1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        out = packed_model(input_ids=ids, position_ids=pos, cu_seqlens=cu).logits
        sep = torch.cat([ref(input_ids=d).logits for d in docs], 1)
    assert (out - sep).abs().max() < 1e-4
    # without document masking the packed row differs: the test can fail
    with torch.no_grad():
        leaky = ref(input_ids=ids, position_ids=pos).logits
    assert (leaky - sep).abs().max() > 1e-2


def test_native_varlen_detection():
    import os

    assert not uses_native_varlen(AutoConfig.from_pretrained(TINY_LLAMA))
    assert uses_native_varlen(AutoConfig.from_pretrained(os.path.join(ROOT, "configs/debug/gla.json")))
    assert uses_native_varlen(AutoConfig.from_pretrained(os.path.join(ROOT, "configs/debug/transformer_tiny.json")))


def test_the_trainer_s_document_bound_reaches_flame_s_attention(monkeypatch):
    """HF models under varlen get the trainer's max_seqlen (the data's bound on a document) down to
    flame's dispatch, as flame's transformer does: on GPU varlen_attn then needs no host sync."""
    import flame.models.hf_attention as hf_attention

    seen = []
    dispatch = hf_attention.attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("max_seqlen"))
        return dispatch(*args, **kwargs)

    monkeypatch.setattr(hf_attention, "attention", spy)
    cfg = AutoConfig.from_pretrained(TINY_LLAMA)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=NAME).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    pos = torch.tensor([[*range(5), *range(7)]])
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, cu_seqlens=cu, max_seqlen=8)
    assert seen == [8] * cfg.num_hidden_layers
