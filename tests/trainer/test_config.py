"""Config parsing: flame's and the softpick paper's command lines, aliases, bad keys."""

import os

import pytest

from flame.config.manager import FlameConfigManager
from flame.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOML = os.path.join(ROOT, "flame/models/fla.toml")
CONFIG = os.path.join(ROOT, "tests/assets/tiny_llama.json")
CORPUS = os.path.join(ROOT, "flame/assets/sample_corpus")


def parse(*args):
    return FlameConfigManager().parse_args(["--job.config_file", TOML, "--model.config", CONFIG, *args])


def test_flame_readme_command():
    cfg = parse(
        "--job.dump_folder", "exp/transformer-340M", "--model.tokenizer_path", "flame/assets/tokenizer",
        "--optimizer.name", "AdamW", "--optimizer.eps", "1e-15", "--optimizer.lr", "1e-3",
        "--lr_scheduler.warmup_steps", "1024", "--lr_scheduler.lr_min", "0.1", "--lr_scheduler.decay_type", "cosine",
        "--training.batch_size", "1", "--training.seq_len", "65536", "--training.context_len", "4096",
        "--training.varlen", "--training.gradient_accumulation_steps", "1", "--training.steps", "20480",
        "--training.max_norm", "1.0", "--training.skip_nan_inf", "--training.dataset", "HuggingFaceFW/fineweb-edu",
        "--training.dataset_name", "sample-10BT", "--training.dataset_split", "train", "--training.streaming",
        "--training.num_workers", "32", "--training.prefetch_factor", "2", "--training.seed", "42",
        "--training.compile", "--checkpoint.interval", "2048", "--checkpoint.load_step", "-1",
        "--checkpoint.keep_latest_k", "2", "--metrics.log_freq", "1",
    )
    t = cfg.training
    assert (t.local_batch_size, t.seq_len, t.context_len, t.varlen, t.streaming) == (1, 65536, 4096, True, True)
    assert cfg.compile.enable and cfg.debug.seed == 42 and t.skip_nan_inf
    assert cfg.lr_scheduler.min_lr_factor == pytest.approx(0.1)
    assert t.dataloader.num_workers == 32 and t.dataloader.prefetch_factor == 2
    assert cfg.checkpoint.keep_latest_k == 2 and cfg.checkpoint.load_step == -1


def test_softpick_paper_command():
    cfg = parse(
        "--job.dump_folder", "exp/softpick-340M", "--optimizer.eps", "1e-15", "--optimizer.lr", "3e-4",
        "--lr_scheduler.warmup_steps", "1024", "--lr_scheduler.lr_min", "0.1", "--lr_scheduler.decay_type", "cosine",
        "--training.batch_size", "16", "--training.seq_len", "4096", "--training.gradient_accumulation_steps", "1",
        "--training.steps", "22528", "--training.max_norm", "1.0", "--training.skip_nan_inf",
        "--training.dataset", "HuggingFaceFW/fineweb-edu", "--training.dataset_name", "sample-100BT",
        "--training.dataset_split", "train", "--training.num_workers", "32", "--training.prefetch_factor", "2",
        "--training.seed", "79", "--training.compile", "--checkpoint.interval", "8192", "--checkpoint.load_step", "-1",
        "--metrics.log_freq", "1", "--comm.init_timeout_seconds", "600", "--comm.train_timeout_seconds", "600",
        "--training.data_parallel_replicate_degree", "1", "--training.data_parallel_shard_degree", "-1",
        "--training.tensor_parallel_degree", "1", "--checkpoint.hf_upload_enabled", "--checkpoint.hf_repo_base_name", "x",
    )
    assert cfg.training.local_batch_size == 16 and cfg.comm.init_timeout_seconds == 600
    assert cfg.parallelism.data_parallel_shard_degree == -1 and cfg.checkpoint.hf_upload_enabled


def test_cli_overrides_toml_and_aliases():
    cfg = parse("--optimizer.lr", "0.5", "--checkpoint.enable_checkpoint", "--job.print_args",
                "--checkpoint.last_save_model_weights_only", "--training.deterministic",
                "--training.data_probs", "0.6,0.4", "--validation.enable", "--validation.interval", "7")
    assert cfg.optimizer.lr == 0.5 and cfg.checkpoint.enable and cfg.job.print_config
    assert cfg.checkpoint.last_save_model_only and cfg.debug.deterministic
    assert cfg.training.data_probs == [0.6, 0.4] and cfg.validation.freq == 7
    # the TOML value survives where the CLI is silent
    assert cfg.optimizer.eps == 1e-15


def test_defaults_keep_final_checkpoint_resumable():
    assert parse().checkpoint.last_save_model_only is False


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--training.batchsize", "3"], "did you mean 'training.batch_size'"),
        (["--optimzer.lr", "3"], "did you mean 'optimizer.lr'"),
        (["--training.steps", "ten"], "--training.steps 'ten'"),
        (["--training.steps", "--job.dump_folder", "x"],
         "--training.steps: no value (the next argument, '--job.dump_folder', is an option); expected integer"),
        (["--lr_scheduler.decay_type", "exp"], "must be one of linear, sqrt, cosine"),
        (["--training.seq_len", "1"], "training.seq_len 1"),
        (["--training.varlen", "--training.context_len", "9000", "--training.seq_len", "4096"], "training.context_len 9000"),
        (["--model.config", "/nonexistent.json"], "/nonexistent.json"),
        (["--lr_scheduler.lr_min", "2"], "lr_scheduler.lr_min 2"),
        (["--checkpoint.keep_latest_k", "1", "--checkpoint.async_mode", "async"], "keep at least 2"),
        (["--checkpoint.hf_upload_enabled"], "needs checkpoint.hf_repo_base_name"),
        (["--checkpoint.hf_upload_enabled", "--checkpoint.hf_repo_base_name", "x", "--checkpoint.no-export-hf"],
         "needs checkpoint.export_hf"),
        (["--validation.enable", "--validation.freq", "0"], "validation.freq 0: must be >= 1"),
        (["--validation.enable", "--validation.freq", "-3"], "validation.freq -3: must be >= 1"),
        (["--validation.enable", "--validation.steps", "0"], "--validation.steps 0: validation steps must be positive"),
        (["--validation.enable", "--validation.steps", "-2"], "--validation.steps -2: validation steps must be positive"),
        (["--validation.local_batch_size", "0"], "validation.local_batch_size 0: must be >= 1"),
        (["--validation.seq_len", "0"], "validation.seq_len 0: must be >= 2"),
        (["--training.num_workers", "0", "--training.persistent_workers"], "training.persistent_workers needs"),
        (["--training.streaming", "--training.shuffle_buffer_size", "0"], "training.shuffle_buffer_size 0: must be >= 1"),
        # [offload] values were checked only when the planner ran: auto on CPU or off trained on
        (["--offload.gpu_memory_gib", "-5"], "offload.gpu_memory_gib=-5.0: expected a number >= 0"),
        (["--offload.enable", "off", "--offload.cpu_threads", "-2"], "offload.cpu_threads=-2: expected an integer >= 0"),
        (["--offload.enable", "off", "--offload.master_dtype", "bfloat16"],
         "offload.moment_dtype='float32': must equal offload.master_dtype"),
        # a plan file or overrides with offload off were dropped in silence (the run trained plain)
        (["--offload.enable", "off", "--offload.plan", CONFIG, "--offload.overrides", "weights[*]=host"],
         "offload.plan, offload.overrides set but offload.enable is off: add --offload.enable on"),
    ],
)
def test_bad_cli(args, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        parse(*args)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_bad_toml(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[training]\nbatchsize = 3\n')
    with pytest.raises(ConfigError, match="unknown TOML key 'training.batchsize'; did you mean 'training.batch_size'"):
        FlameConfigManager().parse_args(["--job.config_file", str(bad), "--model.config", CONFIG])
    section = tmp_path / "section.toml"  # a misspelled table used to get "did you mean 'training.sft'?"
    section.write_text('[trainig]\nsteps = 3\n')
    with pytest.raises(ConfigError, match=r"^unknown TOML table '\[trainig\]'; did you mean 'training'\?$"):
        FlameConfigManager().parse_args(["--job.config_file", str(section), "--model.config", CONFIG])
    broken = tmp_path / "broken.toml"
    broken.write_text("[training\n")
    with pytest.raises(ConfigError, match="broken.toml"):
        FlameConfigManager().parse_args(["--job.config_file", str(broken), "--model.config", CONFIG])
    with pytest.raises(ConfigError, match="no such file"):
        FlameConfigManager().parse_args(["--job.config_file", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match="a folder, not a TOML file"):
        FlameConfigManager().parse_args(["--job.config_file", str(tmp_path)])


def test_bad_values_each_name_themselves(tmp_path):
    """A dump folder that is a file, no training steps, a varlen context longer than the sequence."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    cases = [(["--job.dump_folder", str(a_file)], "a file, not a folder"),
             (["--training.steps", "0"], "training.steps 0: must be >= 1"),
             (["--training.varlen", "--training.seq_len", "16", "--training.context_len", "32"],
              "set --training.context_len"),
             (["--training.dataset", str(tmp_path / "no_corpus")], "training.dataset: '.*no_corpus' does not exist"),
             (["--training.dataset", f"{CORPUS},{tmp_path}/shards/*.jsonl"], r"training.dataset: '.*shards/\*.jsonl' matches no file"),
             (["--model.tokenizer_path", "./no_tokenizer_here"], "model.tokenizer_path: './no_tokenizer_here': no such folder"),
             (["--validation.dataset", CORPUS, "--validation.seq_len", "64"],
              r"validation.dataset, validation.seq_len set but validation is off: add --validation.enable"),
             (["--profiling.enable_profiling", "--profiling.profile_freq", "3"],
              r"profiling.profile_freq 3: a profiling cycle must hold profiling.profiler_warmup \(3, at least 0\) \+ profiling.profiler_active \(1, at least 1\) steps")]
    for extra, says in cases:
        with pytest.raises(ConfigError, match=says):
            FlameConfigManager().parse_args(["--model.config", CONFIG, "--job.dump_folder", str(tmp_path / "run"),
                                             *extra])


def test_logging_backend_without_its_package_is_refused(tmp_path, monkeypatch):
    """torchtitan would log the ImportError and train on without the backend."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"metrics.enable_wandb: the wandb package is not installed \(pip install wandb\)"):
        FlameConfigManager().parse_args(["--model.config", CONFIG, "--job.dump_folder", str(tmp_path / "run"),
                                         "--metrics.enable_wandb"])


def test_cli_canonical_key_beats_toml_alias():
    # fla.toml sets training.tensor_parallel_degree = 1, training.data_parallel_shard_degree = -1,
    # checkpoint.enable_checkpoint = true and lr_scheduler.lr_min = 0.1 (flame's spellings)
    cfg = parse("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1",
                "--checkpoint.no-enable", "--lr_scheduler.min_lr_factor", "0.0", "--training.local_batch_size", "3")
    p = cfg.parallelism
    assert (p.tensor_parallel_degree, p.data_parallel_shard_degree) == (2, 1)
    assert cfg.checkpoint.enable is False
    assert cfg.lr_scheduler.min_lr_factor == 0.0 and cfg.lr_scheduler.lr_min == 0.0
    assert cfg.training.local_batch_size == 3 and cfg.training.batch_size == 3
    # the alias on the command line still works, and wins over the TOML
    assert parse("--training.tensor_parallel_degree", "2").parallelism.tensor_parallel_degree == 2


def test_boolean_flags_of_sections_with_string_annotations():
    """[offload] is written with `from __future__ import annotations` (its field types are strings):
    its booleans are flags like every other section's, both ways, and the next option parses."""
    cfg = parse("--offload.activation_offload", "--offload.gpu_memory_gib", "6", "--offload.no-calibrate")
    assert cfg.offload.activation_offload is True and cfg.offload.calibrate is False
    assert cfg.offload.gpu_memory_gib == 6
    assert parse().offload.activation_offload is False


@pytest.mark.parametrize("extra, named", [
    (["--validation.freq", "5"], "validation.freq"),
    (["--validation.steps", "3"], "validation.steps"),
    (["--validation.interval", "5"], "validation.interval"),
    (["--validation.holdout_fraction", "0.1"], "validation.holdout_fraction"),
])
def test_validation_option_without_enable_is_an_error(extra, named):
    """--validation.freq/steps (the spellings docs/data.md shows) without --validation.enable used to
    be ignored without a word, while validation.interval, their alias, was an error."""
    with pytest.raises(ConfigError) as e:
        parse(*extra)
    assert str(e.value) == f"{named} set but validation is off: add --validation.enable (or drop the option)"


@pytest.mark.parametrize("extra, named", [
    (["--optimizer.muon_lr", "0.02"], "optimizer.muon_lr given with optimizer.name AdamW"),
    (["--optimizer.name", "Adam", "--optimizer.muon_momentum", "0.9", "--optimizer.muon_adjust_lr", "original"],
     "optimizer.muon_momentum, optimizer.muon_adjust_lr given with optimizer.name Adam"),
])
def test_muon_options_without_muon_are_an_error(extra, named):
    """--optimizer.muon_lr with AdamW used to train AdamW and ignore it without a word."""
    with pytest.raises(ConfigError) as e:
        parse(*extra)
    assert str(e.value) == f"{named}: Muon's options apply with --optimizer.name Muon only"
    assert parse("--optimizer.name", "Muon", *extra[-2:]).optimizer.name == "Muon"


@pytest.mark.parametrize("extra, named", [
    (["--checkpoint.initial_load_path", CORPUS], f"checkpoint.initial_load_path {CORPUS}"),
    (["--checkpoint.load_step", "20"], "checkpoint.load_step 20"),
])
def test_checkpoint_loads_with_checkpointing_off_are_an_error(extra, named):
    """--checkpoint.no-enable --checkpoint.initial_load_path X used to train from scratch (loss 9.03
    at step 1 of the default job) without loading X or saying so."""
    with pytest.raises(ConfigError) as e:
        parse("--checkpoint.no-enable", *extra)
    assert str(e.value) == (f"{named} with checkpointing off (checkpoint.enable false): nothing would be "
                            "loaded; drop --checkpoint.no-enable")
