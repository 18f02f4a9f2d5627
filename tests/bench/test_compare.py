"""bench/compare.py: a regression beyond the noise is flagged (exit 1); an improvement is not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.record import write_record

from . import payloads
from .scripts import BENCH_DIR, load_bench

compare = load_bench("compare")


def _write(tmp_path: Path, name: str, bench: str, payload: dict[str, Any]) -> str:
    path = tmp_path / name
    write_record(path, record_of(bench, payload, {}))
    return str(path)


def test_planted_regression_is_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "a.json", "throughput", payloads.throughput(tokens_per_s=1000.0))
    b = _write(tmp_path, "b.json", "throughput", payloads.throughput(tokens_per_s=900.0))
    assert compare.main([a, b]) == 1
    out = capsys.readouterr().out
    flagged = [line.split()[0] for line in out.splitlines() if line.endswith("<-- worse")]
    assert flagged == ["offline.output_tokens_per_s", "offline.total_tokens_per_s"]
    assert "2 worse by more than 5%" in out


def test_a_slower_step_is_flagged_where_lower_is_better(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", "capacity", payloads.capacity(startup_s=1.0))
    b = _write(tmp_path, "b.json", "capacity", payloads.capacity(startup_s=1.2))
    assert compare.main([a, b]) == 1
    changes = compare.compare(*(compare.load_record(p) for p in (a, b)), threshold=0.05)
    assert {c.name for c in changes if c.flagged} == {"tiny.startup_measured_s",
                                                      "tiny.startup_estimate_s"}


def test_an_improvement_is_not_flagged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "a.json", "capacity", payloads.capacity(gain=0.08, startup_s=1.0))
    b = _write(tmp_path, "b.json", "capacity", payloads.capacity(gain=0.12, startup_s=0.5))
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "<-- worse" not in out and "0 worse" in out
    assert "tiny.startup_measured_s" in out and "0.500" in out  # B/A printed


def test_threshold_separates_noise_from_regression(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", "throughput", payloads.throughput(tokens_per_s=1000.0))
    b = _write(tmp_path, "b.json", "throughput", payloads.throughput(tokens_per_s=970.0))
    assert compare.main([a, b]) == 0  # 3% is within the default 5%
    assert compare.main([a, b, "--threshold", "0.01"]) == 1


def test_a_count_that_was_zero_is_flagged_on_any_rise() -> None:
    assert compare.worse(0, 1, "lower", 0.05)
    assert not compare.worse(0, 0, "lower", 0.05)
    assert not compare.worse(5, 0, "lower", 0.05)


def test_a_published_file_compares_with_itself(capsys: pytest.CaptureFixture[str]) -> None:
    path = str(BENCH_DIR.parent / "docs" / "results" / "capacity-h200-2026-12-03.json")
    assert compare.main([path, path]) == 0
    assert "1.000" in capsys.readouterr().out


def test_different_benches_are_refused(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.json", "throughput", payloads.throughput())
    b = _write(tmp_path, "b.json", "elastic", payloads.elastic())
    with pytest.raises(SystemExit) as e:
        compare.main([a, b])
    assert e.value.code == 2


def test_limits_are_printed_but_never_flagged(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "a.json", "throughput", payloads.throughput())
    slower_machine = payloads.throughput() | {"copy_bandwidth_gbps": 50.0, "gemm_tflops": 1.0}
    b = _write(tmp_path, "b.json", "throughput", slower_machine)
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    limits = out.split("in-run limits")[1].splitlines()
    assert {line.split()[0]: line.split()[3] for line in limits[2:4]} == {
        "copy_gb_per_s": "0.500", "gemm_tflops": "0.500"}
    assert "<-- worse" not in out and "0 worse" in out
