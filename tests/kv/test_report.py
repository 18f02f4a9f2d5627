"""KVCacheReport renders every figure in an aligned table with human units."""

from __future__ import annotations

import pytest

from kvfit.kv.report import KVCacheReport, format_bytes

MiB = 1 << 20
GiB = 1 << 30


def report(**kw: object) -> KVCacheReport:
    args: dict = dict(
        method="measured",
        total=80 * GiB,
        budget=80 * GiB,
        weights=16 * GiB,
        non_torch=768 * MiB,
        transient=3 * GiB // 2,
        margin=768 * MiB,
        committed_bytes=56 * GiB,
        num_blocks=28672,
        estimate_num_blocks=26000,
        max_blocks=65536,
    )
    args.update(kw)
    return KVCacheReport(**args)


def test_format_bytes() -> None:
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(GiB) == "1.00 GiB"
    assert format_bytes(256 * MiB) == "256.00 MiB"
    assert format_bytes(0) == "0.00 MiB"


def test_table_has_every_figure_aligned() -> None:
    lines = report().format_table().splitlines()
    assert len(lines) == 11
    assert len({len(line) for line in lines}) == 1  # right-aligned values end in one column
    table = "\n".join(lines)
    for text in ("measured", "80.00 GiB", "16.00 GiB", "768.00 MiB", "1.50 GiB", "56.00 GiB"):
        assert text in table
    assert "28,672" in table and "26,000" in table and "65,536" in table
    assert str(report()) == report().format_table()


def test_missing_estimate_and_cap_are_shown_as_dashes() -> None:
    table = report(method="override", estimate_num_blocks=None, max_blocks=None).format_table()
    rows = {line.rsplit(maxsplit=1)[0].strip(): line.split()[-1] for line in table.splitlines()}
    assert rows["blocks by estimate"] == rows["blocks cap"] == "-"


def test_unknown_method_is_an_error() -> None:
    with pytest.raises(ValueError, match="measured"):
        report(method="guessed")


def test_oom_guard_shrinks_get_a_row_once_there_is_one() -> None:
    assert "OOM guard" not in report().format_table()
    lines = report(oom_guard_shrinks=3).format_table().splitlines()
    assert len(lines) == 12 and len({len(line) for line in lines}) == 1
    assert lines[-1].split()[:3] == ["OOM", "guard", "shrinks"] and lines[-1].split()[-1] == "3"


def test_the_cpu_total_is_labelled_a_host_budget() -> None:
    assert report().format_table().splitlines()[1].startswith("device total ")
    host = report(on_host=True).format_table().splitlines()
    assert host[1].startswith("host budget ") and host[1].endswith("80.00 GiB")
    assert not any("device" in line for line in host)


def test_graphs_and_buffers_get_a_row_after_the_weights_when_given() -> None:
    assert "graphs" not in report().format_table()
    lines = report(graphs_and_buffers=3 * GiB // 2).format_table().splitlines()
    assert len(lines) == 12 and len({len(line) for line in lines}) == 1
    assert lines[4].startswith("graphs, buffers ") and lines[4].endswith("1.50 GiB")


def test_the_hosts_process_memory_gets_a_row_after_the_weights_when_given() -> None:
    assert "process" not in report().format_table()
    lines = report(on_host=True, host_process=300 << 20).format_table().splitlines()
    assert len(lines) == 12 and len({len(line) for line in lines}) == 1
    assert lines[4].startswith("process, other ") and lines[4].endswith("300.00 MiB")
