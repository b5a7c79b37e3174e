"""LoRA layers on tiny models (CPU, in process): the adapted model starts as the base, only adapters
are trainable, targets, and exports (merged HF folder, PEFT adapters) that compute the adapted model."""

import json
import os

import pytest
import torch

from flame.errors import ConfigError
from flame.lora import Lora, LoRALinear, apply_lora, is_adapter_key
from tests.trainer.helpers import ROOT, TINY_LLAMA, TOKENIZER

TRANSFORMER = os.path.join(ROOT, "configs/debug/transformer_tiny.json")
GLA = os.path.join(ROOT, "configs/debug/gla.json")
CONFIGS = pytest.mark.parametrize("config", [TINY_LLAMA, TRANSFORMER], ids=["hf_llama", "flame_transformer"])
# an FLA family too (its layers' torch fallbacks on CPU, as the trainer enables them)
WITH_FLA = pytest.mark.parametrize("config", [TINY_LLAMA, TRANSFORMER, GLA], ids=["hf_llama", "flame_transformer", "fla_gla"])


@pytest.fixture(scope="module", autouse=True)
def cpu_fallbacks():
    from flame.models.cpu import enable_cpu_fallbacks

    enable_cpu_fallbacks()


def _model(config: str, lora: Lora | None = None, seed: int = 0):
    """Built as the trainer builds it: meta, LoRA, materialized, the model's init (float32)."""
    from flame.models import build

    model_config = build.load_model_config(config)
    model = build.build_meta_model(model_config)
    if lora is not None:
        apply_lora(model, lora)
    model.to_empty(device="cpu")
    build.init_weights(model, seed)
    return model.eval()


def _ids(model, seed=1):
    return torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def _trained(model, seed=2):
    """Adapters moved away from their init (B = 0 would hide a wrong merge)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter_key(name):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@WITH_FLA
def test_at_init_the_adapted_model_is_the_base_model_and_only_adapters_train(config):
    base = _model(config)
    adapted = _model(config, Lora(rank=4, alpha=8.0))
    sd_base, sd = base.state_dict(), adapted.state_dict()
    # the base weights keep their keys and the seeded init draws them as without LoRA
    assert set(sd) - set(sd_base) == {k for k in sd if is_adapter_key(k)}
    assert all(torch.equal(sd[k], v) for k, v in sd_base.items())
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert trainable == {k for k in sd if is_adapter_key(k)} and trainable
    layers = [m for m in adapted.modules() if isinstance(m, LoRALinear)]
    # q k v o gate up down in every block (GLA: also its output gate g_proj)
    assert len(layers) == (8 if config == GLA else 7) * adapted.config.num_hidden_layers
    assert all(m.lora_A.abs().max() > 0 and not m.lora_B.any() for m in layers)
    ids = _ids(base)
    with torch.no_grad():
        assert torch.equal(adapted(ids).logits, base(ids).logits)


def test_adapters_do_not_depend_on_sharding_and_follow_the_seed():
    from flame.lora.layer import init_adapters

    a, b = _model(TINY_LLAMA, Lora(rank=4), seed=0), _model(TINY_LLAMA, Lora(rank=4), seed=0)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    init_adapters(b, seed=1)
    assert not torch.equal(a.model.layers[0].self_attn.q_proj.lora_A, b.model.layers[0].self_attn.q_proj.lora_A)


def test_targets_glob_full_names_and_bad_patterns_are_named():
    model = _model(TINY_LLAMA, Lora(rank=2, targets=["q_proj", "model.layers.1.mlp.*"]))
    wrapped = sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))
    assert wrapped == ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "model.layers.1.mlp.gate_proj",
                       "model.layers.1.mlp.up_proj", "model.layers.1.self_attn.q_proj"]
    from flame.models import build

    meta = build.build_meta_model(build.load_model_config(TINY_LLAMA))
    with pytest.raises(ConfigError, match="lora.targets 'qproj' matches no linear.*q_proj"):
        apply_lora(meta, Lora(rank=2, targets=["q_proj", "qproj"]))
    with pytest.raises(ConfigError, match="match no linear"):
        apply_lora(meta, Lora(rank=2, targets=["g_proj"]))  # a default name this model lacks, alone
    with pytest.raises(ConfigError, match="lora.targets 'lm_head'"):  # only the decoder blocks' linears
        apply_lora(meta, Lora(rank=2, targets=["lm_head"]))


@pytest.mark.parametrize("family", ["gla", "delta_net", "qwen3"])
def test_default_targets_cover_the_attention_and_mlp_of_fla_and_hf_families(family):
    from flame.models import build

    model = build.build_meta_model(build.load_model_config(os.path.join(ROOT, "configs/debug", f"{family}.json")))
    line = apply_lora(model, Lora(rank=4))
    leaves = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= leaves, line
    # FLA's fused SwiGLU reads down_proj.weight directly: turned off so the adapter is applied
    assert not any(getattr(m, "fuse_swiglu", False) for m in model.modules())


@WITH_FLA
def test_merged_export_computes_the_adapted_model(config, tmp_path):
    from transformers import AutoModelForCausalLM

    from flame.utils.hf_export import export_hf

    lora = Lora(rank=4, alpha=12.0)
    model = _trained(_model(config, lora))
    ids = _ids(model)
    with torch.no_grad():
        want = model(ids).logits
    out = export_hf(model.state_dict(), model.config, TOKENIZER, str(tmp_path / "hf"), dtype="float32", lora=lora)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())
    with torch.no_grad():
        got = merged(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # the merge matters: the base weights alone give other logits
    with pytest.raises(ConfigError, match="LoRA adapters"):
        export_hf(model.state_dict(), model.config, None, str(tmp_path / "x"), dtype="float32")


@CONFIGS
def test_peft_loads_the_adapters_onto_the_base(config, tmp_path):
    pytest.importorskip("peft")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from flame.utils.hf_export import export_hf

    # a subset of the q_proj/v_proj and mlp layers: PEFT must adapt exactly these
    lora = Lora(rank=4, alpha=8.0, targets=["q_proj", "v_proj", "*.layers.1.mlp.*"])
    model = _trained(_model(config, lora))
    ids = _ids(model)
    with torch.no_grad():
        want = model(ids).logits
    sd = model.state_dict()
    base_dir = export_hf({k: v for k, v in sd.items() if not is_adapter_key(k)}, model.config, TOKENIZER,
                         str(tmp_path / "base"), dtype="float32")
    export_hf(sd, model.config, TOKENIZER, str(tmp_path / "merged"), dtype="float32", lora=lora,
              adapter_dir=str(tmp_path / "adapter"), base_model=base_dir)
    adapter_cfg = json.load(open(tmp_path / "adapter" / "adapter_config.json"))
    assert (adapter_cfg["r"], adapter_cfg["lora_alpha"], adapter_cfg["base_model_name_or_path"]) == (4, 8.0, base_dir)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                           str(tmp_path / "adapter")).eval()
    adapted = sorted(n for n, _ in peft_model.named_modules() if n.endswith(".lora_A"))
    assert len(adapted) == 2 * 2 + 3  # q, v in both blocks; gate, up, down in block 1
    with torch.no_grad():
        got = peft_model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
