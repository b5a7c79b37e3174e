"""Pre-tokenize a dataset once into memory-mapped token shards that training reads directly.

    python -m flame.utils.preprocess --dataset flame/assets/sample_corpus \\
        --tokenizer flame/assets/tokenizer --output data/sample_tokens --num-proc 8

Then train with ``--training.dataset data/sample_tokens``. Documents are stored without BOS/EOS
(the loader adds them per ``training.boundary_policy``), in dataset order; the loader shuffles.
The output must be read with the same tokenizer (its name and vocabulary size are recorded in
``flame_tokens.json``, and the loader checks the vocabulary size).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from flame.data.options import parse_sources
from flame.data.shards import ShardWriter
from flame.data.sources import open_hf, pick_column
from flame.data.tokenizer import load_tokenizer
from flame.errors import ConfigError
from flame.utils.cli import CliParser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = CliParser(prog="python -m flame.utils.preprocess", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, help="hub id (local cache), local folder, file or glob")
    ap.add_argument("--dataset-name", "--dataset_name", default=None)
    ap.add_argument("--split", default="train")
    ap.add_argument("--data-dir", "--data_dir", default=None)
    ap.add_argument("--data-files", "--data_files", default=None)
    ap.add_argument("--text-column", "--text_column", default=None)
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder or cached hub id")
    ap.add_argument("--output", required=True, type=Path)
    ap.add_argument("--num-proc", "--num_proc", type=int, default=1, help="tokenizer processes")
    ap.add_argument("--batch-size", "--batch_size", type=int, default=1000, help="documents per tokenizer call")
    ap.add_argument("--shard-tokens", "--shard_tokens", type=int, default=1 << 28, help="tokens per shard file")
    args = ap.parse_args(argv)
    for flag, value in (("--num-proc", args.num_proc), ("--batch-size", args.batch_size),
                        ("--shard-tokens", args.shard_tokens)):
        if value < 1:
            ap.error(f"{flag} {value}: must be >= 1")
    return args


# the data code names the trainer's options; this command's are these
TRAINER_OPTIONS = {"training.dataset": "--dataset", "training.text_column": "--text-column",
                   "model.tokenizer_path": "--tokenizer"}


def _own_option_names(message: str) -> str:
    for trainer_option, flag in TRAINER_OPTIONS.items():
        message = message.replace(trainer_option, flag)
    return message


def preprocess(args: argparse.Namespace) -> dict:
    if args.output.exists() and not args.output.is_dir():
        raise ConfigError(f"--output: {str(args.output)!r} is a file, not a folder")
    if args.output.exists() and any(args.output.iterdir()):
        raise ConfigError(f"--output: {str(args.output)!r} exists and is not empty")
    spec = parse_sources(args.dataset, args.dataset_name, args.split, args.data_dir, args.data_files)[0]
    tokenizer = load_tokenizer(args.tokenizer)
    ds = open_hf(spec, args.split, streaming=False, role="train")
    column, is_ids = pick_column(ds.column_names, args.text_column, repr(args.dataset))
    if len(ds) == 0:
        raise ConfigError(f"--dataset: {args.dataset!r} is empty (0 documents)")
    ds = ds.select_columns([column])
    if not is_ids:
        def tokenize(batch):
            texts = [t if t is not None else "" for t in batch[column]]
            return {"input_ids": tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]}

        # datasets >= 5 starts a process pool for any num_proc >= 1; None tokenizes in this process
        ds = ds.map(tokenize, batched=True, batch_size=args.batch_size,
                    num_proc=args.num_proc if args.num_proc > 1 else None,
                    remove_columns=[column], desc="tokenizing",
                    load_from_cache_file=False)  # a run with another tokenizer of the same path must not reuse ids
    elif column != "input_ids":
        ds = ds.rename_column(column, "input_ids")
    writer = ShardWriter(args.output, vocab_size=len(tokenizer), shard_tokens=args.shard_tokens)
    step = 10_000
    for start in range(0, len(ds), step):
        writer.add(ds[start:start + step]["input_ids"])
    return writer.close(
        tokenizer={"path": str(args.tokenizer), "vocab_size": len(tokenizer)},
        source={"dataset": args.dataset, "name": args.dataset_name, "split": args.split,
                "data_dir": args.data_dir, "data_files": args.data_files, "column": column},
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.time()
    try:
        meta = preprocess(args)
    except ConfigError as e:
        print(f"flame: error: {_own_option_names(str(e))}", file=sys.stderr)
        return 2
    print(f"wrote {meta['num_docs']:,} documents, {meta['num_tokens']:,} tokens in {len(meta['shards'])} shard(s) "
          f"to {args.output} ({time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
