"""Benchmarks that time Triton kernels say so when Triton is missing, instead of failing on
import; the ones with a CPU mode run without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kvfit

ROOT = Path(__file__).resolve().parents[2]
# Runs a bench script as `python3 bench/X.py ARGS` would, with `import triton` failing.
NO_TRITON = ("import runpy, sys; sys.modules['triton'] = None; script = sys.argv[1]; "
             "sys.argv = sys.argv[1:]; runpy.run_path(script, run_name='__main__')")


def run_without_triton(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(kvfit.__file__).parents[1]),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", NO_TRITON, str(ROOT / "bench" / script), *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def test_attention_bench_names_what_it_needs() -> None:
    result = run_without_triton("attention.py", "--out", "unused.json")
    assert result.returncode == 1
    assert result.stderr.startswith("bench/attention.py times the Triton kernels, so it needs "
                                    "Triton and a CUDA device (pip install 'kvfit[cuda]')")
    assert "Traceback" not in result.stderr


def test_sampling_bench_runs_on_the_cpu_without_triton(tmp_path: Path) -> None:
    out = tmp_path / "sampling.json"
    result = run_without_triton("sampling.py", "--device", "cpu", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())
    result = run_without_triton("sampling.py", "--device", "cuda", "--out", str(out))
    assert result.returncode == 2
    assert "needs" in result.stderr.splitlines()[-1]
