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
