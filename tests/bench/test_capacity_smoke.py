"""bench/capacity.py end to end on the CPU: kvfit-tiny, two rounds, its startup stages."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from kvfit.benchmarks.record import validate

from .scripts import load_bench

STAGES = ["start_workers", "load_weights", "profile", "allocate_kv_cache", "warm_up",
          "size_kv_cache", "total"]  # eager on the CPU: no graph capture


def test_capacity_bench_records_and_prints_each_rounds_startup_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "capacity.json"
    load_bench("capacity").main(["--device", "cpu", "--models", "kvfit-tiny",
                                 "--max-model-len", "256", "--max-num-seqs", "4",
                                 "--startup-rounds", "2", "--no-warmup", "--out", str(out)])
    record = json.loads(out.read_text())
    assert validate(record) == []
    result = record["results"]["results"][0]
    for path in ("measured", "estimate"):
        rows = result["rounds"][path]
        assert len(rows) == 2
        for row in rows:
            assert list(row["stages"]) == STAGES and all(s > 0 for s in row["stages"].values())
            assert sum(s for n, s in row["stages"].items() if n != "total") <= \
                row["stages"]["total"] <= row["startup_s"]
        medians = result[f"stages_{path}"]
        assert medians == {n: statistics.median(r["stages"][n] for r in rows) for n in STAGES}
        figures = record["figures"]
        assert figures[f"kvfit-tiny.{path}.stage.total_s"] == {
            "value": medians["total"], "unit": "s", "direction": "lower"}
    table = capsys.readouterr().out.split("Startup stages, s (median over the rounds)")[1]
    assert all(name in table for name in STAGES)
    assert "kvfit-tiny  measured" in table and "kvfit-tiny  estimate" in table
