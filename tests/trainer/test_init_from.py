"""``--model.init_from``: the first step's loss is the HF model's own loss (computed here with
transformers) on the same batch, on one device, under FSDP2 on 2 gloo ranks and with offload;
shape/name mismatches and pickle-only folders are one line; a resumed run ignores it."""

import json
import logging
import os
import pytest
import torch
import torch.nn.functional as F

from tests.trainer.helpers import ROOT, TINY_LLAMA, TOKENIZER, losses, run_job, tiny_job, train_in_process

STEPS = ["--training.steps", "2", "--lr_scheduler.total_steps", "4"]


def _save_tiny_llama(folder, vocab: int, seed: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(TINY_LLAMA)
    cfg.vocab_size = vocab
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # weights far from any fresh init: the loss tells them apart
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(folder)  # safetensors
    return str(folder)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama whose vocabulary is the bundled tokenizer's (8192: not raised), with that tokenizer."""
    from transformers import AutoTokenizer

    folder = _save_tiny_llama(tmp_path_factory.mktemp("hf"), 8192, seed=7)
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(folder)
    return folder


def hf_loss(folder: str, batches: list[dict]) -> float:
    """The HF model's mean token loss over ``batches`` (transformers alone, float32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            logits = model(input_ids=b["input_ids"]).logits
            total += F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100,
                                     reduction="sum").item()
            count += int((b["labels"] != -100).sum())
    return total / count


def first_batches(args: list[str], dp: int) -> list[dict]:
    """Each data-parallel rank's first batch of the job ``args`` describes."""
    from flame.config.manager import FlameConfigManager
    from flame.data import build_dataloader, build_tokenizer

    cfg = FlameConfigManager().parse_args(args)
    tok = build_tokenizer(cfg)
    return [next(iter(build_dataloader(cfg, tok, rank, dp))) for rank in range(dp)]


@pytest.fixture(scope="module")
def one_device(hf_dir, tmp_path_factory):
    """A 2-step run from hf_dir on one process; returns (dump, the HF loss of its first batch)."""
    dump = str(tmp_path_factory.mktemp("one") / "run")
    seen = []

    def capture(trainer):
        fetch = trainer.next_batches
        trainer.next_batches = lambda it: seen.append(fetch(it)) or seen[-1]

    train_in_process(tiny_job(dump, "--model.init_from", hf_dir, *STEPS, config=hf_dir), capture)
    return dump, hf_loss(hf_dir, seen[0])


def test_first_step_loss_is_the_hf_models(one_device):
    dump, reference = one_device
    assert losses(dump)[0] == pytest.approx(reference, rel=1e-5), (losses(dump), reference)


def test_fsdp_two_ranks_first_step_loss_is_the_hf_models(hf_dir, tmp_path):
    dump = str(tmp_path / "fsdp")
    run_job(2, dump, "--model.init_from", hf_dir, "--training.steps", "1", config=hf_dir)
    batches = first_batches(tiny_job(dump, config=hf_dir), dp=2)
    assert losses(dump)[0] == pytest.approx(hf_loss(hf_dir, batches), rel=1e-5)


def test_offload_first_step_loss_is_the_hf_models(hf_dir, one_device, tmp_path):
    dump = str(tmp_path / "off")
    profile = os.path.join(ROOT, "flame/offload/profiles/h100_80gb_measured.json")
    run_job(1, dump, "--model.init_from", hf_dir, "--training.steps", "1", "--offload.enable", "on",
            "--offload.profile", profile, "--offload.overrides", "weights[*]=host", "--offload.compute_dtype",
            "float32", config=hf_dir)
    assert losses(dump)[0] == pytest.approx(one_device[1], rel=1e-5)


def test_lora_adapters_keep_their_init_and_the_base_loads(hf_dir, one_device, tmp_path):
    """LoRA wraps the model before the load: the base comes from the folder, the zero-initialized
    adapters are not looked for in it, so the first step's loss is still the HF model's."""
    dump = str(tmp_path / "lora")
    run_job(1, dump, "--model.init_from", hf_dir, "--training.steps", "1", "--lora.rank", "4", config=hf_dir)
    assert losses(dump)[0] == pytest.approx(one_device[1], rel=1e-5)


def test_resume_ignores_init_from(one_device, tmp_path, caplog):
    """The relaunch names a folder whose vocabulary does not fit: loading it would stop the run."""
    dump, _ = one_device
    wrong = _save_tiny_llama(tmp_path / "wrong", 256, seed=1)
    before = losses(dump)
    with caplog.at_level(logging.INFO):
        train_in_process(tiny_job(dump, "--model.init_from", wrong, "--training.steps", "3",
                                  "--lr_scheduler.total_steps", "4", config=TINY_LLAMA))
    assert losses(dump)[:2] == before and len(losses(dump)) == 3
    assert any("ignored, the run resumes from its own checkpoint (step 2)" in r.getMessage() for r in caplog.records)


def test_vocabulary_raised_by_the_tokenizer_is_one_line(tmp_path, capsys):
    from flame.train import main

    small = _save_tiny_llama(tmp_path / "small", 256, seed=1)  # the tokenizer's 8192 ids raise it
    dump = str(tmp_path / "run")
    code = main(tiny_job(dump, "--model.init_from", small, *STEPS, config=small))
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("flame: error:")]
    assert code == 2 and len(errors) == 1, errors
    assert "tensor model.embed_tokens.weight is [256, 64] in the checkpoint, [8192, 64] in this model" in errors[0]
    assert not os.path.exists(os.path.join(dump, "checkpoint"))


def test_missing_unexpected_and_pickle_only_are_named(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from flame.components.init_from import match, weight_files
    from flame.errors import ConfigError

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir))
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert len(match(model, shapes, hf_dir)) == len(state)
    missing = dict(shapes)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.1\.mlp\.up_proj\.weight \[128, 64\] of this model "
                                          r"is not in the checkpoint"):
        match(model, missing, hf_dir)
    with pytest.raises(ConfigError, match=r"tensor model\.layers\.2\.x\.weight \[3\] of the checkpoint is not in"):
        match(model, {**shapes, "model.layers.2.x.weight": (3,)}, hf_dir)
    with pytest.raises(ConfigError, match=r"tensor model\.norm\.weight is \[65\] in the checkpoint, \[64\]"):
        match(model, {**shapes, "model.norm.weight": (65,)}, hf_dir)

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    torch.save(state, pickled / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"only pickle weights \(pytorch_model\.bin\); flame reads safetensors only"):
        weight_files(str(pickled))
    sharded = tmp_path / "sharded"  # an index names the shards (other safetensors files are not read)
    sharded.mkdir()
    save_file(state, sharded / "model-00001-of-00001.safetensors")
    save_file({"junk": torch.zeros(1)}, sharded / "consolidated.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        '{"weight_map": {"%s": "model-00001-of-00001.safetensors"}}' % next(iter(state)))
    assert weight_files(str(sharded)) == [str(sharded / "model-00001-of-00001.safetensors")]


def test_relative_init_from_is_recorded_absolute(hf_dir, monkeypatch):
    """The run's config (and so the PEFT adapters' base_model_name_or_path) names the folder
    from any working directory."""
    from flame.config.manager import FlameConfigManager

    monkeypatch.chdir(os.path.dirname(hf_dir))
    cfg = FlameConfigManager().parse_args(["--model.init_from", os.path.basename(hf_dir)])
    assert (cfg.model.init_from, cfg.model.config, cfg.model.tokenizer_path) == (hf_dir, hf_dir, hf_dir)


def test_config_and_tokenizer_follow_init_from(hf_dir):
    from flame.config.manager import FlameConfigManager
    from flame.errors import ConfigError

    from flame.launch import job_args

    cfg = FlameConfigManager().parse_args(["--model.init_from", hf_dir])
    assert (cfg.model.config, cfg.model.tokenizer_path) == (hf_dir, hf_dir)
    # train.sh's default job names a model and tokenizer of its own: init_from replaces them
    cfg = FlameConfigManager().parse_args(job_args(["--model.init_from", hf_dir]))
    assert (cfg.model.config, cfg.model.tokenizer_path) == (hf_dir, hf_dir)
    cfg = FlameConfigManager().parse_args(["--model.init_from", hf_dir, "--model.config", TINY_LLAMA])
    assert cfg.model.config == TINY_LLAMA and cfg.model.tokenizer_path == hf_dir
    with pytest.raises(ConfigError, match="no such folder, and no such model in the local Hugging Face cache"):
        FlameConfigManager().parse_args(["--model.init_from", "nobody-xyz/no-such-model"])


def test_a_peft_adapter_folder_is_named_as_such(tmp_path, capsys):
    """``DUMP/hf_adapter`` given as init_from: one line saying it holds adapters and what to give instead."""
    from flame.lora.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from flame.utils.dump_folder import main  # what train.sh runs before any process starts

    adapter = tmp_path / "hf_adapter"
    adapter.mkdir()
    (adapter / ADAPTER_CONFIG).write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "/models/base"}))
    (adapter / ADAPTER_WEIGHTS).write_bytes(b"")
    for extra in ([], ["--model.config", TINY_LLAMA]):  # with a config of its own, too: not a weight mismatch
        assert main(["--model.init_from", str(adapter), *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"flame: error: model.init_from '{adapter}': holds LoRA adapters")
        assert "base model's folder" in lines[0] and "DUMP/hf" in lines[0] and "(/models/base)" in lines[0]


def test_a_run_s_dump_folder_is_named_as_such(tmp_path, capsys):
    """A dump folder given as init_from (the user meant its export): one line naming DUMP/hf when there
    is one, the converter when there is not, with a model config of the user's own too."""
    from flame.utils.dump_folder import main

    dump = tmp_path / "base"
    (dump / "checkpoint" / "step-4").mkdir(parents=True)
    (dump / "job_config.json").write_text("{}")
    for export in (False, True):
        if export:
            (dump / "hf").mkdir()
            (dump / "hf" / "config.json").write_text("{}")
        for extra in ([], ["--model.config", TINY_LLAMA]):
            assert main(["--model.init_from", str(dump), *extra]) == 2
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 1, lines
            assert lines[0].startswith(f"flame: error: model.init_from '{dump}' is a run's dump folder")
            assert (f"export {str(dump / 'hf')!r}" in lines[0]) is export
            assert ("convert_dcp_to_hf" in lines[0]) is not export
