"""bench/determinism.py end to end on the CPU: kvfit-tiny, a few short requests, both modes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "determinism.py"


def test_determinism_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH.parent))  # it imports bench/throughput.py
    spec = importlib.util.spec_from_file_location("bench_determinism", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    out = tmp_path / "determinism.json"
    assert bench.main(["--device", "cpu", "--model", "kvfit-tiny", "--num-seqs", "4",
                       "--min-len", "8", "--max-len", "16", "--no-warmup",
                       "--check-models", "kvfit-tiny", "--check-prompts", "3",
                       "--check-others", "5", "--check-max-tokens", "24",
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    result = record["results"]
    assert record["bench"] == "determinism"
    assert [t["mode"] for t in result["throughputs"]] == ["default", "deterministic"]
    speeds = [t["output_tokens_per_s"] for t in result["throughputs"]]
    assert record["figures"]["cost"]["value"] == pytest.approx(1 - speeds[1] / speeds[0])
    deterministic = next(c for c in result["checks"] if c["mode"] == "deterministic")
    assert deterministic["preemptions"] > 0
    assert set(deterministic["identical"].values()) == {3}  # every prompt, every case
    assert record["figures"]["kvfit-tiny.identical"]["value"] == 1.0
