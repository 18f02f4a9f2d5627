"""`decode_order`: the decode launch's rows, longest programs first (host side, no GPU)."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
import torch

pytest.importorskip("triton")
from kvfit.ops.decode_order import decode_order  # noqa: E402
from kvfit.ops.triton_attention import (  # noqa: E402
    MAX_SPLITS,
    decode_block_n,
    decode_split_tokens,
)

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn


def _program_tiles(seq_lens: np.ndarray, query_lens: np.ndarray, dtype: torch.dtype,
                   head_dim: int = 128) -> list[int]:
    """Tiles each sequence's programs read, by the kernel's split layout: one split of
    cdiv(tiles, splits) tiles (what `_decode_range` computes), 0 for a row that is no decode."""
    split_tokens = decode_split_tokens(dtype, len(seq_lens), 8, 132)
    block_n = decode_block_n(head_dim)
    out = []
    for n, q in zip(seq_lens.tolist(), query_lens.tolist(), strict=True):
        splits = max(1, min(MAX_SPLITS, -(-n // split_tokens)))
        tiles = -(-n // block_n)
        out.append(-(-tiles // splits) if q == 1 else 0)
    return out


@pytest.mark.parametrize("dtype", [BF16, FP8])
def test_rows_with_the_longest_programs_start_first(dtype: torch.dtype) -> None:
    """A 300-token row is one program of 300 tokens, a 1,100-token one three of ~370 (bf16
    splits of 512): the order follows the programs' length, not the sequence's, and keeps
    the batch order among equals; prefill rows, which the decode kernel skips, go last."""
    rng = np.random.default_rng(0)
    seq_lens = rng.integers(1, 4096, 256)
    query_lens = np.ones(256, dtype=np.int64)
    query_lens[[3, 50, 200]] = [7, 300, 2]
    order = decode_order(seq_lens, query_lens, 8, 128, dtype, 132)
    assert order.dtype == np.int32 and sorted(order.tolist()) == list(range(256))
    tiles = _program_tiles(seq_lens, query_lens, dtype)
    keys = [(-tiles[i], i) for i in order.tolist()]
    assert keys == sorted(keys)
    assert set(order[-3:].tolist()) == {3, 50, 200}


def test_a_short_sequence_may_go_before_a_longer_one_split_in_shorter_parts() -> None:
    """64 rows: splits of 512 tokens (fewer rows split finer, `decode_split_tokens`)."""
    seq_lens = np.array([1100, 450, 5] + [1] * 61)
    order = decode_order(seq_lens, np.ones(64, np.int64), 8, 128, BF16, 132)
    assert order[:3].tolist() == [1, 0, 2]  # 8 tiles of 64, then 1,100's 3 splits of 6


def _makespan(works: list[float], slots: int) -> float:
    ends = [0.0] * slots
    for w in works:
        heapq.heappush(ends, heapq.heappop(ends) + w)
    return max(ends)


def test_the_order_shortens_a_launch_that_ends_on_long_programs() -> None:
    """Why the order exists, on a model of the hardware's dispatch (each program starts on
    the first free slot, in launch order): rows of mixed lengths, the long ones last in the
    batch as a prefill's new sequences often are, finish on fewer idle slots longest first."""
    rng = np.random.default_rng(1)
    seq_lens = np.sort(rng.integers(100, 2300, 256))
    query_lens = np.ones(256, dtype=np.int64)
    tiles = _program_tiles(seq_lens, query_lens, BF16)
    split_tokens = decode_split_tokens(BF16, 256, 8, 132)
    splits = [max(1, min(MAX_SPLITS, -(-n // split_tokens))) for n in seq_lens.tolist()]

    def programs(rows: list[int]) -> list[float]:  # (rank, split, KV head), head fastest
        return [tiles[r] + 1.0 for r in rows for _ in range(splits[r]) for _ in range(8)]

    slots = 2 * 132
    ideal = sum(programs(list(range(256)))) / slots
    batch = _makespan(programs(list(range(256))), slots)
    ordered = _makespan(programs(decode_order(seq_lens, query_lens, 8, 128, BF16,
                                              132).tolist()), slots)
    assert ordered < batch
    assert ordered / ideal < 1.02


def test_a_launch_that_starts_at_once_keeps_the_batch_order() -> None:
    """Fewer rows x KV heads than SMs: every program starts at once, whatever the order."""
    seq_lens = np.array([5, 4000, 300, 2000])
    order = decode_order(seq_lens, np.ones(4, np.int64), 8, 128, BF16, 132)
    assert order.tolist() == [0, 1, 2, 3] and order.dtype == np.int32
    assert decode_order(seq_lens, np.ones(4, np.int64), 8, 128, BF16, 16).tolist()[0] == 1
