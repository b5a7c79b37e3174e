#!/usr/bin/env bash
# flame job runner: bash train.sh [--section.key value ...] [--job.config_file X.toml]
# Without --job.config_file, the options apply on top of the default tiny job (a small model on the
# bundled corpus and tokenizer; runs on CPU); with it, the TOML is the base instead.
# Environment: NGPU (processes per node; default: visible GPUs, or 1 on CPU), NNODE (default 1),
# NODE_RANK, MASTER_ADDR, MASTER_PORT (single node without MASTER_PORT: a free port), LOG_RANK
# (ranks whose output reaches the console; default 0), PYTHON. The launcher is flame/launch.py.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python}"
command -v "$py" > /dev/null 2>&1 || { echo "flame: error: PYTHON=$py: no such executable (PYTHON names the Python that has flame installed)" >&2; exit 2; }
exec "$py" "$here/flame/launch.py" "$@"
