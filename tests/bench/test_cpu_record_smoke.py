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


def test_adversarial_engines_take_the_kv_cache_dtype_and_small_batch_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--kv-cache-dtype fp8` runs the sweep on e4m3 caches (every run done, nothing out of
    memory); `--[no-]small-batch-kernels` and `--[no-]fused-decode-input` reach each engine,
    and leave the engine's default when not given."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))  # its sibling imports (capacity)
    bench = load_bench("adversarial")
    made: list = []

    class Recorded(bench.LLM):  # type: ignore[name-defined]
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            made.append((kwargs, self.config))

    monkeypatch.setattr(bench, "LLM", Recorded)
    out = tmp_path / "adversarial.json"
    for flag in ("--no-small-batch-kernels", None, "--fused-decode-input"):
        monkeypatch.setattr(sys, "argv", ["adversarial.py", *ARGV["adversarial"],
                                          "--margins", "default", "--features", "temperature",
                                          "all", "--kv-cache-dtype", "fp8",
                                          *([flag] if flag else []), "--out", str(out)])
        bench.main()
        (summary,) = load_record(out)["results"]["summaries"]
        assert summary["all_completed"] and summary["ooms"] == summary["errors"] == 0
    (off, config_off), (default, config_default), (fused, config_fused) = made
    assert config_off.cache_config.cache_dtype == config_default.cache_config.cache_dtype == "fp8"
    assert off["small_batch_kernels"] is False and config_off.small_batch_kernels is False
    assert "small_batch_kernels" not in default and "fused_decode_input" not in default
    assert config_default.fused_decode_input is False and config_fused.fused_decode_input


def test_adversarial_engines_take_the_logprobs_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--logprobs-mode processed_logprobs` runs the sweep's logprob requests in that mode (the
    mode warmup measures): every run done, nothing out of memory."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    bench = load_bench("adversarial")
    made: list = []

    class Recorded(bench.LLM):  # type: ignore[name-defined]
        def __init__(self, **kwargs: object) -> None:
            super().__init__(**kwargs)
            made.append(self.config)

    monkeypatch.setattr(bench, "LLM", Recorded)
    out = tmp_path / "adversarial.json"
    monkeypatch.setattr(sys, "argv", ["adversarial.py", *ARGV["adversarial"], "--margins",
                                      "default", "--features", "logprobs", "all",
                                      "--logprobs-mode", "processed_logprobs", "--out", str(out)])
    bench.main()
    (summary,) = load_record(out)["results"]["summaries"]
    assert summary["all_completed"] and summary["ooms"] == summary["errors"] == 0
    assert [c.model_config.logprobs_mode for c in made] == ["processed_logprobs"]
