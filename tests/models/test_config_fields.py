"""A model config's mistakes are one line each: a near-miss field name, a missing core field of
flame's transformer, a value a config or model constructor refuses, a model.module that fails to
import. Transformers keeps unknown fields as attributes, so without these checks they pass silently."""
import json
import logging

import pytest

from flame.errors import ConfigError
from flame.models import build as model_build
from flame.models.registry import import_model_modules
from models_testlib import DEBUG_DIR


def _config(tmp_path, name, edit):
    with open(f"{DEBUG_DIR}/{name}.json") as f:
        data = json.load(f)
    edit(data)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return str(path)


def _rename(old, new):
    return lambda d: d.__setitem__(new, d.pop(old))


@pytest.mark.parametrize("name, edit, fragment", [
    ("transformer_tiny", _rename("num_heads", "num_head"), "field 'num_head' is not one that TransformerConfig takes; did you mean 'num_heads'?"),
    ("transformer_tiny", _rename("attn_impl", "atn_impl"), "did you mean 'attn_impl'?"),
    ("gla", _rename("expand_k", "expand_kk"), "field 'expand_kk' is not one that GLAConfig takes; did you mean 'expand_k'?"),
    ("transformer_tiny", lambda d: d.pop("num_heads"), "lacks field(s) num_heads"),
    ("transformer_tiny", lambda d: d.__setitem__("hidden_size", "128"), "hidden_size '128': must be a whole number >= 1"),
])
def test_config_mistakes_are_named(tmp_path, name, edit, fragment):
    with pytest.raises(ConfigError) as err:
        model_build.load_model_config(_config(tmp_path, name, edit))
    assert fragment in str(err.value)


def test_a_model_folder_s_near_miss_is_a_warning_and_legacy_fields_pass(tmp_path, caplog):
    """A downloaded config.json keeps loading (legacy fields such as rope_theta are not near misses);
    a near miss in it is said in one warning."""
    folder = tmp_path / "llama"
    folder.mkdir()
    data = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "vocab_size": 256, "rope_theta": 500000.0,
            "rope_scaling": None, "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        model_build.load_model_config(str(folder))
    assert "did you mean" not in caplog.text
    data["num_key_value_head"] = data.pop("num_key_value_heads")
    (folder / "config.json").write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING):
        model_build.load_model_config(str(folder))
    assert "did you mean 'num_key_value_heads'?" in caplog.text


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d.__setitem__("num_heads", 5), "key dim must be divisible by num_heads"),
    (lambda d: d.__setitem__("attn_mode", "chunkk"), "chunkk"),
])
def test_a_value_the_model_refuses_is_one_config_error(tmp_path, edit, fragment):
    config = model_build.load_model_config(_config(tmp_path, "gla", edit))
    with pytest.raises(ConfigError, match="model type 'gla': the model cannot be built from its config") as err:
        model_build.build_meta_model(config)
    assert fragment in str(err.value)


def test_a_model_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "broken_syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'needs_dep' cannot be imported: it needs 'no_such_dependency_xyz'"):
        import_model_modules("needs_dep")
    with pytest.raises(ConfigError, match=r"'broken_syntax' cannot be imported: .*broken_syntax.py, line 1"):
        import_model_modules("broken_syntax")
