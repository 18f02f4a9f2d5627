"""The governor with the cache's use: an idle cache gives back what it does not use after
`idle_s` (not before, never below one sequence), a busy cache short of blocks grows inside the
band, and two engines sharing one scripted device pass memory to the busy one without
oscillating."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise

import pytest

from kvfit.elastic import ElasticConfig, KVCacheGovernor, KVUsage, MemoryAmount

GiB = 1 << 30
TOTAL = 100 * GiB
LOW, HIGH = 4 * GiB, 8 * GiB


def governor(idle_s: float = 5.0, min_interval_s: float = 2.0) -> KVCacheGovernor:
    return KVCacheGovernor(ElasticConfig(MemoryAmount(nbytes=LOW), MemoryAmount(nbytes=HIGH),
                                         min_interval_s=min_interval_s, poll_interval_s=0.1,
                                         idle_s=idle_s))


def test_usage_target_is_used_plus_headroom_never_below_the_floor() -> None:
    assert KVUsage(1000, used_blocks=100, floor=64).idle_target == 200
    assert KVUsage(1000, used_blocks=0, floor=64).idle_target == 64
    assert KVUsage(1000, used_blocks=100, floor=64).is_low
    assert not KVUsage(1000, used_blocks=300, floor=64).is_low  # would keep 600 of 1000
    assert not KVUsage(1000, used_blocks=0, floor=64, short=True).is_low
    assert not KVUsage(64, used_blocks=0, floor=64).is_low  # at the floor: nothing to give


def test_demand_is_the_larger_of_use_and_what_running_sequences_will_hold() -> None:
    young = KVUsage(1000, used_blocks=100, floor=64, need_blocks=400)
    assert young.demand_blocks == 400 and young.idle_target == 800
    assert not young.is_low  # 100 in use, but 400 needed before they finish
    assert young.needs_more is False and KVUsage(1000, 100, 64, need_blocks=600).needs_more
    assert KVUsage(1000, used_blocks=300, floor=64, need_blocks=200).demand_blocks == 300


def test_idle_shrink_comes_after_idle_s_of_low_use_not_before() -> None:
    g, idle = governor(idle_s=5.0), KVUsage(1000, used_blocks=10, floor=64)
    assert g.idle_shrink(idle, now=0.0) is None
    assert g.idle_shrink(idle, now=4.9) is None
    assert g.idle_shrink(idle, now=5.0) == 64


def test_no_idle_shrink_while_a_failed_shrink_backs_off() -> None:
    g, idle = governor(idle_s=5.0), KVUsage(1000, used_blocks=10, floor=64)
    g.idle_shrink(idle, now=0.0)
    wait = g.failed(5.0)
    assert g.idle_shrink(idle, now=5.0) is None and g.idle_shrink(idle, now=5.0 + wait) == 64


def test_a_busy_moment_restarts_the_idle_clock() -> None:
    g, idle = governor(idle_s=5.0), KVUsage(1000, used_blocks=10, floor=64)
    g.idle_shrink(idle, now=0.0)
    assert g.idle_shrink(KVUsage(1000, used_blocks=600, floor=64), now=3.0) is None
    assert g.idle_shrink(idle, now=4.0) is None
    assert g.idle_shrink(idle, now=8.9) is None
    assert g.idle_shrink(idle, now=9.0) == 64


def test_idle_s_zero_never_shrinks_and_leaves_grows_to_free_memory() -> None:
    g, idle = governor(idle_s=0.0), KVUsage(1000, used_blocks=0, floor=64)
    assert all(g.idle_shrink(idle, now=t) is None for t in (0.0, 100.0, 1e6))
    assert g.decide(20 * GiB, TOTAL, now=100.0, usage=idle) == -14 * GiB


def test_only_a_cache_short_of_headroom_grows() -> None:
    for used in (10, 300, 500):  # idle, then between the two thresholds: holds
        assert governor().decide(20 * GiB, TOTAL, 100.0, KVUsage(1000, used, 64)) == 0
    assert governor().decide(20 * GiB, TOTAL, 100.0, KVUsage(1000, 501, 64)) == -14 * GiB


def test_a_light_steady_load_settles_after_one_idle_shrink() -> None:
    """100 blocks in use of 1000, lots of free memory: one idle shrink to 200, then neither
    an idle shrink (not low) nor a grow (it has its headroom): no periodic give and take."""
    g = governor(idle_s=5.0, min_interval_s=2.0)
    usage = KVUsage(1000, used_blocks=100, floor=64)
    g.idle_shrink(usage, now=0.0)
    assert g.idle_shrink(usage, now=5.0) == 200
    g.resized(5.0)
    usage = KVUsage(200, used_blocks=100, floor=64)
    for now in (5.1, 10.0, 20.0, 100.0):
        assert g.decide(50 * GiB, TOTAL, now, usage) == 0
        assert g.idle_shrink(usage, now) is None


def test_a_short_cache_grows_inside_the_band_down_to_its_lower_quarter() -> None:
    short = KVUsage(1000, used_blocks=1000, floor=64, short=True)
    g = governor(min_interval_s=2.0)
    assert g.decide(7 * GiB, TOTAL, 100.0, short) == -2 * GiB  # to 5 GiB free
    assert g.decide(7 * GiB, TOTAL, 100.0, KVUsage(1000, 1000, 64)) == 0  # not short: holds
    assert g.decide(5 * GiB, TOTAL, 100.0, short) == 0  # never toward the low watermark
    g.resized(100.0)
    assert g.decide(7 * GiB, TOTAL, 101.0, short) == 0  # waits the interval like any grow


@dataclass
class Engine:
    """A simulated engine: a cache of `blocks` (1 GiB each) under a governor, busy or idle."""

    governor: KVCacheGovernor
    blocks: int
    budget: int
    busy: bool = False
    sizes: list[int] = field(default_factory=list)

    def usage(self) -> KVUsage:
        used = self.blocks if self.busy else 0
        return KVUsage(self.blocks, used, floor=2, short=self.busy)

    def peers_keep(self, usage: KVUsage, now: float, spare: int) -> int | None:
        """The blocks kept for peers on a demand board (None: no board)."""
        return None

    def publish(self, usage: KVUsage, now: float) -> None:
        """Say what the cache lacks on a demand board (none here)."""

    def poll(self, device: Device, now: float) -> None:
        self.poll_free(device.free(), now)

    def poll_free(self, free: int, now: float) -> None:
        """What `KVCacheResizer.govern` does with `free` device bytes, in whole blocks."""
        usage = self.usage()
        keep = self.peers_keep(usage, now, self.governor.spare_bytes(free, TOTAL))
        want = self.governor.decide(free, TOTAL, now, usage)
        target = self.blocks - want // GiB if want > 0 else self.blocks + (-want) // GiB
        shared = False
        if want == 0:
            target = self.governor.idle_shrink(usage, now, keep)
            if target is None:  # as `KVCacheResizer.govern`: a busy cache's tail to its peers
                target = self.governor.share_shrink(usage, now, keep)
                shared = target is not None
            target = target or self.blocks
        target = max(2, min(target, self.budget))
        if want < 0 and self.blocks >= self.budget:
            self.governor.grow_attempted(now)  # at its budget (under a block: nothing tried)
        if target != self.blocks:
            grew = target > self.blocks and want < 0
            self.governor.resized(now, grew=grew, idle=want == 0 and not shared)
            self.blocks = target
            if grew:
                self.publish(self.usage(), now)
        self.sizes.append(self.blocks)


@dataclass
class Device:
    """The engines' caches, `other` use, and `jitter`: what other use gives back for a poll
    now and then (torch's allocator releasing a few MiB moves free memory that much)."""

    engines: list[Engine]
    other: int = 10 * GiB  # weights, activations, the CUDA contexts
    jitter: int = 0
    polls: int = 0

    def free(self) -> int:
        self.polls += 1
        wobble = self.jitter * (self.polls % 3) // 2  # 0, jitter / 2, jitter, 0, ...
        return TOTAL - self.other + wobble - sum(e.blocks for e in self.engines) * GiB


@pytest.mark.parametrize("phase_s", [30.0, 60.0])
@pytest.mark.parametrize("idle_polls_first", [False, True])
@pytest.mark.parametrize("idle_s", [5.0, 0.5])  # longer and shorter than the interval
@pytest.mark.parametrize("jitter", [0, GiB // 2])
def test_two_engines_pass_memory_to_the_busy_one_without_oscillating(
        phase_s: float, idle_polls_first: bool, idle_s: float, jitter: int) -> None:
    """Alternating load on a device both engines start on at 45 GiB each: in each phase the
    busy engine ends up holding most of the memory, and within a phase each cache changes
    direction at most once (no ping-pong). With free memory wobbling by under a block, the
    busy engine's band grow that finds no whole block holds none back."""
    a = Engine(governor(idle_s=idle_s, min_interval_s=2.0), blocks=42, budget=85)
    b = Engine(governor(idle_s=idle_s, min_interval_s=2.0), blocks=42, budget=85)
    device = Device([a, b], jitter=jitter)
    assert LOW <= device.free() <= HIGH
    now, dt = 0.0, 0.1
    for phase in range(4):
        busy, idle = (a, b) if phase % 2 == 0 else (b, a)
        busy.busy, idle.busy = True, False
        start, idle_start, phase_start = len(busy.sizes), len(idle.sizes), now
        grown_at = None
        while now < (phase + 1) * phase_s:
            for engine in ((idle, busy) if idle_polls_first else (a, b)):
                engine.poll(device, now)
            if grown_at is None and busy.blocks >= 80:
                grown_at = now
            now += dt
        assert busy.blocks >= 80 and idle.blocks == 2, (phase, a.blocks, b.blocks)
        # Within a poll of the idle engine's give-back (idle_s after its load stopped), not an
        # interval later: a small grow into the band at the phase's start holds none back.
        assert grown_at is not None and grown_at - phase_start <= idle_s + 2 * dt, grown_at
        assert all(y <= x for x, y in pairwise(idle.sizes[idle_start:]))  # never takes back
        assert device.free() >= LOW
        for engine in (a, b):
            moves = [y - x for x, y in pairwise(engine.sizes[start:]) if y != x]
            turns = sum(1 for x, y in pairwise(moves) if (x > 0) != (y > 0))
            assert turns <= 1, (phase, engine.sizes[start:])
