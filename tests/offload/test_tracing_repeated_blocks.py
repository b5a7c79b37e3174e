"""A model of identical blocks is traced at two blocks and the block's costs repeated: the costs
must be those of tracing every block, and a model whose blocks differ is traced whole."""

import copy
import dataclasses

import pytest
import torch

from flame.models.build import load_model_config
from flame.offload.measure import tracing
from tests.trainer.helpers import ROOT


def config(name: str, layers: int = 4, **changes):
    cfg = copy.deepcopy(load_model_config(f"{ROOT}/configs/debug/{name}.json", None))
    cfg.num_hidden_layers = layers
    for k, v in changes.items():
        setattr(cfg, k, v)
    return cfg


def full_trace(cfg, mb, seq, **kw):
    with tracing.cpu_fallbacks():
        return tracing.measure_costs(tracing.meta_model(cfg), mb, seq, **kw)


@pytest.mark.parametrize("name", ["llama", "gla", "gated_deltanet"])
def test_repeated_block_costs_are_the_whole_trace_s(name, monkeypatch):
    cfg = config(name)
    traced = []
    measure = tracing.measure_costs
    monkeypatch.setattr(tracing, "measure_costs", lambda m, *a, **k: traced.append(len(tracing.find_blocks(m)[1]))
                        or measure(m, *a, **k))
    got = tracing.model_costs(cfg, torch.bfloat16, [1, 2], 64, compiled_loss=True)
    assert traced == [2, 2]  # the shallow model, once per micro-batch
    for mb in (1, 2):
        assert got[mb] == full_trace(cfg, mb, 64, compiled_loss=True)


def test_blocks_that_differ_are_traced_whole(monkeypatch):
    # a GLA model with softmax attention in block 1: two kinds of block
    cfg = config("gla", attn={"layers": [1], "num_heads": 4, "num_kv_heads": 4})
    traced = []
    measure = tracing.measure_costs
    monkeypatch.setattr(tracing, "measure_costs", lambda m, *a, **k: traced.append(len(tracing.find_blocks(m)[1]))
                        or measure(m, *a, **k))
    costs = tracing.model_costs(cfg, torch.bfloat16, [1], 64)[1]
    assert traced == [4] and dataclasses.replace(costs.layers[0], name=costs.layers[1].name) != costs.layers[1]
    assert tracing._two_block_config(cfg, tracing.find_blocks(tracing.meta_model(cfg))[1]) is None


def test_a_per_layer_list_in_the_config_means_a_whole_trace():
    cfg = config("llama", layer_types=["full_attention"] * 4)
    assert tracing._two_block_config(cfg, tracing.find_blocks(tracing.meta_model(cfg))[1]) is None
    assert tracing._two_block_config(config("llama"), tracing.find_blocks(tracing.meta_model(config("llama")))[1]) is not None


def test_repeated_block_costs_with_lora_adapters_are_the_whole_trace_s():
    from flame.lora import apply_lora
    from flame.lora.config import Lora

    cfg, lora = config("llama"), Lora(rank=4)
    got = tracing.model_costs(cfg, torch.bfloat16, [1], 64, lora=lora)[1]
    with tracing.cpu_fallbacks():
        meta = tracing.meta_model(cfg)
        apply_lora(meta, lora)
        assert got == tracing.measure_costs(meta, 1, 64)
    assert got.layers[0].frozen_numel > 0
