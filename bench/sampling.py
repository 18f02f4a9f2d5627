"""Sampling one token per logits row on the GPU: today's Sampler torch math vs the fused kernel,
greedy decoding's argmax (torch's against the one-launch kernel), and the top-k / top-p /
min-p filters: the former sort path vs per-row thresholds.

    PYTHONPATH=src python3 bench/sampling.py --out sampling.json
    PYTHONPATH=src python3 bench/sampling.py --out sampling_sweep.json --sweep
    PYTHONPATH=src python3 bench/sampling.py --out filters_sweep.json --sweep-filters
    PYTHONPATH=src python3 bench/sampling.py --out sampling_cpu.json --device cpu

Bf16 logits `[N, V]` over Qwen3's vocabulary, every row sampling at temperature 0.8. The first
table has no filters: the torch path is timed with no row seeded and with every row seeded (a
generator per row, as seeded requests get today); the kernel's logits read is reported against
device copy bandwidth (bytes read + written) measured in the same run. The filter table times,
at `--filter-rows` rows, the sort path (float copy, sort, softmax, cumsum, scatter, then the
draw) against `filter_thresholds` + `gumbel_sample`, with each one's peak extra memory as a
fraction of the logits' bytes. `--device cpu` runs both tables on the torch paths at small
sizes (wall-clock medians; no kernel, no bandwidth), as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.ops import argmax_scratch, filter_thresholds, greedy_argmax, gumbel_sample
from kvfit.ops.memwatch import watch_memory
from kvfit.ops.reference import sort_filter_reference

try:
    from triton.testing import do_bench
except ImportError:  # --device cpu times with wall-clock repeats
    do_bench = None

QWEN3_VOCAB = 151936
SWEEP_TILES = [(512, 4), (1024, 4), (2048, 4), (2048, 8), (4096, 8)]  # (block, num_warps)
SWEEP_SPLITS = [None, 1, 2, 4, 8, 16, 32, 64, 149]
SWEEP_FILTERS = [  # (chunk, num_warps, candidates, float64 masses) of the filter kernel
    (2048, 4, 16, True),
    (2048, 4, 16, False),
    (1024, 4, 16, True),
    (1024, 2, 16, True),
    (2048, 8, 16, True),
    (4096, 4, 16, True),
    (4096, 8, 16, True),
    (8192, 8, 16, True),
    (2048, 4, 32, True),
    (2048, 4, 8, True),
]
# (label, top_k, top_p, min_p) of every row in a filter-table row; None: that filter is off.
FILTER_SETTINGS = [
    ("k50 p0.9", 50, 0.9, None),
    ("p0.95", None, 0.95, None),
    ("min_p0.05", None, None, 0.05),
    ("k50 p0.9 min_p0.05", 50, 0.9, 0.05),
    ("k1000 p0.99", 1000, 0.99, None),
]


def sampler_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    token_seeds: list[tuple[int, int]],
    generator: torch.Generator,
) -> torch.Tensor:
    """The exponential race as `kvfit.engine.sampler.Sampler._sample` runs it at commit 71f058c
    (without top-k/top-p): float copy, divide, softmax, Exp(1) noise, a generator per seeded
    `(row, seed)`, divide, argmax."""
    probs = (logits.float() / temperature[:, None]).softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for row, seed in token_seeds:
        noise[row].exponential_(generator=torch.Generator(probs.device).manual_seed(seed))
    return probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax(dim=-1)


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median milliseconds of `fn`: `do_bench` on CUDA, wall-clock repeats elsewhere."""
    if device.type == "cuda":
        return do_bench(fn, return_mode="median")
    fn()  # warm
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def inputs(num_rows: int, vocab_size: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device).manual_seed(0)
    logits = torch.randn(num_rows, vocab_size, device=device, generator=gen).mul_(3).bfloat16()
    temperature = torch.full((num_rows,), 0.8, device=device)
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), device=device, generator=gen)
    return logits, temperature, seeds


def bench_row(num_rows: int, vocab_size: int, copy_bw: float | None, device: torch.device) -> dict:
    logits, temperature, seeds = inputs(num_rows, vocab_size, device)
    generator = torch.Generator(device).manual_seed(0)
    token_seeds = list(enumerate(seeds.tolist()))

    torch_ms, seeded_ms, kernel_ms = (
        median_ms(fn, device)
        for fn in (
            partial(sampler_torch, logits, temperature, [], generator),
            partial(sampler_torch, logits, temperature, token_seeds, generator),
            partial(gumbel_sample, logits, temperature, seeds),
        )
    )
    # Greedy decoding: torch's one-block-a-row argmax against the one-launch split kernel.
    scratch = argmax_scratch(num_rows, device)
    argmax_torch_ms, argmax_ms = (median_ms(fn, device) for fn in (
        partial(torch.argmax, logits, dim=-1), partial(greedy_argmax, logits, scratch)))
    read_bw = logits.nbytes / (kernel_ms * 1e-3)
    return dict(
        num_rows=num_rows,
        vocab_size=vocab_size,
        torch_ms=torch_ms,
        torch_seeded_ms=seeded_ms,
        kernel_ms=kernel_ms,
        argmax_torch_ms=argmax_torch_ms,
        argmax_kernel_ms=argmax_ms,
        speedup=torch_ms / kernel_ms,
        speedup_seeded=seeded_ms / kernel_ms,
        kernel_gb_per_s=read_bw / 1e9,
        frac_of_copy=None if copy_bw is None else read_bw / copy_bw,
    )


def sort_path(logits, temperature, seeds, top_k, top_p, min_p) -> torch.Tensor:
    """The former sampler: filter a float32 copy of logits / T by sorting, then draw at T = 1."""
    filtered = sort_filter_reference(logits, temperature, top_k, top_p, min_p)
    return gumbel_sample(filtered, torch.ones_like(temperature), seeds)


def threshold_path(logits, temperature, seeds, top_k, top_p, min_p) -> torch.Tensor:
    thresholds = filter_thresholds(logits, temperature, top_k, top_p, min_p)
    return gumbel_sample(logits, temperature, seeds, thresholds)


def peak_fraction(fn: Callable[[], object], logits: torch.Tensor) -> float:
    """Peak memory allocated by one call above what was live before it, / the logits' bytes."""
    with watch_memory(logits.device) as watch:
        fn()
    return watch.peak_bytes / logits.nbytes


def filter_row(label: str, num_rows: int, vocab_size: int, filters: tuple,
               device: torch.device) -> dict:  # fmt: skip
    logits, temperature, seeds = inputs(num_rows, vocab_size, device)
    top_k, top_p, min_p = (
        None if v is None else torch.full((num_rows,), v, dtype=dtype, device=device)
        for v, dtype in zip(filters, (torch.int64, torch.float32, torch.float32), strict=True)
    )
    args = (logits, temperature, seeds, top_k, top_p, min_p)
    sort_ms, thr_ms, filter_ms = (
        median_ms(fn, device)
        for fn in (
            partial(sort_path, *args),
            partial(threshold_path, *args),
            partial(filter_thresholds, logits, temperature, top_k, top_p, min_p),
        )
    )
    return dict(
        setting=label,
        num_rows=num_rows,
        vocab_size=vocab_size,
        sort_ms=sort_ms,
        threshold_ms=thr_ms,
        filter_thresholds_ms=filter_ms,
        speedup=sort_ms / thr_ms,
        sort_peak_of_logits=peak_fraction(partial(sort_path, *args), logits),
        threshold_peak_of_logits=peak_fraction(partial(threshold_path, *args), logits),
    )


def filter_table(num_rows: int, vocab_size: int, device: torch.device) -> list[dict]:
    print(f"filters: {num_rows} rows x {vocab_size} bf16, T 0.8; sort path vs thresholds "
          "(peak extra memory / logits bytes)")  # fmt: skip
    print(f"{'setting':>20} {'sort ms':>9} {'thr ms':>8} {'filter ms':>10} {'speedup':>8} "
          f"{'sort mem':>9} {'thr mem':>8}")  # fmt: skip
    rows = []
    for label, *filters in FILTER_SETTINGS:
        r = filter_row(label, num_rows, vocab_size, tuple(filters), device)
        rows.append(r)
        print(
            f"{label:>20} {r['sort_ms']:>9.3f} {r['threshold_ms']:>8.3f} "
            f"{r['filter_thresholds_ms']:>10.3f} {r['speedup']:>7.1f}x "
            f"{r['sort_peak_of_logits']:>9.3f} {r['threshold_peak_of_logits']:>8.4f}",
            flush=True,
        )
    return rows


def sweep(batches: list[int], vocab_size: int) -> list[dict]:
    """Kernel time per (block, num_warps, num_splits), to choose the launcher's defaults
    (`num_splits` None is the default split rule)."""
    from kvfit.ops.triton_sampling import gumbel_sample_triton  # CUDA only

    rows = []
    for num_rows in batches:
        logits, temperature, seeds = inputs(num_rows, vocab_size, torch.device("cuda"))
        for block, num_warps in SWEEP_TILES:
            for splits in SWEEP_SPLITS:
                run = partial(gumbel_sample_triton, logits, temperature, seeds,
                              num_splits=splits, block=block, num_warps=num_warps)  # fmt: skip
                ms = do_bench(run, return_mode="median")
                row = dict(num_rows=num_rows, block=block, num_warps=num_warps,
                           num_splits=splits, ms=ms)  # fmt: skip
                rows.append(row)
                print(f"{num_rows:>5} {block:>6} {num_warps:>3} {splits!s:>5} {ms:>8.4f} ms",
                      flush=True)  # fmt: skip
    return rows


def sweep_filters(num_rows: int, vocab_size: int) -> list[dict]:
    """Filter kernel time per (chunk, num_warps, candidates) and setting, to choose the
    defaults of `kvfit.ops.triton_filters`; every config must give the default's thresholds."""
    from kvfit.ops.triton_filters import filter_thresholds_triton  # CUDA only

    device = torch.device("cuda")
    logits, temperature, _ = inputs(num_rows, vocab_size, device)
    rows = []
    searches = [s for s in FILTER_SETTINGS if s[3] is None]  # not the closed-form min-p
    for label, *values in searches:
        filters = [None if v is None else torch.full((num_rows,), v, dtype=dtype, device=device)
                   for v, dtype in zip(values, (torch.int64, torch.float32, torch.float32),
                                       strict=True)]  # fmt: skip
        expect = filter_thresholds_triton(logits, temperature, *filters)
        for chunk, num_warps, candidates, f64 in SWEEP_FILTERS:
            run = partial(filter_thresholds_triton, logits, temperature, *filters, chunk=chunk,
                          num_warps=num_warps, candidates=candidates, mass_float64=f64)  # fmt: skip
            same = bool(torch.equal(run(), expect))
            ms = do_bench(run, return_mode="median")
            rows.append(dict(setting=label, num_rows=num_rows, chunk=chunk,
                             num_warps=num_warps, candidates=candidates, mass_float64=f64,
                             ms=ms, same=same))  # fmt: skip
            print(f"{label:>20} {chunk:>5} {num_warps:>3} {candidates:>3} "
                  f"{'f64' if f64 else 'f32'} {ms:>8.4f} ms{'' if same else '  DIFFERS'}",
                  flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--batches", type=int, nargs="+", help="default 1 64 256 (cpu: 4)")
    parser.add_argument("--vocab-size", type=int, help=f"default {QWEN3_VOCAB} (cpu: 4096)")
    parser.add_argument("--filter-rows", type=int, help="rows of the filter table (default "
                        "256, cpu: 8; 0: no filter table)")  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="time kernel configs, not the table")
    parser.add_argument("--sweep-filters", action="store_true",
                        help="time filter kernel configs at --filter-rows rows, not the tables")
    args = parser.parse_args()
    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    if on_cuda and not torch.cuda.is_available():
        parser.error("needs a CUDA device (or --device cpu)")
    if on_cuda and do_bench is None:
        parser.error("--device cuda times the Triton kernels and needs Triton (pip install "
                     "'kvfit[cuda]'), or run --device cpu")
    batches = args.batches or ([1, 64, 256] if on_cuda else [4])
    vocab_size = args.vocab_size or (QWEN3_VOCAB if on_cuda else 4096)
    filter_rows = (256 if on_cuda else 8) if args.filter_rows is None else args.filter_rows
    if args.sweep_filters:
        if not on_cuda:
            parser.error("--sweep-filters times the CUDA kernel")
        write_record(args.out, record_of("sampling-sweep", sweep_filters(filter_rows, vocab_size),
                                         vars(args)))
        return
    if args.sweep:
        if not on_cuda:
            parser.error("--sweep times the CUDA kernel")
        write_record(args.out, record_of("sampling-sweep", sweep(batches, vocab_size), vars(args)))
        return

    # The record's limits; `copy_bw` stays the rows' roofline, timed by do_bench as they are.
    limits = in_run_limits(device)
    copy_bw = copy_bandwidth() if on_cuda else None
    name = torch.cuda.get_device_name() if on_cuda else "cpu (torch paths)"
    print(f"{name}  bf16 logits  vocab {vocab_size}")
    if copy_bw is not None:
        print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(f"{'N':>5} {'torch ms':>9} {'seeded ms':>10} {'kernel ms':>10} {'speedup':>8} "
          f"{'seeded':>7} {'GB/s':>6} {'of copy':>8} {'argmax torch':>13} "
          f"{'one launch':>11}")  # fmt: skip
    rows = []
    for num_rows in batches:
        r = bench_row(num_rows, vocab_size, copy_bw, device)
        rows.append(r)
        of_copy = "" if r["frac_of_copy"] is None else f"{r['frac_of_copy']:.0%}"
        print(
            f"{num_rows:>5} {r['torch_ms']:>9.3f} {r['torch_seeded_ms']:>10.3f} "
            f"{r['kernel_ms']:>10.4f} {r['speedup']:>7.1f}x {r['speedup_seeded']:>6.1f}x "
            f"{r['kernel_gb_per_s']:>6.0f} {of_copy:>8} {r['argmax_torch_ms']:>13.4f} "
            f"{r['argmax_kernel_ms']:>11.4f}",
            flush=True,
        )
    filters = filter_table(filter_rows, vocab_size, device) if filter_rows else []
    result = dict(device=name, copy_gb_per_s=None if copy_bw is None else copy_bw / 1e9,
                  sampling=rows, filters=filters, **limits)  # fmt: skip
    write_record(args.out, record_of("sampling", result, vars(args)))


if __name__ == "__main__":
    main()
