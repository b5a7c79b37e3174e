#!/usr/bin/env bash
# flame job runner: bash train.sh [--job.config_file X.toml] [--section.key value ...]
# With no arguments it trains a small model on the bundled corpus and tokenizer (runs on CPU).
# Environment: NGPU (processes per node; default: visible GPUs, or 1 on CPU), NNODE (default 1),
# NODE_RANK, MASTER_ADDR, MASTER_PORT, LOG_RANK (ranks whose output reaches the console; default 0).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"

if [ "$#" -eq 0 ]; then
  set -- --job.config_file "$here/flame/models/fla.toml" \
    --job.dump_folder exp/default-tiny \
    --model.config "$here/configs/debug/transformer_tiny.json" \
    --model.tokenizer_path "$here/flame/assets/tokenizer" \
    --training.dataset "$here/flame/assets/sample_corpus" \
    --training.batch_size 8 --training.seq_len 256 --training.steps 120 \
    --training.num_workers 0 --training.mixed_precision_param float32 \
    --optimizer.lr 3e-3 --lr_scheduler.warmup_steps 20 --lr_scheduler.decay_type cosine \
    --checkpoint.interval 50 --checkpoint.keep_latest_k 1 --metrics.log_freq 10
fi

if [ -z "${NGPU:-}" ]; then
  NGPU=$("$PYTHON" -c 'import torch; print(max(torch.cuda.device_count(), 1))')
fi
NNODE="${NNODE:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
LOG_RANK="${LOG_RANK:-0}"

for a in "$@"; do case "$a" in -h|--help) exec "$PYTHON" -m flame.train --help;; esac; done

# the dump folder decides where per-rank logs and the run snapshot go
dump=$("$PYTHON" -m flame.utils.dump_folder "$@")
mkdir -p "$dump/logs"
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "command: bash train.sh $*"
  echo "flame: $(git -C "$here" rev-parse HEAD 2>/dev/null || echo unknown)$(git -C "$here" diff --quiet 2>/dev/null || echo ' (modified)')"
  echo "NGPU=$NGPU NNODE=$NNODE"
} > "$dump/run_info.txt"

export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODE" --nproc_per_node "$NGPU" --node_rank "$NODE_RANK" \
  --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" \
  --local-ranks-filter "$LOG_RANK" --role rank --tee 3 --log_dir "$dump/logs" \
  -m flame.train "$@"
