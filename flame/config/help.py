"""``python -m flame.train --help``: flame's options, one name per setting, one-line descriptions.

tyro's help lists every torchtitan field (pipeline, float8, fault tolerance ...) whether flame
reads it or not, shows torchtitan's defaults where flame's job file sets others, loses the
docstrings of flame's extension fields (the merged dataclass has no source) and lists each
alias pair twice. This help is built from the parsed command line instead: the options flame
reads, each with the first sentence of its field docstring (flame's own where flame defines
the field, torchtitan's otherwise) and the value the command line (its options over its job
file) gives it. Hidden options are
still accepted on the command line and in TOML.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import sys
import textwrap
import typing
from dataclasses import fields, is_dataclass
from typing import Literal

from flame.config import job_config as flame_job_config
from flame.config.manager import _ALIASES

# torchtitan options flame never reads (its trainer, model building and data loading are its
# own) or rejects when set (pipeline/context/expert parallelism, memory_budget AC)
HIDDEN_SECTIONS = ("quantize", "memory_estimation", "fault_tolerance", "experimental")
HIDDEN = {
    "job.save_config_file", "job.print_config", "job.print_args",
    "metrics.disable_color_printing",
    "model.name", "model.flavor", "model.hf_assets_path", "model.converters", "model.print_after_conversion",
    "optimizer.early_step_in_backward",
    "training.dataset_path", "training.dtype",
    "parallelism.enable_async_tensor_parallel", "parallelism.module_fqns_per_model_part",
    "checkpoint.enable_ft_dataloader_checkpoints", "checkpoint.initial_load_in_hf",
    "checkpoint.initial_load_in_hf_quantized", "checkpoint.last_save_in_hf",
    "activation_checkpoint.memory_budget", "activation_checkpoint.visualize_memory_budget_pareto",
    "validation.dataset_path",
    "debug.moe_force_load_balance",
}
HIDDEN_PREFIXES = ("training.dataloader.", "validation.dataloader.", "parallelism.pipeline_parallel_",
                   "parallelism.context_parallel_", "parallelism.expert_")

# one name per setting: the spelling shown -> the other spelling, accepted but not listed. Derived from
# manager's aliases (flame spelling -> torchtitan field): flame's spelling is shown, except for the aliases
# below, which flame's JobConfig documents as "Alias of" the torchtitan field (that field is shown);
# aliases of hidden options are not listed at all.
_SHOWN_AS_TORCHTITAN = {"checkpoint.last_save_model_weights_only"}
SHOWN_ALIASES = dict(
    (field, alias) if alias in _SHOWN_AS_TORCHTITAN else (alias, field)
    for alias, field in _ALIASES.items() if alias not in HIDDEN
)
# torchtitan fields without a docstring of their own
EXTRA_DOCS = {
    "optimizer.beta1": "Decay of the first-moment (mean) average of Adam/AdamW.",
    "optimizer.beta2": "Decay of the second-moment (variance) average of Adam/AdamW.",
    "compile.backend": "torch.compile backend.",
}
_ALIAS_OF = {other: shown for shown, other in SHOWN_ALIASES.items()}


def field_docstrings(cls) -> dict[str, str]:
    """Field name -> the string literal written right below the field, over ``cls``'s bases."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue  # generated classes (torchtitan's merged dataclasses) have no source
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                out[node.target.id] = after.value.value
    return out


def first_sentence(doc: str) -> str:
    text = " ".join(doc.split()).replace("``", "`")
    text = re.sub(r"\s*\(?\b[Aa]lias of `[\w.]+`\)?\.?", "", text).strip()
    text = re.split(r":\s+-\s+'", text)[0]  # a bullet list of choices: the metavar lists them
    match = re.search(r"(?<=[^.]\.)\s+(?=[A-Z(`])", text)
    return (text[:match.start()] if match else text).strip()


def _hints(cls) -> dict:
    try:  # sections written with `from __future__ import annotations` hold their types as strings
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {f.name: f.type for f in fields(cls)}


def _options(config, flame_cls, prefix: str = ""):
    """(key, type, description, value) of every leaf option of a parsed config."""
    hints = _hints(type(config))
    docs = field_docstrings(type(config))
    flame_docs = field_docstrings(flame_cls) if flame_cls is not None else {}
    flame_types = _hints(flame_cls) if flame_cls is not None else {}
    for f in fields(config):
        value = getattr(config, f.name)
        key = prefix + f.name
        if is_dataclass(value):
            sub = flame_types.get(f.name)
            yield from _options(value, sub if is_dataclass(sub) else None, key + ".")
        else:
            yield key, hints.get(f.name, f.type), flame_docs.get(f.name) or docs.get(f.name, ""), value


def is_hidden(key: str) -> bool:
    return (key in HIDDEN or key in _ALIAS_OF or key.split(".")[0] in HIDDEN_SECTIONS
            or key.startswith(HIDDEN_PREFIXES))


def _metavar(tp) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, __import__("types").UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _metavar(args[0]) if len(args) == 1 else "|".join(_metavar(a) for a in args)
    if origin is Literal:
        return "{" + ",".join(str(x) for x in typing.get_args(tp)) + "}"
    if origin is list:
        return "A,B,..."
    return {int: "INT", float: "FLOAT", str: "STR"}.get(tp, "VALUE")


def _show(value) -> str:
    if value is None or value == "":
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ",".join(str(x) for x in value) or "empty"
    return str(value)


def help_entries(config) -> list[tuple[str, str, str, str]]:
    """(section, option line, description, shown value) of every option flame lists."""
    by_key = {key: (tp, doc, value) for key, tp, doc, value in _options(config, flame_job_config.JobConfig)}
    entries = []
    for key, (tp, doc, value) in by_key.items():
        if is_hidden(key):
            continue
        description = first_sentence(EXTRA_DOCS.get(key, doc))
        other = SHOWN_ALIASES.get(key)
        if other is not None:
            o_tp, o_doc, o_value = by_key[other]
            description = description or first_sentence(o_doc)
            description = f"{description.rstrip('.')} (also --{other})"
            if value is None or (tp is bool and not value):  # the alias was not set: the other spelling holds it
                value = o_value
        is_flag = tp is bool or (typing.get_origin(tp) is not None and bool in typing.get_args(tp))
        option = f"--{key}" if is_flag else f"--{key} {_metavar(tp)}"
        entries.append((key.split(".")[0], option, description, _show(value)))
    return entries


def format_entries(entries, width: int = 100) -> str:
    lines = []
    section = None
    for sec, option, description, value in entries:
        if sec != section:
            lines += ["", f"{sec}:"]
            section = sec
        lines.append(f"  {option}  [{value}]")
        if description:
            lines += textwrap.wrap(description, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def format_help(config, prog: str, toml_path: str | None) -> str:
    intro = f"""usage: {prog} [--job.config_file X.toml] [--section.key VALUE ...]

Values come from the command line, else the job file, else flame's defaults; [the value] below
is the one this command line gives (its options, then its job file). Job file: {toml_path or 'none'}
(--job.config_file; the bundled flame/models/fla.toml when not given, '' for none).
Flags: --section.flag turns one on, --section.no-flag off. Dashes and underscores are
interchangeable. Input paths in a job file are relative to its folder; bundled ones
(flame/assets/..., configs/...) work from any directory."""
    return intro + "\n" + format_entries(help_entries(config))


def print_help(text: str) -> None:
    """Write ``--help`` output to stdout. A reader that closes the pipe early (``| head``) is
    not an error: the rest is discarded, and stdout is pointed at /dev/null so that the flush
    at interpreter exit does not raise BrokenPipeError again."""
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
