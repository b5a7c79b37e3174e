"""flame's transformer model on CPU: configs, meta build + init, training, varlen, generate, save/load."""
import json
import os
import warnings

import pytest
import torch

from flame.errors import ConfigError
from flame.models.transformer import TransformerConfig, TransformerForCausalLM, load_config

warnings.filterwarnings("ignore", message=".*attention mask.*")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_heads=4, num_kv_heads=2, vocab_size=97,
            fuse_norm=True, fuse_swiglu=True, fuse_cross_entropy=True)

# name -> parameters (fp32 count from the formula below); ~340M means 373.9M with the untied lm_head
EXPECTED_PARAMS = {
    "transformer_340M.json": 373_867_520,
    "transformer_1B.json": 1_364_297_728,
    "transformer_7B.json": 6_738_415_616,
    "vanilla_transformer_120M.json": 134_105_856,
    "vanilla_transformer_340M.json": 373_867_520,
    "softpick_transformer_340M.json": 373_867_520,
    "rectified_transformer_340M.json": 373_867_520,
    "scaled_vanilla_transformer_340M.json": 373_867_520 + 24 * 16,
    "scaled_softpick_transformer_340M.json": 373_867_520 + 24 * 16,
    "softpick_scaled_transformer_340M.json": 373_867_520 + 24 * 16,
    "softpick_transformer_120M.json": 134_105_856,
    "vanilla_transformer_1B.json": 1_364_297_728,
    "softpick_transformer_1B.json": 1_364_297_728,
    "vanilla_transformer_7B.json": 6_738_415_616,
    "softpick_transformer_7B.json": 6_738_415_616,
}


def formula(c):
    from flame.models.transformer import mlp_intermediate_size

    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = (c.get("num_kv_heads") or c["num_heads"]) * (h // c["num_heads"])
    inter = mlp_intermediate_size(h, c.get("hidden_ratio"), c.get("intermediate_size"))
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * inter + 2 * h
    return L * per_layer + h + V * h * (1 if c.get("tie_word_embeddings") else 2)


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_shipped_configs_build_on_meta(name):
    path = os.path.join(CONFIGS, name)
    with open(path) as f:
        raw = json.load(f)
    cfg = load_config(path)
    with torch.device("meta"):
        model = TransformerForCausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    scaled = "scaled" in raw["attn_impl"]
    assert n == EXPECTED_PARAMS[name] == formula(raw) + (raw["num_hidden_layers"] * raw["num_heads"] if scaled else 0)


def test_scaled_softpick_alias_config_is_identical():
    a = json.load(open(os.path.join(CONFIGS, "scaled_softpick_transformer_340M.json")))
    b = json.load(open(os.path.join(CONFIGS, "softpick_scaled_transformer_340M.json")))
    assert a == b


def test_auto_classes_and_fla_json_compat():
    import transformers

    cfg = transformers.AutoConfig.for_model("transformer", **TINY)
    assert type(cfg) is TransformerConfig and cfg.attn_impl == "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model) is TransformerForCausalLM
    # an FLA TransformerConfig JSON (no attn_impl) loads; FLA's parameter names are kept
    names = set(model.state_dict())
    for key in ("model.embeddings.weight", "model.layers.0.attn_norm.weight", "model.layers.0.attn.q_proj.weight",
                "model.layers.1.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"):
        assert key in names


def test_meta_build_then_reset_parameters():
    cfg = TransformerConfig(attn_impl="parallel_scaled_softpick_attn", **TINY)
    with torch.device("meta"):
        model = TransformerForCausalLM(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.reset_parameters_for_training()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    assert torch.all(model.model.layers[0].attn.ssmax_scale == 0.3)
    assert torch.all(model.model.norm.weight == 1)
    w = model.model.layers[0].attn.q_proj.weight
    assert abs(w.std().item() - 0.02) < 0.005


@pytest.mark.parametrize("name,message", [
    (dict(attn_impl="flash_attn2"), "'flash_attn2'"),
    (dict(attn_impl=["sdpa"]), "1 names for 2 layers"),
    (dict(attn_impl="softpick", hidden_size=16, num_heads=2), "head dim 8"),
    (dict(attn_impl="softpick", hidden_size=1024, num_heads=2), "head dim 512"),
    (dict(num_heads=3), "not divisible"),
    (dict(attn_impl="softpick", window_size=16), "window_size"),
])
def test_config_errors(name, message):
    kw = dict(TINY, **name)
    with pytest.raises(ConfigError, match=message):
        TransformerConfig(**kw)


def test_load_config_errors(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"model_type": "transformer", "hidden_size": 64}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.json")
    p.write_text(json.dumps(dict(TINY, model_type="transformer", attn_impl="bogus")))
    with pytest.raises(ConfigError, match="'bogus'"):
        load_config(p)


TRAIN_IMPLS = ["sdpa", "naive_attn", "parallel_softpick_attn", "naive_rectified_attn", "parallel_scaled_attn",
               "naive_scaled_softpick_attn", "flex", ["softpick", "sdpa"]]


@pytest.mark.parametrize("impl", TRAIN_IMPLS, ids=str)
def test_tiny_model_trains(impl):
    torch.manual_seed(0)
    model = TransformerForCausalLM(TransformerConfig(attn_impl=impl, **TINY))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 97, (1, 48))
    cu = torch.tensor([0, 20, 48], dtype=torch.int32)
    losses = []
    for _ in range(6):
        logits = model(input_ids=x, cu_seqlens=cu).logits   # the trainer's call: logits only
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("impl", ["sdpa", "parallel_scaled_softpick_attn", "naive_rectified_attn"])
def test_varlen_equals_separate_documents(impl):
    torch.manual_seed(1)
    model = TransformerForCausalLM(TransformerConfig(attn_impl=impl, **TINY)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.attn, "ssmax_scale"):
                layer.attn.ssmax_scale.uniform_(0.2, 1.5)
    docs = [torch.randint(0, 97, (1, n)) for n in (7, 1, 12)]
    packed = torch.cat(docs, 1)
    cu = torch.tensor([0, 7, 8, 20], dtype=torch.int32)
    with torch.no_grad():
        out = model(input_ids=packed, cu_seqlens=cu, use_cache=False).logits
        ref = torch.cat([model(input_ids=d, use_cache=False).logits for d in docs], 1)
        # position_ids per document give the same result as cu_seqlens-derived positions
        pos = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
        out2 = model(input_ids=packed, cu_seqlens=cu, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out2, out)


@pytest.mark.parametrize("impl", ["sdpa", "parallel_softpick_attn", "naive_scaled_softpick_attn", "rectified"])
def test_generate_matches_full_forward(impl):
    torch.manual_seed(2)
    model = TransformerForCausalLM(TransformerConfig(attn_impl=impl, **TINY)).eval()
    prompt = torch.randint(0, 97, (2, 6))
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                         pad_token_id=0)
    assert out.shape == (2, 11)
    # greedy tokens via repeated full forwards without a cache
    seq = prompt
    with torch.no_grad():
        for _ in range(5):
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)
    # a left-padded prompt generates the same continuation as the unpadded one
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), prompt[:1]], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    out_p = model.generate(padded, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out_p[:, 9:], out[:1, 6:])


def test_labels_loss_and_attention_weights():
    torch.manual_seed(3)
    model = TransformerForCausalLM(TransformerConfig(attn_impl="naive_softpick_attn", **TINY))
    x = torch.randint(0, 97, (2, 10))
    out = model(input_ids=x, labels=x, output_attentions=True, use_cache=False)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (2, 4, 10, 10)
    kept = model(input_ids=x, logits_to_keep=1, use_cache=False).logits
    torch.testing.assert_close(kept, out.logits[:, -1:])


def test_save_and_load_roundtrip(tmp_path):
    import transformers

    torch.manual_seed(4)
    model = TransformerForCausalLM(TransformerConfig(attn_impl=["parallel_scaled_softpick_attn", "sdpa"], **TINY))
    model.save_pretrained(tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    assert saved["model_type"] == "transformer" and saved["attn_impl"] == ["parallel_scaled_softpick_attn", "sdpa"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is TransformerForCausalLM
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    x = torch.randint(0, 97, (1, 9))
    torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits)


class _OnCuda:
    """Stands for a CUDA tensor of activations: only the device and dtype matter to the dispatch checks."""
    is_cuda = True

    def __init__(self, dtype=torch.bfloat16):
        self.dtype = dtype


@pytest.mark.parametrize("name, env, reads", [
    ("sdpa", "flex", False),      # FlexAttention: document mask from cu_seqlens, no max_seqlen
    ("sdpa", "varlen", True),     # torch varlen_attn takes max_seqlen
    ("sdpa", None, True),         # varlen_attn by default
    ("fla", "flex", False),
    ("flex", "varlen", False),    # attn_impl flex: FlexAttention whatever the variable says
    ("triton", "flex", True),     # flame's kernels size their grid by it
    ("parallel_softpick_attn", "flex", True),
    ("naive_softpick_attn", "varlen", False),
])
def test_max_seqlen_host_sync_only_where_read(monkeypatch, name, env, reads):
    """The transformer syncs the host for max_seqlen (one .item() per forward) only when a layer's
    varlen path reads it; never on CPU."""
    from flame.models.attention import get_backend
    from flame.models.attention.dispatch import reads_max_seqlen

    if env is None:
        monkeypatch.delenv("FLAME_VARLEN_SOFTMAX", raising=False)
    else:
        monkeypatch.setenv("FLAME_VARLEN_SOFTMAX", env)
    assert reads_max_seqlen(get_backend(name), _OnCuda(), 64) is reads
    assert reads_max_seqlen(get_backend(name), torch.zeros(1), 64) is False


@pytest.mark.parametrize("dtype, head_dim, autocast, flex", [
    (torch.bfloat16, 64, False, False),    # varlen_attn (flash)
    (torch.float16, 256, False, False),
    (torch.float32, 64, False, True),      # flash takes half precision only
    (torch.float32, 64, True, False),      # ... which autocast gives the projections
    (torch.bfloat16, 512, False, True),    # nor head dims above 256
])
def test_varlen_softmax_kernel_choice(monkeypatch, dtype, head_dim, autocast, flex):
    """Softmax over documents on GPU: torch's varlen_attn by default, FlexAttention (with the mask the
    model builds once per forward) where flash cannot run the layer, or always with FLAME_VARLEN_SOFTMAX=flex."""
    from flame.models.attention import get_backend
    from flame.models.attention import dispatch

    monkeypatch.delenv("FLAME_VARLEN_SOFTMAX", raising=False)
    if dispatch._varlen_attn() is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device=None: autocast)
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device: torch.bfloat16)
    backend = get_backend("sdpa")
    assert dispatch.uses_flex_varlen(backend, _OnCuda(dtype), None, head_dim) is flex
    assert dispatch.reads_max_seqlen(backend, _OnCuda(dtype), head_dim) is not flex
    monkeypatch.setenv("FLAME_VARLEN_SOFTMAX", "flex")
    assert dispatch.uses_flex_varlen(backend, _OnCuda(dtype), None, head_dim) is True


def test_the_kernel_choice_traced_in_a_compiled_block_does_not_recompile(monkeypatch):
    """The choice between varlen_attn and FlexAttention is made inside compiled blocks (HF models
    reach the dispatch only there): making it twice must not fail a guard of the first trace."""
    from flame.models.attention import dispatch

    monkeypatch.delenv("FLAME_VARLEN_SOFTMAX", raising=False)

    def choose(x):
        return x + (2 if dispatch._softmax_varlen_attn(torch.bfloat16, 64) else 1)

    torch._dynamo.reset()
    fn = torch.compile(choose, backend="eager")
    x = torch.zeros(3)
    first = fn(x)
    with torch.compiler.set_stance("fail_on_recompile"):
        torch.testing.assert_close(fn(x), first)
    torch._dynamo.reset()


def test_kernel_env_bad_value_is_one_config_error(monkeypatch):
    """A FLAME_VARLEN_SOFTMAX or FLAME_ATTN_AUTOTUNE value the kernels do not know is a ConfigError
    naming it (train.sh's config check calls check_kernel_env: tests/trainer/test_cli.py)."""
    from flame.errors import ConfigError
    from flame.utils.kernel_env import check_kernel_env

    monkeypatch.setenv("FLAME_VARLEN_SOFTMAX", "flash")
    with pytest.raises(ConfigError, match="FLAME_VARLEN_SOFTMAX='flash': expected one of varlen, flex"):
        check_kernel_env()
    monkeypatch.setenv("FLAME_VARLEN_SOFTMAX", "")   # empty: the default
    check_kernel_env()
    monkeypatch.setenv("FLAME_ATTN_AUTOTUNE", "yes")
    with pytest.raises(ConfigError, match="FLAME_ATTN_AUTOTUNE='yes'"):
        check_kernel_env()
