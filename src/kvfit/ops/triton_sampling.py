"""Fused Gumbel-max sampling: one pass over each logits row, noise drawn inside the kernel.

Sampling token i with probability softmax(logits / T)_i is the same as taking the argmax of
`logits / T + g` with g i.i.d. Gumbel(0, 1) noise, so a row needs one streaming read with a
running (max, argmax) and no softmax, no noise tensor and no per-row generator. The noise of
column c of a row seeded s is a pure function of (s, c), so a row's token does not depend on
its batch mates, on the tile size or on how the vocabulary is split across programs.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kvfit.ops.sampling import MIN_TEMPERATURE, check_sample_inputs

BLOCK = 1024  # columns per tile (a [BLOCK // 4, 4] tile: one Philox call feeds 4 columns)
NUM_WARPS = 4
# Resident programs per SM that keep enough loads in flight to stream logits at memory speed;
# rows are split across programs until the grid reaches this many.
PROGRAMS_PER_SM = 8
_2_POW_M32 = tl.constexpr(2.0**-32)
_LN2 = tl.constexpr(math.log(2))
_LOG2E = tl.constexpr(1 / math.log(2))
_MIN_T = tl.constexpr(MIN_TEMPERATURE)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    # One MUFU instruction instead of libdevice's ~12-FMA polynomial: the logs are most of the
    # kernel's arithmetic. The interpreter has no libdevice.
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _gumbel(seed, counter, j, FAST_LOG: tl.constexpr):
    """Gumbel noise, scaled by log2(e), `[Q, 4]` of columns `4 * counter + j`: from word j of
    Philox(seed, counter), one Philox call (`counter` is `[Q, 1]`) for four columns."""
    r0, r1, r2, r3 = tl.randint4x(seed, counter)
    bits = tl.where(j == 0, r0, tl.where(j == 1, r1, tl.where(j == 2, r2, r3)))
    # u in (0, 1), never 0; exact where it is small.
    u = (bits.to(tl.float32) + 0.5) * _2_POW_M32
    # E = -ln(1 - u) ~ Exp(1), taken as log1p (the 1 - y term undoes y's rounding) so small E,
    # which is Gumbel's upper tail and so decides the winners, keeps full precision.
    y = 1.0 - u
    e = tl.where(y == 1.0, u, _log2(y, FAST_LOG) * (u / (y - 1.0)) * _LN2)
    return -_log2(e, FAST_LOG)


# tiles_per_split follows the row count: not specialised, or a new row count could compile anew.
# Neither is has_thresholds, so calls with and without thresholds share one compiled kernel.
@triton.jit(do_not_specialize=["tiles_per_split", "has_thresholds"])
def _gumbel_argmax_kernel(
    logits, temperature, seeds, thresholds, split_max, split_argmax,
    stride_n, stride_v, vocab_size, tiles_per_split, has_thresholds,
    BLOCK: tl.constexpr,
    FAST_LOG: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temperature + row)
    seed = tl.load(seeds + row)
    sample = t > 0  # temperature <= 0: greedy, no noise
    # Columns below the row's threshold are out (-inf). Greedy rows and absent thresholds get
    # -inf, which leaves every value as it was: the same bits as without thresholds.
    floor = tl.load(thresholds + row, mask=sample & (has_thresholds != 0), other=float("-inf"))
    # Scores in base 2, (x / T + g) * log2(e): same argmax, and log2 is the cheap log.
    scale = _LOG2E / tl.where(sample, tl.maximum(t, _MIN_T), 1.0)
    q = tl.arange(0, BLOCK // 4)[:, None]
    j = tl.arange(0, 4)[None, :]
    row_logits = logits + row.to(tl.int64) * stride_n
    best = tl.full((BLOCK // 4, 4), float("-inf"), tl.float32)
    best_col = tl.zeros((BLOCK // 4, 4), tl.int32)
    start = split * tiles_per_split * BLOCK
    for tile in range(tiles_per_split):
        counter = (start + tile * BLOCK) // 4 + q
        cols = 4 * counter + j
        x = tl.load(row_logits + cols * stride_v, mask=cols < vocab_size, other=float("-inf"))
        x = x.to(tl.float32)
        x = tl.where(x < floor, float("-inf"), x)
        score = tl.where(sample, x * scale + _gumbel(seed, counter, j, FAST_LOG), x)
        # Strict `>`: each lane keeps its first maximum; -inf and NaN never replace anything.
        better = score > best
        best = tl.where(better, score, best)
        best_col = tl.where(better, cols, best_col)
    top = tl.max(best)
    # The lowest column among lanes holding the maximum: ties go to the first index, as in
    # torch.argmax. A row of only -inf leaves every lane at column 0 (any index is valid).
    col = tl.min(tl.where(best == top, best_col, vocab_size))
    out = row * tl.num_programs(1) + split
    tl.store(split_max + out, top)
    tl.store(split_argmax + out, col.to(tl.int64))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the Triton interpreter on CPU tensors
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(num_rows: int, num_tiles: int, device: torch.device) -> int:
    wanted = triton.cdiv(PROGRAMS_PER_SM * _num_sms(device), num_rows)
    return max(1, min(wanted, num_tiles))


def gumbel_sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    thresholds: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    block: int = BLOCK,
    num_warps: int = NUM_WARPS,
) -> torch.Tensor:
    """One token id per row of `logits` `[N, V]` (bf16/fp16/fp32, any strides): the argmax over
    columns c of `logits[n, c] / temperature[n] + g(seeds[n], c)`, with g Gumbel noise from
    Philox, i.e. a sample from softmax(logits[n] / temperature[n]). Rows with temperature <= 0
    take the plain argmax. -inf logits never win unless the whole row is -inf. With
    `thresholds` (`[N]` float32, see `filter_thresholds`), sampled rows draw only among columns
    with `logits[n, c] >= thresholds[n]`.

    `temperature` is `[N]` float32 and `seeds` `[N]` int64; the same seed and logits give the
    same token. `num_splits` (programs per row, default: enough to fill the GPU), `block` and
    `num_warps` are tuning knobs that never change the result. Returns `[N]` int64.
    """
    check_sample_inputs(logits, temperature, seeds, thresholds)
    num_rows, vocab_size = logits.shape
    if block < 4 or block & (block - 1):
        raise ValueError(f"block must be a power of two >= 4, got {block}")
    if num_rows == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    num_tiles = triton.cdiv(vocab_size, block)
    splits = num_splits or _num_splits(num_rows, num_tiles, logits.device)
    tiles_per_split = triton.cdiv(num_tiles, splits)
    splits = triton.cdiv(num_tiles, tiles_per_split)  # no split left without a tile
    split_max = torch.empty(num_rows, splits, dtype=torch.float32, device=logits.device)
    split_argmax = torch.empty(num_rows, splits, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(num_rows, splits)](
        logits, temperature, seeds,
        temperature if thresholds is None else thresholds,  # float32 [N]: never read if None
        split_max, split_argmax,
        *logits.stride(), vocab_size, tiles_per_split, int(thresholds is not None),
        BLOCK=block, FAST_LOG=not triton.knobs.runtime.interpret, num_warps=num_warps,
    )  # fmt: skip
    if splits == 1:
        return split_argmax.view(num_rows)
    # Splits hold consecutive column ranges, so the first split with the maximum (argmax's tie
    # rule) holds the first column with it.
    return split_argmax.gather(1, split_max.argmax(dim=1, keepdim=True)).view(num_rows)
