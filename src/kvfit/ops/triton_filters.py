"""Top-k, top-p and min-p as one logit threshold per row, found without sorting the vocabulary.

Every filter keeps a top prefix of the row, so each is a threshold: top-k's is the k-th largest
logit, min-p's is closed form, top-p's is the logit where the mass at or above it reaches top_p.
The kernel finds them by bisection over each value's order-preserving integer key (16-bit keys
for bf16/fp16, 32-bit for fp32): a pass over the row counts (or weighs) the keys at or above
CANDIDATES cut points at once and keeps the sub-interval holding the answer, so a 16-bit
search takes at most 4 passes and usually fewer (it starts on the row's [min, max] keys). Only
keys inside the current interval need the per-cut test, so after the first pass most tiles
skip it. One program per row loops over the row in tiles; the row (300 KB of bf16 at a 152k
vocabulary) is re-read from L2, and the only memory written is the [N] output.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvfit.ops.sampling import check_filter_inputs

# Columns per tile, cut points per pass (4 bits of the key per pass over the row) and warps.
# ptxas for sm_90: 120 registers, no spills, so two programs fit an SM and 256 rows run in one
# wave on an H200; a [1024, 16] float64 accumulator at 8 warps spills. Untimed: see
# `bench/sampling.py --sweep-filters`.
BLOCK = 256
CANDIDATES = 16
NUM_WARPS = 8
_LOG2E = tl.constexpr(1 / math.log(2))
_INT32_MIN = tl.constexpr(-(2**31))
_INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _keys(x, KEY_BITS: tl.constexpr):
    """int32 keys in the order of the float values; -0.0 and 0.0 share a key."""
    if KEY_BITS == 16:
        bits = x.to(tl.int16, bitcast=True).to(tl.int32)
        bits = tl.where(bits == -32768, 0, bits)
        # Negative floats order backwards as integers: flipping all but the sign bit fixes that.
        return bits ^ ((bits >> 31) & 0x7FFF)
    else:
        bits = x.to(tl.int32, bitcast=True)
        bits = tl.where(bits == _INT32_MIN, 0, bits)
        return bits ^ ((bits >> 31) & _INT32_MAX)


@triton.jit
def _key_value(key, DTYPE: tl.constexpr, KEY_BITS: tl.constexpr):
    """The float32 value of a `_keys` key of a `DTYPE` value (the inverse map)."""
    key = key.to(tl.int32)
    if KEY_BITS == 16:
        bits = key ^ ((key >> 31) & 0x7FFF)
        return bits.to(tl.int16).to(DTYPE, bitcast=True).to(tl.float32)
    else:
        bits = key ^ ((key >> 31) & _INT32_MAX)
        return bits.to(tl.float32, bitcast=True)


@triton.jit
def _search(
    row_logits, stride_v, vocab_size, num_tiles, lo, hi, target, fraction, floor, top, scale,
    MASS: tl.constexpr, KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, CANDIDATES: tl.constexpr,
    MASS_F64: tl.constexpr,
):  # fmt: skip
    """The largest key t in [lo, hi) with W(key >= t) >= target. W counts the row's keys, or with
    MASS sums exp((x - top) / T) over the x >= floor; a negative target means `fraction` x
    W(key >= lo). Needs W(>= lo) >= target and W(>= hi) < target."""
    d = tl.arange(0, CANDIDATES)
    cols = tl.arange(0, BLOCK)
    while hi - lo > 1:
        step = (hi - lo + CANDIDATES - 1) // CANDIDATES
        cand = tl.minimum(lo + d * step, hi)  # int64: hi - lo may not fit an int32
        cut = cand.to(tl.int32)
        lo32 = lo.to(tl.int32)
        last = (hi - 1).to(tl.int32)  # hi itself may be 2**31
        # W(>= cut) = W(inside [lo, hi) and >= cut) + W(>= hi). Only the keys inside need a
        # test per cut, and after the first pass few are: tiles without one skip that work.
        # Per lane, summed over tiles: one reduction per pass, not per tile. Masses are summed
        # in float64, so no summation order (tile size, the torch path's) moves the threshold;
        # counts in int32, exactly.
        if MASS and MASS_F64:
            acc = tl.zeros((BLOCK, CANDIDATES), tl.float64)
            above = tl.zeros((BLOCK,), tl.float64)
        elif MASS:
            acc = tl.zeros((BLOCK, CANDIDATES), tl.float32)
            above = tl.zeros((BLOCK,), tl.float32)
        else:
            acc = tl.zeros((BLOCK, CANDIDATES), tl.int32)
            above = tl.zeros((BLOCK,), tl.int32)
        for tile in range(num_tiles):
            c = tile * BLOCK + cols
            x = tl.load(row_logits + c * stride_v, mask=c < vocab_size, other=float("-inf"))
            key = _keys(x, KEY_BITS)
            if MASS:
                xf = x.to(tl.float32)
                w = tl.where(xf >= floor, tl.exp2((xf - top) * scale), 0.0)
                if MASS_F64:
                    w = w.to(tl.float64)
                counted = w > 0
            else:
                w = (c < vocab_size).to(tl.int32)
                counted = c < vocab_size
            above += tl.where(key > last, w, 0)
            inside = counted & (key >= lo32) & (key <= last)
            if tl.max(inside.to(tl.int32), axis=0) > 0:
                at_or_above = inside[:, None] & (key[:, None] >= cut[None, :])
                acc += tl.where(at_or_above, w[:, None], 0)
        totals = tl.sum(acc, axis=0).to(tl.float64) + tl.sum(above, axis=0).to(tl.float64)
        # Candidate 0 is lo, so its total is W(>= lo): the whole mass on the first pass.
        whole = tl.sum(tl.where(d == 0, totals, 0.0))
        target = tl.where(target < 0, fraction.to(tl.float64) * whole, target)
        ok = ((totals >= target) | (d == 0)) & (cand < hi)
        new_lo = tl.max(tl.where(ok, cand, lo))
        hi = tl.min(tl.where(~ok & (cand > new_lo), cand, hi))
        lo = new_lo
    return lo


# The has_* flags say whether a filter tensor was given; specialised, each mix of filters
# would compile its own kernel the first time a batch used it.
@triton.jit(do_not_specialize=["has_top_k", "has_top_p", "has_min_p"])
def _filter_threshold_kernel(
    logits, temperature, top_k, top_p, min_p, thresholds,
    stride_n, stride_v, vocab_size, has_top_k, has_top_p, has_min_p,
    KEY_BITS: tl.constexpr, BLOCK: tl.constexpr, CANDIDATES: tl.constexpr,
    MASS_F64: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t = tl.load(temperature + row)
    k = tl.load(top_k + row, mask=has_top_k != 0, other=vocab_size).to(tl.int32)
    p = tl.load(top_p + row, mask=has_top_p != 0, other=1.0)
    min_p_ = tl.load(min_p + row, mask=has_min_p != 0, other=0.0)
    on_k = k < vocab_size
    on_p = p < 1.0
    active = (t > 0) & (on_k | on_p | (min_p_ > 0.0))
    # Inactive rows (greedy or unfiltered) read nothing: every loop runs zero times.
    num_tiles = tl.where(active, tl.cdiv(vocab_size, BLOCK), 0)
    row_logits = logits + row.to(tl.int64) * stride_n
    cols = tl.arange(0, BLOCK)

    x_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    key_min = tl.full((BLOCK,), _INT32_MAX, tl.int32)
    key_max = tl.full((BLOCK,), _INT32_MIN, tl.int32)
    for tile in range(num_tiles):
        c = tile * BLOCK + cols
        valid = c < vocab_size
        x = tl.load(row_logits + c * stride_v, mask=valid, other=float("-inf"))
        key = _keys(x, KEY_BITS)
        x_max = tl.maximum(x_max, x.to(tl.float32))
        key_min = tl.minimum(key_min, tl.where(valid, key, _INT32_MAX))
        key_max = tl.maximum(key_max, tl.where(valid, key, _INT32_MIN))
    top = tl.max(x_max)
    lo = tl.min(key_min).to(tl.int64)
    hi = tl.max(key_max).to(tl.int64) + 1
    scale = _LOG2E / tl.where(t > 0, t, 1.0)
    dtype = logits.dtype.element_ty

    # top-k: the k-th largest value is the largest key with at least k keys at or above it.
    lo_k = _search(row_logits, stride_v, vocab_size, num_tiles, lo, tl.where(on_k, hi, lo + 1),
                   k.to(tl.float64), p, top, top, scale,
                   False, KEY_BITS, BLOCK, CANDIDATES, MASS_F64)  # fmt: skip
    t_k = tl.where(on_k, _key_value(lo_k, dtype, KEY_BITS), float("-inf"))
    t_min_p = top + t * tl.log(min_p_)  # -inf where min-p is off
    t_s = tl.maximum(t_k, t_min_p)  # S = {x >= t_s}: both filters keep a top prefix
    # top-p over S, searched from a key at or below S's smallest: one below t_min_p's key once
    # rounded to the logits' dtype (rounding moves it by at most one key).
    lo_p = tl.maximum(lo_k, _keys(t_min_p.to(dtype), KEY_BITS).to(tl.int64) - 1)
    lo_p = _search(row_logits, stride_v, vocab_size, num_tiles, lo_p,
                   tl.where(on_p, hi, lo_p + 1), p.to(tl.float64) * 0.0 - 1.0, p, t_s, top, scale,
                   True, KEY_BITS, BLOCK, CANDIDATES, MASS_F64)  # fmt: skip
    t_p = tl.where(on_p, _key_value(lo_p, dtype, KEY_BITS), float("-inf"))
    thr = tl.maximum(t_s, t_p)
    tl.store(thresholds + row, tl.where(active & (top > float("-inf")), thr, float("-inf")))


@functools.cache
def _absent(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in for a filter tensor that is None (never read), of a fixed dtype so that
    passing None does not change the kernel's signature."""
    return torch.zeros(1, dtype=dtype, device=device)


def filter_thresholds_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    block: int = BLOCK,
    candidates: int = CANDIDATES,
    num_warps: int = NUM_WARPS,
    mass_float64: bool = True,
) -> torch.Tensor:
    """`kvfit.ops.sampling.filter_thresholds` as one Triton program per row. `block`,
    `candidates` (powers of two >= 2) and `num_warps` are tuning knobs that never change the
    result. `mass_float64=False` sums top-p's masses per lane in float32 (an experiment: the
    result may then differ from the torch path's where a mass lies within rounding of top_p).
    Extra memory: the `[N]` float32 output only."""
    check_filter_inputs(logits, temperature, top_k, top_p, min_p)
    for name, value in (("block", block), ("candidates", candidates)):
        if value < 2 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 2, got {value}")
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    device = logits.device
    _filter_threshold_kernel[(num_rows,)](
        logits, temperature,
        # One dtype whether top_k is given or not (int32, as the engine passes it): a second
        # would compile a second kernel.
        _absent(device, torch.int32) if top_k is None else top_k.int(),
        _absent(device, torch.float32) if top_p is None else top_p,
        _absent(device, torch.float32) if min_p is None else min_p,
        out, *logits.stride(), vocab_size,
        int(top_k is not None), int(top_p is not None), int(min_p is not None),
        KEY_BITS=8 * logits.element_size(), BLOCK=block, CANDIDATES=candidates,
        MASS_F64=mass_float64, num_warps=num_warps,
    )  # fmt: skip
    return out
