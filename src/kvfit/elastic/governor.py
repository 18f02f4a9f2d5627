"""The co-tenancy governor's policy: from the device's free memory alone, when to shrink the
KV cache so another process can allocate, and when to grow it back.

Pure: the engine reads free memory between steps, asks `KVCacheGovernor.decide` and resizes;
tests drive it with a scripted clock and free-memory figures.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass
from decimal import Decimal

from kvfit.elastic.usage import KVUsage
from kvfit.kv.report import format_bytes

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_AMOUNT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB)?\s*$")

DEFAULT_LOW_WATERMARK = "0.05"
DEFAULT_HIGH_WATERMARK = "0.1"
DEFAULT_MIN_INTERVAL_S = 5.0
DEFAULT_IDLE_S = 0.0  # off: the governor grows back to the budget whenever memory is free
POLL_INTERVAL_S = 0.05
"""How often the engine reads free memory: often enough to shrink within a second of another
process allocating, rarely enough to cost nothing (one `cudaMemGetInfo`)."""
MAX_BACKOFF_S = 60.0
"""The longest the governor waits to retry after resizes that keep failing (or
`min_interval_s`, if longer)."""


@dataclass(frozen=True)
class MemoryAmount:
    """A watermark of device free memory: `nbytes`, or a `fraction` of its total memory (on
    the CPU: of `cpu_kv_cache_space_bytes`)."""

    nbytes: int | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, value: str | float | int, setting: str) -> MemoryAmount:
        """A fraction of total memory in (0, 1) (`0.05`), or bytes: a whole number
        (`2147483648`) or one with a binary unit (`2GiB`, `512MiB`, `1.5GiB`). Raises
        `ValueError` naming `setting`."""
        # str() writes a float under 1e-4 with an exponent (1e-05), which the pattern refuses:
        # its shortest exact digits are written out instead (0.00001). Through float(): numpy's
        # repr is np.float64(0.05), and its float32 is no float at all.
        is_float = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
        text = format(Decimal(repr(float(value))), "f") if is_float else str(value)
        match = _AMOUNT.match(text)
        if match is None:
            raise ValueError(f"{setting} must be a fraction of device memory in (0, 1) such "
                             f"as 0.05, or bytes such as 2147483648, 2GiB or 512MiB; got "
                             f"{value!r}")
        number, unit = float(match[1]), match[2] or ""
        if not unit and number < 1:
            if number <= 0:
                raise ValueError(f"{setting} must be above 0, got {value!r}")
            return cls(fraction=number)
        if not unit and "." in match[1]:  # 1.0 means a fraction, not one byte
            raise ValueError(f"{setting}: {value!r} is neither a fraction below 1 nor a whole "
                             f"number of bytes; add a unit (e.g. 1.5GiB)")
        return cls(nbytes=math.ceil(number * _UNITS[unit]))

    def resolve(self, total: int) -> int:
        """Bytes, on a device of `total` bytes."""
        return self.nbytes if self.nbytes is not None else int(self.fraction * total)

    def __str__(self) -> str:
        if self.nbytes is not None:
            return format_bytes(self.nbytes)
        return f"{self.fraction:g} of device memory"


@dataclass(frozen=True)
class ElasticConfig:
    """`--elastic-kv-cache`: watermarks of device free memory and the least time between a
    resize and the next grow (a grow that failed is retried after it, then after twice as
    long with each consecutive failure: `KVCacheGovernor.failed`); `idle_s`: how long
    the cache's use must stay low before it gives the unused part back (0: never);
    `demand_dir`: where engines on one device publish what their caches lack."""

    low_watermark: MemoryAmount
    high_watermark: MemoryAmount
    min_interval_s: float = DEFAULT_MIN_INTERVAL_S
    idle_s: float = 0.0
    poll_interval_s: float = POLL_INTERVAL_S
    demand_dir: str | None = None  # the `DemandBoard`'s root (None: engines share no demand)

    def watermarks(self, total: int, free_bounded: bool = False) -> tuple[int, int]:
        """`(low, high)` in bytes on a device of `total` bytes; `ValueError` unless
        low < high, and, where free memory never exceeds `total` (`free_bounded`: a GPU; on
        the CPU free memory is the host's, `total` the KV budget), high < total."""
        low, high = self.low_watermark.resolve(total), self.high_watermark.resolve(total)
        if not low < high:
            raise ValueError(
                f"elastic_low_watermark ({self.low_watermark}: {low} bytes) must be below "
                f"elastic_high_watermark ({self.high_watermark}: {high} bytes) on a device of "
                f"{total} bytes: the band between them keeps the cache from oscillating")
        if free_bounded and not high < total:  # never reached: the cache would never grow
            raise ValueError(
                f"elastic_high_watermark ({self.high_watermark}: {high} bytes) must be below "
                f"the device's {total} bytes (its free memory never exceeds them); lower it")
        return low, high


@dataclass
class KVCacheGovernor:
    """When to resize the KV cache for other processes on the same device.

    Free memory under the low watermark (another process is allocating) gives back, at once,
    what brings it to the middle of the two watermarks: a shrink is never delayed (but by a
    failed one's backoff, below), since the other process may fail without it. Free memory above
    the high watermark takes what brings it down to that middle, but only `min_interval_s` after
    the last shrink (the governor's, the out-of-memory guard's, or a resize through the API; not
    an idle one's) and the last grow attempt that grew nothing (it failed, or the cache was at
    its budget; a poll whose free memory holds no further block or chunk tries nothing, and
    holds nothing back). A grow does not hold the next one back: memory another engine gives
    back in steps is taken as it comes, and growing twice is no oscillation. A resize that
    fails (a driver error, a grow that found no memory) is retried after a backoff that doubles
    with each consecutive failure in its direction (`failed`): a driver that keeps failing is
    not retried at every poll, each retry preempting what the resize preempts (a KV
    connector's cache: every sequence). Between the
    watermarks nothing changes. Landing in the middle of the band, a resize cannot trigger the
    opposite one by itself: hysteresis, with a grow after a shrink at most one per interval.

    With `idle_s` and the cache's `KVUsage`, memory also flows between co-tenant engines,
    whose free memory alone never moves: a cache whose use stays low for `idle_s` shrinks to
    what it uses plus headroom (`idle_shrink`), or, where kvfit peers publish what they lack,
    by that much only; and only a cache short of headroom grows (one that has it would take
    back what it just gave). A busy cache short of blocks grows even
    inside the band, down to its lower quarter, so it never pushes free memory under the low
    watermark itself; a busy cache with blocks beyond its demand gives that tail to peers that
    lack blocks (`share_shrink`).
    """

    config: ElasticConfig
    last_poll: float = -math.inf
    last_resize: float = -math.inf  # the last resize that holds grows back: not a grow
    last_grow_attempt: float = -math.inf  # the last grow attempt that grew nothing
    low_since: float | None = None  # since when the cache's use has been low
    share_since: float | None = None  # since when a busy cache has had a tail a peer lacks
    # Consecutive failed resizes by direction, and when the next may be tried (`failed`).
    num_failed_shrinks: int = 0
    num_failed_grows: int = 0
    shrink_retry_at: float = -math.inf
    grow_retry_at: float = -math.inf

    def due(self, now: float) -> bool:
        """Whether a poll interval has passed since the last poll (and count this one)."""
        if now - self.last_poll < self.config.poll_interval_s:
            return False
        self.last_poll = now
        return True

    def decide(self, free: int, total: int, now: float, usage: KVUsage | None = None) -> int:
        """Bytes of KV cache to give back (> 0) or take (< 0) with `free` of `total` device
        bytes free at `now`, the cache used as `usage` (None: free memory alone decides); 0
        to leave it as it is (also while a failed resize in that direction backs off)."""
        low, high = self.config.watermarks(total)
        middle = (low + high) // 2
        if free < low:
            return middle - free if self.shrink_due(now) else 0
        if not self.grow_due(now):
            return 0
        if usage is not None and self.config.idle_s > 0 and not usage.needs_more:
            return 0  # a cache with headroom leaves free memory to a busy co-tenant
        if free > high:
            return middle - free
        floor_of_band = _floor_of_band(low, high)
        if usage is not None and usage.short and free > floor_of_band:
            return floor_of_band - free
        return 0

    def spare_bytes(self, free: int, total: int) -> int:
        """Of `free` device bytes, what a busy co-tenant short of blocks takes without anyone
        giving back (`decide` grows it down to the band's lower quarter): what an idle engine
        need not give for a peer's want."""
        return max(0, free - _floor_of_band(*self.config.watermarks(total)))

    def idle_shrink(self, usage: KVUsage, now: float,
                    peers_keep: int | None = None) -> int | None:
        """Blocks to shrink the cache to, once its use has stayed low for `idle_s` (None
        until then, or with `idle_s` 0): what it uses plus headroom, never below `floor`.

        `peers_keep`, where other kvfit engines share the device (`DemandBoard`): the blocks
        left once they have what they lack. The cache then gives back only that, keeping the
        rest (and its prefix cache) until a peer asks: an idle cache nobody needs stays. Such
        a give leaves the idle clock running, so a peer's further want is answered at once.
        None, its use not looked at, while a failed shrink backs off (`shrink_due`)."""
        if not self.shrink_due(now):
            return None
        if not (self.config.idle_s > 0 and usage.is_low):
            self.low_since = None
            return None
        self.low_since, held = _held(self.low_since, now, self.config.idle_s)
        if not held:
            return None
        target = max(usage.idle_target, peers_keep or 0)
        if target >= usage.num_blocks:
            return None  # idle still: the next peer that asks is answered at once
        if target == usage.idle_target:
            self.low_since = None
        # else: a peer's want, which grows as its burst is admitted; the cache stays idle, so
        # the next want is answered at the next poll, not `idle_s` on.
        return target

    def share_shrink(self, usage: KVUsage, now: float,
                     peers_keep: int | None) -> int | None:
        """Blocks a busy cache shrinks to so that peers short of blocks get its tail:
        `peers_keep` (what `KVCacheResizer` leaves it: at least its demand plus one
        `max_model_len` sequence, and every block a live sequence holds, so the shrink
        preempts nothing), once a peer has lacked that tail for `idle_s`. None for a cache
        idle by its use (`idle_shrink` gives for it), one short of blocks itself, no peer
        asking, or while a failed shrink backs off.

        Why: a cache that grew for a burst keeps what it holds while a quarter of it or more
        stays in use, so without this a co-tenant that turns busy meanwhile waits for blocks
        until the first goes idle (four engines sharing one device, `tests/elastic/
        test_share.py`). The caller counts the shrink as a resize that holds grows back
        (`resized`), so the cache does not take back at once what it gave."""
        if (not self.shrink_due(now) or self.config.idle_s <= 0 or peers_keep is None
                or usage.short or usage.is_low or peers_keep >= usage.num_blocks):
            self.share_since = None
            return None
        self.share_since, held = _held(self.share_since, now, self.config.idle_s)
        if not held:
            return None
        self.share_since = None
        return peers_keep

    def grow_due(self, now: float) -> bool:
        """Whether the cache may grow at `now` (or, released by a failure, be backed again):
        `min_interval_s` after the last resize that holds grows back (a shrink, the API's, a
        release) and after the last grow attempt that grew nothing."""
        interval = self.config.min_interval_s
        return (now - self.last_resize >= interval and now - self.last_grow_attempt >= interval
                and now >= self.grow_retry_at)

    def shrink_due(self, now: float) -> bool:
        """Whether the cache may shrink at `now`: at once, unless a shrink failed and its
        backoff has not passed (`failed`)."""
        return now >= self.shrink_retry_at

    def resized(self, now: float, grew: bool = False, idle: bool = False) -> None:
        """The cache was resized (or released by a failed resize) at `now`; `grew`: by this
        governor's grow, which does not hold the next grow back; `idle`: by an idle shrink
        (`idle_shrink`), which holds none back either: it answered no shortage of memory, and
        the cache grows again only once its use asks (`KVUsage.needs_more`) and memory is free
        (an engine busy again right after it gave its cache to a peer must not wait an
        interval for the peer's give-back). Ends the backoff of that direction."""
        if grew:
            self.num_failed_grows, self.grow_retry_at = 0, -math.inf
        else:
            if not idle:
                self.last_resize = now
            self.num_failed_shrinks, self.shrink_retry_at = 0, -math.inf

    def failed(self, now: float, grow: bool = False) -> float:
        """A shrink (`grow`: a grow, or backing a released cache) failed at `now`; returns how
        long the next one in that direction waits (`backoff_wait_s`)."""
        if grow:
            self.num_failed_grows += 1
            wait = self.backoff_wait_s(self.num_failed_grows, grow)
            self.grow_retry_at = now + wait
        else:
            self.num_failed_shrinks += 1
            wait = self.backoff_wait_s(self.num_failed_shrinks, grow)
            self.shrink_retry_at = now + wait
        return wait

    def backoff_wait_s(self, num_failed: int, grow: bool) -> float:
        """The wait after `num_failed` consecutive failed shrinks (`grow`: grows): two poll
        intervals after a shrink's first failure, `min_interval_s` after a grow's (two poll
        intervals at least: with `min_interval_s` 0 a failing grow would otherwise be retried
        at every poll, its wait never doubling), doubling with each further one up to
        `MAX_BACKOFF_S` (or `min_interval_s`, if longer); 0 for none."""
        if num_failed == 0:
            return 0.0
        c = self.config
        first = 2 * c.poll_interval_s
        if grow:
            first = max(first, c.min_interval_s)
        return min(first * 2.0 ** min(num_failed - 1, 64), max(MAX_BACKOFF_S, c.min_interval_s))

    @property
    def backoff_s(self) -> float:
        """The backoff the latest failed resize set (the longer of the two directions'); 0
        once a resize in each direction that failed has succeeded."""
        return max(self.backoff_wait_s(self.num_failed_shrinks, grow=False),
                   self.backoff_wait_s(self.num_failed_grows, grow=True))

    def grow_attempted(self, now: float) -> None:
        """A grow was tried at `now` and grew nothing (failed, or nothing to do at the
        budget): the next attempt waits the interval."""
        self.last_grow_attempt = now


def _held(since: float | None, now: float, span: float) -> tuple[float, bool]:
    """A condition true at `now`, true since `since` (None: it starts now): when it started,
    and whether it has held for `span`."""
    since = now if since is None else since
    return since, now - since >= span


def _floor_of_band(low: int, high: int) -> int:
    """The lowest free memory a busy cache short of blocks grows down to: the band's lower
    quarter, so it never pushes free memory under the low watermark itself."""
    return low + (high - low) // 4
