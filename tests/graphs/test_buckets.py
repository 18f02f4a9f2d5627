"""Token-count buckets of piecewise graphs: which sizes are captured, which one a step pads to."""

from __future__ import annotations

import pytest

from kvfit.graphs.buckets import bucket_for, default_buckets


@pytest.mark.parametrize("max_tokens", [1, 16, 100, 2048, 8192, 10000])
def test_the_largest_bucket_is_max_tokens_and_padding_wastes_at_most_a_quarter(
        max_tokens: int) -> None:
    buckets = default_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for n in range(1, max_tokens + 1):
        b = bucket_for(buckets, n)
        assert b is not None and n <= b
        assert b - n < 16 or (b - n) * 4 <= n, (n, b)  # fine steps first, then a quarter


def test_default_buckets_for_8192() -> None:
    buckets = default_buckets(8192)
    assert buckets[:8] == [16, 32, 48, 64, 80, 96, 112, 128]
    assert buckets[8:12] == [160, 192, 224, 256] and buckets[-4:] == [5120, 6144, 7168, 8192]
    assert len(buckets) == 32 and all(b % 16 == 0 for b in buckets)


def test_bucket_for_picks_the_smallest_that_holds_the_step() -> None:
    buckets = [16, 32, 48]
    assert [bucket_for(buckets, n) for n in (1, 16, 17, 33, 48)] == [16, 16, 32, 48, 48]
    assert bucket_for(buckets, 49) is None and bucket_for([], 1) is None
