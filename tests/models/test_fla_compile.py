"""Per-block compile of FLA models: identical blocks share their compiled graphs (FLA reads the
layer index for its cache, and HGRN2 branches on it; Dynamo would otherwise compile each block)."""
import types

import pytest
import torch
from torch._dynamo.utils import counters

from models_testlib import debug_config


@pytest.fixture(autouse=True)
def dynamo_ints_restored():
    """prepare_fla_for_compile sets a Dynamo option for the process: back to its value after each
    test (monkeypatch would delete the option: Dynamo's config keeps it outside ``__dict__``)."""
    before = torch._dynamo.config.allow_unspec_int_on_nn_module
    yield
    torch._dynamo.config.allow_unspec_int_on_nn_module = before


def _compiled_graphs(name: str, layers: int, prepare: bool) -> int:
    from transformers import AutoModelForCausalLM

    from flame.distributed.parallelize import apply_compile
    from flame.models.blocks import find_block_list

    cfg = debug_config(name)
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    torch._dynamo.reset()
    counters.clear()
    if prepare:
        apply_compile(model, types.SimpleNamespace(backend="eager"))
    else:
        _, _, blocks = find_block_list(model)
        for i in range(len(blocks)):
            blocks[i] = torch.compile(blocks[i], backend="eager")
    x = torch.randint(0, cfg.vocab_size, (1, 32))
    model(input_ids=x).logits.float().sum().backward()
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    return graphs


def test_hgrn2_blocks_share_graphs_after_prepare(cpu_fallbacks):
    # HGRN2's `self.layer_idx > 0` branch: without the preparation every block is a new graph
    assert _compiled_graphs("hgrn2", 4, prepare=False) == 4
    assert _compiled_graphs("hgrn2", 4, prepare=True) == 2


def test_lazy_cache_layer_idx_reads_the_index_only_with_a_cache(cpu_fallbacks):
    import fla.layers.utils as utils

    from flame.models.fla_compile import lazy_cache_layer_idx

    lazy_cache_layer_idx()
    assert lazy_cache_layer_idx() == 0  # idempotent

    class Probe:
        reads = 0

        @property
        def layer_idx(self):
            Probe.reads += 1
            return 3

    assert utils.require_cache_layer_idx(Probe(), None) is None and Probe.reads == 0
    assert utils.require_cache_layer_idx(Probe(), object()) == 3 and Probe.reads == 1
    with pytest.raises(ValueError):  # a cache without a layer index is still FLA's error
        utils.require_cache_layer_idx(types.SimpleNamespace(), object())


def test_compiled_blocks_match_eager_after_prepare(cpu_fallbacks):
    from transformers import AutoModelForCausalLM

    from flame.distributed.parallelize import apply_compile

    cfg = debug_config("hgrn2")
    cfg.num_hidden_layers = 3
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg)
    model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(ref.state_dict())
    torch._dynamo.reset()
    apply_compile(model, types.SimpleNamespace(backend="eager"))
    x = torch.randint(0, cfg.vocab_size, (2, 24))
    torch.testing.assert_close(model(input_ids=x).logits, ref(input_ids=x).logits, rtol=0, atol=0)
    torch._dynamo.reset()
