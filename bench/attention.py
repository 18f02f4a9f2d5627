"""Paged attention on the GPU: decode bandwidth vs a device copy, prefill vs contiguous SDPA.

    PYTHONPATH=src python3 bench/attention.py --out attn.json
    PYTHONPATH=src python3 bench/attention.py --kv-cache-dtype fp8 --out attn_fp8.json
    PYTHONPATH=src python3 bench/attention.py --sweep --kv-cache-dtype fp8 --num-heads 16 \
        --num-kv-heads 8 --out $OUT/attn-sweep-fp8.json  # tiles, splits, and the fp8 dots' dtype
    PYTHONPATH=src python3 bench/attention.py --batch-invariant --num-heads 16 --num-kv-heads 8 \\
        --batches 256 --contexts 1024 --out $OUT/attn-bi.json     # the deterministic mode
    PYTHONPATH=src python3 bench/attention.py --decode-input --num-heads 16 --num-kv-heads 8 \\
        --batches 1 4 16 64 256 --contexts 1024 --out $OUT/attn-di.json  # the fused input

Decode is memory bound, so it is reported as KV bytes read per second against the bandwidth of a
device-to-device copy (bytes read + written) measured in the same run. Prefill is reported as
attention TFLOP/s against torch's scaled_dot_product_attention on the same sequences laid out
contiguously (no paging, KV heads pre-expanded): an upper bound. On Hopper torch's SDPA
picks cuDNN's fused attention, not FlashAttention-2 (torch's own FlashAttention-2 ran at 52-61%
of it on an H100, below the paged kernel: docs/benchmarks.md, 2026-12-06). `--kv-cache-dtype
fp8` reads an e4m3 cache (scales 1.0, float16 compute as the engine's) with the same queries;
its KV bytes are one per value; `--sweep` adds each fp8 path side by side (`fp8_compute_rows`).

`--batch-invariant`: what attention costs in the deterministic mode, where the prefill kernel
runs every row (`batch_invariant=True`: no split-KV, a decode row in a tile of BLOCK_M query
rows of which only its GQA group is real). At each `--batches` x `--contexts` decode case: the
default path (split-KV decode kernel + reduction) against the mode's, each with its share of
the copy bandwidth, and the mode's kernel with other BLOCK_M (`--bi-block-m`, the current
BLOCK_N and warps kept) with a bit check against the mode's current output: a BLOCK_M that
gives the same bits can run the mode's decode-only steps without breaking invariance. Plus one
prefill case (`BI_PREFILL`) in both modes, with the same candidates: one other BLOCK_M for
every row of the mode keeps invariance by construction (one tile config for all rows, as
today: 16, from this bench's 2026-12-04 run), and the two cases' candidate times give what it
would cost prefill and save decode. The command above (qwen3-0.6b-shape's heads) should take
well under a minute on an H200 (an estimate: the copy-bandwidth measure, ~10 timed kernels of
~0.2 s, a few Triton compiles).

`--decode-input`: one layer's decode attention with its input (Qwen3's q/k norms, rotary, the
new token's K/V store) at each `--batches` x `--contexts` case, three ways, as the kernels'
device time (`kernel_us`, L2 flushed): `attention_input` then `paged_attention` (three
kernels: input, decode, split reduction), the fused `decode_attention` with the reduction as
its own kernel, and with it in the launch (`split_tickets`, as the engine runs it). The
difference is what the engine's `--fused-decode-input` saves a layer, before the graph's
per-node cost.

`--mixed-decode`: decode over sequences of mixed lengths (uniform in 100-`--mixed-max-len`,
seeded), as the engine's batches hold them, at each `--batches`, with the programs started in
three orders: the batch's, longest programs first (`kvfit.ops.decode_order`, the engine's),
and shortest first (the worst case). KV bytes over time against the copy bandwidth, as the
table's decode rows.

    PYTHONPATH=src python3 bench/attention.py --mixed-decode --num-heads 16 --num-kv-heads 8 \\
        --batches 64 128 256 --out $OUT/attn-mixed.json
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.ops.attention import AttentionMetadata

try:
    from triton.testing import do_bench

    from kvfit.ops.decode_order import decode_order
    from kvfit.ops.sm_count import num_sms
    from kvfit.ops.triton_attention import paged_attention_triton
except ImportError as e:
    raise SystemExit(f"bench/attention.py times the Triton kernels, so it needs Triton and a "
                     f"CUDA device (pip install 'kvfit[cuda]'): {e}") from None

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BI_PREFILL = (8, 1024)
"""(sequences, tokens each) of `--batch-invariant`'s prefill case: a mixed step's prefill rows
at the default 8192-token step budget."""
PREFILL_SWEEP = [
    dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=st)
    for bm, bn, w, st in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                          (128, 128, 8, 2)]
]  # fmt: skip
DECODE_SWEEP = [
    dict(BLOCK_N=bn, num_warps=w, num_stages=st)
    for bn, w, st in [(64, 4, 3), (64, 4, 2), (128, 4, 3), (128, 8, 3), (32, 4, 4), (64, 8, 4),
                      (128, 8, 2)]
] + [
    # The fp8 pairs kernel at 128 tokens and 4 warps fits 128 registers when capped (168
    # uncapped; 8 bytes spilled, outside its loops), so 4 programs per SM as at BLOCK_N 64, with
    # fewer instructions per KV byte (sm_90: `tools/triton_sass.py --cache-dtype fp8
    # --block-n 128 --maxnreg 128`).
    dict(BLOCK_N=128, num_warps=4, num_stages=3, maxnreg=128),
]  # fmt: skip


@dataclass
class Shape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def paged_cache(shape: Shape, num_tokens: int,
                cache_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-outermost cache `[blocks, 2, block_size, kv_heads, head_dim]`: K and V views,
    in `cache_dtype` (default: the shape's)."""
    num_blocks = -(-num_tokens // shape.block_size)
    cache = torch.empty(
        num_blocks,
        2,
        shape.block_size,
        shape.num_kv_heads,
        shape.head_dim,
        dtype=shape.dtype,
        device="cuda",
    ).uniform_(-1, 1)
    if cache_dtype is not None and cache_dtype != shape.dtype:
        cache = cache.to(cache_dtype)
    return cache[:, 0], cache[:, 1]


def metadata(query_lens: list[int], seq_lens: list[int], block_size: int, num_blocks: int):
    """Sequences on randomly scattered blocks, as a long-running cache ends up."""
    blocks_per_seq = -(-max(seq_lens) // block_size)
    perm = torch.randperm(num_blocks, device="cuda")[: len(seq_lens) * blocks_per_seq]
    query_start_loc = torch.tensor([0, *query_lens], device="cuda").cumsum(0).int()
    return AttentionMetadata(
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64, device="cuda"),
        query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_table=perm.view(len(seq_lens), blocks_per_seq).int(),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )


def time_paged(shape: Shape, k_cache, v_cache, query_lens, seq_lens, timer=None,
               **overrides) -> float:
    """Median ms of one paged_attention_triton call (or what `timer(fn)` gives, as
    `kernel_us`); `overrides` go to the kernel launcher."""
    md = metadata(query_lens, seq_lens, shape.block_size, k_cache.shape[0])
    query = torch.randn(
        sum(query_lens), shape.num_heads, shape.head_dim, dtype=shape.dtype, device="cuda"
    )
    out = torch.empty_like(query)
    scale = shape.head_dim**-0.5
    overrides = {**_fp8_scales(k_cache), **overrides}

    def fn():
        return paged_attention_triton(query, k_cache, v_cache, md, scale, out, **overrides)

    return timer(fn) if timer else do_bench(fn, return_mode="median")


def kernel_us(fn, reps: int = 30) -> float:
    """Median device time in us of the kernels one `fn()` launches, from the profiler, with L2
    flushed before each call. A launch of few sequences runs shorter than its host launch
    takes, so do_bench's events around it time the host (the sweep's 1-16 x 1k rows varied
    2.5x between neighbouring split lengths); an engine step replays it from a CUDA graph."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.fill_(1)  # a fill kernel: the marker between calls
            fn()
        torch.cuda.synchronize()
    calls: list[float] = []
    for e in sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start):
        if re.search(r"fill|Memset", e.name, re.I):
            calls.append(0.0)
        elif calls:
            calls[-1] += e.time_range.elapsed_us()
    return statistics.median(calls)


def bench_decode(shape: Shape, k_cache, v_cache, batch: int, context: int, copy_bw: float):
    ms = time_paged(shape, k_cache, v_cache, [1] * batch, [context] * batch)
    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_dim * k_cache.element_size()
    bandwidth = kv_bytes / (ms * 1e-3)
    return dict(
        batch=batch,
        context=context,
        ms=ms,
        gb_per_s=bandwidth / 1e9,
        frac_of_copy=bandwidth / copy_bw,
    )


def mixed_decode_rows(shape: Shape, k_cache, v_cache, batches: list[int], max_len: int,
                      copy_bw: float, kv_cache_dtype: torch.dtype,
                      split_tokens: list[int]) -> list[dict]:
    """`--mixed-decode`: each batch's decode in three start orders (module docstring), then
    longest first at each of `split_tokens` (`--mixed-split-tokens`)."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    for batch in batches:
        seq_lens = torch.randint(100, max_len + 1, (batch,), generator=gen)
        md = metadata([1] * batch, seq_lens.tolist(), shape.block_size, k_cache.shape[0])
        query = torch.randn(batch, shape.num_heads, shape.head_dim, dtype=shape.dtype,
                            device="cuda")
        out = torch.empty_like(query)
        lpt = decode_order(seq_lens.numpy(), np.ones(batch, np.int64), shape.num_kv_heads,
                           shape.head_dim, kv_cache_dtype, num_sms(query.device))
        kv_bytes = (2 * int(seq_lens.sum()) * shape.num_kv_heads * shape.head_dim
                    * k_cache.element_size())
        row = dict(batch=batch, max_len=max_len, kv_gb=kv_bytes / 1e9)
        variants = [("batch", None, None), ("longest_first", lpt, None),
                    ("shortest_first", lpt[::-1].copy(), None)]
        variants += [(f"longest_first_split{t}", decode_order(
            seq_lens.numpy(), np.ones(batch, np.int64), shape.num_kv_heads, shape.head_dim,
            kv_cache_dtype, split_tokens=t), t) for t in split_tokens]
        for name, order, tokens in variants:
            md.decode_order = None if order is None else torch.from_numpy(order).cuda()
            ms = do_bench(lambda md=md, q=query, o=out, t=tokens: paged_attention_triton(
                q, k_cache, v_cache, md, shape.head_dim**-0.5, o, split_tokens=t,
                **_fp8_scales(k_cache)), return_mode="median")
            row[f"{name}_ms"] = ms
            row[f"{name}_of_copy"] = kv_bytes / (ms * 1e-3) / copy_bw
        rows.append(row)
        print(f"{batch:>6} {row['kv_gb']:>7.2f} " + " ".join(
            f"{row[v[0] + '_ms']:>9.4f} {row[v[0] + '_of_copy']:>5.0%}" for v in variants),
            flush=True)
    return rows


def time_sdpa(shape: Shape, batch: int, length: int) -> float:
    """Median ms of causal SDPA on contiguous sequences with KV heads pre-expanded."""
    q, k, v = (
        torch.randn(batch, shape.num_heads, length, shape.head_dim, dtype=shape.dtype,
                    device="cuda")
        for _ in range(3)
    )  # fmt: skip
    return do_bench(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=shape.head_dim**-0.5),
        return_mode="median",
    )


def bench_prefill(shape: Shape, k_cache, v_cache, batch: int, length: int):
    ms = time_paged(shape, k_cache, v_cache, [length] * batch, [length] * batch)
    sdpa_ms = time_sdpa(shape, batch, length)
    flops = 2 * 2 * batch * shape.num_heads * shape.head_dim * length * length / 2  # causal half
    return dict(
        batch=batch,
        length=length,
        ms=ms,
        sdpa_ms=sdpa_ms,
        tflops=flops / (ms * 1e-3) / 1e12,
        sdpa_tflops=flops / (sdpa_ms * 1e-3) / 1e12,
        frac_of_sdpa=sdpa_ms / ms,
    )


def decode_input_calls(shape: Shape, k_cache, v_cache, batch: int, context: int) -> dict:
    """The three ways of one layer's decode attention with its input, on one decode row per
    sequence at position `context - 1` (Qwen3's q/k norms, rotary, the new K/V's store)."""
    from kvfit.ops.attention import paged_attention
    from kvfit.ops.attention_input import attention_input, decode_attention
    from kvfit.ops.layers import RotaryEmbedding

    md = metadata([1] * batch, [context] * batch, shape.block_size, k_cache.shape[0])
    blocks = md.block_table.long()[:, (context - 1) // shape.block_size]
    md = dataclasses.replace(
        md, slot_mapping=blocks * shape.block_size + (context - 1) % shape.block_size)
    widths = [shape.num_heads * shape.head_dim, 2 * shape.num_kv_heads * shape.head_dim]
    q, kv = torch.randn(batch, sum(widths), dtype=shape.dtype, device="cuda").split(widths, -1)
    k, v = kv.view(batch, 2, shape.num_kv_heads, shape.head_dim).unbind(1)
    ones = torch.ones(shape.head_dim, dtype=shape.dtype, device="cuda")
    rope = RotaryEmbedding(shape.head_dim, context + 1, base=1e6).to("cuda")
    args = dict(positions=torch.full((batch,), context - 1, dtype=torch.int64, device="cuda"),
                q=q.view(batch, shape.num_heads, shape.head_dim), k=k, v=v,
                q_norm_weight=ones, k_norm_weight=ones, eps=1e-6,
                cos_sin_cache=rope.cos_sin_cache, k_cache=k_cache, v_cache=v_cache)
    scale = shape.head_dim**-0.5
    tickets = torch.zeros(batch * shape.num_kv_heads, dtype=torch.int32, device="cuda")
    with_tickets = dataclasses.replace(md, split_tickets=tickets)

    def unfused() -> torch.Tensor:
        x = attention_input(**args, slot_mapping=md.slot_mapping)
        return paged_attention(x, k_cache, v_cache, md, scale)

    return {"unfused": unfused,
            "fused": lambda: decode_attention(**args, metadata=md, scale=scale),
            "fused_tickets": lambda: decode_attention(**args, metadata=with_tickets,
                                                      scale=scale)}


def decode_input_rows(shape: Shape, k_cache, v_cache, cases: list[tuple[int, int]]
                      ) -> list[dict]:
    """`--decode-input`: the unfused pair against `decode_attention` with and without
    `split_tickets`, in kernel microseconds, at each (batch, context) of `cases`."""
    rows = []
    for batch, context in cases:
        calls = decode_input_calls(shape, k_cache, v_cache, batch, context)
        us = {name: kernel_us(fn) for name, fn in calls.items()}
        rows.append(dict(batch=batch, context=context, kernel_us=us))
        print(f"decode input {batch:>4} x {context:<6} " + "  ".join(
            f"{name} {t:7.1f} us" for name, t in us.items()), flush=True)
    return rows


def sweep(shape: Shape, k_cache, v_cache) -> list[dict]:
    """Tile configs and split counts at the target shapes, to choose the kernels' defaults."""
    rows = []
    for cfg in PREFILL_SWEEP:
        ms = time_paged(shape, k_cache, v_cache, [16384], [16384], prefill_config=cfg)
        rows.append(dict(case="prefill 1x16k", config=cfg, ms=ms))
    for cfg in DECODE_SWEEP:
        for batch, context in [(64, 4096), (1, 32768)]:
            ms = time_paged(shape, k_cache, v_cache, [1] * batch, [context] * batch,
                            decode_config=cfg)  # fmt: skip
            rows.append(dict(case=f"decode {batch}x{context}", config=cfg, ms=ms))
    # Fixed split lengths, then the default (None: `decode_split_tokens`, which shortens the
    # splits of a launch of few sequences), at those launches too.
    # `kernel_us`: the decode and reduction kernels' device time alone, which is what a graphed
    # step pays.
    for tokens in [64, 128, 256, 512, 1024, 2048, None]:
        for batch, context in [(64, 4096), (1, 32768), (1, 1024), (4, 1024), (16, 1024),
                               (64, 1024), (256, 1024)]:
            ms = time_paged(shape, k_cache, v_cache, [1] * batch, [context] * batch,
                            split_tokens=tokens)  # fmt: skip
            us = time_paged(shape, k_cache, v_cache, [1] * batch, [context] * batch,
                            timer=kernel_us, split_tokens=tokens)  # fmt: skip
            rows.append(dict(case=f"decode {batch}x{context}",
                             config=dict(split_tokens=tokens or "default"), ms=ms,
                             kernel_us=us))
    if k_cache.dtype == torch.float8_e4m3fn:
        rows += fp8_compute_rows(shape, k_cache, v_cache)
    for r in rows:
        kernels = f"{r['kernel_us']:>7.1f} us kernels" if "kernel_us" in r else ""
        print(f"{r['case']:>20} {r['ms']:>8.3f} ms {kernels} {r['config']}", flush=True)
    return rows


def fp8_compute_rows(shape: Shape, k_cache, v_cache) -> list[dict]:
    """An e4m3 cache by each path, at the default tile configs, side by side: tiles widened to
    the query's dtype, tiles widened to float16 (the engine's compute for a bf16 model), and
    float16 decode reading the pages as uint16 pairs of dims (the engine's decode kernel;
    prefill has one kernel, so its pairs row repeats the float16 one)."""
    paths = {str(shape.dtype).removeprefix("torch."): dict(fp8_compute_dtype=shape.dtype,
                                                           fp8_pairs=False),
             "float16": dict(fp8_compute_dtype=torch.float16, fp8_pairs=False),
             "float16 pairs": dict(fp8_compute_dtype=torch.float16, fp8_pairs=True)}
    rows = []
    for name, path in paths.items():
        for batch, context in [(64, 4096), (256, 1024), (1, 32768)]:
            ms = time_paged(shape, k_cache, v_cache, [1] * batch, [context] * batch, **path)
            rows.append(dict(case=f"decode {batch}x{context}", config=dict(fp8_compute=name),
                             ms=ms))
        if not path["fp8_pairs"]:
            ms = time_paged(shape, k_cache, v_cache, [16384], [16384], **path)
            rows.append(dict(case="prefill 1x16k", config=dict(fp8_compute=name), ms=ms))
    return rows


def _fp8_scales(k_cache: torch.Tensor) -> dict:
    """An e4m3 cache's launch arguments as the engine passes them: scales 1.0, and float16
    compute (`ops/attention.py`'s choice for a bf16 model; the query's own dtype otherwise)."""
    if k_cache.dtype != torch.float8_e4m3fn:
        return {}
    return {"k_scale": torch.ones(1, device="cuda"), "v_scale": torch.ones(1, device="cuda"),
            "fp8_compute_dtype": torch.float16}


def bench_batch_invariant(shape: Shape, k_cache, v_cache, case: str, batch: int, length: int,
                          block_ms: list[int], copy_bw: float) -> dict:
    """One case (`case` "decode": `batch` rows over `length` tokens of context; "prefill":
    `batch` sequences of `length` new tokens) in the default and the batch-invariant path,
    and the mode's kernel at each of `block_ms` with its bits against the mode's current
    output."""
    from kvfit.ops.triton_attention import _batch_invariant_config  # the mode's tiles

    query_lens = [1] * batch if case == "decode" else [length] * batch
    md = metadata(query_lens, [length] * batch, shape.block_size, k_cache.shape[0])
    query = torch.randn(sum(query_lens), shape.num_heads, shape.head_dim, dtype=shape.dtype,
                        device="cuda")
    scale, extra = shape.head_dim**-0.5, _fp8_scales(k_cache)

    def run(out: torch.Tensor, **kw) -> torch.Tensor:
        return paged_attention_triton(query, k_cache, v_cache, md, scale, out, **extra, **kw)

    def ms(**kw) -> float:
        out = torch.empty_like(query)
        return do_bench(lambda: run(out, **kw), return_mode="median")

    row = dict(case=case, batch=batch, length=length, default_ms=ms(),
               mode_ms=ms(batch_invariant=True))
    row["mode_over_default"] = row["mode_ms"] / row["default_ms"]
    if case == "decode":
        kv_bytes = (2 * batch * length * shape.num_kv_heads * shape.head_dim
                    * k_cache.element_size())
        row["default_frac_of_copy"] = kv_bytes / (row["default_ms"] * 1e-3) / copy_bw
        row["mode_frac_of_copy"] = kv_bytes / (row["mode_ms"] * 1e-3) / copy_bw
    current = _batch_invariant_config(shape.head_dim)
    row["mode_config"] = current
    reference = run(torch.empty_like(query), batch_invariant=True)
    row["candidates"] = []
    for bm in block_ms:
        cfg = {**current, "BLOCK_M": bm}
        got = run(torch.empty_like(query), batch_invariant=True, prefill_config=cfg)
        t = ms(batch_invariant=True, prefill_config=cfg)
        row["candidates"].append(dict(config=cfg, ms=t, over_default=t / row["default_ms"],
                                      same_bits_as_mode=torch.equal(got, reference)))
    return row


def print_batch_invariant(rows: list[dict]) -> None:
    print(f"{'case':>8} {'batch':>6} {'length':>7} {'default ms':>11} {'mode ms':>9} "
          f"{'mode/default':>12} {'default of copy':>15} {'mode of copy':>12}")
    for r in rows:
        copy = (f"{r['default_frac_of_copy']:>15.0%} {r['mode_frac_of_copy']:>12.0%}"
                if r["case"] == "decode" else "")
        print(f"{r['case']:>8} {r['batch']:>6} {r['length']:>7} {r['default_ms']:>11.3f} "
              f"{r['mode_ms']:>9.3f} {r['mode_over_default']:>12.2f} {copy}")
        for c in r.get("candidates", []):
            print(f"{'':>8} the mode at BLOCK_M {c['config']['BLOCK_M']:>3}: {c['ms']:.3f} ms "
                  f"({c['over_default']:.2f} x default), same bits as the mode's "
                  f"BLOCK_M {r['mode_config']['BLOCK_M']}: "
                  f"{'yes' if c['same_bits_as_mode'] else 'no'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON results path")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument(
        "--max-cache-gib",
        type=float,
        default=40.0,
        help="skip decode cases whose KV cache would exceed this",
    )
    parser.add_argument("--sweep", action="store_true", help="time tile configs, not the table")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the cache's dtype: auto = --dtype, fp8 = e4m3 (scales 1.0)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="decode (and one prefill case) in the default path vs the "
                             "deterministic mode's, not the table")
    parser.add_argument("--decode-input", action="store_true",
                        help="a layer's decode attention with its input, unfused and fused "
                             "(with and without the split reduction in the launch), not the "
                             "table")
    parser.add_argument("--mixed-decode", action="store_true",
                        help="decode over mixed lengths in three program orders, not the table")
    parser.add_argument("--mixed-max-len", type=int, default=2300,
                        help="--mixed-decode: the longest sequence (the shortest is 100)")
    parser.add_argument("--mixed-split-tokens", type=int, nargs="*", default=[],
                        help="--mixed-decode: also longest first at these split lengths "
                             "(65536: no split, no reduction kernel)")
    parser.add_argument("--bi-block-m", type=int, nargs="*", default=[128, 64, 32],
                        help="BLOCK_M values tried for the mode's decode rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    shape = Shape(
        args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, DTYPES[args.dtype]
    )
    token_bytes = 2 * shape.num_kv_heads * shape.head_dim * shape.dtype.itemsize
    cases = [
        (b, c)
        for b in args.batches
        for c in args.contexts
        if b * c * token_bytes <= args.max_cache_gib * 2**30
    ]
    # The record's limits; `copy_bw` stays the rows' roofline, timed by do_bench as they are.
    limits = ({} if args.sweep or args.decode_input or args.mixed_decode
              else in_run_limits("cuda"))
    cache_tokens = max(max(b * c for b, c in cases), 65536)
    cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else shape.dtype
    k_cache, v_cache = paged_cache(shape, cache_tokens, cache_dtype)
    copy_bw = copy_bandwidth()
    if args.sweep:
        write_record(args.out, record_of("attention-sweep", sweep(shape, k_cache, v_cache),
                                         vars(args)))
        return
    if args.mixed_decode:
        print(f"{torch.cuda.get_device_name()}  {args.dtype}  KV {args.kv_cache_dtype}  heads "
              f"{shape.num_heads}/{shape.num_kv_heads}; copy {copy_bw / 1e9:.0f} GB/s; "
              f"ms and share of copy: batch order, longest first, shortest first, then "
              f"longest first split at {args.mixed_split_tokens}")
        rows = mixed_decode_rows(shape, k_cache, v_cache, args.batches, args.mixed_max_len,
                                 copy_bw, cache_dtype, args.mixed_split_tokens)
        result = dict(device=torch.cuda.get_device_name(),
                      shape={**asdict(shape), "dtype": args.dtype,
                             "kv_cache_dtype": args.kv_cache_dtype},
                      copy_gb_per_s=copy_bw / 1e9, mixed_decode=rows)
        write_record(args.out, record_of("attention-mixed-decode", result, vars(args)))
        return
    if args.decode_input:
        rows = decode_input_rows(shape, k_cache, v_cache, cases)
        result = dict(device=torch.cuda.get_device_name(),
                      shape={**asdict(shape), "dtype": args.dtype}, decode_input=rows)
        write_record(args.out, record_of("attention-decode-input", result, vars(args)))
        return
    if args.batch_invariant:
        rows = [bench_batch_invariant(shape, k_cache, v_cache, "decode", b, c, args.bi_block_m,
                                      copy_bw) for b, c in cases]
        rows.append(bench_batch_invariant(shape, k_cache, v_cache, "prefill", *BI_PREFILL,
                                          args.bi_block_m, copy_bw))
        print(f"{torch.cuda.get_device_name()}  {args.dtype}  KV {args.kv_cache_dtype}  heads "
              f"{shape.num_heads}/{shape.num_kv_heads}  head_dim {shape.head_dim}; copy "
              f"bandwidth {copy_bw / 1e9:.0f} GB/s")
        print_batch_invariant(rows)
        result = dict(device=torch.cuda.get_device_name(),
                      shape={**asdict(shape), "dtype": args.dtype,
                             "kv_cache_dtype": args.kv_cache_dtype},
                      copy_gb_per_s=copy_bw / 1e9, cases=rows, **limits)
        write_record(args.out, record_of("attention-batch-invariant", result, vars(args)))
        return

    print(
        f"{torch.cuda.get_device_name()}  {args.dtype}  KV {args.kv_cache_dtype}  "
        f"heads {shape.num_heads}/"
        f"{shape.num_kv_heads}  head_dim {shape.head_dim}  block {shape.block_size}"
    )
    print(f"copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(f"{'decode batch':>12} {'context':>8} {'ms':>8} {'GB/s':>8} {'of copy':>8}")
    decode = []
    for b, c in cases:
        r = bench_decode(shape, k_cache, v_cache, b, c, copy_bw)
        decode.append(r)
        print(
            f"{b:>12} {c:>8} {r['ms']:>8.3f} {r['gb_per_s']:>8.0f} {r['frac_of_copy']:>8.0%}",
            flush=True,
        )
    print(
        f"{'prefill batch':>13} {'length':>7} {'ms':>8} {'TFLOP/s':>8} {'SDPA':>8} {'of SDPA':>8}"
    )
    prefill = []
    for b, n in [(1, 4096), (4, 4096), (1, 16384), (16, 1024)]:
        r = bench_prefill(shape, k_cache, v_cache, b, n)
        prefill.append(r)
        print(
            f"{b:>13} {n:>7} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['sdpa_tflops']:>8.1f} "
            f"{r['frac_of_sdpa']:>8.0%}",
            flush=True,
        )
    result = dict(
        device=torch.cuda.get_device_name(),
        shape={**asdict(shape), "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype},
        copy_gb_per_s=copy_bw / 1e9,
        decode=decode,
        prefill=prefill,
        **limits,
    )
    write_record(args.out, record_of("attention", result, vars(args)))


if __name__ == "__main__":
    main()
