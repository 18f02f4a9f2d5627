#!/usr/bin/env bash
# One call on the GPU machine: the `gpu` test suite, then the benchmarks named as arguments, each
# a bench name optionally followed by its flags in one quoted argument (vmm attention throughput
# capacity sampling; none = tests only). Logs and JSON go to $OUT (or ./gpu-out).
#   bash bench/run_gpu.sh vmm attention "capacity --num-prompts 128 48 --startup-rounds 3"
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m kvfit.cli probe 2>&1 | tee "$out/probe.txt"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests} \
  2>&1 | tee "$out/gpu_tests.log" | tail -40
for spec in "$@"; do
  read -r name flags <<< "$spec"
  echo "== bench/$name.py $flags"
  # shellcheck disable=SC2086  # the flags are words
  timeout "${BENCH_TIMEOUT:-240}" python3 "bench/$name.py" --out "$out/$name.json" $flags \
    2>&1 | tee "$out/$name.log" | tail -30
done
