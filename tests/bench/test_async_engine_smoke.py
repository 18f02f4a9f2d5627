"""bench/async_engine.py end to end on the CPU: AsyncLLM (engine process) and offline."""

from __future__ import annotations

import json
from pathlib import Path

from .scripts import load_bench


def test_async_engine_bench_smoke(tmp_path: Path) -> None:
    bench = load_bench("async_engine")

    out = tmp_path / "async_engine.json"
    result = bench.main(["--device", "cpu", "--model", "kvfit-tiny", "--num-prompts", "4",
                         "--input-len", "8", "--output-len", "4", "--max-num-seqs", "2",
                         "--engines", "process", "--out", str(out)])

    record = json.loads(out.read_text())
    assert record["bench"] == "async-engine"
    assert record["results"] == json.loads(json.dumps(result))
    (row,) = result["rows"]
    assert row["engine"] == "process" and row["output_throughput"] > 0
    assert row["ratio"] == row["output_throughput"] / result["offline"]["output_throughput"]
