"""bench/elastic_pair.py end to end on the CPU: two kvfit-tiny engines in two spawned processes
take turns being busy, static split then elastic. Host memory moves with other processes, so
the smoke checks the flow, the record and that the idle engine gave memory back, not the
speedup."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import psutil
import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 (the bench module)
    # Importable by name, so the spawned engines can unpickle their target.
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    monkeypatch.delitem(sys.modules, "elastic_pair", raising=False)
    import elastic_pair

    return elastic_pair


def test_elastic_pair_bench_smoke(bench, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "pair.json"
    result = bench.main(["--device", "cpu", "--models", "kvfit-tiny", "kvfit-tiny",
                         "--max-model-len", "256", "--max-num-seqs", "8", "--concurrency", "8",
                         "--input-len", "32", "--output-len", "16", "--phase-s", "2",
                         "--num-phases", "2", "--idle-s", "0.5", "--min-interval", "0.5",
                         "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["bench"] == "elastic-pair"
    assert record["results"] == json.loads(json.dumps(result))
    assert record["figures"]["token_ratio"]["value"] == pytest.approx(result["token_ratio"])
    for mode in ("static", "elastic"):
        r = result["modes"][mode]
        assert r["output_tokens"] == sum(e["output_tokens"] for e in r["engines"]) > 0
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] <= 2.0  # a phase at most
        for engine in r["engines"]:
            assert engine["output_tokens"] > 0 and engine["samples"]
            assert all(0 <= s["t"] <= 4.5 for s in engine["samples"])
    static, elastic = (result["modes"][m]["engines"] for m in ("static", "elastic"))
    assert all(e["kv_cache_idle_shrinks"] == 0 and not e["resizes"] for e in static)
    # Engine 0 idles in the second phase: by its end it has given its cache back.
    assert elastic[0]["kv_cache_idle_shrinks"] >= 1
    assert any(r["cause"] == "idle" and r["time"] >= 2.0 for r in elastic[0]["resizes"])
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE and "spawn" in " ".join(p.cmdline())]
