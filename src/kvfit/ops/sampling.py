"""Seeded Gumbel-max sampling of one token per logits row, greedy decoding's argmax, and the
top-k / top-p / min-p filters as one logit threshold per row: Triton on CUDA, torch elsewhere."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvfit.ops.triton_argmax import ArgmaxScratch

LOGITS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MIN_TEMPERATURE = 2.0**-64
"""Sampled rows divide by at least this temperature. Below ~4e-39, 1 / T overflows float32
(and a logit / T well before), which made scores inf (the first positive logit won, not the
largest) and top-p's masses NaN; at any T this small softmax(x / T) is the argmax's anyway."""


def temperature_divisor(temperature: torch.Tensor) -> torch.Tensor:
    """What each row's logits are divided by: its temperature, at least `MIN_TEMPERATURE`; 1
    for a greedy row (temperature <= 0), which is not scaled."""
    return torch.where(temperature > 0, temperature.clamp_min(MIN_TEMPERATURE), 1.0)


# Bytes of [rows, V] temporaries the torch threshold search holds at once (at most 21 per logit:
# int32 keys, float64 masses, int64 bucket ids and a mask): 2 rows of a 152k vocabulary, under
# 1/8 of 256 such rows of bf16 logits.
_FILTER_BYTES = 8 << 20
_FILTER_BYTES_PER_LOGIT = 24
# Cuts per pass of the torch search: one histogram weighs them all, so a 16-bit key takes 2
# passes and a 32-bit key 4.
_TORCH_CANDIDATES = 256


def argmax_scratch(max_rows: int, device: torch.device) -> ArgmaxScratch | None:
    """The scratch `greedy_argmax` takes for calls of up to `max_rows` rows on `device`
    (`triton_argmax.ArgmaxScratch`); None off CUDA or for no rows, where it needs none."""
    if device.type != "cuda" or max_rows <= 0:
        return None
    from kvfit.ops.triton_argmax import ArgmaxScratch  # CUDA-only dependency

    return ArgmaxScratch.allocate(max_rows, device)


def greedy_argmax(logits: torch.Tensor, scratch: ArgmaxScratch | None = None) -> torch.Tensor:
    """`logits.argmax(dim=-1)` (`[N, V]` -> `[N]` int64, first column on ties): on CUDA with a
    `scratch` of at least N rows in one launch (`triton_argmax`: the row split over the SMs),
    else torch's reduction (one thread block a row). The same ids either way."""
    if scratch is not None and logits.is_cuda and logits.shape[0] <= scratch.max_rows:
        from kvfit.ops.triton_argmax import argmax_triton  # CUDA-only dependency

        return argmax_triton(logits, scratch)
    return logits.argmax(dim=-1)


def gumbel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    thresholds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token id per row of `logits` `[N, V]` from softmax(logits / temperature).

    Each row n takes the argmax of `logits[n] / temperature[n] + g` with g Gumbel noise drawn
    from `seeds[n]` alone, so the same seed and logits give the same token whatever the batch.
    Rows with temperature <= 0 take the plain argmax (first index on ties). Filtered or banned
    tokens (-inf logits) never win unless the whole row is -inf. `temperature` is `[N]` float32,
    `seeds` `[N]` int64 (a 64-bit seed as its two's-complement int64); returns `[N]` int64.
    `thresholds` (`[N]` float32, from `filter_thresholds`) restricts sampled rows to the columns
    with `logits[n, c] >= thresholds[n]`; greedy rows ignore it. None or -inf filters nothing
    and draws exactly the unfiltered token. CUDA and CPU draw different noise for the same seed.
    """
    if logits.is_cuda:
        from kvfit.ops.triton_sampling import gumbel_sample_triton  # CUDA-only dependency

        return gumbel_sample_triton(logits, temperature, seeds, thresholds)
    return gumbel_sample_torch(logits, temperature, seeds, thresholds)


def gumbel_sample_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    thresholds: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch path of `gumbel_sample` (CPU): the same math with each row's noise from a
    `torch.Generator` seeded by `seeds[row]`."""
    check_sample_inputs(logits, temperature, seeds, thresholds)
    sample = temperature > 0
    scores = logits.float() / temperature_divisor(temperature)[:, None]
    if thresholds is not None:
        floor = torch.where(sample, thresholds, float("-inf"))[:, None]
        scores.masked_fill_(logits.float() < floor, float("-inf"))
    noise = torch.empty_like(scores)
    for row, seed in enumerate(seeds.tolist()):
        noise[row].exponential_(generator=torch.Generator(logits.device).manual_seed(seed))
    # Exp(1) noise can be exactly 0; the floor keeps Gumbel noise finite so -inf stays -inf.
    gumbel = noise.clamp_min_(torch.finfo(noise.dtype).tiny).log_().neg_()
    return torch.where(sample[:, None], scores + gumbel, scores).argmax(dim=-1)


def check_sample_inputs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    thresholds: torch.Tensor | None = None,
) -> None:
    """Raise ValueError unless logits is `[N, V>0]` in a supported dtype and temperature
    (`[N]` float32), seeds (`[N]` int64) and thresholds (`[N]` float32 or None) sit on its
    device. Reads no values (no sync)."""
    _check_logits(logits)
    _check_rows(logits, "temperature", temperature, (torch.float32,))
    _check_rows(logits, "seeds", seeds, (torch.int64,))
    _check_rows(logits, "thresholds", thresholds, (torch.float32,))


def check_filter_inputs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> None:
    """Raise ValueError unless `filter_thresholds` can take these shapes, dtypes and devices.
    Reads no values (no sync)."""
    _check_logits(logits)
    _check_rows(logits, "temperature", temperature, (torch.float32,))
    _check_rows(logits, "top_k", top_k, (torch.int32, torch.int64))
    _check_rows(logits, "top_p", top_p, (torch.float32,))
    _check_rows(logits, "min_p", min_p, (torch.float32,))


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [num_rows, vocab_size > 0], got {tuple(logits.shape)}")
    if logits.dtype not in LOGITS_DTYPES:
        raise ValueError(f"logits dtype {logits.dtype} is not one of {LOGITS_DTYPES}")


def _check_rows(
    logits: torch.Tensor, name: str, t: torch.Tensor | None, dtypes: tuple[torch.dtype, ...]
) -> None:
    """A per-row `[N]` tensor (None passes) in one of `dtypes` on the logits' device."""
    if t is None:
        return
    if t.shape != logits.shape[:1] or t.dtype not in dtypes or t.device != logits.device:
        wanted = " or ".join(str(d) for d in dtypes)
        raise ValueError(
            f"{name} must be [{logits.shape[0]}] {wanted} on {logits.device}, got "
            f"{list(t.shape)} {t.dtype} on {t.device}"
        )


# --- top-k / top-p / min-p as a threshold per row ---------------------------------------------


def filter_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-row logit thresholds `[N]` float32 that apply min-p, top-k and top-p without sorting:
    row n keeps exactly the columns c with `float(logits[n, c]) >= thresholds[n]` (raw logits,
    before temperature); -inf where the row filters nothing or is greedy (temperature <= 0).
    Pass the result to `gumbel_sample(..., thresholds=)`.

    On the tempered distribution p = softmax(logits / T), in vLLM's order: min-p keeps p_i >=
    min_p * max(p) (x_i >= max(x) + T ln(min_p)), top-k keeps the k largest, and of the tokens
    both keep, top-p keeps the smallest most likely set whose probability renormalised over them
    reaches top_p (at least one token). Masses are exp((x - max) / T) in float32, summed in
    float64 so that the result does not depend on the order of summation. Equal logits at
    a threshold are all kept: a sort would keep an arbitrary subset of them, this is the
    deterministic choice. Otherwise the kept set is the sort's (`reference.sort_filter_reference`).

    `logits` `[N, V]` bf16/fp16/fp32, any strides; `temperature` `[N]` float32; `top_k` `[N]`
    int32/int64 in [1, V] (V: off), `top_p` `[N]` float32 in (0, 1] (1: off), `min_p` `[N]`
    float32 in [0, 1] (0: off); None turns a filter off for every row.

    Extra device memory: the `[N]` float32 output, plus on CUDA
    `triton_filters.workspace_bytes(N, V)` (2.8 MiB at 256 x 151,936: per-piece partial sums)
    and on the torch path at most `_FILTER_BYTES` (8 MiB) of row-block temporaries: 1/9 of
    256 x 151,936 bf16 logits and O(1) in N.
    """
    if logits.is_cuda:
        from kvfit.ops.triton_filters import filter_thresholds_triton  # CUDA-only dependency

        return filter_thresholds_triton(logits, temperature, top_k, top_p, min_p)
    return filter_thresholds_torch(logits, temperature, top_k, top_p, min_p)


def filter_thresholds_torch(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch path of `filter_thresholds` (any device): the same search as the Triton kernel,
    vectorised over blocks of rows whose temporaries fit `_FILTER_BYTES`."""
    check_filter_inputs(logits, temperature, top_k, top_p, min_p)
    num_rows, vocab_size = logits.shape
    out = torch.full((num_rows,), float("-inf"), device=logits.device)
    block = max(1, _FILTER_BYTES // (_FILTER_BYTES_PER_LOGIT * vocab_size))
    for start in range(0, num_rows, block):
        rows = slice(start, start + block)
        filters = (None if t is None else t[rows] for t in (top_k, top_p, min_p))
        out[rows] = _block_thresholds(logits[rows], temperature[rows], *filters)
    return out


def _block_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    num_rows, vocab_size = logits.shape
    device = logits.device
    neg_inf = torch.tensor(float("-inf"), device=device)
    k = top_k.long() if top_k is not None else torch.full((num_rows,), vocab_size, device=device)
    p = top_p if top_p is not None else torch.ones(num_rows, device=device)
    min_p = min_p if min_p is not None else torch.zeros(num_rows, device=device)
    on_k, on_p = k < vocab_size, p < 1
    active = (temperature > 0) & (on_k | on_p | (min_p > 0))
    if not active.any():
        return neg_inf.expand(num_rows).clone()
    keys = sortable_keys(logits)
    x = logits.float()
    top = x.amax(dim=1)
    lo, hi = keys.amin(dim=1).long(), keys.amax(dim=1).long() + 1
    # top-k: the k-th largest value is the largest key with at least k keys at or above it.
    lo_k = _search(keys, None, lo, torch.where(on_k, hi, lo + 1), k.double(), None)
    t_k = torch.where(on_k, key_values(lo_k, logits.dtype), neg_inf)
    t_min_p = top + temperature * min_p.log()  # -inf where min-p is off
    t_s = torch.maximum(t_k, t_min_p)  # S = {x >= t_s}: both filters keep a top prefix
    # top-p: the largest key with at least top_p of S's mass at or above it, searched from any
    # key at or below S's smallest (one below t_min_p rounded to the logits' dtype).
    floor = sortable_keys(t_min_p.to(logits.dtype)[:, None])[:, 0].long() - 1
    lo_p = torch.maximum(lo_k, floor)
    scale = math.log2(math.e) / temperature_divisor(temperature)
    mass = (x - top[:, None]).mul_(scale[:, None]).exp2_().masked_fill_(x < t_s[:, None], 0.0)
    del x  # the search needs only keys and masses, summed in float64 (see `_search`)
    mass = mass.double()
    lo_p = _search(keys, mass, lo_p, torch.where(on_p, hi, lo_p + 1), None, p)
    t_p = torch.where(on_p, key_values(lo_p, logits.dtype), neg_inf)
    thresholds = torch.maximum(t_s, t_p)
    return torch.where(active & (top > float("-inf")), thresholds, neg_inf)


def _search(
    keys: torch.Tensor,
    weights: torch.Tensor | None,
    lo: torch.Tensor,
    hi: torch.Tensor,
    target: torch.Tensor | None,
    fraction: torch.Tensor | None,
) -> torch.Tensor:
    """Per row, the largest key t in [lo, hi) with W(keys >= t) >= target, where W counts keys
    (`weights` None) or sums `weights` (float64); `target` None means `fraction` x W(>= lo).
    Needs W(>= lo) >= target and W(>= hi) < target. Each pass cuts [lo, hi) at
    `_TORCH_CANDIDATES` evenly spaced keys and weighs every key's bucket in one histogram."""
    num_rows, num_cuts = keys.shape[0], _TORCH_CANDIDATES
    d = torch.arange(num_cuts, device=keys.device)
    # W(>= cut d) is the sum of the buckets above d: a [cuts, cuts] triangle, not a cumsum.
    above_cut = torch.ones(num_cuts, num_cuts, dtype=torch.float64, device=keys.device).tril()
    first_bin = (torch.arange(num_rows, device=keys.device) * (num_cuts + 1))[:, None]
    while bool((hi - lo > 1).any()):
        step = (hi - lo + num_cuts - 1) // num_cuts
        cand = torch.minimum(lo[:, None] + d * step[:, None], hi[:, None])
        # Bucket j holds the keys at or above exactly j cuts (cuts clamped to hi count only
        # for keys at or above hi, which are at or above every cut).
        bucket = keys.long().sub_(lo[:, None]).div_(step[:, None], rounding_mode="floor")
        bucket.add_(1).clamp_(0, num_cuts).masked_fill_(keys >= hi[:, None], num_cuts)
        hist = torch.bincount(
            bucket.add_(first_bin).flatten(),
            None if weights is None else weights.flatten(),
            minlength=num_rows * (num_cuts + 1),
        ).view(num_rows, num_cuts + 1)
        del bucket
        totals = hist[:, 1:].double() @ above_cut
        if target is None:
            target = fraction.double() * totals[:, 0]  # cut 0 is lo: the whole mass
        ok = ((totals >= target[:, None]) | (d == 0)) & (cand < hi[:, None])
        new_lo = torch.where(ok, cand, lo[:, None]).amax(dim=1)
        hi = torch.where(~ok & (cand > new_lo[:, None]), cand, hi[:, None]).amin(dim=1)
        lo = new_lo
    return lo


def sortable_keys(values: torch.Tensor) -> torch.Tensor:
    """int32 keys in the order of the float values (16-bit keys for bf16/fp16, 32-bit for fp32);
    -0.0 and 0.0 share a key, so equal floats have equal keys."""
    if values.element_size() == 2:
        bits, low = values.view(torch.int16).int(), 0x7FFF
    else:
        bits, low = values.view(torch.int32).clone(), 0x7FFFFFFF
    bits.masked_fill_(bits == -low - 1, 0)  # -0.0's bits are the sign bit alone
    # Negative floats order backwards as integers: flipping all but the sign bit fixes that.
    return bits.bitwise_xor_((bits >> 31).bitwise_and_(low))


def key_values(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float32 values of `sortable_keys` of `dtype` (the inverse map)."""
    low = 0x7FFF if dtype.itemsize == 2 else 0x7FFFFFFF
    bits = keys.int() ^ ((keys.int() >> 31) & low)
    if dtype.itemsize == 2:
        return bits.short().view(dtype).float()
    return bits.view(torch.float32)
