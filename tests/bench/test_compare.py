"""bench/compare.py: a regression beyond the noise is flagged (exit 1); an improvement is not."""

from __future__ import annotations

import copy
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
    # The startup stages slowed with it: compare names each one that grew.
    stages = {f"tiny.{m}.stage.{s}_s" for m in ("measured", "estimate")
              for s in ("load_weights", "warm_up", "total")}
    assert {c.name for c in changes if c.flagged} == {"tiny.startup_measured_s",
                                                      "tiny.startup_estimate_s", *stages}


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


@pytest.mark.parametrize("content", ["{not json", "3", '"results and sweeps"', "[1, 2]",
                                     '{"a": 1}', "null"])
def test_a_file_that_is_no_record_is_a_clear_error_not_a_traceback(
        tmp_path: Path, content: str, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, "a.json", "throughput", payloads.throughput())
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    for argv in ([good, str(bad)], [str(bad), good]):
        with pytest.raises(SystemExit) as e:  # a usage error (2), never 1: 1 is a regression
            compare.main(argv)
        assert e.value.code == 2
        assert "bad.json" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_figure_that_is_not_finite_is_a_clear_error(
        tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, "a.json", "throughput", payloads.throughput())
    text = Path(good).read_text().replace('"value": 1000.0', f'"value": {value}', 1)
    assert value in text
    bad = tmp_path / "b.json"
    bad.write_text(text)
    with pytest.raises(SystemExit) as e:
        compare.main([good, str(bad)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "b.json" in err and "finite" in err and "Traceback" not in err


def test_a_missing_file_is_a_clear_error(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    good = _write(tmp_path, "a.json", "throughput", payloads.throughput())
    with pytest.raises(SystemExit) as e:
        compare.main([good, str(tmp_path / "missing.json")])
    assert e.value.code == 2 and "missing.json" in capsys.readouterr().err


def test_different_configs_and_machines_are_warned(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    record = record_of("throughput", payloads.throughput(), {"num_seqs": 8, "device": "cpu"})
    write_record(a, record)
    other = copy.deepcopy(record)
    other["config"]["num_seqs"] = 64
    other["machine"]["gpu"] = "NVIDIA H200"
    write_record(b, other)
    assert compare.main([str(a), str(b)]) == 0  # a warning, not a regression
    out = capsys.readouterr()
    text = out.out + out.err
    assert "num_seqs" in text and "8" in text and "64" in text
    assert "H200" in text and "warning" in text.lower()
    assert compare.main([str(a), str(a)]) == 0
    out = capsys.readouterr()
    assert "warning" not in (out.out + out.err).lower()


def test_figures_in_one_record_only_say_which(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    a = tmp_path / "a.json"
    b = tmp_path / "b.json"
    record = record_of("throughput", payloads.throughput(), {})
    write_record(a, record)
    other = copy.deepcopy(record)
    other["figures"]["new.figure"] = other["figures"].pop("offline.of_limit")
    write_record(b, other)
    assert compare.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "A only" in out and "B only" in out
    a_only = next(line for line in out.splitlines() if "A only" in line)
    b_only = next(line for line in out.splitlines() if "B only" in line)
    assert "offline.of_limit" in a_only and "new.figure" in b_only


@pytest.mark.parametrize("a, b, direction, flagged", [
    (0.0, 1.0, "lower", True), (0.0, 0.0, "higher", False), (0.0, -1.0, "higher", True),
    (-2.0, -1.0, "lower", True), (-2.0, -1.0, "higher", False), (-1.0, -2.0, "higher", True),
    (10.0, 9.4, "higher", True), (10.0, 9.6, "higher", False), (10.0, 10.6, "lower", True),
])
def test_zero_and_negative_values_are_judged_on_the_right_side(
        a: float, b: float, direction: str, flagged: bool) -> None:
    assert compare.worse(a, b, direction, 0.05) is flagged


def test_records_that_share_no_figure_are_warned(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    a = _write(tmp_path, "a.json", "capacity", payloads.capacity())
    other = payloads.capacity()
    other["results"][0]["model"] = "other-model"
    b = _write(tmp_path, "b.json", "capacity", other)
    assert compare.main([a, b]) == 0
    out = capsys.readouterr().out
    assert "warning" in out and "no figure" in out and "0 figures compared" in out


@pytest.mark.parametrize("threshold", ["nan", "inf", "-0.1"])
def test_a_threshold_that_could_flag_nothing_is_refused(tmp_path: Path, threshold: str) -> None:
    a = _write(tmp_path, "a.json", "throughput", payloads.throughput(tokens_per_s=1000.0))
    b = _write(tmp_path, "b.json", "throughput", payloads.throughput(tokens_per_s=10.0))
    with pytest.raises(SystemExit) as e:  # nan passed the old `< 0` check: exit 0 on a 99% drop
        compare.main([a, b, "--threshold", threshold])
    assert e.value.code == 2


def test_a_figure_whose_unit_or_direction_changed_is_warned_not_misjudged(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    record = record_of("throughput", payloads.throughput(), {})
    write_record(a, record)
    other = copy.deepcopy(record)
    ttft = other["figures"]["ttft.tiny.len64.ttft_s"]
    ttft |= {"value": ttft["value"] * 1000, "unit": "ms"}  # the same time, in ms
    other["figures"]["offline.of_limit"]["direction"] = "lower"
    write_record(b, other)
    assert compare.main([str(a), str(b)]) == 0  # 1000x "slower" is a unit, not a regression
    out = capsys.readouterr().out
    assert "warning: ttft.tiny.len64.ttft_s: unit 's' in A, 'ms' in B" in out
    assert "warning: offline.of_limit: higher is better in A, lower in B" in out
