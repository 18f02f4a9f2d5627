"""A busy cache's free tail to peers that lack blocks (`KVCacheGovernor.share_shrink`): the
policy's conditions, and four engines on one scripted device whose busy sets overlap, where a
cache that grew for one burst would otherwise keep what a co-tenant turning busy needs."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from kvfit.elastic import DemandBoard, KVUsage

from .test_demand import BoardEngine
from .test_idle import HIGH, LOW, TOTAL, GiB, governor

BUSY = KVUsage(100, used_blocks=30, floor=4, need_blocks=40)  # not idle: a third in use


def test_a_busy_cache_gives_its_tail_once_a_peer_has_lacked_it_for_idle_s() -> None:
    g = governor(idle_s=1.0)
    assert not BUSY.is_low and not BUSY.short
    assert g.share_shrink(BUSY, now=0.0, peers_keep=60) is None  # the clock starts
    assert g.share_shrink(BUSY, now=0.9, peers_keep=60) is None
    assert g.share_shrink(BUSY, now=1.0, peers_keep=60) == 60
    # The want gone (nobody lacks: the resizer keeps all) stops the clock.
    assert g.share_shrink(BUSY, now=1.1, peers_keep=100) is None
    assert g.share_shrink(BUSY, now=1.2, peers_keep=60) is None
    assert g.share_shrink(BUSY, now=2.2, peers_keep=60) == 60


@pytest.mark.parametrize("usage,peers_keep,idle_s", [
    (BUSY, None, 1.0),  # no board, or no peer
    (BUSY, 100, 1.0),  # nothing to give
    (KVUsage(100, used_blocks=10, floor=4), 60, 1.0),  # idle by its use: `idle_shrink` gives
    (KVUsage(100, used_blocks=100, floor=4, short=True), 60, 1.0),  # short itself
    (BUSY, 60, 0.0),  # elastic_idle_s 0: the cache's use is not looked at
])
def test_no_share_where_the_cache_is_idle_short_or_nobody_asks(
        usage: KVUsage, peers_keep: int | None, idle_s: float) -> None:
    g = governor(idle_s=idle_s)
    assert all(g.share_shrink(usage, now=t, peers_keep=peers_keep) is None
               for t in (0.0, 10.0, 100.0))


def test_no_share_while_a_failed_shrink_backs_off() -> None:
    g = governor(idle_s=1.0)
    g.share_shrink(BUSY, now=0.0, peers_keep=60)
    wait = g.failed(1.0)
    assert g.share_shrink(BUSY, now=1.0, peers_keep=60) is None
    assert g.share_shrink(BUSY, now=1.0 + wait, peers_keep=60) is None  # the clock restarted
    assert g.share_shrink(BUSY, now=2.0 + wait, peers_keep=60) == 60


# Phases of 20 s: which engines are busy, and the blocks each busy one's work needs.
PHASES = [{0: 40}, {1: 30, 2: 30}, {3: 70}, {0: 50, 3: 50}, {1: 20, 2: 20, 3: 20}, {2: 85},
          {0: 30, 1: 30}]


def test_four_engines_with_overlapping_bursts_starve_none_and_never_pass_the_low_watermark(
        tmp_path: Path) -> None:
    """Four engines on a 100 GiB device (10 GiB other use), 20 GiB of cache each to start.
    Free memory never falls under the low watermark; within a phase no cache changes direction
    more than once; and at each phase's end every busy engine has its demand, or the memory it
    lacks is held by others' demands: no engine holds more than its own demand plus one
    sequence (an idle one its floor) while a busy peer lacks blocks. Without `share_shrink`
    the engine busy in phase 2 kept 78 blocks through phase 3, its peer there starved at 3
    (of its 50), and in phase 4 two busy engines waited at 2 blocks each."""
    engines = [BoardEngine(governor(idle_s=0.5, min_interval_s=2.0), blocks=20, budget=85,
                           board=DemandBoard(tmp_path, "gpu")) for _ in range(4)]
    other, now, dt = 10 * GiB, 0.0, 0.1

    def free() -> int:
        return TOTAL - other - sum(e.blocks for e in engines) * GiB

    for phase, demands in enumerate(PHASES):
        for i, engine in enumerate(engines):
            engine.busy, engine.demand = i in demands, demands.get(i, 0)
        start = [len(e.sizes) for e in engines]
        while now < (phase + 1) * 20.0:
            for engine in engines:
                engine.poll_free(free(), now)
                assert free() >= LOW, (phase, now, [e.blocks for e in engines])
            now += dt
        held = [e.blocks for e in engines]
        assert free() <= HIGH + GiB, (phase, held)  # no memory left unused
        for i, engine in enumerate(engines):
            if engine.busy and engine.blocks < engine.demand:
                # A block short (the floor's slack) covers the band's rounding to whole blocks.
                assert all(o.blocks <= (o.demand if o.busy else 0) + o.usage().floor + 1
                           for o in engines if o is not engine), (phase, i, held)
        for engine, first in zip(engines, start, strict=True):
            moves = [y - x for x, y in pairwise(engine.sizes[first:]) if y != x]
            assert sum(1 for x, y in pairwise(moves) if (x > 0) != (y > 0)) <= 1, (
                phase, engine.sizes[first:])
