"""bench/kv_dtype.py end to end on the CPU: kvfit-tiny's engine in both cache dtypes, and the
accuracy comparison on a tiny checkpoint against transformers (float32: exact for auto)."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

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
                       "--accuracy-len", "24", "--profile", str(tmp_path / "prof"),
                       "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    result = record["results"]
    assert record["bench"] == "kv-dtype"
    auto, fp8 = result["engine"]
    assert (auto["dtype"], fp8["dtype"]) == ("float32", "float8_e4m3fn")
    assert auto["block_bytes"] == 4 * fp8["block_bytes"]  # float32 on the CPU
    assert record["figures"]["fp8.kv_blocks"]["value"] == fp8["num_blocks"]
    assert result["ratios"]["blocks_ratio"] == fp8["num_blocks"] / auto["num_blocks"]
    assert [d["batch"] for d in fp8["decode"]] == [2]
    # The offline run's limit counts its KV bytes at the cache's dtype: the same workload's
    # KV traffic is a quarter of float32's in e4m3, and its weights the same.
    limits = auto["throughput"]["limit"], fp8["throughput"]["limit"]
    assert limits[1]["kv_read_gib"] == pytest.approx(limits[0]["kv_read_gib"] / 4)
    assert limits[1]["weight_gib"] == limits[0]["weight_gib"]
    assert result["ratios"]["limit_ratio"] > 1
    assert record["figures"]["fp8.of_limit"]["value"] == fp8["throughput"]["of_limit"] > 0
    for run in (auto, fp8):  # --profile: one more run each, its split in the record and a file
        assert run["profile"]["steps"]
        assert (tmp_path / f"prof.{run['kv_cache_dtype']}.txt").read_text()
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


def test_the_rounded_store_is_the_fp8_cache(bench, tiny_model: Callable[[str], Path]) -> None:
    """`--error-split`'s variants round the stored K/V of a model-dtype engine in place. Rounding
    both to e4m3 must give the real FP8 cache's log-probabilities (the split is then a split of
    that cache's error), rounding neither must change nothing, and the store is restored."""
    args = bench.parse_args(["--out", "unused", "--device", "cpu", "--accuracy-len", "40"])
    model = str(tiny_model("qwen3"))
    engines = {"auto": bench.accuracy_engine(model, args, {}),
               "fp8": bench.accuracy_engine(model, args, {"kv_cache_dtype": "fp8"})}
    try:
        prompt = list(range(3, 43))
        own = -int(math.log2(torch.finfo(engines["auto"].config.model_config.dtype).eps))
        base = bench.prefill_logprobs(engines["auto"], prompt)
        fp8 = bench.prefill_logprobs(engines["fp8"], prompt)
        rounded = {"both": (bench.e4m3, bench.e4m3), "none": (bench.exact, bench.exact),
                   "own_bits": (bench.mantissa_bits(own), bench.mantissa_bits(own)),
                   **bench.ERROR_SPLIT, **bench.NOISE_FLOOR}
        logprobs = {name: bench.variant_logprobs(engines, rounded, name, prompt)
                    for name in rounded}
    finally:
        for llm in engines.values():
            llm.shutdown()
    assert not torch.equal(fp8, base)
    torch.testing.assert_close(logprobs["both"], fp8, rtol=0, atol=1e-5)
    assert torch.equal(logprobs["none"], base)
    # Rounding the cache to its own dtype's mantissa changes nothing (7 bits for bf16).
    assert torch.equal(logprobs["own_bits"], base)
    for name in [*bench.ERROR_SPLIT, *bench.NOISE_FLOOR]:
        assert not torch.equal(logprobs[name], base), name
    assert bench.llama.attention_input.__name__ == "attention_input"
    h = bench.hadamard(64, torch.device("cpu"))
    torch.testing.assert_close(h @ h.T, torch.eye(64))


def test_three_mantissa_bits_are_e4m3_in_its_normal_range(bench) -> None:
    """`--noise-floor`'s precision series is e4m3 at 3 bits, where e4m3 has no subnormal or
    saturation: the series and the real format meet at that point."""
    x = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 40
    x = x[(x.abs() >= 2**-6) & (x.abs() <= 448)]
    assert torch.equal(bench.mantissa_bits(3)(x), bench.e4m3(x))
    assert not torch.equal(bench.mantissa_bits(4)(x), bench.e4m3(x))
