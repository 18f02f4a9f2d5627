"""bench/elastic.py end to end on the CPU: kvfit-tiny under load while a spawned co-tenant takes
host memory, holds it and frees it (host available memory moves with other processes too, so
the smoke checks the flow and the record, not the resizes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 (the bench module)
    # Importable by name, so the spawned co-tenant can unpickle its target.
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    monkeypatch.delitem(sys.modules, "elastic", raising=False)
    import elastic

    return elastic


def test_elastic_bench_smoke(bench, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "elastic.json"
    result = bench.main(["--device", "cpu", "--model", "kvfit-tiny", "--max-model-len", "256",
                         "--max-num-seqs", "8", "--num-prompts", "8", "--input-len", "32",
                         "--output-len", "16", "--cotenant-gib", "0.125", "--chunk-mib", "16",
                         "--idle-s", "0.5", "--hold-s", "1", "--after-s", "1",
                         "--min-interval", "0.2", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(result))
    assert result["failed"] == 0 and result["errors"] == [] and result["completed"] > 0
    assert result["completed"] % 8 == 0 and result["output_tokens"] == 16 * result["completed"]
    assert result["time_to_shrink_s"] is not None and result["time_to_shrink_s"] >= 0
    samples = result["samples"]
    assert samples[0]["t"] < 0 < samples[-1]["t"]  # before the co-tenant asked, and after
    assert max(s["cotenant_bytes"] for s in samples) == 128 << 20
    assert samples[-1]["cotenant_bytes"] == 0
    assert all(s["kv_blocks"] >= 16 for s in samples)  # never below one max_model_len sequence
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE and "spawn" in " ".join(p.cmdline())]
