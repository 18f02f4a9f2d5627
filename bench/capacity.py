"""KV cache capacity, startup time and the adversarial workload: measured sizing vs the estimate.

    python3 bench/capacity.py --out capacity.json                     # on the GPU machine
    python3 bench/capacity.py --device cpu --models kvfit-tiny --max-model-len 256 \\
        --max-num-seqs 4 --num-prompts 8 --max-tokens 4 --out c.json

Per model (dummy weights), side by side in one process:
- capacity and startup: engines built with measured sizing (the default) and by the estimate at
  gpu_memory_utilization 0.92 (`enable_extensible_kv_cache=False`), `--startup-rounds` times
  each, alternating, after one untimed engine that compiles the kernels; startup is the fastest
  construction to ready. Each engine is shut down
  before the next, and the device memory free afterwards is checked against before it.
- adversarial workload on the measured engine, default margins: prompts of random tokens up to
  max_model_len, more of them than max_num_seqs so the batch runs full, sampling with
  logprobs=20 and prompt_logprobs=20, run to completion. The peak true need is the allocator's
  peak (reserved: what it took from the device, fragmentation included; and allocated) above
  the live allocations at ready, against the headroom sizing kept (transient + margin), which
  is also read at ready (free + torch's idle reserve). Any out-of-memory error is recorded.
Targets (issue 6): >= 7% more KV blocks than the estimate; startup <= 0.8x; zero OOM.
On the CPU the host monitor stands in for the allocator (resident memory, KV pages excluded).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import time
from typing import Any

import psutil
import torch

from kvfit import LLM, SamplingParams
from kvfit.kv.monitor import CudaMemoryMonitor, HostMemoryMonitor, MemoryMonitor
from kvfit.kv.report import format_bytes

MiB = 1 << 20
# Memory a shut-down engine may leave behind (allocator rounding, library state) and still count
# as having returned everything.
RETURN_TOLERANCE = 64 * MiB


def _free_memory(device: torch.device) -> int:
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
    report = llm.kv_cache_report
    return {"method": report.method, "num_blocks": report.num_blocks,
            "kv_bytes": report.committed_bytes, "transient": report.transient,
            "margin": report.margin, "budget": report.budget, "startup_s": startup_s}


def shut_down(llm: LLM, free_before: int) -> dict[str, Any]:
    """Shut `llm` down; whether the device got back what it took."""
    device = llm.config.device
    llm.shutdown()
    del llm
    free_after = _free_memory(device)
    return {"free_before": free_before, "free_after": free_after,
            "returned": free_after >= free_before - RETURN_TOLERANCE}


def monitor_for(llm: LLM) -> MemoryMonitor:
    if llm.config.device.type == "cuda":
        return CudaMemoryMonitor(llm.config.device)
    return HostMemoryMonitor(llm.config.cache_config.cpu_kv_cache_space_bytes)


def _kv_resident() -> int:
    """Host: resident KV pages (shared memory), which the run touches and the peak includes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"^RssShmem:\s+(\d+) kB", f.read(), re.MULTILINE)[1]) * 1024


def spy_batch_sizes(llm: LLM) -> list[int]:
    """The size of every batch `llm` schedules from now on (does the batch run full?)."""
    sizes: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule() -> Any:
        batch = schedule()
        if batch is not None:
            sizes.append(len(batch))
        return batch

    llm.engine.scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return sizes


def adversarial(llm: LLM, num_prompts: int, max_tokens: int, seed: int) -> dict[str, Any]:
    """Long random prompts with logprobs and prompt logprobs, run to completion on `llm`."""
    rng = random.Random(seed)
    mc = llm.config.model_config
    vocab, longest = mc.hf_config.vocab_size, mc.max_model_len - max_tokens
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]}
               for length in (rng.randint(longest // 2, longest) for _ in range(num_prompts))]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=mc.max_logprobs, prompt_logprobs=mc.max_logprobs)
    batch_sizes = spy_batch_sizes(llm)
    monitor = monitor_for(llm)
    cuda = llm.config.device.type == "cuda"
    ready = monitor.snapshot()
    monitor.reset_peak()
    oom, start = None, time.perf_counter()
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        # Library workspaces that fail to allocate surface as RuntimeErrors (CUBLAS, cuDNN).
        if not isinstance(error, torch.OutOfMemoryError) and "ALLOC_FAILED" not in str(error):
            raise
        oom = str(error).splitlines()[0]
    if cuda:
        torch.cuda.synchronize(llm.config.device)
        peak_reserved = torch.cuda.max_memory_reserved(llm.config.device)
        peak_allocated = torch.cuda.max_memory_allocated(llm.config.device)
    else:
        peak_reserved = peak_allocated = monitor.step_peak().reserved_peak - _kv_resident()
    report = llm.kv_cache_report
    kept = report.transient + report.margin
    # Memory torch holds idle at ready is headroom too: sizing counted it as free.
    need_reserved = max(0, peak_reserved - ready.torch_allocated)
    return {"num_prompts": num_prompts, "max_batch": max(batch_sizes, default=0),
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in prompts),
            "elapsed_s": time.perf_counter() - start, "headroom_kept": kept,
            "headroom_at_ready": ready.usable_free,
            "need_reserved": need_reserved,
            "need_allocated": max(0, peak_allocated - ready.torch_allocated),
            "used_fraction": need_reserved / kept, "oom": oom}


def bench_model(args: argparse.Namespace, model: str, num_prompts: int) -> dict[str, Any]:
    """Capacity, startup and the adversarial run of one model."""
    device = torch.device(args.device)
    rows: dict[str, list[dict[str, Any]]] = {"measured": [], "estimate": []}
    adversarial_row: dict[str, Any] | None = None
    if args.warmup:
        # One untimed engine first: Triton compiles its kernels (and CUDA loads its libraries)
        # once per process, which would otherwise be charged to whichever path starts first.
        free_before = _free_memory(device)
        shut_down(build(args, model, None)[0], free_before)
    for round_ in range(args.startup_rounds):
        # Alternate which path goes first, so neither always pays for cold kernel caches.
        order = ("measured", "estimate") if round_ % 2 == 0 else ("estimate", "measured")
        for path in order:
            free_before = _free_memory(device)
            llm, startup_s = build(args, model, None if path == "measured" else False)
            row = sizing_row(llm, startup_s)
            if path == "measured" and adversarial_row is None:
                adversarial_row = adversarial(llm, num_prompts, args.max_tokens, args.seed)
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
        "adversarial": adversarial_row,
    }


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
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
    print_table("Adversarial workload (target: zero OOM)",
                ["model", "prompts", "max batch", "prompt tokens", "headroom kept", "free at ready",
                 "peak need reserved", "peak need allocated", "used", "OOM"],
                [[r["model"], str(a["num_prompts"]), str(a["max_batch"]),
                  f"{a['prompt_tokens']:,}",
                  format_bytes(a["headroom_kept"]), format_bytes(a["headroom_at_ready"]),
                  format_bytes(a["need_reserved"]),
                  format_bytes(a["need_allocated"]), f"{100 * a['used_fraction']:.0f}%",
                  a["oom"] or "none"]
                 for r in results if (a := r["adversarial"]) is not None])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b-shape", "qwen3-8b-shape"])
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[256, 96],
                        help="adversarial prompts per model (one value, or one per model)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens generated per adversarial prompt")
    parser.add_argument("--startup-rounds", type=int, default=2)
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="build one untimed engine per model first (kernel compilation)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if len(args.num_prompts) not in (1, len(args.models)):
        parser.error("--num-prompts takes one value or one per model")
    if args.max_tokens >= args.max_model_len // 2:
        parser.error("--max-tokens must be below half of --max-model-len")
    num_prompts = args.num_prompts * len(args.models) if len(args.num_prompts) == 1 \
        else args.num_prompts
    results = [bench_model(args, model, n) for model, n in zip(args.models, num_prompts,
                                                               strict=True)]
    device = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    with open(args.out, "w") as f:
        json.dump({"device": device, "args": vars(args), "results": results}, f, indent=2)
    print_tables(results)


if __name__ == "__main__":
    main()
