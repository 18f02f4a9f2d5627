"""KV cache capacity and startup time: measured sizing vs the estimate.

    python3 bench/capacity.py --out capacity.json                     # on the GPU machine
    python3 bench/capacity.py --device cpu --models kvfit-tiny --max-model-len 256 \\
        --max-num-seqs 4 --startup-rounds 1 --out c.json

Per model (dummy weights), side by side in one process:
- capacity and startup: engines built with measured sizing (the default) and by the estimate at
  gpu_memory_utilization 0.92 (`enable_extensible_kv_cache=False`), `--startup-rounds` times
  each, alternating, after one untimed engine that compiles the kernels; startup is the fastest
  construction to ready. Each engine is shut down before the next, and the device memory free
  afterwards is checked against before it.
- startup stages: each round's `LLM.startup_stages` (seconds per stage and the engine's total)
  in its row, and per path the median of each stage over the rounds (`stages_measured`,
  `stages_estimate`), printed as a table.
Targets: >= 7% more KV blocks than the estimate; startup <= 0.8x.
The adversarial workload (every sampling feature at a full batch, long prompts, out-of-memory
errors and guard events) is bench/adversarial.py, which imports this module's helpers.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import psutil
import torch

from kvfit import LLM
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import bench_device, in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.kv.report import format_bytes

MiB = 1 << 20
# Memory a shut-down engine may leave behind (allocator rounding, library state) and still count
# as having returned everything.
RETURN_TOLERANCE = 64 * MiB


def free_memory(device: torch.device) -> int:
    """Device memory free now, after dropping what torch caches (host: available memory)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def _engine_args(args: argparse.Namespace, model: str, extensible: bool | None) -> dict[str, Any]:
    """The same engine for both paths but the sizing; margins and utilization left default."""
    return dict(model=model, device=args.device, load_format="dummy",
                max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                enable_extensible_kv_cache=extensible, enforce_eager=args.enforce_eager)


def build(args: argparse.Namespace, model: str, extensible: bool | None) -> tuple[LLM, float]:
    """An engine and the seconds its construction took to ready."""
    start = time.perf_counter()
    llm = LLM(**_engine_args(args, model, extensible))
    if llm.config.device.type == "cuda":
        torch.cuda.synchronize(llm.config.device)
    return llm, time.perf_counter() - start


def sizing_row(llm: LLM, startup_s: float) -> dict[str, Any]:
    """How `llm`'s cache was sized, and how long the engine took to ready."""
    report = llm.kv_cache_report
    return {"method": report.method, "num_blocks": report.num_blocks,
            "kv_bytes": report.committed_bytes, "transient": report.transient,
            "margin": report.margin, "budget": report.budget, "startup_s": startup_s,
            "total": report.total, "weights": report.weights, "non_torch": report.non_torch,
            "graphs_and_buffers": report.graphs_and_buffers, "stages": llm.startup_stages}


def median_stages(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each stage's median seconds over `runs`, in the order the stages ran (a stage some
    rounds lack, graph capture where one fell back to eager, over the rounds that have it)."""
    names = list(dict.fromkeys(name for r in runs for name in r["stages"]))
    return {name: statistics.median(r["stages"][name] for r in runs if name in r["stages"])
            for name in names}


def shut_down(llm: LLM, free_before: int) -> dict[str, Any]:
    """Shut `llm` down; whether the device got back what it took."""
    device = llm.config.device
    llm.shutdown()
    del llm
    free_after = free_memory(device)
    return {"free_before": free_before, "free_after": free_after,
            "returned": free_after >= free_before - RETURN_TOLERANCE}


def bench_model(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Capacity and startup of one model."""
    device = torch.device(args.device)
    rows: dict[str, list[dict[str, Any]]] = {"measured": [], "estimate": []}
    if args.warmup:
        # One untimed engine first: Triton compiles its kernels (and CUDA loads its libraries)
        # once per process, which would otherwise be charged to whichever path starts first.
        free_before = free_memory(device)
        shut_down(build(args, model, None)[0], free_before)
    for round_ in range(args.startup_rounds):
        # Alternate which path goes first, so neither always pays for cold kernel caches.
        order = ("measured", "estimate") if round_ % 2 == 0 else ("estimate", "measured")
        for path in order:
            free_before = free_memory(device)
            llm, startup_s = build(args, model, None if path == "measured" else False)
            row = sizing_row(llm, startup_s)
            row.update(shut_down(llm, free_before))
            rows[path].append(row)
            print(f"{model} round {round_} {path}: {row['num_blocks']:,} blocks, "
                  f"ready in {startup_s:.2f} s, memory returned: {row['returned']}", flush=True)
    best = {path: min(r["startup_s"] for r in runs) for path, runs in rows.items()}
    measured, estimate = rows["measured"][0], rows["estimate"][0]
    return {
        "model": model, "rounds": rows, "measured": measured, "estimate": estimate,
        "blocks_gain": measured["num_blocks"] / estimate["num_blocks"] - 1,
        "startup_measured_s": best["measured"], "startup_estimate_s": best["estimate"],
        "startup_ratio": best["measured"] / best["estimate"],
        "memory_returned": all(r["returned"] for runs in rows.values() for r in runs),
        "stages_measured": median_stages(rows["measured"]),
        "stages_estimate": median_stages(rows["estimate"]),
    }


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    """`rows` under `header`, columns aligned: the first left, the rest right."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    for line in (header, *rows):
        print("  ".join(cell.rjust(w) if i else cell.ljust(w)
                        for i, (cell, w) in enumerate(zip(line, widths, strict=True))))


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def print_tables(results: list[dict[str, Any]]) -> None:
    print_table("KV capacity (target: >= +7% blocks)",
                ["model", "measured", "estimate 0.92", "gain", "measured KV", "estimate KV"],
                [[r["model"], f"{r['measured']['num_blocks']:,}",
                  f"{r['estimate']['num_blocks']:,}", _pct(r["blocks_gain"]),
                  format_bytes(r["measured"]["kv_bytes"]), format_bytes(r["estimate"]["kv_bytes"])]
                 for r in results])
    print_table("Startup to ready (target: ratio <= 0.8)",
                ["model", "measured s", "estimate s", "ratio", "memory returned"],
                [[r["model"], f"{r['startup_measured_s']:.2f}", f"{r['startup_estimate_s']:.2f}",
                  f"{r['startup_ratio']:.2f}", str(r["memory_returned"])] for r in results])
    names = list(dict.fromkeys(name for r in results for path in ("measured", "estimate")
                               for name in r[f"stages_{path}"]))
    print_table("Startup stages, s (median over the rounds)", ["model", "sizing", *names],
                [[r["model"], path, *(f"{r[f'stages_{path}'][n]:.3f}"
                                      if n in r[f"stages_{path}"] else "-" for n in names)]
                 for r in results for path in ("measured", "estimate")])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--device", default="cuda", type=bench_device)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b-shape", "qwen3-8b-shape"])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--startup-rounds", type=int, default=2)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="build one untimed engine per model first (kernel compilation)")
    parser.add_argument("--enforce-eager", action="store_true")
    args = parser.parse_args(argv)
    limits = in_run_limits(args.device)  # before the engines: they size from free memory
    results = [bench_model(args, model) for model in args.models]
    device = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    write_record(args.out, record_of("capacity", {"device": device, "args": vars(args),
                                                  "results": results, **limits}, vars(args)))
    print_tables(results)


if __name__ == "__main__":
    main()
