"""Token-count buckets: the step sizes piecewise graphs are captured at, and the one a step
of n tokens pads up to."""

from __future__ import annotations

import bisect


def default_buckets(max_tokens: int, smallest: int = 16, per_octave: int = 4) -> list[int]:
    """Sizes to capture for steps of up to `max_tokens` tokens: multiples of `smallest` up to
    8 x `smallest`, then `per_octave` evenly spaced sizes per doubling (padding wastes at most
    1 / `per_octave` of a step), and `max_tokens` itself, always the largest: the size warmup
    measured, so no capture allocates beyond it."""
    sizes = set(range(smallest, 8 * smallest + 1, smallest))
    octave = 8 * smallest
    while octave < max_tokens:
        step = octave // per_octave
        sizes.update(range(octave + step, 2 * octave + 1, step))
        octave *= 2
    return sorted({s for s in sizes if s < max_tokens} | {max_tokens})


def bucket_for(buckets: list[int], num_tokens: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `num_tokens`; None when none does."""
    i = bisect.bisect_left(buckets, num_tokens)
    return buckets[i] if i < len(buckets) else None
