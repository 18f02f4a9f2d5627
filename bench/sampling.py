"""Sampling one token per logits row on the GPU: today's Sampler torch math vs the fused kernel.

    PYTHONPATH=src python3 bench/sampling.py --out sampling.json
    PYTHONPATH=src python3 bench/sampling.py --out sampling_sweep.json --sweep

Bf16 logits `[N, V]` over Qwen3's vocabulary, every row sampling at temperature 0.8 (no top-k or
top-p: both paths would share that sort). The torch path is timed with no row seeded and with
every row seeded (a generator per row, as seeded requests get today). The kernel's logits read
is reported against device copy bandwidth (bytes read + written) measured in the same run.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch
from triton.testing import do_bench

from kvfit.ops.triton_sampling import gumbel_sample_triton

QWEN3_VOCAB = 151936
SWEEP_TILES = [(512, 4), (1024, 4), (2048, 4), (2048, 8), (4096, 8)]  # (block, num_warps)
SWEEP_SPLITS = [None, 1, 2, 4, 8, 16, 32, 64, 149]


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


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (do_bench(lambda: dst.copy_(src), return_mode="median") * 1e-3)


def inputs(num_rows: int, vocab_size: int) -> tuple[torch.Tensor, ...]:
    logits = torch.randn(num_rows, vocab_size, device="cuda").mul_(3).bfloat16()
    temperature = torch.full((num_rows,), 0.8, device="cuda")
    seeds = torch.randint(-(2**62), 2**62, (num_rows,), device="cuda")
    return logits, temperature, seeds


def bench_row(num_rows: int, vocab_size: int, copy_bw: float) -> dict:
    logits, temperature, seeds = inputs(num_rows, vocab_size)
    generator = torch.Generator("cuda").manual_seed(0)
    token_seeds = list(enumerate(seeds.tolist()))

    torch_ms, seeded_ms, kernel_ms = (
        do_bench(fn, return_mode="median")
        for fn in (
            partial(sampler_torch, logits, temperature, [], generator),
            partial(sampler_torch, logits, temperature, token_seeds, generator),
            partial(gumbel_sample_triton, logits, temperature, seeds),
        )
    )
    read_bw = logits.nbytes / (kernel_ms * 1e-3)
    return dict(
        num_rows=num_rows,
        vocab_size=vocab_size,
        torch_ms=torch_ms,
        torch_seeded_ms=seeded_ms,
        kernel_ms=kernel_ms,
        speedup=torch_ms / kernel_ms,
        speedup_seeded=seeded_ms / kernel_ms,
        kernel_gb_per_s=read_bw / 1e9,
        frac_of_copy=read_bw / copy_bw,
    )


def sweep(batches: list[int], vocab_size: int) -> list[dict]:
    """Kernel time per (block, num_warps, num_splits), to choose the launcher's defaults
    (`num_splits` None is the default split rule)."""
    rows = []
    for num_rows in batches:
        logits, temperature, seeds = inputs(num_rows, vocab_size)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--vocab-size", type=int, default=QWEN3_VOCAB)
    parser.add_argument("--sweep", action="store_true", help="time kernel configs, not the table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    if args.sweep:
        with open(args.out, "w") as f:
            json.dump(sweep(args.batches, args.vocab_size), f, indent=2)
        return

    copy_bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  bf16 logits  vocab {args.vocab_size}")
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(f"{'N':>5} {'torch ms':>9} {'seeded ms':>10} {'kernel ms':>10} {'speedup':>8} "
          f"{'seeded':>7} {'GB/s':>6} {'of copy':>8}")  # fmt: skip
    rows = []
    for num_rows in args.batches:
        r = bench_row(num_rows, args.vocab_size, copy_bw)
        rows.append(r)
        print(
            f"{num_rows:>5} {r['torch_ms']:>9.3f} {r['torch_seeded_ms']:>10.3f} "
            f"{r['kernel_ms']:>10.4f} {r['speedup']:>7.1f}x {r['speedup_seeded']:>6.1f}x "
            f"{r['kernel_gb_per_s']:>6.0f} {r['frac_of_copy']:>8.0%}",
            flush=True,
        )
    result = dict(device=torch.cuda.get_device_name(), copy_gb_per_s=copy_bw / 1e9, sampling=rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
