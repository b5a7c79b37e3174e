#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests and acceptance rows, copy results to $OUT.
# usage: FLAME_COMMIT=<sha> bash benchmarks/gpu_session.sh TAG "PYTEST_ARGS" "ACCEPTANCE_ARGS"
#   FLAME_COMMIT: the commit of the tree sent (the device copy's .git can be stale), recorded in the JSON
#   TAG names the result files; an empty PYTEST_ARGS or ACCEPTANCE_ARGS skips that part.
set -uo pipefail
tag=$1; tests=${2:-}; accept=${3:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "$tests" ]; then
  # one process (the carried wheels have no pytest-xdist, and GPU tests should not share the card)
  timeout 300 python3 -m pytest -q -x -p no:cacheprovider -o "addopts=-m 'not slow'" $tests 2>&1 | tail -40 | tee "$out/gpu_tests_$tag.txt"
fi
if [ -n "$accept" ]; then
  python3 benchmarks/acceptance.py "$out/acceptance_$tag.json" $accept 2>&1 | grep -v "^WARNING" | tail -60
fi
