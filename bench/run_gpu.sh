#!/usr/bin/env bash
# One call on the GPU machine: the `gpu` test suite, then the benchmarks named as arguments
# (vmm attention throughput capacity; none = tests only). Logs and JSON go to $OUT (or ./gpu-out).
#   bash bench/run_gpu.sh vmm attention
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -m kvfit.cli probe 2>&1 | tee "$out/probe.txt"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -q -p no:cacheprovider ${TESTS:-tests} \
  2>&1 | tee "$out/gpu_tests.log" | tail -40
for name in "$@"; do
  echo "== bench/$name.py"
  timeout "${BENCH_TIMEOUT:-240}" python3 "bench/$name.py" --out "$out/$name.json" \
    2>&1 | tee "$out/$name.log" | tail -30
done
