"""LoRA through the trainer on CPU (gloo): only adapters change and are in the optimizer and its
checkpointed state, exact resume (with dropout), the exports of a run, FSDP2 on 2 ranks, errors."""

import os

import pytest
import torch

from flame.errors import ConfigError
from flame.lora import is_adapter_key
from tests.trainer.helpers import losses, run_job, tiny_job, train_in_process

LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--optimizer.lr", "1e-2"]


def test_only_adapters_change_and_the_exports_compute_the_trained_model(tmp_path):
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    dump = str(tmp_path / "run")
    before = {}

    def snapshot(trainer):
        before.update({k: v.clone() for k, v in trainer.model.state_dict().items()})

    trainer = train_in_process(tiny_job(dump, *LORA, "--training.steps", "3", "--checkpoint.interval", "3",
                                        "--checkpoint.export_hf", "--checkpoint.export_dtype", "float32",
                                        "--lora.export_adapters"), before_train=snapshot)
    after = trainer.model.state_dict()
    adapters = {k for k in after if is_adapter_key(k)}
    assert adapters and all(torch.equal(after[k], before[k]) for k in after if k not in adapters)
    assert all(not torch.equal(after[k], before[k]) for k in adapters)
    in_optimizer = {id(p) for g in trainer.optimizers.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in trainer.model.named_parameters() if is_adapter_key(n)}
    # the checkpoint's optimizer state is the adapters' alone
    keys = FileSystemReader(os.path.join(dump, "checkpoint", "step-3")).read_metadata().state_dict_metadata
    moments = [k for k in keys if k.startswith("optimizer.state.")]
    assert moments and all(is_adapter_key(k.split(".", 2)[2].rsplit(".", 1)[0]) for k in moments), moments[:4]

    ids = torch.randint(0, trainer.model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(dump, "hf"), dtype=torch.float32).eval()
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-5, atol=1e-5)
    assert sorted(os.listdir(os.path.join(dump, "hf_adapter"))) == ["adapter_config.json", "adapter_model.safetensors"]

    # the checkpoint converted afterwards: the same merged weights (rank/alpha from job_config.json)
    from flame.utils import convert_dcp_to_hf
    from safetensors.torch import load_file

    assert convert_dcp_to_hf.main(["--path", dump, "--step", "3", "--dtype", "float32", "--out", str(tmp_path / "conv"),
                                   "--adapter-out", str(tmp_path / "conv_adapter")]) == 0
    for name in ("hf/model.safetensors", "hf_adapter/adapter_model.safetensors"):
        ref = load_file(os.path.join(dump, name))
        got = load_file(str(tmp_path / name.replace("hf", "conv")))
        assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref), name


def test_resume_repeats_the_uninterrupted_losses_with_dropout(tmp_path):
    common = [*LORA, "--lora.dropout", "0.1", "--lr_scheduler.total_steps", "6", "--checkpoint.interval", "3"]
    full, split = str(tmp_path / "full"), str(tmp_path / "split")
    train_in_process(tiny_job(full, "--training.steps", "6", *common))
    train_in_process(tiny_job(split, "--training.steps", "3", *common))
    train_in_process(tiny_job(split, "--training.steps", "6", *common))
    assert len(losses(full)) == 6 and losses(split) == losses(full)
    # the masks are drawn: without the restored generator state the resumed steps differ
    ref = str(tmp_path / "nodrop")
    train_in_process(tiny_job(ref, "--training.steps", "6", *LORA, "--lr_scheduler.total_steps", "6",
                              "--checkpoint.no-enable"))
    assert losses(ref) != losses(full)


def test_fsdp_two_ranks_with_block_checkpointing_repeat_one_rank(tmp_path):
    common = [*LORA, "--training.steps", "4", "--checkpoint.no-enable", "--activation_checkpoint.mode", "full",
              "--training.batch_size", "2"]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    # the same sequences per step: two ranks read the document shares that two loader workers of
    # one rank read, one batch each (the workers take turns: one batch of each per optimizer step)
    train_in_process(tiny_job(one, *common, "--training.gradient_accumulation_steps", "2",
                              "--training.num_workers", "2"))
    run_job(2, two, *common)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5, abs=1e-6)
    assert losses(one)[-1] < losses(one)[0]


@pytest.mark.parametrize("extra, fragment", [
    (["--lora.rank", "-1"], "lora.rank -1: must be >= 0"),
    (["--lora.rank", "4", "--lora.dropout", "1"], "lora.dropout 1.0"),
    (["--lora.export_adapters"], "lora.export_adapters given with LoRA off"),
    (["--lora.targets", "bogus_proj"], "lora.targets given with LoRA off"),
    (["--lora.alpha", "32", "--lora.dropout", "0.1"], "lora.alpha, lora.dropout given with LoRA off"),
    (["--lora.rank", "4", "--parallelism.tensor_parallel_degree", "2"], "tensor parallelism"),
])
def test_bad_lora_config_is_refused(tmp_path, extra, fragment):
    from flame.config.manager import FlameConfigManager

    with pytest.raises(ConfigError, match=fragment):
        FlameConfigManager().parse_args(tiny_job(str(tmp_path / "run"), *extra))


def _checkpoint(dump: str, step: int, tmp_path) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = str(tmp_path / f"{os.path.basename(dump)}-{step}.pt")
    dcp_to_torch_save(os.path.join(dump, "checkpoint", f"step-{step}"), out)
    return torch.load(out, weights_only=False)


@pytest.mark.slow  # four trainer runs (about a minute on 2 cores); tests/offload/test_engine_lora.py is the fast check
def test_lora_on_the_offload_engine_matches_plain_resumes_and_exports(tmp_path):
    """The base streamed from the host (float32 compute, as the plain CPU run): the plain LoRA run's
    losses and weights, the base unchanged, optimizer state for the adapters only, an exact resume
    and the plain run's merged export."""
    from safetensors.torch import load_file

    from tests.trainer.test_offload_training import PROFILE

    offload = ["--offload.enable", "on", "--offload.profile", PROFILE, "--offload.overrides", "weights[*]=host",
               "--offload.compute_dtype", "float32"]
    # eps 1e-8 and for-loop AdamW: as the trainer's offload tests (flame's 1e-15 turns rounding into +-lr steps)
    common = [*LORA, "--lr_scheduler.total_steps", "4", "--checkpoint.interval", "2", "--optimizer.eps", "1e-8",
              "--optimizer.implementation", "for-loop", "--checkpoint.export_hf", "--checkpoint.export_dtype",
              "float32"]
    plain, off, split = (str(tmp_path / n) for n in ("plain", "off", "split"))
    train_in_process(tiny_job(plain, "--training.steps", "4", *common))
    trainer = train_in_process(tiny_job(off, "--training.steps", "4", *common, *offload))
    assert trainer.parts.weights is not None  # the engine ran the model
    assert losses(off) == pytest.approx(losses(plain), rel=1e-5, abs=1e-6)
    want, got = _checkpoint(plain, 4, tmp_path), _checkpoint(off, 4, tmp_path)
    model_keys = [k for k, v in want.items() if isinstance(v, torch.Tensor)]  # the model's entries are flattened
    assert model_keys and set(model_keys) == {k for k, v in got.items() if isinstance(v, torch.Tensor)}
    start = _checkpoint(off, 2, tmp_path)
    for k in model_keys:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
        if not is_adapter_key(k):
            assert torch.equal(got[k], start[k]), k  # the frozen base never moves
    moments = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in got["optimizer"] if k.startswith("state.")}
    assert moments == {k for k in model_keys if is_adapter_key(k)}
    merged, ref = load_file(os.path.join(off, "hf", "model.safetensors")), load_file(os.path.join(plain, "hf", "model.safetensors"))
    assert merged.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(merged[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
    # a launch that stops at step 2 and resumes repeats the uninterrupted offloaded run
    train_in_process(tiny_job(split, "--training.steps", "2", *common, *offload))
    train_in_process(tiny_job(split, "--training.steps", "4", *common, *offload))
    assert losses(split) == losses(off)


def test_lora_on_a_converted_hf_base_keeps_the_base_and_trains(tmp_path):
    from transformers import AutoTokenizer

    from flame.models import build
    from flame.utils.hf_export import export_hf, hf_to_dcp
    from tests.trainer.helpers import TINY_LLAMA, TOKENIZER

    # an HF folder with weights the run's seed does not draw, converted into the run's step-0 (the
    # two-command start from HF weights)
    config = build.load_model_config(TINY_LLAMA)
    build.fit_vocab(config, len(AutoTokenizer.from_pretrained(TOKENIZER)), 64)
    base = build.build_meta_model(config)
    base.to_empty(device="cpu")
    build.init_weights(base, seed=7)
    hf = export_hf(base.state_dict(), config, TOKENIZER, str(tmp_path / "hf"), dtype="float32")
    dump = str(tmp_path / "run")
    hf_to_dcp(hf, os.path.join(dump, "checkpoint", "step-0"))
    trainer = train_in_process(tiny_job(dump, *LORA, "--training.steps", "2", "--checkpoint.interval", "2"))
    got, want = trainer.model.state_dict(), base.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())  # the base loaded, then frozen
    assert any(got[k].any() for k in got if k.endswith(".lora_B"))  # the fresh adapters trained


def test_resuming_a_lora_run_without_lora_names_the_adapters(tmp_path):
    """Relaunching a LoRA run without --lora.rank used to stop with 'its optimizer state is another
    optimizer's (resuming with another optimizer.name?)', which sent the user to the wrong option."""
    dump = str(tmp_path / "lora")
    train_in_process(tiny_job(dump, "--training.steps", "1", *LORA))
    with pytest.raises(ConfigError) as e:
        train_in_process(tiny_job(dump, "--training.steps", "2", "--optimizer.lr", "1e-2"))
    message = str(e.value)
    assert "lora_A of the checkpoint is not in this model" in message and "resume with its lora.rank" in message
    assert "optimizer" not in message and "\n" not in message


def test_resuming_with_another_lora_alpha_is_an_error(tmp_path, monkeypatch):
    """A relaunch with another --lora.alpha trained on in silence with another adapter scale, and
    rewrote job_config.json, from which the exports of the earlier checkpoints take alpha."""
    dump = str(tmp_path / "lora")
    train_in_process(tiny_job(dump, "--training.steps", "1", *LORA))
    with pytest.raises(ConfigError) as e:
        train_in_process(tiny_job(dump, "--training.steps", "2", *LORA, "--lora.alpha", "16"))
    assert str(e.value).startswith("lora.alpha=16: the checkpoint's adapters were trained with lora.alpha=8")
    # checkpoints written before flame saved alpha load as before
    from flame.lora import scale

    old = str(tmp_path / "old")
    monkeypatch.setattr(scale.AdapterScale, "state_dict", lambda self: {})
    train_in_process(tiny_job(old, "--training.steps", "1", *LORA))
    monkeypatch.undo()
    train_in_process(tiny_job(old, "--training.steps", "2", *LORA))
    assert len(losses(old)) == 2
