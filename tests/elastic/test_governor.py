"""The co-tenancy governor's policy, exactly: watermark parsing, the hysteresis band, shrinks at
once, grows at most once per interval (after any resize, and after a failed grow)."""

from __future__ import annotations

import numpy as np
import pytest

from kvfit.elastic import ElasticConfig, KVCacheGovernor, MemoryAmount

GiB, MiB = 1 << 30, 1 << 20
TOTAL = 100 * GiB


@pytest.mark.parametrize(("text", "amount"), [
    ("0.05", MemoryAmount(fraction=0.05)),
    (0.5, MemoryAmount(fraction=0.5)),
    ("2147483648", MemoryAmount(nbytes=2 * GiB)),
    (4096, MemoryAmount(nbytes=4096)),
    ("2GiB", MemoryAmount(nbytes=2 * GiB)),
    ("1.5 GiB", MemoryAmount(nbytes=3 * GiB // 2)),
    ("512MiB", MemoryAmount(nbytes=512 * MiB)),
    ("1", MemoryAmount(nbytes=1)),  # a whole number is bytes, even 1
    (1e-05, MemoryAmount(fraction=1e-05)),  # a float that str() writes with an exponent
    # numpy's: repr np.float64(0.05), a float32 no float; an integer is bytes.
    (np.float64(0.05), MemoryAmount(fraction=0.05)),
    (np.float32(1e-05), MemoryAmount(fraction=float(np.float32(1e-05)))),
    (np.int64(GiB), MemoryAmount(nbytes=GiB)),
])
def test_watermarks_are_fractions_or_bytes(text: str | float, amount: MemoryAmount) -> None:
    assert MemoryAmount.parse(text, "elastic_low_watermark") == amount


@pytest.mark.parametrize("text", ["0", "-1", "2GB", "2 gigabytes", "1.5", "", "0.0", "1.0", 1.0,
                                  "2147483648.0", float("nan"), float("inf"), -0.05,
                                  np.float64("nan"), True])
def test_bad_watermarks_name_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match="elastic_high_watermark"):
        MemoryAmount.parse(text, "elastic_high_watermark")


def test_watermarks_resolve_against_the_device_and_low_must_be_below_high() -> None:
    config = ElasticConfig(MemoryAmount(fraction=0.05), MemoryAmount(nbytes=8 * GiB))
    assert config.watermarks(TOTAL) == (5 * GiB, 8 * GiB)
    with pytest.raises(ValueError, match="elastic_low_watermark .* below elastic_high"):
        config.watermarks(200 * GiB)  # 10 GiB low, 8 GiB high
    # A GPU's free memory never exceeds its total: such a cache would never grow back. On the
    # CPU free memory is the host's and the total the KV budget, so it can.
    with pytest.raises(ValueError, match=r"elastic_high_watermark .* below the device's 6"):
        config.watermarks(6 * GiB, free_bounded=True)
    assert config.watermarks(6 * GiB) == (int(0.05 * 6 * GiB), 8 * GiB)


def governor(min_interval_s: float = 10.0) -> KVCacheGovernor:
    return KVCacheGovernor(ElasticConfig(MemoryAmount(nbytes=4 * GiB), MemoryAmount(nbytes=8 * GiB),
                                         min_interval_s=min_interval_s, poll_interval_s=0.1))


def test_free_memory_under_low_gives_back_to_the_middle_at_once() -> None:
    g = governor()
    assert g.decide(1 * GiB, TOTAL, now=0.0) == 5 * GiB  # to the middle: 6 GiB free
    g.resized(0.0)
    # Right after a resize, another shortage is answered at once: shrinks never wait.
    assert g.decide(3 * GiB, TOTAL, now=0.01) == 3 * GiB


@pytest.mark.parametrize("free", [4 * GiB, 6 * GiB, 8 * GiB])
def test_free_memory_within_the_band_changes_nothing(free: int) -> None:
    assert governor().decide(free, TOTAL, now=100.0) == 0


def test_grows_take_down_to_the_middle_and_one_that_grew_nothing_waits_an_interval() -> None:
    g = governor(min_interval_s=10.0)
    assert g.decide(20 * GiB, TOTAL, now=0.0) == -14 * GiB  # first grow: nothing before it
    g.resized(0.0, grew=True)
    # Another process gave more back right after: taken at once, a grow holds none back.
    assert g.decide(30 * GiB, TOTAL, now=0.1) == -24 * GiB
    g.grow_attempted(0.2)  # it failed (or the cache was at its budget): the retry waits
    assert g.decide(20 * GiB, TOTAL, now=10.1) == 0
    assert g.decide(20 * GiB, TOTAL, now=10.2) == -14 * GiB


def test_a_resize_through_the_api_holds_off_the_next_grow_for_an_interval() -> None:
    g = governor(min_interval_s=10.0)
    g.resized(0.0)  # LLM.resize_kv_cache: the user's size stands for an interval
    assert g.decide(20 * GiB, TOTAL, now=9.9) == 0
    assert g.decide(20 * GiB, TOTAL, now=10.0) == -14 * GiB


def test_a_shrink_holds_off_the_next_grow_for_an_interval() -> None:
    g = governor(min_interval_s=10.0)
    g.resized(5.0)  # a shrink at t=5
    assert g.decide(20 * GiB, TOTAL, now=14.0) == 0
    assert g.decide(20 * GiB, TOTAL, now=15.0) < 0


def test_an_idle_shrink_holds_no_grow_back() -> None:
    """An idle cache's give-back answers no shortage: once busy again (its use asks) it grows
    into whatever is free at the next poll, not an interval after it gave."""
    g = governor(min_interval_s=10.0)
    g.resized(5.0, idle=True)
    assert g.grow_due(5.1) and g.decide(20 * GiB, TOTAL, now=5.1) == -14 * GiB


def test_a_resize_landing_in_the_middle_never_triggers_the_opposite_one() -> None:
    """Whatever the free memory, applying the decision lands inside the band, where the next
    decision is 0: the governor cannot oscillate on its own."""
    g = governor(min_interval_s=0.0)
    for free in (0, GiB, 3 * GiB, 9 * GiB, 50 * GiB):
        after = free + g.decide(free, TOTAL, now=1.0)
        assert 4 * GiB <= after <= 8 * GiB
        assert g.decide(after, TOTAL, now=2.0) == 0


def test_polls_are_spaced_by_the_poll_interval() -> None:
    g = governor()
    assert g.due(0.0) and not g.due(0.05) and g.due(0.1) and not g.due(0.15)


def test_failed_resizes_back_off_doubling_per_direction_up_to_a_cap() -> None:
    """A shrink that failed is retried two poll intervals later, then twice as late each time
    up to MAX_BACKOFF_S; a grow's from `min_interval_s`. A success in a direction ends its
    backoff; a failed grow never delays a shrink."""
    from kvfit.elastic.governor import MAX_BACKOFF_S

    g = governor(min_interval_s=10.0)
    waits = [g.failed(0.0) for _ in range(12)]
    assert waits[:4] == [0.2, 0.4, 0.8, 1.6] and waits[-1] == MAX_BACKOFF_S == max(waits)
    assert g.backoff_s == MAX_BACKOFF_S
    assert not g.shrink_due(MAX_BACKOFF_S - 1) and g.shrink_due(MAX_BACKOFF_S)
    assert g.decide(1 * GiB, TOTAL, now=MAX_BACKOFF_S - 1) == 0  # under the low watermark
    assert g.decide(1 * GiB, TOTAL, now=MAX_BACKOFF_S) == 5 * GiB
    g.resized(70.0)  # a shrink worked
    assert g.shrink_due(70.0) and g.backoff_s == 0
    assert [g.failed(100.0, grow=True) for _ in range(3)] == [10.0, 20.0, 40.0]
    assert g.shrink_due(100.0)  # another process may need memory now
    assert g.decide(20 * GiB, TOTAL, now=139.0) == 0  # the grow's backoff: 40 s
    assert g.decide(20 * GiB, TOTAL, now=140.0) == -14 * GiB
    g.resized(140.0, grew=True)
    assert g.backoff_s == 0 and g.grow_due(140.0)


def test_a_failing_grow_backs_off_even_without_a_min_interval() -> None:
    """With `min_interval_s` 0 a failed grow still waits two poll intervals, then doubles: a
    zero first wait would double to zero and retry the grow at every poll."""
    g = governor(min_interval_s=0.0)
    assert [g.failed(0.0, grow=True) for _ in range(3)] == [0.2, 0.4, 0.8]
    assert g.decide(20 * GiB, TOTAL, now=0.7) == 0
    assert g.decide(20 * GiB, TOTAL, now=0.8) < 0
