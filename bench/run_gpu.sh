#!/usr/bin/env bash
# One call on the GPU machine: the `gpu` test suite, then the benchmarks named as arguments, each
# a bench name optionally followed by its flags in one quoted argument (vmm attention throughput
# capacity sampling adversarial skinny_linear; none = tests only). Output goes to $OUT (or ./gpu-out): run.log
# with every log, gpu_tests$TAG.log and <bench>$TAG.json; few files, since the device returns at
# most 8. BENCH_TIMEOUT (default 240 s) bounds each bench.
#   bash bench/run_gpu.sh vmm attention "capacity --startup-rounds 3"
#   TESTS=none BENCH_TIMEOUT=360 bash bench/run_gpu.sh \
#     "adversarial --models qwen3-0.6b-shape --deadline-s 270"   # bench/adversarial.py: both models
#   TESTS=tests/engine TAG=_wired bash bench/run_gpu.sh throughput   # a second pass, same $OUT
#   SHARD=1/2 TAG=_1 bash bench/run_gpu.sh   # the first half of the gpu tests (whole suite
#                                            # ~470 s on an H100: two calls leave room; the
#                                            # halves are by count, and the first holds the
#                                            # engine tests: on the H200 on 2026-12-06 it ran
#                                            # past 330 s where the second took 74 s)
set -uo pipefail
out=${OUT:-gpu-out}
tag=${TAG:-}
mkdir -p "$out"
log="$out/run.log"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{
  echo "== run_gpu.sh $* (TESTS=${TESTS:-tests} TAG=$tag) $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -m kvfit.cli probe 2>&1
} | tee -a "$log"
if [ "${TESTS:-tests}" != none ]; then
  # shellcheck disable=SC2206  # the paths are words
  tests=(${TESTS:-tests})
  if [ -n "${SHARD:-}" ]; then  # i/n: the i-th of n contiguous parts of the gpu tests, in order
    ids=$(python3 -m pytest -m gpu -q --collect-only -p no:cacheprovider "${tests[@]}" | grep '::')
    mapfile -t tests < <(awk -v i="${SHARD%/*}" -v n="${SHARD#*/}" -v all="$(wc -l <<< "$ids")" \
      'NR > int((i - 1) * all / n) && NR <= int(i * all / n)' <<< "$ids")
    echo "== SHARD $SHARD: ${#tests[@]} of $(wc -l <<< "$ids") gpu tests" | tee -a "$log"
  fi
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15 \
    "${tests[@]}" 2>&1 | tee "$out/gpu_tests$tag.log" | tail -40
fi
for spec in "$@"; do
  read -r name flags <<< "$spec"
  echo "== bench/$name.py $flags" | tee -a "$log"
  # shellcheck disable=SC2086  # the flags are words
  timeout "${BENCH_TIMEOUT:-240}" python3 "bench/$name.py" --out "$out/$name$tag.json" $flags \
    2>&1 | tee -a "$log" | tail -30
done
