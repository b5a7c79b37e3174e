"""Parse ``--job.config_file X.toml`` + ``--section.key value`` into flame's JobConfig.

torchtitan's ConfigManager does the TOML -> dataclass -> tyro CLI merge; flame adds:
its own JobConfig extension merged in automatically, the bundled ``flame/models/fla.toml`` as
the base when no ``--job.config_file`` is given, input paths that resolve from any working
directory, one-line errors naming the bad key or value (TOML and CLI), comma-separated float
lists, alias folding, and a ``--help`` of flame's options (``flame.config.help``).
"""

import contextlib
import difflib
import glob
import importlib.util
import io
import os
import re
import sys
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Literal

import tyro

try:
    import tomllib
except ModuleNotFoundError:  # python < 3.11
    import tomli as tomllib

from torchtitan.config import ConfigManager
from torchtitan.config.manager import custom_registry

from flame.config import job_config as flame_job_config
from flame.errors import ConfigError


def _register_float_list_rule(registry: tyro.constructors.ConstructorRegistry) -> None:
    # flame users write `--training.data_probs 0.6,0.4`; tyro would want space-separated floats.
    @registry.primitive_rule
    def list_float_rule(type_info: tyro.constructors.PrimitiveTypeInfo):
        if type_info.type != list[float]:
            return None
        return tyro.constructors.PrimitiveConstructorSpec(
            nargs=1,
            metavar="A,B,...",
            instance_from_str=lambda args: [float(x) for x in args[0].split(",") if x],
            is_instance=lambda inst: isinstance(inst, list)
            and all(isinstance(x, (int, float)) for x in inst),
            str_from_instance=lambda inst: [",".join(str(x) for x in inst)],
        )


_register_float_list_rule(custom_registry)


def flat_fields(cls, prefix: str = "") -> dict[str, Any]:
    """Map every leaf option ``section.key`` (and nested ``a.b.c``) to its type."""
    out: dict[str, Any] = {}
    try:  # sections written with `from __future__ import annotations` hold their types as strings
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        hints = {}
    for f in fields(cls):
        name = f"{prefix}{f.name}"
        tp = hints.get(f.name, f.type)
        if is_dataclass(tp):
            out.update(flat_fields(tp, name + "."))
        else:
            out[name] = tp
    return out


# the checkout (or install prefix) holding the flame package: bundled assets such as
# `flame/assets/tokenizer` and `configs/...` resolve against it from any working directory
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_TOML = os.path.join(PACKAGE_ROOT, "flame", "models", "fla.toml")

# options naming input files or folders, and whether they hold comma-separated lists (one per
# source; `;` separates several globs of one source in data_files). Output paths (dump_folder)
# stay relative to the working directory.
PATH_OPTIONS = {
    "model.config": False,
    "model.tokenizer_path": False,
    "model.init_from": False,
    "training.dataset": True,
    "training.data_files": True,
    "validation.dataset": True,
    "checkpoint.initial_load_path": False,
    "offload.profile": False,
    "offload.plan": False,
}
# output paths: only a leading ~ is expanded (they stay relative to the working directory)
OUTPUT_PATH_OPTIONS = ("job.dump_folder", "offload.save_plan")


def _locate(path: str, bases: list[str]) -> str:
    """``path`` joined to the first base where it exists (a glob: matches something); unchanged
    when it is absolute, empty, or found nowhere (a hub id, or a file still to be written). A
    leading ``~`` is the home folder (TOML values and quoted options reach flame unexpanded)."""
    path = os.path.expanduser(path)
    if not path or os.path.isabs(path) or path == "auto":
        return path
    for base in bases:
        candidate = os.path.join(base, path)
        if glob.glob(candidate) if glob.has_magic(path) else os.path.exists(candidate):
            return path if base == os.getcwd() else os.path.normpath(candidate)
    return path


def resolve_path_option(key: str, value, bases: list[str]):
    """One PATH_OPTIONS value with every entry located against ``bases`` (first match wins); an
    OUTPUT_PATH_OPTIONS value with its leading ~ expanded."""
    if not isinstance(value, str) or not value:
        return value
    if key in OUTPUT_PATH_OPTIONS:
        return os.path.expanduser(value)
    if not PATH_OPTIONS[key]:
        return _locate(value, bases)
    return ",".join(";".join(_locate(g.strip(), bases) if g.strip() else g for g in entry.split(";"))
                    for entry in value.split(","))


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    return f"; did you mean '{match[0]}'?" if match else ""


def _is_bool(tp) -> bool:
    return tp is bool or (typing.get_origin(tp) in (typing.Union, types.UnionType) and bool in typing.get_args(tp))


def type_name(tp) -> str:
    """How an option's type reads in an error or in --help."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(x) for x in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp) or (str,)
        return f"a list of {type_name(item)}s"
    return {int: "integer", float: "number", str: "string", bool: "true or false"}.get(tp, getattr(tp, "__name__", str(tp)))


def _toml_value_ok(tp, value) -> bool:
    """Whether a TOML value can stand for an option of type ``tp`` (TOML has no null)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_toml_value_ok(a, value) for a in typing.get_args(tp) if a is not type(None))
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (item,) = typing.get_args(tp) or (typing.Any,)
        return isinstance(value, list) and all(_toml_value_ok(item, x) for x in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    return True  # dict, Any, ...: left to the code that reads it


def _check_value(key: str, tp, value: str) -> None:
    """Reject a CLI value that cannot become the option's type, in one line."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    for a in args:
        try:
            if a is int:
                int(value)
            elif a is float:
                float(value)
            elif typing.get_origin(a) is Literal:
                if value not in [str(x) for x in typing.get_args(a)]:
                    continue
            elif a == list[float]:
                [float(x) for x in value.split(",") if x]
            return
        except ValueError:
            continue
    if typing.get_origin(tp) is Literal or any(typing.get_origin(a) is Literal for a in args):
        choices = [str(x) for a in args for x in typing.get_args(a)]
        raise ConfigError(f"--{key} {value!r}: must be one of {', '.join(choices)}")
    if isinstance(value, str) and value.startswith("--"):
        raise ConfigError(f"--{key}: no value (the next argument, {value!r}, is an option); expected {type_name(tp)}")
    raise ConfigError(f"--{key} {value!r}: expected {type_name(tp)}")


class FlameConfigManager(ConfigManager):
    """torchtitan's ConfigManager with flame's extension always merged in."""

    def __init__(self):
        merged = ConfigManager._merge_configs(ConfigManager().config_cls, flame_job_config.JobConfig)
        super().__init__(merged)
        self.valid = flat_fields(merged)

    # -- CLI ---------------------------------------------------------------------------
    def _check_cli(self, args: list[str]) -> set[str]:
        """Validate the CLI; return the option names it sets (``section.key``)."""
        keys = sorted(self.valid)
        given = set()
        i = 0
        while i < len(args):
            arg = args[i]
            i += 1
            if arg in ("-h", "--help"):
                continue
            if not arg.startswith("--"):
                raise ConfigError(f"unexpected argument {arg!r}: options are --section.key value")
            key, eq, value = arg[2:].partition("=")
            key = key.replace("-", "_")
            negated = key.split(".")[-1].startswith("no_") and key not in self.valid
            if negated:
                parts = key.split(".")
                key = ".".join(parts[:-1] + [parts[-1][3:]])
            if key not in self.valid:
                raise ConfigError(f"unknown option '--{arg[2:].partition('=')[0]}'{_closest(key, keys)}")
            given.add(key)
            tp = self.valid[key]
            if _is_bool(tp) and eq:
                flag = key.rsplit(".", 1)
                raise ConfigError(f"--{arg[2:]}: {key} is a flag, written --{key} (on) or "
                                  f"--{flag[0]}.no-{flag[1]} (off), without a value")
            if _is_bool(tp):
                continue  # a flag
            if not eq:
                if i >= len(args):
                    raise ConfigError(f"--{key}: missing value")
                value = args[i]
                i += 1
            if not _is_bool(tp):
                _check_value(key, tp, value)
        return given

    # -- TOML --------------------------------------------------------------------------
    @staticmethod
    def toml_path(args: list[str]) -> str | None:
        """The job file the command line names; the bundled default when it names none
        (``--job.config_file ''`` asks for no file: torchtitan's and flame's defaults only)."""
        path = DEFAULT_TOML
        for i, arg in enumerate(args):
            k, eq, v = arg.partition("=")
            if k in ("--job.config_file", "--job.config-file"):
                path = v if eq else (args[i + 1] if i + 1 < len(args) else None)
        return path or None

    def _maybe_load_toml(self, args):
        path = self.toml_path(args)
        if path is None:
            return None
        if not os.path.isfile(path):
            raise ConfigError(f"job.config_file {path!r}: " + ("a folder, not a TOML file" if os.path.isdir(path)
                                                                else "no such file"))
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"job.config_file {path!r}: {e}") from None
        self.toml_file = path
        # input paths in the file are relative to the file's folder (then the working
        # directory, then flame's checkout for bundled assets)
        bases = [os.path.dirname(os.path.abspath(path)), os.getcwd(), PACKAGE_ROOT]
        for key in PATH_OPTIONS:
            section, name = key.split(".")
            table = data.get(section)
            if isinstance(table, dict) and name in table:
                table[name] = resolve_path_option(key, table[name], bases)
        if isinstance(data.get("job"), dict):
            data["job"].setdefault("config_file", os.path.abspath(path))
        else:
            data.setdefault("job", {"config_file": os.path.abspath(path)})
        return data

    def _dict_to_dataclass(self, cls, data, prefix: str = ""):
        if not is_dataclass(cls):
            return data
        names = {f.name: f for f in fields(cls)}
        try:  # sections written with `from __future__ import annotations` hold their types as strings
            hints = typing.get_type_hints(cls)
        except (NameError, TypeError):
            hints = {}
        for key in data:
            if key not in names:
                full = f"{prefix}{key}"
                if isinstance(data[key], dict):  # a misspelled [section]: the closest section, not a key in one
                    tables = sorted(f"{prefix}{n}" for n, f in names.items() if is_dataclass(hints.get(n, f.type)))
                    raise ConfigError(f"unknown TOML table '[{full}]'{_closest(full, tables)}")
                raise ConfigError(f"unknown TOML key '{full}'{_closest(full, sorted(self.valid))}")
        kwargs = {}
        for name, value in data.items():
            tp = hints.get(name, names[name].type)
            if is_dataclass(tp):
                if not isinstance(value, dict):
                    raise ConfigError(f"TOML key '{prefix}{name}' must be a table [{prefix}{name}]")
                kwargs[name] = self._dict_to_dataclass(tp, value, f"{prefix}{name}.")
            elif not _toml_value_ok(tp, value):
                where = getattr(self, "toml_file", "the job file")
                raise ConfigError(f"{prefix}{name} = {value!r} in {where}: expected {type_name(tp)}")
            else:
                kwargs[name] = value
        return cls(**kwargs)

    def _maybe_add_custom_config(self, args, toml_values):
        # flame's own extension is already merged; a user module still stacks on top.
        return super()._maybe_add_custom_config(args, toml_values)

    def _validate_config(self) -> None:
        # torchtitan's version maps tokenizer_path onto hf_assets_path with warnings and
        # probes old torchtitan asset paths; flame reads model.tokenizer_path itself.
        pass

    def base_config(self, args: list[str]):
        """The config the job file alone gives (no CLI values), aliases folded."""
        toml_values = self._maybe_load_toml(args)
        config_cls = self._maybe_add_custom_config(args, toml_values)
        base = self._dict_to_dataclass(config_cls, toml_values) if toml_values else config_cls()
        resolve_aliases(base)
        return base

    def help_text(self, args: list[str], prog: str = "python -m flame.train") -> str:
        """``--help``: flame's options with one-line descriptions and the values this command
        line gives them, its options over its job file (``flame.config.help``)."""
        from flame.config.help import format_help

        return format_help(self.help_config(args), prog, self.toml_path(args))

    def help_config(self, args: list[str]):
        """The config a command line gives, its options over its job file, unchecked (what
        ``--help`` shows as each option's value)."""
        config, _ = self._parse_cli([a for a in args if a not in ("-h", "--help")])
        return config

    def parse_args(self, args: list[str] | None = None):
        args = list(sys.argv[1:] if args is None else args)
        if "-h" in args or "--help" in args:
            from flame.config.help import print_help

            print_help(self.help_text(args))
            raise SystemExit(0)
        config, given = self._parse_cli(args)
        from flame.components.init_from import follow_init_from

        follow_init_from(config, given)
        validate(config)
        return config

    def _parse_cli(self, args: list[str]):
        """The job file with the command line's values on top, paths resolved and aliases folded;
        and the option names the command line sets. No checks that read the files it names."""
        given = self._check_cli(args)
        # tyro reports what flame's checks let through as a multi-line box: one line instead
        captured = io.StringIO()
        try:
            with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
                config = super().parse_args(args)
        except SystemExit as e:
            if not e.code:
                raise
            text = " ".join(line.strip(" │╭╮╰╯─") for line in captured.getvalue().splitlines())
            text = " ".join(w for w in text.split() if "helptext" not in w)
            raise ConfigError(f"command line rejected: {text.split(' For full')[0].strip() or 'invalid arguments'}") from None
        except AssertionError as e:  # a torchtitan section's own check (its __post_init__)
            named = [f"{a} {args[i + 1]}" for i, a in enumerate(args[:-1]) if _option_named_in(a, str(e))]
            raise ConfigError(f"{', '.join(named) + ': ' if named else ''}{e}") from None
        cwd_then_package = [os.getcwd(), PACKAGE_ROOT]
        for key in (*PATH_OPTIONS, *OUTPUT_PATH_OPTIONS):
            section, name = key.split(".")
            sec = getattr(config, section)
            setattr(sec, name, resolve_path_option(key, getattr(sec, name), cwd_then_package))
        resolve_aliases(config, given)
        return config, given


def _option_named_in(arg: str, message: str) -> bool:
    """``--section.name`` whose section and name both appear as words of ``message``."""
    if not arg.startswith("--") or "." not in arg:
        return False
    words = set(re.findall(r"[a-z_]+", message.lower()))
    section, name = arg[2:].split(".", 1)
    return section in words and name in words


# flame spelling -> the torchtitan field it stands for
_ALIASES = {
    "training.batch_size": "training.local_batch_size",
    "lr_scheduler.lr_min": "lr_scheduler.min_lr_factor",
    "training.compile": "compile.enable",
    "training.seed": "debug.seed",
    "training.deterministic": "debug.deterministic",
    "training.data_parallel_replicate_degree": "parallelism.data_parallel_replicate_degree",
    "training.data_parallel_shard_degree": "parallelism.data_parallel_shard_degree",
    "training.tensor_parallel_degree": "parallelism.tensor_parallel_degree",
    "checkpoint.enable_checkpoint": "checkpoint.enable",
    "checkpoint.last_save_model_weights_only": "checkpoint.last_save_model_only",
    "validation.interval": "validation.freq",
    "job.print_args": "job.print_config",
}
# boolean aliases only switch their field on
_FLAG_ALIASES = {"training.compile", "training.deterministic", "checkpoint.enable_checkpoint",
                 "checkpoint.last_save_model_weights_only", "job.print_args"}


def resolve_aliases(cfg, cli_keys: set[str] = frozenset()) -> None:
    """Fold flame's spellings into the torchtitan fields the library code reads.

    An alias is applied unless the field it stands for was given on the command line and the
    alias was not: ``--parallelism.tensor_parallel_degree 2`` beats the TOML's
    ``training.tensor_parallel_degree = 1`` (the command line wins over the file).
    """
    for alias, target in _ALIASES.items():
        if target in cli_keys and alias not in cli_keys:
            continue
        a_sec, a_key = alias.split(".")
        t_sec, t_key = target.split(".")
        value = getattr(getattr(cfg, a_sec), a_key)
        if value is None or (alias in _FLAG_ALIASES and not value):
            continue
        setattr(getattr(cfg, t_sec), t_key, value)
    # aliases mirror the resolved values (job_config.json shows both spellings agreeing)
    t = cfg.training
    t.batch_size = t.local_batch_size
    cfg.lr_scheduler.lr_min = cfg.lr_scheduler.min_lr_factor
    dl = t.dataloader
    dl.num_workers, dl.pin_memory, dl.persistent_workers = t.num_workers, t.pin_memory, t.persistent_workers
    dl.prefetch_factor = t.prefetch_factor if t.num_workers > 0 else None


def validate(cfg) -> None:
    """Checks that need no model or devices; each names the bad value."""
    t = cfg.training
    if not cfg.model.config:
        raise ConfigError("model.config is required: path to a model JSON config")
    if not os.path.exists(cfg.model.config):
        raise ConfigError(f"model.config {cfg.model.config!r}: no such file")
    if os.path.exists(cfg.job.dump_folder) and not os.path.isdir(cfg.job.dump_folder):
        raise ConfigError(f"job.dump_folder {cfg.job.dump_folder!r}: a file, not a folder")
    from flame.data.options import missing_local_source
    from flame.data.tokenizer import check_local_tokenizer_path
    from flame.utils.kernel_env import check_kernel_env

    check_kernel_env()

    for key, value in (("training.dataset", t.dataset), ("validation.dataset", getattr(cfg.validation, "dataset", None))):
        missing = missing_local_source(value)
        if missing:
            raise ConfigError(f"{key}: {missing!r} " + ("matches no file" if glob.has_magic(missing) else "does not exist"))
    check_local_tokenizer_path(cfg.model.tokenizer_path)
    if t.local_batch_size < 1:
        raise ConfigError(f"training.batch_size {t.local_batch_size}: must be >= 1")
    if t.seq_len < 2:
        raise ConfigError(f"training.seq_len {t.seq_len}: must be >= 2")
    if t.gradient_accumulation_steps < 1:
        raise ConfigError(f"training.gradient_accumulation_steps {t.gradient_accumulation_steps}: must be >= 1")
    if t.varlen and not 1 <= t.context_len <= t.seq_len:
        raise ConfigError(f"training.context_len {t.context_len}: must be in [1, training.seq_len={t.seq_len}] with varlen "
                          "(set --training.context_len)")
    if t.steps < 1:
        raise ConfigError(f"training.steps {t.steps}: must be >= 1 (an untrained model: "
                          "--checkpoint.create_seed_checkpoint writes its step-0 checkpoint)")
    if t.loss_chunk_tokens < -1:
        raise ConfigError(f"training.loss_chunk_tokens {t.loss_chunk_tokens}: must be >= -1 (-1: auto, 0: off)")
    if t.loss_chunk_tokens > 0 and cfg.parallelism.tensor_parallel_degree > 1:
        raise ConfigError(f"training.loss_chunk_tokens {t.loss_chunk_tokens} with tensor parallel degree "
                          f"{cfg.parallelism.tensor_parallel_degree}: the chunked loss needs a whole output layer; set it to 0")
    if t.max_norm < 0:
        raise ConfigError(f"training.max_norm {t.max_norm}: must be >= 0")
    if t.num_workers < 0:
        raise ConfigError(f"training.num_workers {t.num_workers}: must be >= 0")
    if t.shuffle_buffer_size < 1:
        raise ConfigError(f"training.shuffle_buffer_size {t.shuffle_buffer_size}: must be >= 1")
    if t.persistent_workers and t.num_workers == 0:
        raise ConfigError("training.persistent_workers needs loader workers: set training.num_workers > 0")
    v = cfg.validation
    for name, least in (("local_batch_size", 1), ("seq_len", 2)):  # None: the training value
        value = getattr(v, name)
        if value is not None and value < least:
            raise ConfigError(f"validation.{name} {value}: must be >= {least} (unset: the training value)")
    if not v.enable:
        # validation options given without the switch would be ignored without a word
        given = _given(v, "validation", ("dataset", "interval", "local_batch_size", "seq_len", "freq", "steps",
                                         "holdout_fraction"))
        if "validation.interval" in given:  # its alias freq carries the same value
            given.remove("validation.freq")
        if given:
            raise ConfigError(f"{', '.join(given)} set but validation is off: add --validation.enable "
                              "(or drop the option)")
    if v.enable and v.freq < 1:
        raise ConfigError(f"validation.freq {v.freq}: must be >= 1")
    if not 0.0 <= cfg.lr_scheduler.min_lr_factor <= 1.0:
        raise ConfigError(f"lr_scheduler.lr_min {cfg.lr_scheduler.min_lr_factor}: must be in [0, 1] (a fraction of the peak lr)")
    if cfg.lr_scheduler.warmup_steps < 0:
        raise ConfigError(f"lr_scheduler.warmup_steps {cfg.lr_scheduler.warmup_steps}: must be >= 0")
    if cfg.lr_scheduler.decay_ratio is not None and not 0.0 <= cfg.lr_scheduler.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio {cfg.lr_scheduler.decay_ratio}: must be in [0, 1]")
    if cfg.optimizer.lr <= 0:
        raise ConfigError(f"optimizer.lr {cfg.optimizer.lr}: must be > 0")
    if cfg.optimizer.name not in ("AdamW", "Adam", "Muon"):
        raise ConfigError(f"optimizer.name {cfg.optimizer.name!r}: supported are AdamW, Adam, Muon")
    if cfg.optimizer.name == "Muon":
        from flame.components.muon import check_muon_options

        check_muon_options(cfg)
    else:
        # Muon's options given with another optimizer would be ignored without a word
        changed = _given(cfg.optimizer, "optimizer", ("muon_lr", "muon_momentum", "muon_adjust_lr"))
        if changed:
            raise ConfigError(f"{', '.join(changed)} given with optimizer.name {cfg.optimizer.name}: "
                              "Muon's options apply with --optimizer.name Muon only")
    if cfg.checkpoint.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k {cfg.checkpoint.keep_latest_k}: must be >= 0")
    if cfg.checkpoint.hf_upload_enabled and not cfg.checkpoint.hf_repo_base_name:
        raise ConfigError("checkpoint.hf_upload_enabled needs checkpoint.hf_repo_base_name (the Hub repository to upload to)")
    if cfg.checkpoint.hf_upload_enabled and not cfg.checkpoint.export_hf:
        raise ConfigError("checkpoint.hf_upload_enabled uploads the final export: it needs checkpoint.export_hf")
    if cfg.checkpoint.hf_upload_timeout_seconds < 0:
        raise ConfigError(f"checkpoint.hf_upload_timeout_seconds {cfg.checkpoint.hf_upload_timeout_seconds}: must be >= 0")
    if cfg.checkpoint.keep_latest_k == 1 and cfg.checkpoint.async_mode != "disabled":
        raise ConfigError(f"checkpoint.keep_latest_k 1 with checkpoint.async_mode {cfg.checkpoint.async_mode!r}: "
                          "an async save may still be writing the newest checkpoint; keep at least 2")
    if cfg.checkpoint.enable and cfg.checkpoint.interval < 1:
        raise ConfigError(f"checkpoint.interval {cfg.checkpoint.interval}: must be >= 1")
    if not cfg.checkpoint.enable:
        # with checkpointing off nothing is loaded: the run would start from scratch without a word
        loads = [f"checkpoint.{name} {value}" for name, value in (
            ("initial_load_path", cfg.checkpoint.initial_load_path), ("load_step", cfg.checkpoint.load_step))
            if value not in (None, "", -1)]
        if loads:
            raise ConfigError(f"{', '.join(loads)} with checkpointing off (checkpoint.enable false): nothing "
                              "would be loaded; drop --checkpoint.no-enable")
    if cfg.metrics.log_freq < 1:
        raise ConfigError(f"metrics.log_freq {cfg.metrics.log_freq}: must be >= 1")
    for option, package in (("enable_wandb", "wandb"), ("enable_tensorboard", "tensorboard")):
        # torchtitan logs a missing backend's ImportError and trains on without it
        if getattr(cfg.metrics, option) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"metrics.{option}: the {package} package is not installed (pip install {package})")
    if cfg.probes.interval < 0:
        raise ConfigError(f"probes.interval {cfg.probes.interval}: must be >= 0 (0: no probes)")
    if not 0.0 <= cfg.probes.sink_threshold < 1.0:
        raise ConfigError(f"probes.sink_threshold {cfg.probes.sink_threshold}: must be in [0, 1) "
                          "(a head's mean attention weight on the first token)")
    prof = cfg.profiling
    if prof.enable_profiling and (prof.profiler_warmup < 0 or prof.profiler_active < 1
                                  or prof.profile_freq < prof.profiler_warmup + prof.profiler_active):
        raise ConfigError(f"profiling.profile_freq {prof.profile_freq}: a profiling cycle must hold "
                          f"profiling.profiler_warmup ({prof.profiler_warmup}, at least 0) + profiling.profiler_active "
                          f"({prof.profiler_active}, at least 1) steps")
    if prof.enable_memory_snapshot and prof.profile_freq < 1:
        raise ConfigError(f"profiling.profile_freq {prof.profile_freq}: memory snapshots are written every "
                          "profile_freq steps; must be >= 1")
    if prof.enable_memory_snapshot and cfg.offload.enable == "on" and t.compile:
        # torch 2.11's recorder failed inside the engine's recomputed compiled blocks: a SystemError
        # from autograd in the first backward (no Python exception set)
        raise ConfigError("profiling.enable_memory_snapshot with offload.enable on and training.compile: "
                          "torch's memory recorder crashed in the offload engine's recomputed compiled "
                          "blocks (torch 2.11); snapshot the run without training.compile")
    # bad [offload] values are errors whether or not this run ends up planning (auto on CPU, off)
    cfg.offload.validate()
    if cfg.offload.enable == "off":
        # a plan to replay or placements to force, given with offload off, would be dropped without a word
        given = [o for o in cfg.offload.changed_options() if o in ("offload.plan", "offload.overrides")]
        if given:
            raise ConfigError(f"{', '.join(given)} set but offload.enable is off: add --offload.enable on "
                              "(or drop the option)")
    validate_lora(cfg)


def _given(section, prefix: str, names) -> list[str]:
    """`prefix.name` of each of `names` set to other than its default in `section` (a config dataclass):
    the options a switch that is off would ignore."""
    defaults = type(section)()
    return [f"{prefix}.{name}" for name in names if getattr(section, name) != getattr(defaults, name)]


def validate_lora(cfg) -> None:
    lora = cfg.lora
    if lora.rank < 0:
        raise ConfigError(f"lora.rank {lora.rank}: must be >= 0 (0: LoRA off)")
    if lora.rank == 0:
        # an adapter option given while LoRA is off would otherwise be a full fine-tune in silence
        changed = _given(lora, "lora", ("export_adapters", "alpha", "dropout", "targets"))
        if changed:
            raise ConfigError(f"{', '.join(changed)} given with LoRA off: set lora.rank > 0 "
                              "(lora.rank 0 trains every weight)")
        return
    if lora.alpha <= 0:
        raise ConfigError(f"lora.alpha {lora.alpha}: must be > 0")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"lora.dropout {lora.dropout}: must be in [0, 1)")
    if not any(lora.targets):
        raise ConfigError("lora.targets is empty: name the linear layers that get adapters (e.g. q_proj,v_proj)")
    if cfg.parallelism.tensor_parallel_degree > 1:
        raise ConfigError(f"lora.rank {lora.rank} with parallelism.tensor_parallel_degree "
                          f"{cfg.parallelism.tensor_parallel_degree}: LoRA does not support tensor parallelism; "
                          "use FSDP (data_parallel_shard_degree)")


def accumulation_steps(training, dp: int) -> int:
    """Micro-batches per optimizer step: ``training.gradient_accumulation_steps``, or derived from
    torchtitan's ``training.global_batch_size`` (sequences over all data-parallel ranks) when that
    is given; a one-line error when the two disagree or the global batch does not divide."""
    gb = training.global_batch_size
    acc = training.gradient_accumulation_steps
    if gb is None or gb <= 0:
        return acc
    per = training.local_batch_size * dp
    if gb % per:
        raise ConfigError(f"training.global_batch_size {gb}: not a multiple of batch_size {training.local_batch_size} "
                          f"x {dp} data-parallel rank(s)")
    if acc not in (1, gb // per):
        raise ConfigError(f"training.global_batch_size {gb} and training.gradient_accumulation_steps {acc} disagree "
                          f"(batch_size {training.local_batch_size} x {dp} rank(s) x {acc} = {per * acc})")
    return gb // per
