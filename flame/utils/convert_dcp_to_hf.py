"""Convert a flame/torchtitan DCP checkpoint to a Hugging Face folder.

    python -m flame.utils.convert_dcp_to_hf --path DUMP --step N [--config CFG] [--tokenizer TOK]
        [--dtype bfloat16] [--out DIR] [--max-shard-size 5GB] [--overwrite] [--adapter-out DIR2]

Reads ``DUMP/checkpoint/step-N`` (model keys only) and writes ``DIR`` (default ``DUMP/hf_steps/step-N``).
A LoRA run (``lora.rank > 0`` in its job_config.json) is exported merged (W + alpha/rank * B @ A);
``--adapter-out DIR2`` also writes its adapters alone in PEFT's format.
The model is rebuilt as the run built it, from the ``DUMP/job_config.json`` the trainer writes:
``model.config``, ``model.tokenizer_path`` (the vocabulary raised to the tokenizer's size by
``model.vocab_multiple``) and ``model.module``; ``--config`` / ``--tokenizer`` override the paths. Bad input: one line on stderr, exit status 2.
An incomplete or damaged step folder (see the checkpoint record in flame.components.checkpoint) is
such an error. Loading a DCP checkpoint unpickles its ``.metadata``: convert only checkpoints you wrote.
"""
from __future__ import annotations

import argparse
import os
import sys

from flame.errors import ConfigError
from flame.utils.cli import CliParser


def build_parser() -> argparse.ArgumentParser:
    p = CliParser(prog='python -m flame.utils.convert_dcp_to_hf', description=__doc__.splitlines()[1],
                                epilog='Loading a DCP checkpoint unpickles its .metadata (a crafted file runs code): '
                                       'convert only checkpoints you wrote.')
    p.add_argument('--path', required=True, help='dump folder of the training run')
    p.add_argument('--step', required=True, type=int, help='checkpoint step to convert')
    p.add_argument('--config', help='model config (JSON or HF folder); default: from DUMP/job_config.json')
    p.add_argument('--tokenizer', help='tokenizer path/name; default: from DUMP/job_config.json')
    p.add_argument('--dtype', default='bfloat16', help='weights dtype: bfloat16 (default), float32, float16')
    p.add_argument('--out', help='output folder (default DUMP/hf_steps/step-N)')
    p.add_argument('--max-shard-size', default='5GB', help="split weights above this size (default 5GB)")
    p.add_argument('--overwrite', action='store_true', help='replace an existing output folder')
    p.add_argument('--adapter-out', help='a LoRA run: also write its adapters in PEFT format to this folder '
                                         '(the main export always holds the merged weights)')
    return p


def run(args) -> str:
    from flame.utils.hf_export import export_hf, run_lora_config, run_model_config
    dump = args.path
    ckpt = os.path.join(dump, 'checkpoint', f'step-{args.step}')
    if not os.path.isdir(ckpt):
        raise ConfigError(f"no checkpoint at {ckpt!r}")
    config, tokenizer = run_model_config(dump, args.config, args.tokenizer)
    out = args.out or os.path.join(dump, 'hf_steps', f'step-{args.step}')
    from flame.components.checkpoint import classify, verify
    entry = classify(ckpt)
    if entry.kind == 'incomplete':
        raise ConfigError(f"checkpoint {ckpt!r} is incomplete ({entry.reason})")
    problem = verify(entry)
    if problem:
        raise ConfigError(f"damaged checkpoint: {problem}")
    lora = run_lora_config(dump)
    if args.adapter_out and lora is None:
        raise ConfigError(f"--adapter-out: the run in {dump!r} did not train LoRA adapters (no lora.rank > 0 in "
                          "its job_config.json)")
    return export_hf(ckpt, config, tokenizer, out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                     overwrite=args.overwrite, lora=lora, adapter_dir=args.adapter_out)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
