"""bench/plot.py: every picture drawn from tiny synthetic records is a valid PNG."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.record import write_record

from . import payloads
from .scripts import load_bench

pytest.importorskip("matplotlib")

plot = load_bench("plot")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_every_picture_from_synthetic_records(tmp_path: Path) -> None:
    files = []
    for bench, make in payloads.ALL.items():
        files.append(str(tmp_path / f"{bench}.json"))
        write_record(files[-1], record_of(bench, make(), {}))
    assert plot.main([*files, "--out-dir", str(tmp_path / "img")]) == 0
    written = sorted(p.name for p in (tmp_path / "img").iterdir())
    assert written == sorted(f"{n}.png" for n in (*plot.PLOTS, "adversarial"))
    for name in written:
        data = (tmp_path / "img" / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        image = plot.plt.imread(tmp_path / "img" / name)
        assert image.shape[0] > 200 and image.shape[1] > 300, name
        assert image.std() > 0.05, f"{name} is blank"


def test_only_the_pictures_the_records_carry(tmp_path: Path) -> None:
    records = [record_of("sampling", payloads.sampling(), {})]
    assert [p.name for p in plot.plot_all(records, tmp_path)] == ["filters.png"]
    records[0]["results"]["filters"] = []  # a sampling run without the filter table
    assert plot.plot_all(records, tmp_path / "none") == []


def test_memory_parts_add_up_to_the_device() -> None:
    row = payloads.capacity()["results"][0]
    for method in ("measured", "estimate"):
        parts = plot.memory_segments(row[method], row[method]["total"])
        assert sum(parts.values()) == row[method]["total"]
        assert parts["KV cache"] == row[method]["kv_bytes"]
        assert parts["CUDA graphs, buffers"] == row[method]["graphs_and_buffers"]
    estimate = plot.memory_segments(row["estimate"], row["estimate"]["total"])
    assert estimate["outside the utilization budget"] == row["estimate"]["total"] - int(
        row["estimate"]["total"] * 0.92)


def test_memory_parts_of_a_record_without_graphs_lump_them_with_the_unused() -> None:
    row = payloads.capacity()["results"][0]["measured"]
    full = plot.memory_segments(row, row["total"])
    for key in ("graphs_and_buffers", "weights", "non_torch"):  # older records, in turn
        row.pop(key)
        parts = plot.memory_segments(row, row["total"])
        assert sum(parts.values()) == row["total"] and "CUDA graphs, buffers" not in parts
    assert parts["weights, graphs, unused"] == (full["weights"] + full["non-torch"]
                                                + full["CUDA graphs, buffers"] + full["unused"])


def test_memory_parts_of_a_host_run_are_never_negative() -> None:
    row = payloads.capacity()["results"][0]["measured"]
    row["free_before"] = 10 * row["total"]  # the host's free memory, beyond the budget
    parts = plot.memory_segments(row, row["total"])
    assert parts["in use before start"] == 0 and min(parts.values()) >= 0
