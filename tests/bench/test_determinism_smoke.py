"""bench/determinism.py end to end on the CPU: kvfit-tiny, a few short requests, both modes;
its `--profile` of both modes and the record's summary of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfit.benchmarks.profiling import KernelProfile, KernelStat

from . import scripts


def load_bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 (the bench module)
    monkeypatch.syspath_prepend(str(scripts.BENCH_DIR))  # it imports bench/throughput.py
    return scripts.load_bench("determinism")


def test_determinism_bench_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
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


def test_profile_needs_the_cost_run(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench(monkeypatch)
    with pytest.raises(SystemExit):
        bench.main(["--skip-throughput", "--profile", "p.txt", "--out", "x.json"])
    assert "--profile profiles the cost's workload" in capsys.readouterr().err


def test_profile_of_both_modes_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """On the CPU there are no device kernels, so the families are all zero; what is checked
    is that each mode is profiled, its steps annotated, and both land in the file and the
    record."""
    bench = load_bench(monkeypatch)
    out, profile = tmp_path / "cost.json", tmp_path / "profile.txt"
    assert bench.main(["--device", "cpu", "--model", "kvfit-tiny", "--num-seqs", "4",
                       "--min-len", "8", "--max-len", "16", "--no-warmup", "--skip-checks",
                       "--profile", str(profile), "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["results"]["profile"]
    assert list(summary["modes"]) == ["default", "deterministic"]
    for mode in summary["modes"].values():
        assert set(mode["families_ms"]) == set(bench.FAMILY_NAMES)
        assert mode["steps"]["decode"]["count"] > 0 and mode["wall_s"] > 0
    assert summary["families_diff_ms"] == dict.fromkeys(bench.FAMILY_NAMES, 0.0)
    text = profile.read_text()
    assert "differences: deterministic - default" in text
    assert "decode steps (default / deterministic)" in text
    assert text.count("torch.profiler's table") == 2
    assert "gemm.triton" in capsys.readouterr().out  # the family table is printed too


def test_profile_summary_differences(monkeypatch: pytest.MonkeyPatch) -> None:
    bench = load_bench(monkeypatch)
    profiles = {
        "default": KernelProfile(2.0, [1.0], {"_decode_kernel": KernelStat(3_000.0, 10),
                                               "nvjet_x": KernelStat(1_000.0, 5)}),
        "deterministic": KernelProfile(3.5, [1.0], {"_prefill_kernel": KernelStat(6_000.0, 10),
                                                     "_matmul_kernel": KernelStat(2_500.0, 5)}),
    }
    summary = bench.profile_summary(profiles)
    diff = summary["families_diff_ms"]
    assert diff["attention.decode"] == -3.0 and diff["attention.prefill"] == 6.0
    assert diff["gemm.cublas"] == -1.0 and diff["gemm.triton"] == 2.5
    assert summary["device_diff_ms"] == 4.5 and summary["wall_diff_s"] == 1.5
