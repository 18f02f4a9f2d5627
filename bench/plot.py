"""Benchmark records as pictures: PNGs for docs/benchmarks.md.

    r=docs/results; PYTHONPATH=src python3 bench/plot.py --out-dir docs/img \\
        $r/capacity-h200-2026-12-03.json $r/throughput-h200-2026-12-04.json \\
        $r/serving-h200-2026-12-04.json $r/filters-h200-2026-12-03.json $r/adversarial-*.json

(docs/benchmarks.md gives, beside each picture, the files it is drawn from.)

Each input is a record or a result file published before records existed. Each picture is drawn
from the last input that carries its data (the adversarial one from all of them):

    capacity.png     KV cache size by sizing method and model shape (capacity)
    memory.png       device memory stacked: before start, weights, graphs, transient, margin, KV,
                     unused
    decode.png       decode step against its memory roofline by batch (throughput)
    serving.png      TTFT and ITL percentiles against request rate (serving)
    sleep.png        sleep and wake times by level (sleep)
    filters.png      top-k/top-p/min-p filters against the sort path (sampling)
    adversarial.png  the worst need of each adversarial run against the headroom kept
    elastic.png      KV cache size and the co-tenant's memory over time (elastic)
    elastic_pair.png each engine's KV cache (and output tokens) over time, elastic against static
                     (elastic-pair)
    kv_dtype.png     KV blocks, output tok/s and decode step by cache dtype (kv-dtype)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display on the GPU machine or in CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from kvfit.benchmarks.record import load_record  # noqa: E402

GiB = 1 << 30
Record = dict[str, Any]


def _title(fig: Figure, text: str, r: Record) -> None:
    """The picture's claim, and where its numbers came from."""
    source = ", ".join(x for x in (r["machine"]["gpu"] or "cpu", r["date"] and r["date"][:10],
                                   r["git"]["revision"] and r["git"]["revision"][:10]) if x)
    fig.suptitle(f"{text}\n{source}", fontsize=11)


def _label_bars(ax: Axes, bars: Any, fmt: Callable[[float], str]) -> None:
    for bar in bars:
        ax.annotate(fmt(bar.get_height()), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2),
                    textcoords="offset points")


def plot_capacity(r: Record) -> Figure:
    rows = r["results"]["results"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.38
    for i, (method, label) in enumerate((("measured", "measured (kvfit)"),
                                         ("estimate", "estimate at 0.92 utilization"))):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        bars = ax.bar(xs, [row[method]["kv_bytes"] / GiB for row in rows], width, label=label)
        _label_bars(ax, bars, lambda v: f"{v:.1f}")
    for j, row in enumerate(rows):
        top = row["measured"]["kv_bytes"] / GiB
        ax.annotate(f"{row['blocks_gain']:+.1%} blocks", (j, top * 1.09), ha="center",
                    fontsize=9, fontweight="bold")
    ax.set_xticks(range(len(rows)), [row["model"] for row in rows])
    ax.set_ylabel("KV cache (GiB)")
    ax.set_ylim(0, max(row["measured"]["kv_bytes"] for row in rows) / GiB * 1.22)
    ax.legend(loc="lower right")
    _title(fig, "KV cache capacity by sizing method", r)
    return fig


def memory_segments(row: dict[str, Any], total: int) -> dict[str, float]:
    """Bytes of each part of the device for one engine; `total` is the device memory.

    A record written since capacity.py reports weights (and since it reports them, graph
    pools) splits them out; an older file only knows what was in use before the engine
    started, so weights and graphs fall into one part with what is unused.
    """
    # On the host `total` is the configured budget and free memory is the whole host's.
    before = max(total - row["free_before"], 0)
    parts = {"in use before start": before}
    if "weights" in row:
        parts |= {"weights": row["weights"], "non-torch": row["non_torch"]}
    if row.get("graphs_and_buffers") is not None:
        parts["CUDA graphs, buffers"] = row["graphs_and_buffers"]
    parts |= {"transient peak": row["transient"], "margin": row["margin"],
              "KV cache": row["kv_bytes"]}
    outside = max(total - row["budget"], 0)  # 1 - gpu_memory_utilization of the device
    rest = total - sum(parts.values()) - outside
    parts["unused" if "weights" in row else "weights, graphs, unused"] = max(rest, 0)
    parts["outside the utilization budget"] = outside
    return parts


def plot_memory(r: Record) -> Figure:
    rows = r["results"]["results"]
    bars, labels = [], []
    for row in rows:
        # The measured path's budget is the device (utilization 1.0); the estimate's is 0.92 of it.
        total = row["measured"].get("total", row["measured"]["budget"])
        for method in ("measured", "estimate"):
            bars.append(memory_segments(row[method], total))
            labels.append(f"{row['model']}\n{method}")
    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(11, 4.6), width_ratios=[1, 1])
    names = list(dict.fromkeys(k for b in bars for k in b))
    colors = dict(zip(names, plt.get_cmap("tab10").colors, strict=False))
    for axis, show in ((ax, names), (zoom, [n for n in names if n != "KV cache"])):
        bottom = [0.0] * len(bars)
        for name in show:
            values = [b.get(name, 0) / GiB for b in bars]
            axis.bar(labels, values, bottom=bottom, label=name, color=colors[name])
            bottom = [x + v for x, v in zip(bottom, values, strict=True)]
        axis.tick_params(axis="x", labelsize=8)
        axis.set_ylabel("GiB")
    ax.set_title("whole device", fontsize=10)
    zoom.set_title("everything but the KV cache", fontsize=10)
    handles, names_ = ax.get_legend_handles_labels()
    fig.legend(handles[::-1], names_[::-1], fontsize=8, loc="center left",
               bbox_to_anchor=(1.0, 0.5))
    _title(fig, "Device memory by part, measured sizing vs the 0.92 estimate", r)
    fig.tight_layout()
    return fig


def plot_decode(r: Record) -> Figure:
    decode = r["results"]["decode"]
    models = list(dict.fromkeys(d["model"] for d in decode))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        rows = [d for d in decode if d["model"] == model]
        batches = [d["batch"] for d in rows]
        # Records since the graph flag say whether each step ran from a CUDA graph; a CPU run
        # (or --enforce-eager) ran none, and the label must not claim them.
        graphs = {d.get("graphs", True) for d in rows}
        how = {frozenset({True}): "graphs", frozenset({False}): "eager"}.get(
            frozenset(graphs), "graphs where captured")
        ax.plot(batches, [d["step_ms"] for d in rows], "o-", label=f"decode step ({how})")
        if all("sync_step_ms" in d for d in rows):
            ax.plot(batches, [d["sync_step_ms"] for d in rows], "s--", label="step + host sync")
        # Since the limit model the roofline is the steps' limit: bytes over the copy bandwidth,
        # or FLOPs over the GEMM throughput where those take longer.
        limit = ("limit (bytes / copy or FLOPs / GEMM)" if "memory_bound" in rows[0]
                 else "roofline (bytes / copy)")
        ax.plot(batches, [d["roofline_ms"] for d in rows], "k:", label=limit)
        for d in rows:
            ax.annotate(f"{d['ratio']:.1f}x", (d["batch"], d["step_ms"]), xytext=(4, 4),
                        textcoords="offset points", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel(f"batch (context {rows[0]['context']:.0f} tokens)")
        ax.set_ylabel("ms per step")
        ax.set_title(model, fontsize=10)
        ax.legend(fontsize=8)
    offline = r["results"].get("throughput") or {}
    note = (f"; offline {offline['output_tokens_per_s']:,.0f} output tok/s"
            if "output_tokens_per_s" in offline else "")
    _title(fig, f"Decode step against the memory roofline{note}", r)
    fig.tight_layout()
    return fig


def plot_serving(r: Record) -> Figure:
    all_rows = r["results"]["serve"]["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    limits = list(dict.fromkeys(x.get("max_concurrency", "-") for x in all_rows))
    for limit in limits:
        rows = [x for x in all_rows if x.get("max_concurrency", "-") == limit]
        rates = ["inf" if x["request_rate"] in (None, "inf") else f"{x['request_rate']:g}"
                 for x in rows]
        tag = "" if len(limits) == 1 else f", <= {limit or 'any'} in flight"
        for ax, metric in zip(axes[:2], ("ttft", "itl"), strict=True):
            for p, style in (("p50", "o-"), ("p99", "s--")):
                key = f"{p}_{metric}_ms"
                if all(key in x for x in rows):
                    ax.plot(rates, [x[key] for x in rows], style, label=p + tag)
        axes[2].plot(rates, [x["output_throughput"] for x in rows], "o-", label="served" + tag)
    for ax, metric in zip(axes[:2], ("ttft", "itl"), strict=True):
        ax.set_title(metric.upper(), fontsize=10)
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    offline = r["results"]["offline"]["output_throughput"]
    axes[2].axhline(offline, color="k", ls=":", label="offline LLM.generate")
    served = max(x["output_throughput"] for x in all_rows)
    axes[2].set_ylim(0, max(offline, served) * 1.12)  # the offline line clear of the frame
    axes[2].set_title("output tokens/s", fontsize=10)
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
    for ax in axes[:2]:
        ax.set_ylim(bottom=0)
    _title(fig, "Serving latency and throughput against request rate", r)
    fig.tight_layout()
    return fig


def plot_sleep(r: Record) -> Figure:
    rows = r["results"]["sleep"]
    levels = sorted({x["level"] for x in rows})
    parts = (("sleep_s", "sleep"), ("wake_kv_s", "wake: KV"), ("wake_weights_s", "wake: weights"))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / len(parts)
    for i, (key, label) in enumerate(parts):
        values = [min(x[key] for x in rows if x["level"] == lv) for lv in levels]
        bars = ax.bar([j + (i - 1) * width for j in range(len(levels))], values, width,
                      label=label)
        _label_bars(ax, bars, lambda v: f"{v:.3f}")
    ax.set_xticks(range(len(levels)), [f"level {lv}" for lv in levels])
    ax.set_ylabel("seconds (best cycle)")
    ax.legend()
    _title(fig, f"Sleep and wake of {r['results']['model']}", r)
    return fig


def plot_filters(r: Record) -> Figure:
    rows = r["results"]["filters"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    width = 0.38
    for i, (key, label) in enumerate((("sort_ms", "sort path"),
                                      ("threshold_ms", "thresholds (kvfit)"))):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        _label_bars(ax, ax.bar(xs, [x[key] for x in rows], width, label=label),
                    lambda v: f"{v:.2f}")
    ax.set_xticks(range(len(rows)), [f"{x['setting']}\n{x['speedup']:.1f}x" for x in rows],
                  fontsize=8)
    ax.set_ylabel("ms per batch")
    ax.legend()
    _title(fig, f"Sampling filters, {rows[0]['num_rows']} rows x {rows[0]['vocab_size']:,} "
                "vocabulary", r)
    return fig


def _adversarial_sweeps(records: list[Record]) -> list[dict[str, Any]]:
    """The sweeps with at least one run that measured its need."""
    return [s for r in records for s in r["results"].get("sweeps") or []
            if any(run.get("need_reserved") for run in s["runs"])]


def plot_adversarial(records: list[Record]) -> Figure:
    sweeps = _adversarial_sweeps(records)
    fig, axes = plt.subplots(len(sweeps), 1, figsize=(11, 3.2 * len(sweeps)), squeeze=False)
    for ax, s in zip(axes[:, 0], sweeps, strict=True):
        runs = [run for run in s["runs"] if run.get("need_reserved")]
        kept = runs[0]["headroom_kept"] / GiB
        ax.bar([run["run"] for run in runs], [run["need_reserved"] / GiB for run in runs],
               label="need (peak reserved)")
        ax.axhline(kept, color="r", ls="--", label=f"headroom kept {kept:.2f} GiB")
        ax.set_title(f"{s['model']}, max_model_len {s['max_model_len']}, margin {s['margin']}",
                     fontsize=10)
        ax.set_ylabel("GiB")
        ax.set_ylim(0, kept * 1.35)
        ax.tick_params(axis="x", labelsize=8, rotation=30)
        ax.legend(fontsize=8, loc="upper left")
    _title(fig, "Adversarial requests: what each needed against what was kept", records[-1])
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))  # room for the two-line title
    return fig


def plot_elastic(r: Record) -> Figure:
    samples = r["results"]["samples"]
    t = [s["t"] for s in samples]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.plot(t, [s["kv_blocks"] for s in samples], label="KV blocks (kvfit)")
    ax.set_xlabel("seconds since the co-tenant asked")
    ax.set_ylabel("KV blocks")
    other = ax.twinx()
    other.plot(t, [s["cotenant_bytes"] / GiB for s in samples], "r--", label="co-tenant GiB")
    other.set_ylabel("co-tenant (GiB)")
    ax.set_ylim(bottom=0)
    other.set_ylim(bottom=0)
    fig.legend(loc="lower right", fontsize=8)
    _title(fig, "Elastic KV cache beside a co-tenant", r)
    return fig


def plot_elastic_pair(r: Record) -> Figure:
    """Each engine's KV cache over time, elastic against static; below, where the record's
    samples carry them (since 2026-12-06), each engine's output tokens so far."""
    res = r["results"]
    curves = [(mode, style, rank, engine)
              for mode, style in (("elastic", "-"), ("elastic-alone", "--"), ("static", ":"))
              for rank, engine in enumerate(res["modes"].get(mode, {}).get("engines", []))]
    with_tokens = all("output_tokens" in s for *_, e in curves for s in e["samples"])
    fig, axes = plt.subplots(2 if with_tokens else 1, 1, sharex=True, squeeze=False,
                             figsize=(9, 7.0 if with_tokens else 4.2))
    panels = [(axes[0][0], "kv_bytes", GiB, "KV cache (GiB)")]
    if with_tokens:
        panels.append((axes[1][0], "output_tokens", 1e3, "output tokens so far (thousands)"))
    for ax, key, unit, ylabel in panels:
        for mode, style, rank, engine in curves:
            samples = engine["samples"]
            ax.plot([s["t"] for s in samples], [s[key] / unit for s in samples], style,
                    label=f"{rank}: {engine['model']} ({mode})")
        for k in range(1, res["args"]["num_phases"]):
            ax.axvline(k * res["args"]["phase_s"], color="grey", lw=0.5)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
    axes[-1][0].set_xlabel("seconds since the load started (the busy engines change each "
                           "phase)")
    # Beside the plot: inside, it hid the curves of a cache grown to the top (the 8B engine's
    # elastic cache at 60-70 s of the 2026-12-04 chat run).
    axes[0][0].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ratio = res.get("token_ratio")
    num_engines = max(len(m["engines"]) for m in res["modes"].values())
    _title(fig, f"{num_engines} engines on one device: KV cache over time"
           + ("" if ratio is None else f" (elastic / static tokens {ratio:.2f})"), r)
    return fig


def plot_kv_dtype(r: Record) -> Figure:
    """Blocks under measured sizing, offline output tok/s and the decode steps per cache dtype,
    each labelled with its ratio to the first (the model's dtype)."""
    runs = r["results"]["engine"]
    names = [f"{run['kv_cache_dtype']}\n({run['dtype']})" for run in runs]
    panels = [("KV blocks (measured sizing)", [run["num_blocks"] for run in runs], "{:,.0f}"),
              ("output tok/s (offline)",
               [run["throughput"]["output_tokens_per_s"] for run in runs], "{:,.0f}")]
    for d in runs[0]["decode"]:
        # A batch one dtype's cache could not hold is skipped there (bench/kv_dtype.py): only
        # the batches every run measured are compared.
        steps = [next((x["step_ms"] for x in run["decode"] if x["batch"] == d["batch"]), None)
                 for run in runs]
        if None not in steps:
            panels.append((f"decode step, {d['batch']} seqs (ms)", steps, "{:.2f}"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 4.2), squeeze=False)
    for ax, (label, values, fmt) in zip(axes[0], panels, strict=True):
        bars = ax.bar(names, values, color=["C0", "C1", "C2", "C3"][:len(values)])
        _label_bars(ax, bars, lambda v, fmt=fmt, first=values[0]: f"{fmt.format(v)}\n"
                    f"{v / first:.2f}x")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(0, max(values) * 1.3)
        ax.tick_params(axis="x", labelsize=8)
    _title(fig, f"KV cache dtype: capacity and speed ({runs[0].get('model', '')})", r)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / fig.get_figheight()))
    return fig


def _has(*path: str) -> Callable[[Record], bool]:
    def test(r: Record) -> bool:
        node: Any = r["results"]
        for key in path:
            if not isinstance(node, dict) or not node.get(key):
                return False
            node = node[key]
        return True
    return test


# name -> (which records carry its data, the plot of the last of them)
PLOTS: dict[str, tuple[Callable[[Record], bool], Callable[[Record], Figure]]] = {
    "capacity": (_has("results"), plot_capacity),
    "memory": (_has("results"), plot_memory),
    "decode": (_has("decode"), plot_decode),
    "serving": (_has("serve", "rows"), plot_serving),
    "sleep": (_has("sleep"), plot_sleep),
    "filters": (_has("filters"), plot_filters),
    "elastic": (_has("samples"), plot_elastic),
    "elastic_pair": (_has("modes"), plot_elastic_pair),
    "kv_dtype": (_has("engine"), plot_kv_dtype),
}
BENCH_OF = {"capacity": "capacity", "memory": "capacity", "decode": "throughput",
            "serving": "serving", "sleep": "sleep", "filters": "sampling", "elastic": "elastic",
            "elastic_pair": "elastic-pair", "kv_dtype": "kv-dtype"}


def draws_from(r: Record) -> bool:
    """Whether some picture takes its data from `r` (the last of its bench, where several are
    given)."""
    return any(r["bench"] == BENCH_OF[name] and carries(r)
               for name, (carries, _) in PLOTS.items()) or (
        r["bench"] == "adversarial" and bool(_adversarial_sweeps([r])))


def plot_all(records: list[Record], out_dir: Path) -> list[Path]:
    """Every picture the records carry data for, written to `out_dir`; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (carries, draw) in PLOTS.items():
        found = [r for r in records if r["bench"] == BENCH_OF[name] and carries(r)]
        if found:
            written.append(_save(draw(found[-1]), out_dir / f"{name}.png"))
    # A sweep whose every run was skipped (its deadline) or failed has no need to draw.
    adversarial = [r for r in records if r["bench"] == "adversarial" and _adversarial_sweeps([r])]
    if adversarial:
        written.append(_save(plot_adversarial(adversarial), out_dir / "adversarial.png"))
    return written


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("records", nargs="+", help="records or published result files")
    p.add_argument("--out-dir", default="docs/img", help="where the PNGs go")
    args = p.parse_args(argv)
    records = []
    for path in args.records:
        try:
            records.append(load_record(path))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            p.error(f"{path}: {e}")  # a clear usage error, not a traceback
    # A record no picture draws from (`kvfit bench serve`'s, a run that skipped the part
    # drawn) was passed over in silence, exit 0, as if its pictures had been written.
    benches = ", ".join(sorted({*BENCH_OF.values(), "adversarial"}))
    for path, record in zip(args.records, records, strict=True):
        if not draws_from(record):
            print(f"{path}: no picture draws from this {record['bench']} record (pictures "
                  f"come from {benches} records with their data)", file=sys.stderr)
    written = plot_all(records, Path(args.out_dir))
    for path in written:
        print(path)
    return 0 if written else 1


if __name__ == "__main__":
    raise SystemExit(main())
