"""Convert a Hugging Face model folder to a model-only DCP checkpoint for continual training.

    python -m flame.utils.convert_hf_to_dcp --model HF_DIR --checkpoint DUMP/checkpoint/step-0 [--dtype float32]

The output has the keys torchtitan's ``CheckpointManager`` loads for a model-only checkpoint, so
a run whose ``checkpoint.folder`` holds it as ``step-0`` starts from these weights, and so does
``--checkpoint.initial_load_path <that folder>`` (with ``initial_load_model_only``, the default).
Bad input: one line on stderr, exit status 2.
"""
from __future__ import annotations

import sys

from flame.errors import ConfigError
from flame.utils.cli import CliParser


def main(argv: list[str] | None = None) -> int:
    p = CliParser(prog='python -m flame.utils.convert_hf_to_dcp', description=__doc__.splitlines()[1])
    p.add_argument('--model', required=True, help='Hugging Face model folder (config.json + weights)')
    p.add_argument('--checkpoint', required=True, help='output DCP folder, e.g. DUMP/checkpoint/step-0')
    p.add_argument('--dtype', default='float32', help='stored dtype (default float32: master weights)')
    args = p.parse_args(argv)
    from flame.utils.hf_export import hf_to_dcp
    try:
        keys = hf_to_dcp(args.model, args.checkpoint, dtype=args.dtype)
    except ConfigError as e:
        print(f"flame: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.checkpoint}: {len(keys)} tensors")
    return 0


if __name__ == '__main__':
    sys.exit(main())
