"""Top-k, top-p and min-p as one logit threshold per row, found without sorting the vocabulary.

Every filter keeps a top prefix of the row, so each is a threshold: top-k's is the k-th largest
logit, min-p's is closed form, top-p's is the logit where the mass at or above it reaches top_p.
Both searches work on each value's order-preserving integer key (16-bit keys for bf16/fp16,
32-bit for fp32). Top-k is a radix select, a byte of the key per pass: each pass builds the
256-bin histogram of the next byte among the keys that share the bytes found so far, so a
16-bit key takes 2 passes. Top-p bisects: a pass weighs the keys at or above CANDIDATES cut
points at once and keeps the sub-interval holding the answer (4 passes of 16 cuts for 16 bits;
masses are floats, which integer atomics cannot sum, so each piece writes its own totals).

A row is split into CHUNK-column pieces, one program each, so that 256 rows x 152k columns run
as ~19k programs rather than 256 serial loops (the former one-program-per-row kernel was
latency bound at the speed of the sort it replaced). A pass is one launch: each piece adds its
histogram into the row's (`_radix_kernel`) or writes its totals per cut (`_mass_kernel`), and
the row's last piece to finish sums them in a fixed order (so the result is deterministic)
and narrows the row's search. The launch count is fixed by the key width, not by the data:
nothing syncs with the host, and rows that have converged skip their work. A piece whose
largest key is below the search reads nothing, so later passes read only the pieces holding
the row's top values.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from kvfit.ops.sampling import MIN_TEMPERATURE, check_filter_inputs
from kvfit.ops.triton_tickets import last_to_arrive

# Columns per program (one load), cut points per pass (4 bits of the key) and warps. Chosen by
# `bench/sampling.py --sweep-filters` on the H200.
CHUNK = 2048
CANDIDATES = 16
NUM_WARPS = 4
_LOG2E = tl.constexpr(1 / math.log(2))
_MIN_T = tl.constexpr(MIN_TEMPERATURE)
_INT32_MIN = tl.constexpr(-(2**31))
_INT32_MAX = tl.constexpr(2**31 - 1)
# Flags that say whether a filter tensor was given; specialised, each mix of filters would
# compile its own kernels the first time a batch used it.
_FLAGS = ["has_top_k", "has_top_p", "has_min_p"]


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
def _row_filters(row, temperature, top_k, top_p, min_p, vocab_size,
                 has_top_k, has_top_p, has_min_p):  # fmt: skip
    """Row `row`'s temperature and filters, which of them are on, and whether any is."""
    t = tl.load(temperature + row)
    k = tl.load(top_k + row, mask=has_top_k != 0, other=vocab_size).to(tl.int32)
    p = tl.load(top_p + row, mask=has_top_p != 0, other=1.0)
    m = tl.load(min_p + row, mask=has_min_p != 0, other=0.0)
    on_k = k < vocab_size
    on_p = p < 1.0
    return t, k, p, m, on_k, on_p, (t > 0) & (on_k | on_p | (m > 0.0))


@triton.jit
def _cuts(lo, hi, CANDIDATES: tl.constexpr):
    """CANDIDATES cut points evenly spaced over [lo, hi), clamped to hi (int64: hi - lo may not
    fit an int32); cut 0 is lo."""
    step = (hi - lo + CANDIDATES - 1) // CANDIDATES
    return tl.minimum(lo + tl.arange(0, CANDIDATES) * step, hi)


@triton.jit(do_not_specialize=_FLAGS)
def _key_range_kernel(
    logits, temperature, top_k, top_p, min_p, piece_max, partials,
    stride_n, stride_v, vocab_size, num_pieces, has_top_k, has_top_p, has_min_p,
    KEY_BITS: tl.constexpr, CHUNK: tl.constexpr, CANDIDATES: tl.constexpr,
):  # fmt: skip
    """Each piece's smallest and largest key: into `partials` (for the row's range) and into
    `piece_max` (so later passes skip pieces below their interval)."""
    row, piece = tl.program_id(0).to(tl.int64), tl.program_id(1)
    t, k, p, m, on_k, on_p, active = _row_filters(
        row, temperature, top_k, top_p, min_p, vocab_size, has_top_k, has_top_p, has_min_p
    )
    c = piece * CHUNK + tl.arange(0, CHUNK)
    # Inactive rows (greedy or unfiltered) read nothing.
    valid = c < tl.where(active, vocab_size, 0)
    key = _keys(tl.load(logits + row * stride_n + c * stride_v, mask=valid, other=0.0), KEY_BITS)
    key_max = tl.max(tl.where(valid, key, _INT32_MIN))
    at = row * num_pieces + piece
    tl.store(piece_max + at, key_max)
    tl.store(partials + at * CANDIDATES, tl.min(tl.where(valid, key, _INT32_MAX)).to(tl.float64))
    tl.store(partials + at * CANDIDATES + 1, key_max.to(tl.float64))


@triton.jit
def _radix_kernel(
    logits, select, piece_max, histogram, arrived, stride_n, stride_v, vocab_size, num_pieces,
    SHIFT: tl.constexpr, KEY_BITS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Top-k's radix pass at bit SHIFT: the 256-bin histogram of the digit (key >> SHIFT) & 255
    of the row's keys whose higher digits equal the row's prefix so far, added into the row's
    histogram (integer atomics, so the sum is exact in any order); the row's last piece to
    finish takes the digit."""
    row, piece = tl.program_id(0).to(tl.int64), tl.program_id(1)
    FIRST: tl.constexpr = SHIFT + 8 >= KEY_BITS
    prefix = tl.load(select + row * 3 + 1).to(tl.int32)  # key >> (SHIFT + 8) of the answer
    go = tl.load(select + row * 3 + 2) != 0
    if not FIRST:
        # A piece whose largest key has a smaller prefix holds no key of the set.
        go = go & ((tl.load(piece_max + row * num_pieces + piece) >> (SHIFT + 8)) >= prefix)
    if go:
        c = piece * CHUNK + tl.arange(0, CHUNK)
        valid = c < vocab_size
        key = _keys(tl.load(logits + row * stride_n + c * stride_v, mask=valid, other=0.0),
                    KEY_BITS)
        high = key >> SHIFT
        if FIRST:
            digit = high + 128  # the top digit is signed
            in_set = valid
        else:
            digit = high & 255
            in_set = valid & ((high >> 8) == prefix)
        h = tl.histogram(digit, 256, mask=in_set)
        tl.atomic_add(histogram + row * 256 + tl.arange(0, 256), h, mask=h > 0, sem="relaxed")
    if last_to_arrive(arrived, row, num_pieces):
        _take_digit(row, histogram, select, SHIFT, KEY_BITS)


@triton.jit
def _take_digit(row, histogram, select, SHIFT: tl.constexpr, KEY_BITS: tl.constexpr):
    """The digit of the k-th largest key: the largest d with at least k' keys of the set at
    digit >= d; k' drops by the keys above d. Clears the histogram for the next pass."""
    if tl.load(select + row * 3 + 2) != 0:
        bins = tl.arange(0, 256)
        h = tl.load(histogram + row * 256 + bins)
        tl.store(histogram + row * 256 + bins, tl.zeros((256,), tl.int32))
        need = tl.load(select + row * 3)
        at_or_above = tl.cumsum(h, axis=0, reverse=True).to(tl.int64)
        d = tl.max(tl.where(at_or_above >= need, bins, 0))
        above = tl.sum(tl.where(bins > d, h, 0)).to(tl.int64)
        tl.store(select + row * 3, need - above)
        if SHIFT + 8 >= KEY_BITS:
            prefix = (d - 128).to(tl.int64)
        else:
            prefix = (tl.load(select + row * 3 + 1) << 8) | d
        tl.store(select + row * 3 + 1, prefix)


@triton.jit(do_not_specialize=_FLAGS)
def _begin_kernel(
    logits, temperature, top_k, top_p, min_p, partials, state, fstate, select, histogram,
    arrived, vocab_size, num_pieces, has_top_k, has_top_p, has_min_p,
    KEY_BITS: tl.constexpr, CANDIDATES: tl.constexpr, PIECES: tl.constexpr,
):  # fmt: skip
    """The row's key range and largest logit; top-k's radix select set up (k keys still to
    find, an empty prefix, whether the row selects at all) over a cleared histogram; no piece
    of the row has arrived."""
    row = tl.program_id(0).to(tl.int64)
    t, k, p, m, on_k, on_p, active = _row_filters(
        row, temperature, top_k, top_p, min_p, vocab_size, has_top_k, has_top_p, has_min_p
    )
    s = tl.arange(0, PIECES)
    at = partials + (row * num_pieces + s) * CANDIDATES
    lo = tl.min(tl.load(at, mask=s < num_pieces, other=_INT32_MAX)).to(tl.int64)
    key_max = tl.max(tl.load(at + 1, mask=s < num_pieces, other=_INT32_MIN)).to(tl.int64)
    tl.store(state + row * 3, lo)
    tl.store(state + row * 3 + 2, key_max + 1)
    tl.store(select + row * 3, k.to(tl.int64))
    tl.store(select + row * 3 + 1, 0)
    tl.store(select + row * 3 + 2, (active & on_k).to(tl.int64))
    tl.store(histogram + row * 256 + tl.arange(0, 256), tl.zeros((256,), tl.int32))
    tl.store(arrived + row, 0)
    top = _key_value(key_max, logits.dtype.element_ty, KEY_BITS)
    tl.store(fstate + row * 3 + 1, top.to(tl.float64))


@triton.jit(do_not_specialize=["has_top_p"])
def _mass_kernel(
    logits, temperature, top_p, piece_max, piece_mass, partials, state, fstate, arrived,
    stride_n, stride_v, vocab_size, num_pieces, has_top_p,
    KEY_BITS: tl.constexpr, CHUNK: tl.constexpr, CANDIDATES: tl.constexpr,
    PIECES: tl.constexpr, MASS_F64: tl.constexpr,
):  # fmt: skip
    """One piece's W(key >= cut) for each cut of its row's interval [lo, hi), and its whole W
    (top-p's first pass takes the total from it): W sums exp((x - top) / T) over x >= floor.
    The row's last piece to finish narrows the interval."""
    row, piece = tl.program_id(0).to(tl.int64), tl.program_id(1)
    lo = tl.load(state + row * 3)
    hi = tl.load(state + row * 3 + 1)
    at = row * num_pieces + piece
    out = partials + at * CANDIDATES
    # Keys below lo weigh nothing at any cut: a piece whose largest key is below lo reads
    # nothing. The first pass (a negative target) also sums the whole mass, so there the
    # bound is the key below S's smallest value (slot 2), under which every mass is 0.
    # The whole piece is one load, a 1-D tensor: each cut is one reduction over it.
    first = tl.load(fstate + row * 3) < 0
    bound = tl.where(first, tl.load(state + row * 3 + 2), lo)
    if (hi - lo > 1) & (tl.load(piece_max + at).to(tl.int64) >= bound):
        c = piece * CHUNK + tl.arange(0, CHUNK)
        valid = c < vocab_size
        x = tl.load(logits + row * stride_n + c * stride_v, mask=valid, other=float("-inf"))
        key = _keys(x, KEY_BITS)
        t = tl.load(temperature + row)
        top = tl.load(fstate + row * 3 + 1).to(tl.float32)
        floor = tl.load(fstate + row * 3 + 2).to(tl.float32)
        xf = x.to(tl.float32)
        scale = _LOG2E / tl.where(t > 0, tl.maximum(t, _MIN_T), 1.0)
        w = tl.where(xf >= floor, tl.exp2((xf - top) * scale), 0.0)
        counted = w > 0
        # float64 within the piece too only where the torch path's kept set must be matched
        # exactly (see `filter_thresholds_triton`).
        if MASS_F64:
            w = w.to(tl.float64)
        last = (hi - 1).to(tl.int32)  # hi itself may be 2**31
        tl.store(piece_mass + at, tl.sum(w).to(tl.float64))
        # W(>= cut) = W(inside [lo, hi) and >= cut) + W(>= hi).
        above = tl.sum(tl.where(key > last, w, 0)).to(tl.float64)
        w_in = tl.where(counted & (key >= lo.to(tl.int32)) & (key <= last), w, 0)
        step = (hi - lo + CANDIDATES - 1) // CANDIDATES
        for d in tl.static_range(CANDIDATES):
            cut = tl.minimum(lo + d * step, hi).to(tl.int32)
            tl.store(out + d, tl.sum(tl.where(key >= cut, w_in, 0)).to(tl.float64) + above)
    else:
        tl.store(out + tl.arange(0, CANDIDATES), tl.zeros((CANDIDATES,), tl.float64))
        tl.store(piece_mass + at, 0.0)
    if last_to_arrive(arrived, row, num_pieces):
        _narrow(row, top_p, piece_mass, partials, state, fstate, num_pieces, has_top_p,
                CANDIDATES, PIECES)


@triton.jit
def _narrow(
    row, top_p, piece_mass, partials, state, fstate, num_pieces, has_top_p,
    CANDIDATES: tl.constexpr, PIECES: tl.constexpr,
):  # fmt: skip
    """Narrow the row's [lo, hi) to the largest key t with W(>= t) >= target, from the pieces'
    totals summed in piece order; a negative target means top_p x the row's whole W (the
    first pass). Needs W(>= lo) >= target and W(>= hi) < target."""
    lo = tl.load(state + row * 3)
    hi = tl.load(state + row * 3 + 1)
    if hi - lo > 1:
        d = tl.arange(0, CANDIDATES)
        s = tl.arange(0, PIECES)
        at = partials + (row * num_pieces + s[:, None]) * CANDIDATES + d[None, :]
        totals = tl.sum(tl.load(at, mask=(s < num_pieces)[:, None], other=0.0), axis=0)
        cand = _cuts(lo, hi, CANDIDATES)
        p = tl.load(top_p + row, mask=has_top_p != 0, other=1.0)
        target = tl.load(fstate + row * 3)
        m = tl.load(piece_mass + row * num_pieces + s, mask=s < num_pieces, other=0.0)
        whole = tl.sum(m)
        target = tl.where(target < 0, p.to(tl.float64) * whole, target)
        ok = ((totals >= target) | (d == 0)) & (cand < hi)
        new_lo = tl.max(tl.where(ok, cand, lo))
        tl.store(state + row * 3, new_lo)
        tl.store(state + row * 3 + 1, tl.min(tl.where(~ok & (cand > new_lo), cand, hi)))
        tl.store(fstate + row * 3, target)


@triton.jit(do_not_specialize=_FLAGS)
def _between_kernel(
    logits, temperature, top_k, top_p, min_p, state, fstate, select,
    vocab_size, has_top_k, has_top_p, has_min_p, KEY_BITS: tl.constexpr,
):  # fmt: skip
    """top-k's and min-p's threshold t_s; the top-p search over S = {x >= t_s}."""
    row = tl.program_id(0).to(tl.int64)
    t, k, p, m, on_k, on_p, active = _row_filters(
        row, temperature, top_k, top_p, min_p, vocab_size, has_top_k, has_top_p, has_min_p
    )
    dtype = logits.dtype.element_ty
    # The k-th largest key where top-k selected, else the row's smallest.
    lo_k = tl.where(active & on_k, tl.load(select + row * 3 + 1), tl.load(state + row * 3))
    top = tl.load(fstate + row * 3 + 1).to(tl.float32)
    t_k = tl.where(on_k, _key_value(lo_k, dtype, KEY_BITS), float("-inf"))
    t_min_p = top + t * tl.log(m)  # -inf where min-p is off
    t_s = tl.maximum(t_k, t_min_p)  # both filters keep a top prefix
    # S's mass Z is at least 1 (its top's), so the at most V values of S below
    # t_z = top + T ln((1 - p) / 2V) weigh under (1 - p) Z / 2: the answer is at or above t_z.
    # Searched from a key at or below t_z and S's smallest: one below t_min_p's and t_z's keys
    # once rounded to the logits' dtype (rounding moves each by at most one key). With t_z
    # the first pass cuts a far narrower interval (top - 12 at T 0.8, p 0.95: a few hundred
    # bf16 keys, not 30,000), so top-p converges a pass sooner.
    t_z = top + t * tl.log((1.0 - p) / (2.0 * vocab_size))
    lo_s = tl.maximum(lo_k, _keys(t_min_p.to(dtype), KEY_BITS).to(tl.int64) - 1)
    lo_p = tl.maximum(lo_s, _keys(t_z.to(dtype), KEY_BITS).to(tl.int64) - 1)
    row_hi = tl.load(state + row * 3 + 2)
    tl.store(state + row * 3, lo_p)
    tl.store(state + row * 3 + 1, tl.where(active & on_p, row_hi, lo_p + 1))
    tl.store(state + row * 3 + 2, lo_s)
    tl.store(fstate + row * 3, -1.0)
    tl.store(fstate + row * 3 + 2, t_s.to(tl.float64))


@triton.jit(do_not_specialize=_FLAGS)
def _finish_kernel(
    logits, temperature, top_k, top_p, min_p, state, fstate, thresholds,
    vocab_size, has_top_k, has_top_p, has_min_p, KEY_BITS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    t, k, p, m, on_k, on_p, active = _row_filters(
        row, temperature, top_k, top_p, min_p, vocab_size, has_top_k, has_top_p, has_min_p
    )
    lo_p = tl.load(state + row * 3)
    t_p = tl.where(on_p, _key_value(lo_p, logits.dtype.element_ty, KEY_BITS), float("-inf"))
    thr = tl.maximum(tl.load(fstate + row * 3 + 2).to(tl.float32), t_p)
    top = tl.load(fstate + row * 3 + 1)
    tl.store(thresholds + row, tl.where(active & (top > float("-inf")), thr, float("-inf")))


@functools.cache
def _absent(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A stand-in for a filter tensor that is None (never read), of a fixed dtype so that
    passing None does not change the kernels' signatures."""
    return torch.zeros(1, dtype=dtype, device=device)


def workspace_bytes(num_rows: int, vocab_size: int, chunk: int = CHUNK,
                    candidates: int = CANDIDATES) -> int:  # fmt: skip
    """Device bytes `filter_thresholds_triton` allocates besides its `[N]` output:
    per row, 8 x candidates + 12 bytes per piece of `chunk` columns, plus 76 of search state
    and top-k's 1 KiB histogram."""
    return num_rows * (triton.cdiv(vocab_size, chunk) * (8 * candidates + 12) + 76 + 1024)


def filter_thresholds_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    *,
    chunk: int = CHUNK,
    candidates: int = CANDIDATES,
    num_warps: int = NUM_WARPS,
    mass_float64: bool = False,
) -> torch.Tensor:
    """`kvfit.ops.sampling.filter_thresholds` in Triton, a row split over `chunk`-column
    programs. `chunk`, `candidates` (powers of two >= 2) and `num_warps` are tuning knobs
    that never change the result.

    Top-p's masses are summed in float32 within a piece (at most `chunk` values) and in
    float64 across a row's pieces, in a fixed order: deterministic, and within a few float32
    roundings of the exact mass, more accurate than the sort path's float32 cumsum over the
    whole vocabulary. `mass_float64=True` sums in float64 within pieces too, which makes the
    kept set equal the torch path's even where a mass lies within rounding of top_p, at
    1.24-1.39x the kernel's time on the H200 (`bench/sampling.py --sweep-filters`,
    2026-12-03: 0.903 against 0.730 ms for k1000 p0.99 at 256 x 151,936); the tests use it
    to compare the two paths bit for bit.

    Extra memory: the `[N]` float32 output and `workspace_bytes(N, V)`: 2.8 MiB at 256 rows x
    151,936 columns with the defaults, 1/26 of the bf16 logits. Launches: 3 + the passes of
    each filter given (2 for top-k and 4 for top-p with 16-bit keys) + 1, none waiting on
    the host."""
    check_filter_inputs(logits, temperature, top_k, top_p, min_p)
    for name, value in (("chunk", chunk), ("candidates", candidates)):
        if value < 2 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 2, got {value}")
    num_rows, vocab_size = logits.shape
    out = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    if num_rows == 0:
        return out
    device = logits.device
    num_pieces = triton.cdiv(vocab_size, chunk)
    pieces = triton.next_power_of_2(num_pieces)
    piece_max = torch.empty(num_rows, num_pieces, dtype=torch.int32, device=device)
    piece_mass = torch.empty(num_rows, num_pieces, dtype=torch.float64, device=device)
    partials = torch.empty(num_rows, num_pieces, candidates, dtype=torch.float64, device=device)
    # lo, hi, and the row's largest key + 1 or (top-p) a key at or below S's smallest
    state = torch.empty(num_rows, 3, dtype=torch.int64, device=device)
    fstate = torch.empty(num_rows, 3, dtype=torch.float64, device=device)  # target, top, floor
    # top-k's radix select: keys still to find, the prefix found, whether the row selects
    select = torch.empty(num_rows, 3, dtype=torch.int64, device=device)
    histogram = torch.empty(num_rows, 256, dtype=torch.int32, device=device)
    arrived = torch.empty(num_rows, dtype=torch.int32, device=device)  # pieces done this pass
    # One dtype whether top_k is given or not (int32, as the engine passes it): a second would
    # compile second kernels.
    filters = (
        _absent(device, torch.int32) if top_k is None else top_k.int(),
        _absent(device, torch.float32) if top_p is None else top_p,
        _absent(device, torch.float32) if min_p is None else min_p,
    )
    flags = (int(top_k is not None), int(top_p is not None), int(min_p is not None))
    key_bits = 8 * logits.element_size()
    split = (num_rows, num_pieces)
    _key_range_kernel[split](
        logits, temperature, *filters, piece_max, partials, *logits.stride(), vocab_size,
        num_pieces, *flags, KEY_BITS=key_bits, CHUNK=chunk, CANDIDATES=candidates,
        num_warps=num_warps,
    )  # fmt: skip
    _begin_kernel[(num_rows,)](
        logits, temperature, *filters, partials, state, fstate, select, histogram, arrived,
        vocab_size, num_pieces, *flags, KEY_BITS=key_bits, CANDIDATES=candidates, PIECES=pieces,
    )  # fmt: skip
    # A filter given for no row has nothing to search: its passes are left out, not skipped.
    if top_k is not None:
        for shift in range(key_bits - 8, -1, -8):
            _radix_kernel[split](
                logits, select, piece_max, histogram, arrived, *logits.stride(), vocab_size,
                num_pieces, SHIFT=shift, KEY_BITS=key_bits, CHUNK=chunk, num_warps=num_warps,
            )  # fmt: skip
    _between_kernel[(num_rows,)](
        logits, temperature, *filters, state, fstate, select, vocab_size, *flags,
        KEY_BITS=key_bits,
    )  # fmt: skip
    if top_p is not None:
        # Each pass leaves at most ceil(width / candidates) keys of the interval.
        for _ in range(-(-key_bits // (candidates.bit_length() - 1))):
            _mass_kernel[split](
                logits, temperature, filters[1], piece_max, piece_mass, partials, state, fstate,
                arrived, *logits.stride(), vocab_size, num_pieces, flags[1], KEY_BITS=key_bits,
                CHUNK=chunk, CANDIDATES=candidates, PIECES=pieces, MASS_F64=mass_float64,
                num_warps=num_warps,
            )  # fmt: skip
    _finish_kernel[(num_rows,)](
        logits, temperature, *filters, state, fstate, out, vocab_size, *flags, KEY_BITS=key_bits
    )
    return out
