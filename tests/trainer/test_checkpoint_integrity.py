"""Complete-or-nothing checkpoints: the completion record, cleanup that counts complete checkpoints
only, fallback past incomplete and damaged folders, and one-line errors for bad load options.

The manager tests save a one-layer model through flame's CheckpointManager in this process (world
1, gloo); the trainer test runs ``flame.train.main`` in-process on the tiny job.
"""

import dataclasses
import functools
import json
import logging
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.stateful import Stateful

from flame.components.checkpoint import COMPLETE, SAVING, FlameCheckpointManager
from flame.config.manager import FlameConfigManager
from flame.errors import ConfigError
from tests.trainer.helpers import TINY_LLAMA, TOML, free_port, losses, tiny_job


class Box(Stateful):
    """Stands in for the optimizer, scheduler, dataloader and train state: one tensor of state."""

    def __init__(self):
        self.value = torch.zeros(3)

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, sd):
        self.value.copy_(sd["value"])


@pytest.fixture
def world1(tmp_path, caplog):
    caplog.set_level(logging.INFO)  # not DCP's per-call debug records
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@functools.lru_cache(maxsize=1)
def default_checkpoint_config():
    return FlameConfigManager().parse_args(["--job.config_file", TOML, "--model.config", TINY_LLAMA]).checkpoint


def manager(folder, out=8, bias=False, **options):
    """A manager saving every step (``options``: checkpoint config fields) of a one-layer model."""
    config = dataclasses.replace(default_checkpoint_config(), **{"interval": 1, **options})
    model = nn.Linear(8, out, bias=bias)
    with torch.no_grad():
        model.weight.zero_()
    mgr = FlameCheckpointManager(dataloader=Box(), model_parts=[model], optimizers=Box(), lr_schedulers=Box(),
                                 states={"train_state": Box()}, checkpoint_config=config, sd_adapter=None,
                                 base_folder=str(folder))
    return mgr, model


def save_steps(mgr, model, steps, last=None):
    for s in steps:
        with torch.no_grad():
            model.weight.fill_(float(s))  # the weights tell which step was loaded
        mgr.save(s, last_step=s == last)


def folders(dump):
    mgr_folder = os.path.join(dump, "checkpoint")
    return sorted(os.listdir(mgr_folder), key=lambda n: int(n.split("-")[1]))


def loaded_step(dump, **options):
    mgr, model = manager(dump, **options)
    try:
        assert mgr.load(-1)
        return model.weight.unique().item()
    finally:
        mgr.close()


def kill_mid_save(step_dir):
    """What a kill between the data files and the completion record leaves."""
    os.remove(os.path.join(step_dir, COMPLETE))
    open(os.path.join(step_dir, SAVING), "w").close()


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "checkpoint" in r.getMessage()]


@pytest.mark.parametrize("keep", [1, 2])
def test_incomplete_latest_never_costs_a_complete_checkpoint(tmp_path, world1, caplog, keep):
    # the sequence: step-5 complete, killed while writing step-10, relaunched to step 8
    mgr, model = manager(tmp_path, keep_latest_k=0, interval=5)
    save_steps(mgr, model, [5, 10])  # step-10 is cut short before its record (and before any cleanup)
    mgr.close()
    kill_mid_save(tmp_path / "checkpoint" / "step-10")
    with open(tmp_path / "checkpoint" / "step-10" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)

    mgr, model = manager(tmp_path, keep_latest_k=keep, interval=5)
    assert mgr.load(-1) and model.weight.unique().item() == 5.0
    lines = warnings_of(caplog)
    assert len(lines) == 1 and "step-10" in lines[0] and "incomplete" in lines[0], lines
    save_steps(mgr, model, [8], last=8)
    mgr.close()
    expected = ["step-8", "step-10"] if keep == 1 else ["step-5", "step-8", "step-10"]
    assert folders(tmp_path) == expected
    caplog.clear()
    assert loaded_step(tmp_path) == 8.0
    assert any("step-10" in line for line in warnings_of(caplog))


def test_cleanup_counts_complete_checkpoints_only(tmp_path, world1):
    mgr, model = manager(tmp_path, keep_latest_k=2)
    save_steps(mgr, model, [1, 2])
    kill_mid_save(tmp_path / "checkpoint" / "step-2")
    save_steps(mgr, model, [3])  # complete: 3 and 1 are the newest two; the incomplete 2 goes
    mgr.close()
    assert folders(tmp_path) == ["step-1", "step-3"]


def _truncate(d):
    with open(d / "__0_0.distcp", "r+b") as f:
        f.truncate(os.path.getsize(d / "__0_0.distcp") // 2)
    return "__0_0.distcp"


def _garbage_metadata(d):
    (d / ".metadata").write_bytes(b"not a pickle")
    return ".metadata"


def _delete_distcp(d):
    os.remove(d / "__0_0.distcp")
    return "__0_0.distcp"


def _flip_weight_byte(d):
    # one byte inside the model weight's bytes (the record's checksum is the only thing that can notice)
    md = FileSystemReader(str(d)).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == "weight")
    with open(d / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    return info.relative_path


DAMAGES = [_truncate, _garbage_metadata, _delete_distcp, _flip_weight_byte]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__.strip("_"))
def test_damaged_latest_falls_back_with_one_line_naming_the_file(tmp_path, world1, caplog, damage):
    mgr, model = manager(tmp_path, keep_latest_k=2)
    save_steps(mgr, model, [1, 2])
    mgr.close()
    name = damage(tmp_path / "checkpoint" / "step-2")
    assert loaded_step(tmp_path) == 1.0
    lines = warnings_of(caplog)
    assert len(lines) == 1 and os.path.join("step-2", name) in lines[0] and "falling back" in lines[0], lines

    with pytest.raises(ConfigError, match=f"step-2/{name}"):
        loaded_step(tmp_path, on_damaged="stop")
    with pytest.raises(ConfigError, match=f"checkpoint.load_step 2: damaged .*step-2/{name}"):
        mgr, _ = manager(tmp_path, load_step=2)
        try:
            mgr.load(2)
        finally:
            mgr.close()


def test_no_usable_checkpoint_is_an_error_unless_a_fresh_start_is_asked_for(tmp_path, world1, caplog):
    mgr, model = manager(tmp_path)
    save_steps(mgr, model, [1, 2])
    mgr.close()
    kill_mid_save(tmp_path / "checkpoint" / "step-2")
    _truncate(tmp_path / "checkpoint" / "step-1")
    with pytest.raises(ConfigError, match=r"no usable checkpoint .*step-2 \(the save did not finish\).*step-1 \(damaged"):
        loaded_step(tmp_path)
    mgr, model = manager(tmp_path, allow_fresh_start=True)
    assert mgr.load(-1) is False and model.weight.abs().sum().item() == 0
    mgr.close()
    assert "training from step 1" in warnings_of(caplog)[-1]


def test_only_an_unfinished_first_save_starts_over_with_one_line(tmp_path, world1, caplog):
    """A run killed during its first save has nothing complete to lose: the relaunch trains from step 1
    and says so (found by the chaos script: refusing made every relaunch exit 2)."""
    mgr, model = manager(tmp_path)
    save_steps(mgr, model, [1])
    mgr.close()
    kill_mid_save(tmp_path / "checkpoint" / "step-1")
    mgr, model = manager(tmp_path)
    assert mgr.load(-1) is False and model.weight.abs().sum().item() == 0
    mgr.close()
    assert "no complete checkpoint" in warnings_of(caplog)[-1] and "training from step 1" in warnings_of(caplog)[-1]


def test_checkpoints_without_a_record_still_load(tmp_path, world1, caplog):
    mgr, model = manager(tmp_path)
    save_steps(mgr, model, [1, 2])
    mgr.close()
    for step in (1, 2):  # as written before flame recorded checksums
        os.remove(tmp_path / "checkpoint" / f"step-{step}" / COMPLETE)
    assert loaded_step(tmp_path) == 2.0
    assert any("no completion record" in line for line in warnings_of(caplog))
    _delete_distcp(tmp_path / "checkpoint" / "step-2")  # a legacy folder is still checked against .metadata
    assert loaded_step(tmp_path) == 1.0


def test_async_save_is_recorded_once_written(tmp_path, world1):
    mgr, model = manager(tmp_path, async_mode="async", interval=2)
    save_steps(mgr, model, [1, 2])
    step2 = tmp_path / "checkpoint" / "step-2"
    mgr._pending[1].result()
    save_steps(mgr, model, [3])  # the first step after the write finished records it
    assert (step2 / COMPLETE).is_file() and not (step2 / SAVING).exists()
    record = json.loads((step2 / COMPLETE).read_text())
    assert set(record["files"]) == {".metadata", "__0_0.distcp"}
    mgr.close()
    assert loaded_step(tmp_path) == 2.0


def test_bad_load_options_are_one_line_errors(tmp_path, world1):
    mgr, _ = manager(tmp_path)
    with pytest.raises(ConfigError, match="checkpoint.load_step 999: there are no checkpoints"):
        mgr.load(999)
    mgr.close()
    mgr, model = manager(tmp_path)
    save_steps(mgr, model, [1, 2])
    mgr.close()
    mgr, _ = manager(tmp_path)
    with pytest.raises(ConfigError, match=r"checkpoint.load_step 999: no step-999 .*available steps: 1, 2"):
        mgr.load(999)
    mgr.close()
    mgr, _ = manager(tmp_path / "fresh", initial_load_path=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path .*nowhere.*: no such folder"):
        mgr.load(-1)
    mgr.close()
    seed = str(tmp_path / "checkpoint" / "step-2")
    mgr, model = manager(tmp_path / "fresh", initial_load_path=seed)
    assert mgr.load(-1) and model.weight.unique().item() == 2.0  # a good one loads
    mgr.close()
    _truncate(tmp_path / "checkpoint" / "step-2")
    mgr, _ = manager(tmp_path / "fresh", initial_load_path=seed)
    with pytest.raises(ConfigError, match="checkpoint.initial_load_path .*step-2.*: damaged .*__0_0.distcp has"):
        mgr.load(-1)
    mgr.close()
    mgr, _ = manager(tmp_path, out=4)  # another model shape
    with pytest.raises(ConfigError, match=r"tensor weight is \[8, 8\] in the checkpoint, \[4, 8\] in this model"):
        mgr.load(1)
    mgr.close()


def test_a_checkpoint_with_tensors_the_model_lacks_is_refused(tmp_path, world1):
    """DCP loads only the keys asked for: a model with fewer tensors than the checkpoint (fewer layers,
    no adapters) would silently drop the rest of the checkpoint's weights."""
    mgr, model = manager(tmp_path, bias=True)
    save_steps(mgr, model, [1])
    mgr.close()
    for options in ({}, {"initial_load_path": str(tmp_path / "checkpoint" / "step-1")}):
        mgr, _ = manager(tmp_path if not options else tmp_path / "fresh", **options)
        with pytest.raises(ConfigError, match=r"tensor bias of the checkpoint is not in this model"):
            mgr.load(-1)
        mgr.close()
    mgr, model = manager(tmp_path, bias=True)  # the model it was saved from loads
    assert mgr.load(-1) and model.weight.unique().item() == 1.0
    mgr.close()


def test_position_limit():
    from transformers import AutoConfig, GPT2Config, LlamaConfig

    from flame.models.build import build_meta_model, check_position_limit

    gpt2 = GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=100)
    model = build_meta_model(gpt2)
    check_position_limit(model, gpt2, 64, "training.seq_len")
    with pytest.raises(ConfigError, match=r"training.seq_len 65 is larger than the max_position_embeddings 64.*wpe"):
        check_position_limit(model, gpt2, 65, "training.seq_len")
    llama = AutoConfig.from_pretrained(TINY_LLAMA)  # plain RoPE computes any position
    check_position_limit(build_meta_model(llama), llama, 4 * llama.max_position_embeddings, "training.seq_len")
    dyn = LlamaConfig(**{**llama.to_dict(), "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}})
    with pytest.raises(ConfigError, match="training.context_len 513 .* 'dynamic' RoPE"):
        check_position_limit(build_meta_model(dyn), dyn, 513, "training.context_len")


# -- the trainer -----------------------------------------------------------------------------
def launch(monkeypatch, capsys, dump, *extra, config=TINY_LLAMA):
    from flame.train import main

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    rc = main(tiny_job(dump, *extra, config=config))
    out = capsys.readouterr()
    return rc, out.out, [l for l in out.err.splitlines() if l.startswith("flame: error:")]


def test_trainer_resumes_from_the_previous_complete_checkpoint(tmp_path, monkeypatch, capsys):
    dump = str(tmp_path / "run")
    common = ["--training.steps", "4", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "4"]
    rc, _, _ = launch(monkeypatch, capsys, dump, *common)
    assert rc == 0
    first = losses(dump)
    damaged = os.path.join(dump, "checkpoint", "step-4", "__0_0.distcp")
    with open(damaged, "r+b") as f:
        f.truncate(1000)

    rc, _, errors = launch(monkeypatch, capsys, dump, *common, "--checkpoint.on_damaged", "stop")
    assert rc == 2 and len(errors) == 1 and damaged in errors[0], errors

    other = tmp_path / "wider.json"
    other.write_text(json.dumps(dict(json.load(open(TINY_LLAMA)), intermediate_size=96)))
    rc, _, errors = launch(monkeypatch, capsys, dump, *common, "--checkpoint.load_step", "2", config=str(other))
    assert rc == 2 and len(errors) == 1, errors
    assert re.search(r"tensor model\.layers\.\d\.mlp\.(\w+)_proj\.weight is (\[128, 64\]|\[64, 128\]) in the checkpoint, "
                     r"(\[96, 64\]|\[64, 96\]) in this model", errors[0]), errors

    rc, out, _ = launch(monkeypatch, capsys, dump, *common, "--checkpoint.keep_latest_k", "1")
    assert rc == 0
    assert f"{damaged} has 1000 bytes" in out and "Training from step 3" in out
    assert losses(dump) == first  # steps 3 and 4 again, exactly, in place of the first run's records
    assert os.listdir(os.path.join(dump, "checkpoint")) == ["step-4"]
    assert os.path.isfile(os.path.join(dump, "checkpoint", "step-4", COMPLETE))


def test_convert_refuses_a_damaged_checkpoint(tmp_path, world1, capsys):
    from flame.utils.convert_dcp_to_hf import main

    mgr, model = manager(tmp_path)
    save_steps(mgr, model, [1])
    mgr.close()
    name = _truncate(tmp_path / "checkpoint" / "step-1")
    capsys.readouterr()
    assert main(["--path", str(tmp_path), "--step", "1", "--config", TINY_LLAMA, "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flame: error: damaged checkpoint") and f"step-1/{name}" in err and err.count("\n") == 1
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_with_wrapper_names_is_refused_naming_the_cause(tmp_path):
    """An offloaded run of an older flame saved names like layers.0._orig_mod.w: loading it into
    plain names is refused with the cause, not only the missing tensor."""
    import torch.distributed.checkpoint as dcp

    from flame.components.checkpoint import FlameCheckpointManager
    from flame.errors import ConfigError

    old, plain = str(tmp_path / "old"), str(tmp_path / "plain")
    dcp.save({"layers.0._orig_mod.w": torch.ones(2)}, checkpoint_id=old)
    dcp.save({"layers.1.w": torch.ones(2)}, checkpoint_id=plain)
    for path, cause in ((old, "_orig_mod"), (plain, "another model config")):
        with pytest.raises(ConfigError, match=cause) as e:
            FlameCheckpointManager._guarded(lambda: dcp.load({"layers.0.w": torch.zeros(2)}, checkpoint_id=path), path)
        assert "layers.0.w" in str(e.value)


def test_another_optimizers_state_is_named_as_such(tmp_path):
    """A checkpoint of AdamW resumed with Muon holds optimizer state, only not this optimizer's: the error
    says so instead of calling it a model-only checkpoint."""
    import torch.distributed.checkpoint as dcp

    adamw, model_only = str(tmp_path / "adamw"), str(tmp_path / "model_only")
    dcp.save({"w": torch.ones(2), "optimizer.state.w.exp_avg": torch.ones(2)}, checkpoint_id=adamw)
    dcp.save({"w": torch.ones(2)}, checkpoint_id=model_only)
    muon = {"w": torch.zeros(2), "optimizer.state.w.momentum_buffer": torch.zeros(2)}
    for path, cause in ((adamw, "its optimizer state is another optimizer's"), (model_only, "it holds no optimizer")):
        with pytest.raises(ConfigError, match=cause):
            FlameCheckpointManager._guarded(lambda: dcp.load(dict(muon), checkpoint_id=path), path)
