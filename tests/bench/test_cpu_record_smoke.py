"""bench/adversarial.py and bench/sampling.py on the CPU (their documented smoke runs, smaller):
each writes one record that validates, with figures bench/compare.py compares and, for the
sweep and the filter table, the picture bench/plot.py draws from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvfit.benchmarks.record import load_record, validate

from .scripts import BENCH_DIR, load_bench

ARGV = {
    "adversarial": ["--device", "cpu", "--models", "kvfit-tiny", "--max-model-len", "256",
                    "--max-num-seqs", "8", "--num-prompts", "8", "--max-tokens", "4"],
    "sampling": ["--device", "cpu", "--batches", "2", "--vocab-size", "512", "--filter-rows",
                 "4"],
}
PICTURE = {"adversarial": "adversarial.png", "sampling": "filters.png"}


@pytest.mark.parametrize("name", sorted(ARGV))
def test_a_cpu_run_writes_a_record_that_compares_and_plots(name: str, tmp_path: Path) -> None:
    out = tmp_path / f"{name}.json"
    env = {**os.environ, "PYTHONPATH": str(BENCH_DIR.parent / "src")}
    done = subprocess.run([sys.executable, str(BENCH_DIR / f"{name}.py"), *ARGV[name],
                           "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = load_record(out)
    assert validate(record) == [] and record["bench"] == name
    assert record["date"] and record["versions"]["torch"]
    # A copy without .git (the GPU machine's) names its revision in KVFIT_GIT_REVISION.
    assert record["git"]["revision"] or not (BENCH_DIR.parent / ".git").exists() \
        and not os.environ.get("KVFIT_GIT_REVISION")
    assert record["config"]["device"] == "cpu" and record["machine"]["gpu"] is None
    assert record["figures"]
    assert all(f["unit"] and f["direction"] in ("higher", "lower")
               for f in record["figures"].values())
    assert load_bench("compare").main([str(out), str(out)]) == 0
    pytest.importorskip("matplotlib")
    pictures = load_bench("plot").plot_all([record], tmp_path / "img")
    assert [p.name for p in pictures] == [PICTURE[name]]
