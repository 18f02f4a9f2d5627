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


def test_an_adversarial_record_whose_runs_were_all_skipped_draws_nothing(tmp_path: Path) -> None:
    payload = payloads.adversarial()  # the --deadline-s passed before any run started
    payload["sweeps"][0]["runs"] = [{"run": r["run"], "skipped": "deadline"}
                                    for r in payload["sweeps"][0]["runs"]]
    payload["summaries"][0]["worst_kept_over_peak_need"] = None
    skipped = record_of("adversarial", payload, {})
    assert plot.plot_all([skipped], tmp_path) == []
    drawn = record_of("adversarial", payloads.adversarial(), {})
    assert [p.name for p in plot.plot_all([drawn, skipped], tmp_path)] == ["adversarial.png"]


def test_kv_dtype_draws_the_decode_batches_every_dtype_measured(tmp_path: Path) -> None:
    payload = payloads.kv_dtype()  # fp8 first: the bf16 cache held too few blocks for batch 64
    payload["engine"] = payload["engine"][::-1]
    payload["engine"][1]["decode"] = []
    record = record_of("kv-dtype", payload, {})
    assert [p.name for p in plot.plot_all([record], tmp_path)] == ["kv_dtype.png"]


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"a": 1}', "7"])
def test_a_file_that_is_no_record_is_a_clear_error(tmp_path: Path, content: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    with pytest.raises(SystemExit) as e:
        plot.main([str(bad), "--out-dir", str(tmp_path / "img")])
    assert e.value.code == 2 and "bad.json" in capsys.readouterr().err


def _legend(fig: plot.Figure) -> list[str]:
    return [t.get_text() for ax in fig.axes if ax.get_legend()
            for t in ax.get_legend().get_texts()]


def test_decode_labels_say_eager_steps_and_the_limit_they_are_drawn_against() -> None:
    payload = payloads.throughput()
    for d in payload["decode"]:  # a CPU run: no CUDA graph; the limit model's rows
        d |= {"graphs": False, "memory_bound": True}
    labels = _legend(plot.plot_decode(record_of("throughput", payload, {})))
    assert "decode step (eager)" in labels and "decode step (graphs)" not in labels
    assert any(x.startswith("limit") and "FLOPs" in x for x in labels)
    payload["decode"][0]["graphs"] = True
    assert "decode step (graphs where captured)" in _legend(
        plot.plot_decode(record_of("throughput", payload, {})))
    old = payloads.throughput()  # a file from before both flags: graphs, bytes / copy
    assert {"decode step (graphs)", "roofline (bytes / copy)"} <= set(
        _legend(plot.plot_decode(record_of("throughput", old, {}))))


def test_serving_keeps_the_offline_line_inside_the_frame() -> None:
    payload = payloads.serving()
    payload["offline"]["output_throughput"] = 1000.0  # above every served row
    fig = plot.plot_serving(record_of("serving", payload, {}))
    assert fig.axes[2].get_ylim()[1] > 1000.0 * 1.05


def test_elastic_pair_legend_hides_no_curve() -> None:
    fig = plot.plot_elastic_pair(record_of("elastic-pair", payloads.elastic_pair(), {}))
    fig.canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent()
    assert not legend.overlaps(ax.get_window_extent())
    assert len(fig.axes) == 1  # samples without tokens (records before 2026-12-06): no panel


def test_elastic_pair_plots_each_engines_tokens_where_samples_carry_them() -> None:
    payload = payloads.elastic_pair()
    for mode in payload["modes"].values():
        for engine in mode["engines"]:
            for i, sample in enumerate(engine["samples"]):
                sample["output_tokens"] = 100 * i
    fig = plot.plot_elastic_pair(record_of("elastic-pair", payload, {}))
    cache, tokens = fig.axes
    assert tokens.get_ylabel() == "output tokens so far (thousands)"
    assert len(tokens.get_lines()) - 3 == len(cache.get_lines()) - 3 == 4  # 3 phase lines
    assert max(max(line.get_ydata(), default=0) for line in tokens.get_lines()[:4]) == 1.5


def test_a_record_no_picture_draws_from_is_named(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`kvfit bench serve`'s record has no picture: plot.py said nothing and exited 0."""
    serve = tmp_path / "serve.json"
    write_record(serve, record_of("bench-serve", {
        "request_throughput": 1.0, "output_throughput": 2.0, "failed": 0, "completed": 1,
        "total_output_tokens": 2, "p50_ttft_ms": 3.0}, {}))
    assert plot.main([str(serve), "--out-dir", str(tmp_path / "img")]) == 1
    err = capsys.readouterr().err
    assert f"{serve}: no picture draws from this bench-serve record" in err
    sampling = tmp_path / "sampling.json"
    write_record(sampling, record_of("sampling", payloads.sampling(), {}))
    assert plot.main([str(serve), str(sampling), "--out-dir", str(tmp_path / "img")]) == 0
    out, err = capsys.readouterr()
    assert "filters.png" in out and str(serve) in err and str(sampling) not in err
