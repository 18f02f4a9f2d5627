"""The figures each benchmark claims, drawn from its detailed payload; and older result files
adapted into records.

`FIGURES[bench](payload)` gives the figures, `device_limits(payload)` the in-run limit figures
(the same payload keys in every bench: `limits.in_run_limits`). The same functions serve a
fresh run (`record_of`) and a file published before records existed (`adapt`), so a new GPU
run compares with the last published one figure by figure.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvfit.benchmarks.record import RECORD_SCHEMA_VERSION, figure, make_record

Figures = dict[str, dict[str, Any]]
GiB = 1 << 30
STAGE_SHARE = 0.05
"""A startup stage gets a figure in `capacity` when it takes at least this share of the
engine's startup: a few milliseconds would move more than a compare threshold from noise
alone."""


def _rate(r: Any) -> str:
    return "inf" if r is None or str(r) == "inf" else f"{float(r):g}"


def capacity(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    for r in p["results"]:
        m = r["model"]
        for method in ("measured", "estimate"):
            f[f"{m}.{method}.kv_blocks"] = figure(r[method]["num_blocks"], "blocks", "higher")
        f[f"{m}.blocks_gain"] = figure(r["blocks_gain"], "fraction", "higher")
        f[f"{m}.startup_measured_s"] = figure(r["startup_measured_s"], "s", "lower")
        f[f"{m}.startup_estimate_s"] = figure(r["startup_estimate_s"], "s", "lower")
        for method in ("measured", "estimate"):
            stages = r.get(f"stages_{method}") or {}  # records before stages were kept: none
            total = stages.get("total", 0.0)
            for name, seconds in stages.items():
                if name == "total" or seconds >= STAGE_SHARE * total:
                    f[f"{m}.{method}.stage.{name}_s"] = figure(seconds, "s", "lower")
    return f


def throughput(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    t = p.get("throughput") or {}
    for key in ("output_tokens_per_s", "total_tokens_per_s"):
        if key in t:
            f[f"offline.{key}"] = figure(t[key], "tokens/s", "higher")
    if "of_limit" in t:  # runs before the limit model carry none
        f["offline.of_limit"] = figure(t["of_limit"], "fraction", "higher")
    runs = p.get("throughputs", [])
    for r in runs if len(runs) > 1 else []:  # side by side: backends, graph modes
        name = f"offline.{r['backend']}.{r.get('cudagraph_mode', 'FULL_DECODE_ONLY')}"
        f[f"{name}.output_tokens_per_s"] = figure(r["output_tokens_per_s"], "tokens/s", "higher")
        if "of_limit" in r:
            f[f"{name}.of_limit"] = figure(r["of_limit"], "fraction", "higher")
    for d in p.get("decode", []):
        # Rows with the small-batch kernels carry their name whether or not they are the
        # default (they are since ce335c0), so records either side of the flip compare
        # like with like.
        small = ".small_batch" if d.get("small_batch_kernels") else ""
        # ... and with their PDL set either way (`--pdl`), beside the default ones.
        pdl = {True: ".pdl", False: ".no_pdl"}.get(d.get("pdl"), "")
        if d.get("pdl_trigger"):  # `--pdl-trigger`: where its kernels release their successors
            pdl += f".{d['pdl_trigger']}_trigger"
        fused = ".fused_input" if d.get("fused_decode_input") else ""  # `--fused-decode-input`
        # `--qkv-epilogue`: the attention input in the QKV projection, set either way.
        qkv = {True: ".qkv_epilogue", False: ".no_qkv_epilogue"}.get(d.get("qkv_epilogue"), "")
        # `--one-row-mma`: the fused one-row prologues' product, set either way.
        mma = {True: ".row_mma", False: ".no_row_mma"}.get(d.get("one_row_mma"), "")
        name = f"decode.{d['model']}.batch{d['batch']}{small}{pdl}{fused}{qkv}{mma}"
        f[f"{name}.step_ms"] = figure(d["step_ms"], "ms", "lower")
        f[f"{name}.over_roofline"] = figure(d["ratio"], "ratio", "lower")
    for r in p.get("ttft", []):
        name = f"ttft.{r['model']}.len{r['prompt_len']}"
        f[f"{name}.ttft_s"] = figure(r["ttft_s"], "s", "lower")
        f[f"{name}.of_limit"] = figure(r["of_limit"], "fraction", "higher")
    return f


def _measured_latencies(row: dict[str, Any]) -> set[str]:
    """The latency kinds a load measured: none where no request succeeded, and no TPOT or
    ITL where no request produced a second token. The load reports 0.0 ms for a kind with
    no sample, which as a "lower is better" figure would read as the best run ever."""
    completed = row.get("completed")
    if completed == 0:
        return set()
    tokens = row.get("total_output_tokens")
    if completed is not None and tokens is not None and tokens <= completed:
        return {"ttft", "e2el"}
    return {"ttft", "tpot", "itl", "e2el"}


def _serve_rows(f: Figures, rows: list[dict[str, Any]], prefix: str = "") -> None:
    for row in rows:
        name = f"{prefix}serve.rate{_rate(row['request_rate'])}"
        if "max_concurrency" in row:  # records since the concurrency sweep
            name += f".conc{row['max_concurrency'] or 'any'}"
        f[f"{name}.output_throughput"] = figure(row["output_throughput"], "tokens/s", "higher")
        measured = _measured_latencies(row)
        for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms"):
            if key in row and key.split("_")[1] in measured:
                f[f"{name}.{key}"] = figure(row[key], "ms", "lower")


def _placement(sweep: dict[str, Any]) -> str:
    """A served placement's name: its engine, and its API processes where the run set them."""
    name = str(sweep.get("engine") or "server")
    if sweep.get("api_server_count") is not None:
        name += f".api{sweep['api_server_count']}"
    return name


def serving(p: dict[str, Any]) -> Figures:
    """The first placement's rows and ratio under their own names (the target's), and every
    other placement's (`--engines`, `--api-server-count`) under its name: those are claims
    too (4 API processes: 99.4% of offline on 2026-12-04)."""
    f: Figures = {}
    _serve_rows(f, p["serve"]["rows"])
    f["offline.output_throughput"] = figure(p["offline"]["output_throughput"], "tokens/s",
                                            "higher")
    if p.get("ratio") is not None:
        f["serve_over_offline"] = figure(p["ratio"], "ratio", "higher")
    first = _placement(p["serve"])
    for sweep in p.get("serve_by_engine") or []:
        name = _placement(sweep)
        if sweep is p["serve"] or sweep == p["serve"] or name == first:
            continue
        _serve_rows(f, sweep["rows"], f"{name}.")
        if sweep.get("ratio") is not None:
            f[f"{name}.serve_over_offline"] = figure(sweep["ratio"], "ratio", "higher")
    return f


def async_engine(p: dict[str, Any]) -> Figures:
    f = {"offline.output_throughput": figure(p["offline"]["output_throughput"], "tokens/s",
                                             "higher")}
    for row in p["rows"]:
        f[f"{row['engine']}.output_throughput"] = figure(row["output_throughput"], "tokens/s",
                                                         "higher")
        f[f"{row['engine']}.over_offline"] = figure(row["ratio"], "ratio", "higher")
    return f


def sleep(p: dict[str, Any]) -> Figures:
    c = p["components"]
    f = {"kv_release_recommit_s_per_100GiB": figure(c["kv_release_recommit_s_per_100GiB"],
                                                    "s", "lower"),
         "offload_GBps": figure(c["offload_GBps"], "GB/s", "higher"),
         **({"kv_release_recommit_after_pause_s_per_100GiB": figure(
             c["kv_release_recommit_after_pause_s_per_100GiB"], "s", "lower")}
            if "kv_release_recommit_after_pause_s_per_100GiB" in c else {}),
         "restore_GBps": figure(c["restore_GBps"], "GB/s", "higher"),
         "external_hit_s": figure(p["ttft"]["best"]["external_hit_s"], "s", "lower")}
    for level in sorted({r["level"] for r in p["sleep"]}):
        rows = [r for r in p["sleep"] if r["level"] == level]
        f[f"level{level}.sleep_s"] = figure(min(r["sleep_s"] for r in rows), "s", "lower")
        f[f"level{level}.wake_s"] = figure(
            min(r["wake_kv_s"] + r["wake_weights_s"] for r in rows), "s", "lower")
    return f


def elastic(p: dict[str, Any]) -> Figures:
    f = {k: figure(p[k], "s", "lower")
         for k in ("time_to_shrink_s", "first_shrink_s", "regrow_s") if p.get(k) is not None}
    f["failed"] = figure(p["failed"], "requests", "lower")
    f["oom_guard_events"] = figure(p["oom_guard_events"], "events", "lower")
    if p.get("kv_blocks_before") is not None:
        f["kv_blocks_before"] = figure(p["kv_blocks_before"], "blocks", "higher")
    return f


def elastic_pair(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    for mode, r in p["modes"].items():
        f[f"{mode}.output_tokens"] = figure(r["output_tokens"], "tokens", "higher")
        if r.get("ttft_p99_s") is not None:
            f[f"{mode}.ttft_p99_s"] = figure(r["ttft_p99_s"], "s", "lower")
    if p.get("token_ratio") is not None:
        f["token_ratio"] = figure(p["token_ratio"], "ratio", "higher")
    return f


def sampling(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    for r in p.get("sampling", []):
        f[f"sample.rows{r['num_rows']}.kernel_ms"] = figure(r["kernel_ms"], "ms", "lower")
        if "argmax_kernel_ms" in r:  # records since 2026-12-07
            f[f"greedy.rows{r['num_rows']}.argmax_ms"] = figure(r["argmax_kernel_ms"], "ms",
                                                                "lower")
    for r in p.get("filters", []):
        name = f"filter.{r['setting'].replace(' ', '_')}.rows{r['num_rows']}"
        f[f"{name}.threshold_ms"] = figure(r["threshold_ms"], "ms", "lower")
        f[f"{name}.speedup_over_sort"] = figure(r["speedup"], "ratio", "higher")
    return f


def attention(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    for r in p["decode"]:
        f[f"decode.batch{r['batch']}.ctx{r['context']}.ms"] = figure(r["ms"], "ms", "lower")
    for r in p["prefill"]:
        f[f"prefill.batch{r['batch']}.len{r['length']}.tflops"] = figure(r["tflops"], "TFLOP/s",
                                                                         "higher")
    return f


def attention_batch_invariant(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    for r in p["cases"]:
        name = f"{r['case']}.batch{r['batch']}.len{r['length']}"
        f[f"{name}.default_ms"] = figure(r["default_ms"], "ms", "lower")
        f[f"{name}.mode_ms"] = figure(r["mode_ms"], "ms", "lower")
        f[f"{name}.mode_over_default"] = figure(r["mode_over_default"], "ratio", "lower")
    return f


def attention_decode_input(p: dict[str, Any]) -> Figures:
    """Kernel microseconds of one layer's decode attention with its input, each way, and the
    engine's fused way (the reduction in the launch) over the unfused kernels."""
    f: Figures = {}
    for r in p["decode_input"]:
        name = f"batch{r['batch']}.len{r['context']}"
        for way, us in r["kernel_us"].items():
            f[f"{name}.{way}_us"] = figure(us, "us", "lower")
        f[f"{name}.fused_over_unfused"] = figure(
            r["kernel_us"]["fused_tickets"] / r["kernel_us"]["unfused"], "ratio", "lower")
    return f


def attention_mixed_decode(p: dict[str, Any]) -> Figures:
    """Decode over mixed lengths: each start order's (and split's) milliseconds, and longest
    first at the default split over the batch order."""
    f: Figures = {}
    for r in p["mixed_decode"]:
        name = f"batch{r['batch']}"
        for key, ms in r.items():
            if key.endswith("_ms"):
                f[f"{name}.{key}"] = figure(ms, "ms", "lower")
        f[f"{name}.longest_first_over_batch"] = figure(
            r["longest_first_ms"] / r["batch_ms"], "ratio", "lower")
    return f


def batch_invariant_gemm(p: dict[str, Any]) -> Figures:
    """The mode's GEMM as it is (the current config) against cuBLAS, and its invariance; the
    candidate configs are exploration, not claims."""
    f: Figures = {}
    for t in p["timings"]:
        f[f"{t['model']}.{t['gemm']}.m{t['m']}.current_over_cublas"] = figure(
            t["over_cublas"]["current"], "ratio", "lower")
    for c in p["checks"]:
        if c["kernel"] == "current":
            f[f"{c['model']}.{c['gemm']}.current_invariant"] = figure(
                float(c["invariant"]), "bool", "higher")
    return f


def skinny_linear(p: dict[str, Any]) -> Figures:
    """The small-batch kernels against cuBLAS and the fused pairs against their chains, per
    layer and M (rows past the kernels' 16 time cuBLAS alone), and cuBLAS against the op's
    in-run limit; the sweep's configs are exploration, not claims."""
    f: Figures = {}
    for r in p["layers"]:
        name = f"{r['model']}.{r['layer']}.m{r['m']}"
        if "skinny_over_cublas" in r:
            f[f"{name}.skinny_over_cublas"] = figure(r["skinny_over_cublas"], "ratio", "lower")
            f[f"{name}.skinny_gb_per_s"] = figure(r["weight_gb_per_s"]["skinny"], "GB/s",
                                                  "higher")
        if "cublas_over_limit" in r:
            f[f"{name}.cublas_over_limit"] = figure(r["cublas_over_limit"], "ratio", "lower")
        if "fused_over_unfused" in r:
            f[f"{name}.fused_over_unfused"] = figure(r["fused_over_unfused"], "ratio", "lower")
        # Programmatic dependent launch (sm_90+ runs only), and the plain kernel's tensor-core
        # tile at one row (runs since the FMA path took M = 1), the fused kernel's (since
        # its one-row prologue could feed it), and cuBLASLt beside cuBLAS.
        for col in ("cublaslt", "skinny_pdl", "fused_pdl", "skinny_mma", "fused_mma",
                    "skinny_whole", "fused_whole"):
            if col in r["us"]:
                f[f"{name}.{col}_us"] = figure(r["us"][col], "us", "lower")
    return f


def vmm(p: dict[str, Any]) -> Figures:
    return {"growth_us_per_chunk": figure(p["growth_us_per_chunk"], "us", "lower"),
            "release_plus_recommit_s": figure(p["release_plus_recommit_s"], "s", "lower"),
            "vmm_gbps": figure(p["vmm_gbps"], "GB/s", "higher"),
            "bandwidth_ratio": figure(p["bandwidth_ratio"], "ratio", "higher")}


def adversarial(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    ran: dict[tuple[str, str], int] = {}
    for sweep in p.get("sweeps") or []:
        key = (sweep["model"], sweep["margin"])
        ran[key] = ran.get(key, 0) + sum("skipped" not in r for r in sweep["runs"])
    for s in p.get("summaries") or _summaries_of_runs(p):
        if ran.get((s["model"], s["margin"])) == 0:
            # Every run skipped (the deadline passed first): its zero OOMs, errors and guard
            # events were never measured, so the sweep claims nothing.
            continue
        name = f"{s['model']}.{s['margin']}"
        # Kept over the worst need seen: a fall toward 1 is safety lost (below 1 is an OOM).
        # None where every run of the sweep was skipped (a deadline): no figure then.
        if s["worst_kept_over_peak_need"] is not None:
            f[f"{name}.worst_kept_over_peak_need"] = figure(s["worst_kept_over_peak_need"],
                                                            "ratio", "higher")
        for k in ("ooms", "errors", "guard_events"):
            f[f"{name}.{k}"] = figure(s[k], "count", "lower")
    return f


def _summaries_of_runs(p: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-(model, margin) summaries from the runs themselves, for a result whose run was
    stopped before the bench wrote its summaries."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for sweep in p.get("sweeps") or []:
        runs = [r for r in sweep["runs"] if "need_reserved" in r]
        groups.setdefault((sweep["model"], sweep["margin"]), []).extend(runs)
    ratios = {key: [r["kept_over_need"] for r in runs if r.get("kept_over_need")]
              for key, runs in groups.items()}
    return [{"model": model, "margin": margin,
             "worst_kept_over_peak_need": min(ratios[model, margin], default=None),
             "ooms": sum(bool(r.get("oom")) for r in runs),
             "errors": sum(bool(r.get("error")) for r in runs),
             "guard_events": sum(len(r.get("guard_events") or []) for r in runs)}
            for (model, margin), runs in groups.items()]


def bench_throughput(p: dict[str, Any]) -> Figures:
    return {k: figure(p[k], unit, "higher") for k, unit in (
        ("requests_per_s", "requests/s"), ("output_tokens_per_s", "tokens/s"),
        ("total_tokens_per_s", "tokens/s"))}


def bench_latency(p: dict[str, Any]) -> Figures:
    return {k: figure(v, "s", "lower") for k, v in p.items()
            if k.startswith("latency_") and k.endswith("_s") and k != "latencies_s"}


def bench_serve(p: dict[str, Any]) -> Figures:
    f = {k: figure(p[k], unit, "higher") for k, unit in (
        ("request_throughput", "requests/s"), ("output_throughput", "tokens/s"))}
    measured = _measured_latencies(p)
    f |= {k: figure(v, "ms", "lower") for k, v in p.items()
          if k.endswith(("_ttft_ms", "_itl_ms", "_tpot_ms", "_e2el_ms"))
          and k.split("_")[1] in measured}
    f["failed"] = figure(p["failed"], "requests", "lower")
    return f


def kv_dtype(p: dict[str, Any]) -> Figures:
    f: Figures = {}
    for r in p.get("engine", []):
        name = r["kv_cache_dtype"]
        f[f"{name}.kv_blocks"] = figure(r["num_blocks"], "blocks", "higher")
        f[f"{name}.output_tokens_per_s"] = figure(r["throughput"]["output_tokens_per_s"],
                                                  "tokens/s", "higher")
        if "of_limit" in r["throughput"]:  # records before 2026-12-05b have no limit
            f[f"{name}.of_limit"] = figure(r["throughput"]["of_limit"], "fraction", "higher")
        for d in r["decode"]:
            f[f"{name}.decode.batch{d['batch']}.step_ms"] = figure(d["step_ms"], "ms", "lower")
    for key, value in (p.get("ratios") or {}).items():
        f[key] = figure(value, "ratio", "higher")
    for name, v in (p.get("accuracy") or {}).get("variants", {}).items():
        f[f"accuracy.{name}.next_token_agreement"] = figure(v["next_token_agreement"],
                                                            "fraction", "higher")
        f[f"accuracy.{name}.mean_kl"] = figure(v["mean_kl"], "nats", "lower")
        if "hf_top5" in v:
            f[f"accuracy.{name}.hf_top5"] = figure(v["hf_top5"], "fraction", "higher")
    return f


def determinism(p: dict[str, Any]) -> Figures:
    """The cost (share of the default mode's throughput lost) and, per model, the share of
    prompts bit-identical in the mode's worst case."""
    f: Figures = {}
    speeds = {t["mode"]: t["output_tokens_per_s"] for t in p["throughputs"]}
    if len(speeds) == 2:
        f["cost"] = figure(1 - speeds["deterministic"] / speeds["default"], "fraction", "lower")
        for mode, speed in speeds.items():
            f[f"{mode}.output_tokens_per_s"] = figure(speed, "tok/s", "higher")
    for check in p["checks"]:
        if check["mode"] == "deterministic":
            worst = min(check["identical"].values()) / check["prompts"]
            f[f"{check['model']}.identical"] = figure(worst, "fraction", "higher")
    return f


def device_limits(p: Any) -> Figures:
    """Copy bandwidth and GEMM throughput measured in the run (`limits.limit_keys`), those of
    them the payload has. `copy_gb_per_s` is the copy bandwidth sampling and attention
    published before every bench measured both (they keep it as their kernels' roofline)."""
    if not isinstance(p, dict):  # a sweep's list of configurations
        return {}
    f: Figures = {}
    for key in ("copy_bandwidth_gbps", "copy_gb_per_s"):
        if p.get(key) is not None:
            f["copy_gb_per_s"] = figure(p[key], "GB/s", "higher")
            break
    if p.get("gemm_tflops") is not None:
        f["gemm_tflops"] = figure(p["gemm_tflops"], "TFLOP/s", "higher")
    return f


def host_overhead(result: dict[str, Any]) -> Figures:
    """`bench/host_overhead.py`: host microseconds a step by phase, a token, a request."""
    f: Figures = {"python_ref_us": figure(result["python_ref_us"], "us", "lower")}
    for key, r in (("offline", result.get("offline")),
                   ("served.engine", result.get("served", {}).get("engine"))):
        if r is None:
            continue
        f[f"{key}.host_step_us"] = figure(r["host_step_us"], "us", "lower")
        f[f"{key}.host_us_per_token"] = figure(r["host_us_per_token"], "us", "lower")
        for phase, us in r["phases_us"].items():
            f[f"{key}.{phase}_us"] = figure(us, "us", "lower")
    if (h := result.get("http")) is not None:
        f["http.admit_us_per_request"] = figure(h["admit_us_per_request"], "us", "lower")
        f["http.stream_us_per_chunk"] = figure(h["stream_us_per_chunk"], "us", "lower")
        f["http.api_us_per_token"] = figure(h["api_us_per_token"], "us", "lower")
    if "served" not in result:
        return f
    api = result["served"]["api"]
    f["served.api.step_us"] = figure(api["step_us"], "us", "lower")
    f["served.api.us_per_token"] = figure(api["us_per_token"], "us", "lower")
    f["served.api.admit_us_per_request"] = figure(api["admit_us_per_request"], "us", "lower")
    return f


def no_figures(p: Any) -> Figures:
    """Tuning sweeps: tables of configurations, not claims."""
    return {}


FIGURES: dict[str, Callable[[Any], Figures]] = {
    "capacity": capacity, "throughput": throughput, "serving": serving, "sleep": sleep,
    "elastic": elastic, "elastic-pair": elastic_pair, "sampling": sampling,
    "attention": attention, "attention-batch-invariant": attention_batch_invariant,
    "attention-decode-input": attention_decode_input,
    "attention-mixed-decode": attention_mixed_decode, "vmm": vmm,
    "batch-invariant-gemm": batch_invariant_gemm, "skinny-linear": skinny_linear,
    "adversarial": adversarial, "sampling-sweep": no_figures, "attention-sweep": no_figures,
    "bench-throughput": bench_throughput, "bench-latency": bench_latency,
    "bench-serve": bench_serve, "async-engine": async_engine, "kv-dtype": kv_dtype,
    "determinism": determinism, "host-overhead": host_overhead,
}


def record_of(bench: str, payload: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The record of a run of `bench` (a `bench/` script or `kvfit bench ...`) on this machine:
    its payload, its figures and limits."""
    return make_record(bench, FIGURES[bench](payload), config, payload, device_limits(payload))


def _bench_of(data: Any, name: str) -> str:
    """Which bench wrote a published file: by its keys, the file name where they are alike."""
    if isinstance(data, list) and data and all(isinstance(row, dict) for row in data):
        return "sampling-sweep" if "filters" in name or "sampling" in name else "attention-sweep"
    if not isinstance(data, dict):  # a number, a string (whose `in` would match substrings)
        raise ValueError(f"{name}: not a record, nor a result file of a known bench "
                         f"(a JSON {type(data).__name__}, not an object)")
    for key, bench in (("timings", "batch-invariant-gemm"), ("cases", "attention-batch-invariant"),
                       ("decode_input", "attention-decode-input"),
                       ("mixed_decode", "attention-mixed-decode"),
                       ("kv_cache_dtypes", "kv-dtype"),
                       ("sweeps", "adversarial"), ("serve", "serving"), ("components", "sleep"),
                       ("samples", "elastic"), ("modes", "elastic-pair"), ("prefill", "attention"),
                       ("growth_gib", "vmm"), ("layers", "skinny-linear"),
                       ("throughput", "throughput"), ("copy_bandwidth_gbps", "throughput")):
        if key in data:
            return bench
    if "rows" in data and "offline" in data:
        return "async-engine"
    if "sampling" in data or "filters" in data:
        return "sampling"
    if "results" in data:
        return "capacity"
    raise ValueError(f"{name}: not a record, nor a result file of a known bench")


def adapt(data: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """A record of a result file written before records existed (docs/results/*.json).

    What the file does not say is None: its date comes from the `-YYYY-MM-DD` in its name.
    """
    name = Path(path).name
    bench = _bench_of(data, name)
    found = re.search(r"(\d{4}-\d{2}-\d{2})", name)
    info = data if isinstance(data, dict) else {}
    gpu = info.get("device") if info.get("device") not in (None, "cpu", "cuda") else None
    return {
        "schema_version": RECORD_SCHEMA_VERSION, "bench": bench,
        "date": info.get("date") or (found.group(1) if found else None),
        "git": {"revision": None, "dirty": None},
        "machine": {"gpu": gpu or info.get("device_name"), "gpu_memory_bytes": None,
                    "cpu": None, "host": None},
        "versions": {"python": None, "torch": info.get("torch"), "cuda": info.get("cuda"),
                     "driver": None, "triton": None, "transformers": None},
        "config": info.get("args", {}), "limits": device_limits(data),
        "figures": FIGURES[bench](data), "results": data,
    }
