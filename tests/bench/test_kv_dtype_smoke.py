"""bench/kv_dtype.py end to end on the CPU: kvfit-tiny's engine in both cache dtypes, and the
accuracy comparison on a tiny checkpoint against transformers (float32: exact for auto)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 (the bench module)
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    monkeypatch.delitem(sys.modules, "kv_dtype", raising=False)
    import kv_dtype

    return kv_dtype


def test_kv_dtype_bench_smoke(bench, tmp_path: Path,  # noqa: ANN001
                              tiny_model: Callable[[str], Path]) -> None:
    out = tmp_path / "kv_dtype.json"
    assert bench.main(["--device", "cpu", "--model", "kvfit-tiny", "--num-seqs", "4",
                       "--min-len", "8", "--max-len", "32", "--max-num-seqs", "4",
                       "--decode-batches", "2", "--decode-context", "32", "--iters", "3",
                       "--accuracy-model", str(tiny_model("qwen3")), "--accuracy-prompts", "2",
                       "--accuracy-len", "24", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    result = record["results"]
    assert record["bench"] == "kv-dtype"
    auto, fp8 = result["engine"]
    assert (auto["dtype"], fp8["dtype"]) == ("float32", "float8_e4m3fn")
    assert auto["block_bytes"] == 4 * fp8["block_bytes"]  # float32 on the CPU
    assert record["figures"]["fp8.kv_blocks"]["value"] == fp8["num_blocks"]
    assert result["ratios"]["blocks_ratio"] == fp8["num_blocks"] / auto["num_blocks"]
    assert [d["batch"] for d in fp8["decode"]] == [2]
    variants = result["accuracy"]["variants"]
    assert variants["auto"]["next_token_agreement"] == 1.0 and variants["auto"]["mean_kl"] == 0
    assert variants["auto"]["hf_top1"] == 1.0  # kvfit = transformers in float32
    assert 0 < variants["fp8"]["mean_kl"] < 0.05
    assert variants["fp8_calculated"]["kv_scales"][0] != (1.0, 1.0)
    assert result["accuracy"]["positions"] == 48
    # Agreement over the decisive positions: auto with itself agrees everywhere; a variant's
    # decisive agreement is over a subset, so it exists whenever some position is decisive.
    assert 0 <= result["accuracy"]["decisive_share"] <= 1
    assert variants["auto"]["decisive_agreement"] == 1.0
    assert variants["auto"]["disagreement_margin_median"] is None
    for v in variants.values():
        assert 0 <= v["decisive_agreement"] <= 1
