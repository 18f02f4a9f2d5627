"""The in-run limits (copy bandwidth, GEMM throughput): every bench's record carries those its
payload has, and every bench that writes a record measures them."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvfit.benchmarks.figures import FIGURES, adapt, record_of
from kvfit.benchmarks.limits import DeviceLimits, in_run_limits, limit_keys
from kvfit.benchmarks.record import figure, validate

from . import payloads
from .scripts import BENCH_DIR

SWEEPS = {"sampling-sweep", "attention-sweep"}  # lists of configurations: no payload keys
PAYLOADS = payloads.ALL | payloads.OTHERS
# 4,000 GB/s and 700 TFLOP/s, as `in_run_limits` puts them in a payload.
MEASURED = limit_keys(DeviceLimits(copy_bytes_per_s=4e12, gemm_flops_per_s=7e14), torch.bfloat16)
BOTH = {"copy_gb_per_s": figure(4000.0, "GB/s", "higher"),
        "gemm_tflops": figure(700.0, "TFLOP/s", "higher")}
# What writes a record; each on a GPU measures both limits before its engines start.
RECORD_WRITERS = {*(BENCH_DIR / f"{name}.py" for name in (
    "adversarial", "async_engine", "attention", "batch_invariant_gemm", "capacity",
    "determinism", "elastic", "elastic_pair", "kv_dtype", "sampling", "serving",
    "skinny_linear", "sleep", "throughput", "vmm")),
    *(BENCH_DIR.parent / "src" / "kvfit" / "commands" / f"{name}.py"
      for name in ("bench_offline", "bench_serve"))}


def test_every_bench_has_a_payload_here() -> None:
    assert set(PAYLOADS) | SWEEPS == set(FIGURES)


def test_measured_limits_are_the_payload_keys() -> None:
    assert MEASURED == {"copy_bandwidth_gbps": 4000.0, "gemm_tflops": 700.0,
                        "gemm_dtype": "bfloat16"}


@pytest.mark.parametrize("bench", sorted(PAYLOADS))
def test_each_benchs_record_carries_both_limits_its_payload_has(bench: str) -> None:
    payload = PAYLOADS[bench]()
    record = record_of(bench, payload | MEASURED, {})
    assert validate(record) == [] and record["limits"] == BOTH
    # Without them (a CPU run): none, or only the copy bandwidth an older payload carried.
    bare = record_of(bench, payload, {})["limits"]
    assert "gemm_tflops" not in bare or bench == "throughput"


@pytest.mark.parametrize("bench", sorted(SWEEPS))
def test_a_sweep_carries_no_limits(bench: str) -> None:
    assert record_of(bench, [{"config": 1, "ms": 0.1}], {})["limits"] == {}


def test_a_published_file_keeps_the_copy_bandwidth_it_carried() -> None:
    record = adapt(payloads.attention(), "attention-h200-2026-01-02.json")
    assert record["limits"] == {"copy_gb_per_s": figure(100.0, "GB/s", "higher")}


def test_no_limits_are_measured_on_the_cpu() -> None:
    assert in_run_limits("cpu") == in_run_limits(torch.device("cpu")) == {}
    if not torch.cuda.is_available():
        assert in_run_limits("auto") == {}


def _calls(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.func.id for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}


# Benches of the host alone (no device work to hold against a device's limits).
HOST_ONLY = {BENCH_DIR / "host_overhead.py"}


def test_every_bench_that_writes_a_record_measures_the_limits() -> None:
    scripts = {p for p in BENCH_DIR.glob("*.py") if "record_of" in _calls(p)}
    assert scripts == {p for p in RECORD_WRITERS if p.parent == BENCH_DIR} | HOST_ONLY
    for path in RECORD_WRITERS:
        assert _calls(path) & {"in_run_limits", "measure_device_limits"}, path.name


@pytest.mark.gpu
def test_in_run_limits_on_a_gpu_leave_this_process_as_it_was() -> None:
    before = torch.cuda.is_initialized()
    keys = in_run_limits("cuda")
    assert keys["copy_bandwidth_gbps"] > 100 and keys["gemm_tflops"] > 1
    assert keys["gemm_dtype"] == "bfloat16"
    assert torch.cuda.is_initialized() == before  # measured in a process of its own


# The benches whose --device defaults to CUDA (or that need it): run where torch sees no CUDA
# device they must refuse with a usage error naming the fix, not die in in_run_limits' process.
CUDA_ONLY_BY_DEFAULT = ("adversarial", "attention", "batch_invariant_gemm", "capacity", "elastic",
                        "elastic_pair", "sampling", "skinny_linear")


@pytest.mark.parametrize("name", CUDA_ONLY_BY_DEFAULT)
def test_a_bench_asked_for_cuda_where_there_is_none_refuses_clearly(
        name: str, tmp_path: Path) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(BENCH_DIR.parent / "src")}
    done = subprocess.run([sys.executable, str(BENCH_DIR / f"{name}.py"),
                           "--out", str(tmp_path / "r.json")],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode in (1, 2) and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "CUDA" in done.stderr and not (tmp_path / "r.json").exists()
