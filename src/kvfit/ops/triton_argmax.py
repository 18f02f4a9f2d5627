"""Greedy decoding's argmax over each logits row in one launch: the row split across programs,
the last program of a row to finish choosing among the splits' winners.

torch's `argmax(dim=-1)` reduces a row in one thread block: at one row of a 152k vocabulary
that block walks 300 elements a thread, one dependent load after another, 9.2 us of the 0.6B
shape's 1.0 ms one-row step on an H100 (docs/results/decode-profile-l2-prefetch-h100-2026-12-07.txt)
for 0.3 MB that L2 still holds from the LM head. Split over the SMs, each program reads one tile
or a few; a split torch reduction would need a second launch for the splits.

Each value and its column travel as one int64 key, the value's order-preserving int32 image in
the high half and the column's complement in the low: the largest key is the largest value at
its first column, which is `torch.argmax`'s answer, NaN included (it wins, as there). So every
reduction is an integer max, exact in any order: the token does not depend on the split count,
the tile size or the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvfit.ops.sm_count import num_sms
from kvfit.ops.triton_tickets import last_to_arrive

BLOCK = 1024  # columns per tile
NUM_WARPS = 4
# Programs per SM for a launch of few rows (as the Gumbel sampler's): enough loads in flight to
# read the row at memory speed; rows are split until the grid reaches this many.
PROGRAMS_PER_SM = 8
_INT32_MAX = tl.constexpr(2**31 - 1)
_INT64_MIN = tl.constexpr(-(2**63))  # below every key: masked columns and absent splits
_LOW_MASK = tl.constexpr(2**32 - 1)


@dataclass(frozen=True)
class ArgmaxScratch:
    """Device memory `argmax_triton` reuses from call to call, allocated once before warmup
    measures memory (`allocate`): one int32 ticket per row (`arrived`, zero between launches:
    a row's last program sets it back) and one int64 key per (row, split) (`parts`). Calls on
    one stream run one after another, so one scratch serves them all."""

    arrived: torch.Tensor
    parts: torch.Tensor

    @classmethod
    def allocate(cls, max_rows: int, device: torch.device) -> ArgmaxScratch:
        """Scratch for calls of up to `max_rows` rows on `device`: 4 x max_rows bytes of
        tickets and 8 x max(max_rows, PROGRAMS_PER_SM x SMs) bytes of keys (9 KB at 256 rows on
        132 SMs): the most (row, split) parts `num_splits` makes, at any row count."""
        parts = max(max_rows, _grid_programs(device))
        return cls(torch.zeros(max_rows, dtype=torch.int32, device=device),
                   torch.empty(parts, dtype=torch.int64, device=device))

    @property
    def max_rows(self) -> int:
        """The most rows one call may have (one ticket each)."""
        return self.arrived.numel()


def _grid_programs(device: torch.device) -> int:
    """The programs a launch of few rows is split into: `PROGRAMS_PER_SM` per SM."""
    return PROGRAMS_PER_SM * num_sms(device)


def num_splits(num_rows: int, num_tiles: int, device: torch.device) -> int:
    """Programs per row: the grid up to `PROGRAMS_PER_SM` per SM, one tile each at least, and
    never more than that grid's parts in all (so `ArgmaxScratch` bounds every launch)."""
    return max(1, min(num_tiles, _grid_programs(device) // max(1, num_rows)))


def splits_bound(num_tiles: int, device: torch.device) -> int:
    """The kernel's SPLITS_P2: a power of two at or above any launch's splits over rows of
    `num_tiles` tiles. A constant of the vocabulary and the device, not of the row count, so
    a new batch size compiles nothing."""
    return triton.next_power_of_2(min(num_tiles, _grid_programs(device)))


@triton.jit
def _keys(x, cols):
    """int64 keys of float32 values `x` at columns `cols`: ordered as (value, -column), NaN
    above everything (torch.argmax's NaN wins) and -0.0 equal to 0.0 (a tie, as in torch)."""
    bits = x.to(tl.int32, bitcast=True)
    # Negative floats order backwards as signed ints: flip their magnitude bits.
    key = tl.where(bits < 0, bits ^ _INT32_MAX, bits)
    key = tl.where(x == 0.0, 0, key)
    key = tl.where(x != x, _INT32_MAX, key)
    return (key.to(tl.int64) << 32) | (_LOW_MASK - cols.to(tl.int64))


@triton.jit(do_not_specialize=["tiles_per_split"])
def _argmax_kernel(
    logits, out, arrived, parts, stride_n, stride_v, vocab_size, tiles_per_split,
    BLOCK: tl.constexpr,
    SPLITS_P2: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    row_logits = logits + row.to(tl.int64) * stride_n
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), _INT64_MIN, tl.int64)
    start = split * tiles_per_split * BLOCK
    for tile in range(tiles_per_split):
        cols = start + tile * BLOCK + offs
        mask = cols < vocab_size
        x = tl.load(row_logits + cols.to(tl.int64) * stride_v, mask=mask,
                    other=0.0).to(tl.float32)
        best = tl.maximum(best, tl.where(mask, _keys(x, cols), _INT64_MIN))
    tl.store(parts + row * splits + split, tl.max(best, axis=0))
    if last_to_arrive(arrived, row, splits):
        s = tl.arange(0, SPLITS_P2)
        keys = tl.load(parts + row * splits + s, mask=s < splits, other=_INT64_MIN,
                       cache_modifier=".cg")  # written by other SMs this launch: past L1
        top = tl.max(keys, axis=0)
        tl.store(out + row, _LOW_MASK - (top & _LOW_MASK))


def argmax_triton(logits: torch.Tensor, scratch: ArgmaxScratch, *,
                  splits: int | None = None, block: int = BLOCK) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for `logits` `[N, V]` (bf16/fp16/fp32, any strides, N at most
    `scratch.max_rows`) in one launch: `[N]` int64, the first column of each row's largest
    value (NaN counts as largest, as in torch). `splits` (programs per row, default
    `num_splits`; capped at what the scratch holds) and `block` tune the launch and never
    change the result.

    Device memory: the `[N]` output; the rest is `scratch`'s."""
    num_rows, vocab_size = logits.shape
    if num_rows > scratch.max_rows:
        raise ValueError(f"argmax over {num_rows} rows, scratch for {scratch.max_rows}: "
                         f"allocate the scratch for the most rows a step samples")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    num_tiles = triton.cdiv(vocab_size, block)
    # A requested count is capped where the kernel's tile of keys or the scratch would not
    # hold it (the default never is).
    most = min(num_tiles, _grid_programs(logits.device), scratch.parts.numel() // num_rows)
    splits = min(splits or num_splits(num_rows, num_tiles, logits.device), most)
    tiles_per_split = triton.cdiv(num_tiles, splits)
    splits = triton.cdiv(num_tiles, tiles_per_split)  # no split left without a tile
    _argmax_kernel[(num_rows, splits)](
        logits, out, scratch.arrived, scratch.parts, *logits.stride(), vocab_size,
        tiles_per_split, BLOCK=block, SPLITS_P2=splits_bound(num_tiles, logits.device),
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
