#!/usr/bin/env bash
# Session 4's last H200 call: the gpu tests that changed after the full suite, then the sweeps
# and capacity. Logs append to $OUT/run.log; one JSON per bench (the device returns 8 files).
set -uo pipefail
o=${OUT:-gpu-out}; mkdir -p "$o"; log="$o/run.log"
export PYTHONPATH=src PYTHONUNBUFFERED=1
A=bench/adversarial.py
step() { echo "== $*" | tee -a "$log"; }
step gpu tests
timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_filters.py \
  tests/engine/test_sampling_gpu.py tests/engine/test_oom_guard.py 2>&1 | tee "$o/gpu_tests.log" | tail -4
step adversarial 8B default
timeout 170 python3 $A --models qwen3-8b-shape --max-model-len 32768 4096 --margins default \
  --num-prompts 288 --prompt-len 16 96 --max-tokens 12 --long-factor 1.1 --deadline-s 120 \
  --out "$o/adv_8b.json" >> "$log" 2>&1; grep SUMMARY "$log" | tail -1
step adversarial 0.6B margin zero
timeout 120 python3 $A --models qwen3-0.6b-shape --max-model-len 32768 --margins zero \
  --features all all+long --long-factor 1.1 --deadline-s 70 --out "$o/adv_zero.json" >> "$log" 2>&1
grep SUMMARY "$log" | tail -1
step capacity
timeout 100 python3 bench/capacity.py --startup-rounds 1 --out "$o/capacity.json" >> "$log" 2>&1
tail -14 "$log"
[ "${1:-}" = short ] && exit 0  # the device time left allows no more
step adversarial 0.6B 4096 default
timeout 50 python3 $A --models qwen3-0.6b-shape --max-model-len 4096 --margins default \
  --deadline-s 30 --out "$o/adv_4k.json" >> "$log" 2>&1; grep SUMMARY "$log" | tail -1
step filter sweep
timeout 45 python3 bench/sampling.py --sweep-filters --out "$o/sweep.json" >> "$log" 2>&1
tail -3 "$log"
