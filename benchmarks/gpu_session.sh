#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests and acceptance rows, copy results to $OUT.
# usage: FLAME_COMMIT=<sha> [TEST_GPUS=2,3 ACCEPT_GPUS=0,1 OFFLOAD_GPUS=2,3] bash benchmarks/gpu_session.sh TAG "PYTEST_ARGS" "ACCEPTANCE_ARGS" ["OFFLOAD_ARGS"]
#   FLAME_COMMIT: the commit of the tree sent (the device copy's .git can be stale), recorded in the JSON
#   TAG names the result files; an empty PYTEST_ARGS or ACCEPTANCE_ARGS skips that part.
#   TEST_GPUS / ACCEPT_GPUS: on a machine of several GPUs, the tests run on TEST_GPUS while the
#   acceptance rows run on ACCEPT_GPUS at the same time (each row on its own GPU with --parallel).
#   OFFLOAD_ARGS: benchmarks/offload.py's arguments (e.g. --lanes), run on OFFLOAD_GPUS beside the rest.
#   PROFILE_ARGS: benchmarks/step_profile.py's arguments, run after the tests on TEST_GPUS (capped at
#   PROFILE_TIMEOUT_S, default 300 s).
#   EXPORT_AUTOTUNE=1: at the end, Triton's autotuning results of this call's runs go to
#   $OUT/autotune_results (the layout flame/utils/autotune_results ships; see flame/utils/autotune.py).
#   Wheels: .whl, and .whl-tl / .whl-z3 (tilelang, carried in two calls back to back) where present.
set -uo pipefail
tag=$1; tests=${2:-}; accept=${3:-}; offload=${4:-}
out=${OUT:-/tmp/out}; mkdir -p "$out"
started=$(mktemp)  # logs written after this are this call's
pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@"; }
pipi /tmp/site .whl/*.whl || exit 1
# tilelang arrives over two calls (.whl-tl, then .whl-z3): it goes to its own folder, which joins the
# path only once tilelang imports, so a half-installed tilelang never changes which FLA kernels run
tl=$(ls .whl-tl/*.whl .whl-z3/*.whl 2>/dev/null)
[ -n "$tl" ] && { pipi /tmp/site_tl $tl || exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
if [ -d /tmp/site_tl ] && PYTHONPATH=/tmp/site_tl:$PYTHONPATH python3 -c "import tilelang" 2>/dev/null; then
  export PYTHONPATH=/tmp/site_tl:$PYTHONPATH; echo "tilelang: installed"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
run_tests() {
  # one process (the carried wheels have no pytest-xdist, and GPU tests should not share the card);
  # no -x: one failure must not hide the other tests' results; INFO: a failure's captured log
  # without torch's DEBUG trace records
  timeout 540 python3 -m pytest -q -p no:cacheprovider -o log_level=INFO -o "addopts=-m 'not slow'" $tests > "$out/gpu_tests_$tag.txt" 2>&1
  tail -40 "$out/gpu_tests_$tag.txt"
  if [ -n "${PROFILE_ARGS:-}" ]; then
    # its own cap (PROFILE_TIMEOUT_S): the rows' --budget_s does not cover it
    timeout "${PROFILE_TIMEOUT_S:-300}" python3 benchmarks/step_profile.py "$out/step_profile_$tag.json" $PROFILE_ARGS \
      > "$out/step_profile_$tag.log" 2>&1
    grep -v "^WARNING" "$out/step_profile_$tag.log" | tail -60
  fi
}
test_pid=
if [ -n "$tests" ]; then
  if [ -n "${TEST_GPUS:-}" ]; then
    CUDA_VISIBLE_DEVICES=$TEST_GPUS run_tests &
    test_pid=$!
  else
    run_tests
  fi
fi
offload_pid=
if [ -n "$offload" ]; then
  ( [ -n "${OFFLOAD_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=$OFFLOAD_GPUS
    python3 benchmarks/offload.py "$out/offload_$tag.json" $offload > "$out/offload_$tag.log" 2>&1
    grep -v "^WARNING" "$out/offload_$tag.log" | tail -40 ) &
  offload_pid=$!
fi
if [ -n "$accept" ]; then
  ( [ -n "${ACCEPT_GPUS:-}" ] && export CUDA_VISIBLE_DEVICES=$ACCEPT_GPUS
    python3 benchmarks/acceptance.py "$out/acceptance_$tag.json" $accept 2>&1 | grep -v "^WARNING" | tail -80 )
fi
# every row's console log (the harness keeps only their tails): where a slow or failed row spent its
# time; copied as soon as the rows end too, in case the call's limit ends what is still running
copy_logs() {
  for d in /tmp/flame_acceptance/*/ /tmp/flame_offload_bench/*/; do
    [ "$d/console.log" -nt "$started" ] && { mkdir -p "$out/logs_$tag"; tail -c 2000000 "$d/console.log" > "$out/logs_$tag/$(basename "$d").log"; }
  done
}
copy_logs
[ -n "$test_pid" ] && wait $test_pid
[ -n "$offload_pid" ] && wait $offload_pid
[ -n "${EXPORT_AUTOTUNE:-}" ] && python3 -m flame.utils.autotune export --out "$out/autotune_results"
copy_logs
# one archive: the device tool returns a limited number of files a call
[ -d "$out/logs_$tag" ] && tar czf "$out/logs_$tag.tgz" -C "$out" "logs_$tag" && rm -rf "$out/logs_$tag"
true
