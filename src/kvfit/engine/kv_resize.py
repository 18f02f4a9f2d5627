"""Resizing the KV cache at runtime: the one mechanism behind `LLM.resize_kv_cache`, the
co-tenancy governor (`--elastic-kv-cache`) and the out-of-memory guard.

A shrink goes through the block manager first: the tail's prefix-cache entries are evicted and
the sequences holding tail blocks preempted (recomputed later: nothing is lost), then every
worker commits the smaller size. A grow commits first, then hands the new blocks out. A cache
whose segments must each stay one physical chunk (a KV connector registered it) is resized by
recommitting it whole instead (`KVCacheResizer.recommit`). The cache's addresses never move,
so captured graphs stay valid. No step may be in flight: the engine applies it first
(`settle`).
"""

from __future__ import annotations

import logging
import operator
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvfit.kv.report import format_bytes
from kvfit.vmm import VmmError, VmmOutOfMemoryError

if TYPE_CHECKING:
    from kvfit.elastic import DemandBoard, KVCacheGovernor, KVUsage
    from kvfit.engine.config import EngineConfig
    from kvfit.engine.executor import Executor
    from kvfit.engine.scheduler import Scheduler
    from kvfit.engine.sequence import Sequence

logger = logging.getLogger(__name__)

MAX_EVENTS = 4096
"""Resizes kept in `KVCacheResizer.events` (the latest; the counters count them all)."""


class KVCacheReleasedError(RuntimeError):
    """Requests that waited on a KV cache a failed resize released, which stayed released past
    the engine's limit (`EngineCore.released_timeout_s`): they fail (a server answers 503)
    rather than wait for memory that may never come back. The engine goes on retrying."""


class KVCacheResizeError(RuntimeError):
    """A resize could not be made (a grow that found no memory); the KV cache is as it was."""


@dataclass(frozen=True)
class KVCacheResize:
    """One resize of the KV cache, by `cause` (`api`: `LLM.resize_kv_cache`; `governor`;
    `idle`: the governor's idle shrink; `share`: a busy cache's free tail to peers that lack
    blocks; `wake`; `restore`: a cache a failed resize released, backed again).

    `delta_bytes`: physical bytes gained (negative: given back) on rank 0; `free_bytes`: the
    device free memory that prompted a governor's resize; `time`: `time.monotonic()` at its
    end.
    """

    cause: str
    num_blocks_before: int
    num_blocks_after: int
    delta_bytes: int
    num_preempted: int
    num_evicted: int
    seconds: float
    time: float
    free_bytes: int | None = None


@dataclass
class KVCacheResizer:
    """Grows and shrinks the committed KV cache between steps, keeping the block manager, every
    worker's cache and `cache_config.num_gpu_blocks` equal; logs and counts each resize.

    Bounds: never below one `max_model_len` sequence (`floor`), never above the reserved
    capacity nor what the memory budget allows (`limits`).
    """

    config: EngineConfig
    executor: Executor
    scheduler: Scheduler
    events: deque[KVCacheResize] = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    num_shrinks: int = 0
    num_grows: int = 0
    num_failed_grows: int = 0
    num_failed_shrinks: int = 0  # resizes that raised going down (the governor backs off)
    num_idle_shrinks: int = 0  # of `num_shrinks`: an idle cache giving back what it did not use
    num_share_shrinks: int = 0  # of `num_shrinks`: a busy cache's free tail to peers that lack
    # Called when a recommit could not back even the floor and left the cache released (the
    # engine then backs it again by itself: `restore`).
    on_released: Callable[[], None] = lambda: None
    _warned_at_floor: bool = field(default=False, repr=False)  # once until the next grow

    @property
    def num_blocks(self) -> int:
        return self.scheduler.block_manager.num_blocks

    @property
    def floor(self) -> int:
        """Blocks one `max_model_len` sequence needs: the least the cache may hold."""
        return self.scheduler.block_manager.blocks_for(self.config.scheduler_config.max_model_len)

    def shrink_floor(self) -> int:
        """The least a shrink (the governor's, the out-of-memory guard's) may leave: `floor`,
        for a one-chunk cache rounded up to whole granules per segment (`_granule_ceil`)."""
        if not self.one_chunk():
            return self.floor
        return self._granule_ceil(self.floor, self._granule())

    def shrink_size(self, num_blocks: int) -> int:
        """The size a governor's shrink to `num_blocks` (its idle target, or what is left once
        its peers have what they lack) commits: for a one-chunk cache rounded up to whole
        granules per segment, so it never holds less than the policy asked, and never more
        than it holds now; for any other cache `num_blocks`."""
        if not self.one_chunk():
            return num_blocks
        return min(self._granule_ceil(num_blocks, self._granule()), self.num_blocks)

    def _granule(self) -> int:
        """The commit granule, the largest over the workers (a size ending on it on every one)."""
        return max(self.executor.collective_rpc("kv_cache_commit_granule"))

    def _granule_ceil(self, num_blocks: int, granule: int) -> int:
        """`num_blocks` rounded up to a size whose segments end on a commit `granule`: a
        one-chunk cache backs whole granules, so at a size short of one the connector would
        register memory that no block the block manager hands out uses."""
        step = self.config.kv_cache_spec().granule_block_step(granule)
        return -(-num_blocks // step) * step

    def limits(self) -> tuple[int, int, int]:
        """`(floor, capacity, budget)` blocks, the last two the minimum over workers."""
        _, capacity, budget = zip(*self.executor.collective_rpc("kv_cache_blocks"), strict=True)
        return self.floor, min(capacity), min(budget)

    # -- one resize ------------------------------------------------------------------------

    def resize(self, num_blocks: int, cause: str = "api",
               free_bytes: int | None = None) -> KVCacheResize:
        """Commit exactly `num_blocks` (a one-chunk cache's shrink that finds no memory: fewer,
        `recommit`); raises `ValueError` naming the setting for a size out of bounds,
        `KVCacheResizeError` where a driver call failed (a grow that found no memory: the
        cache stays as it was; a shrink: the cache keeps what it still backs)."""
        num_blocks = self._check_target(num_blocks)
        before, start = self.num_blocks, time.perf_counter()
        num_preempted = num_evicted = 0
        try:
            if num_blocks < before:
                delta, num_preempted, num_evicted = self.shrink(num_blocks)
                self.num_shrinks += 1
            elif num_blocks > before:
                delta, num_preempted, num_evicted = self.grow(num_blocks)
                self.num_grows += 1
                self._warned_at_floor = False
            else:  # gives back what a failed resize left, if anything
                delta = self._commit(num_blocks)[0]
        except KVCacheResizeError:  # a recommit's: it says what the cache holds
            self._count_failure(num_blocks, before)
            raise
        except VmmError as error:
            self._count_failure(num_blocks, before)
            raise KVCacheResizeError(
                f"could not {'grow' if num_blocks > before else 'shrink'} the KV cache from "
                f"{before} to {num_blocks} blocks: {error}; it holds {self.num_blocks} "
                f"blocks") from error
        num_blocks = self.num_blocks  # a recommit may have fallen back smaller
        event = KVCacheResize(cause, before, num_blocks, delta, num_preempted, num_evicted,
                              time.perf_counter() - start, time.monotonic(), free_bytes)
        if num_blocks != before:
            self.events.append(event)
            logger.info(
                "KV cache resized (%s): %d -> %d blocks (%s%s) in %.1f ms; %d sequences "
                "preempted, %d prefix-cache entries evicted%s", cause, before, num_blocks,
                "+" if delta >= 0 else "-", format_bytes(abs(delta)), 1e3 * event.seconds,
                num_preempted, num_evicted,
                "" if free_bytes is None else f"; device free memory {format_bytes(free_bytes)}")
        return event

    def _count_failure(self, num_blocks: int, before: int) -> None:
        self.num_failed_grows += num_blocks > before
        self.num_failed_shrinks += num_blocks < before

    def _check_target(self, num_blocks: int) -> int:
        """`num_blocks` as an int (numpy and torch integers too), checked against the bounds."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        try:
            if isinstance(num_blocks, bool):
                raise TypeError
            num_blocks = operator.index(num_blocks)
        except TypeError:
            raise ValueError(f"num_blocks must be an integer, got {num_blocks!r}") from None
        floor, capacity, budget = self.limits()
        what = f"resize_kv_cache(num_blocks={num_blocks})"
        if num_blocks < floor:
            raise ValueError(
                f"{what}: one max_model_len ({sc.max_model_len}) sequence needs {floor} blocks "
                f"of {cc.block_size} tokens, the least the KV cache may hold; ask for at least "
                f"{floor}, or lower max_model_len")
        if num_blocks > capacity:
            raise ValueError(
                f"{what}: the KV cache reserved {capacity} blocks of address space at startup "
                f"(its capacity, from the memory budget), which a running engine cannot widen; "
                f"ask for at most {capacity}")
        if num_blocks > max(budget, self.num_blocks):
            setting = ("cpu_kv_cache_space_bytes" if self.config.device.type == "cpu"
                       else f"gpu_memory_utilization ({cc.memory_utilization})")
            raise ValueError(
                f"{what}: the memory budget allows {budget} blocks ({setting} of the device, "
                f"less the model, the transient and the margin); ask for at most {budget}, or "
                f"start the engine with a larger {setting.split()[0]}")
        return num_blocks

    # -- the mechanism (also the out-of-memory guard's) ---------------------------------------

    def shrink(self, num_blocks: int, empty_cache: bool = False) -> tuple[int, int, int]:
        """Preempt the tail's holders, evict its prefix-cache entries, then commit
        `num_blocks` on every worker (`empty_cache`: then hand torch's idle memory back, for
        the out-of-memory guard). Returns `(delta_bytes, num_preempted, num_evicted)`. Where
        cutting a physical chunk finds no memory for its copy, it shrinks through whole chunks
        instead (`_shrink_through_chunks`). On another failure the block manager keeps what
        every worker still backs, and it raises. A one-chunk cache is recommitted
        (`recommit`): it may end smaller than `num_blocks`."""
        if self.one_chunk():
            result = self.recommit(num_blocks)
        else:
            victims = self.scheduler.preempt_tail_holders(num_blocks)
            num_evicted = self.scheduler.block_manager.shrink(num_blocks)
            try:
                delta = self._commit(num_blocks)[0]
            except VmmOutOfMemoryError as error:
                more, evicted, delta = self._shrink_through_chunks(num_blocks, error)
                victims, num_evicted = victims + more, num_evicted + evicted
            self.config.cache_config.num_gpu_blocks = self.num_blocks
            result = delta, len(victims), num_evicted
        if empty_cache:
            self.executor.collective_rpc("empty_cache")
        return result

    def _shrink_through_chunks(self, num_blocks: int, error: VmmOutOfMemoryError,
                               ) -> tuple[list[Sequence], int, int]:
        """Shrink to `num_blocks` without copying, after a cut found no memory: unmap whole
        chunks down to the largest size that cuts none (preempting and evicting down to it),
        then map fresh pages back up to `num_blocks`, whose new blocks are free. A grow back
        that finds no memory leaves the smaller size: a shrink never fails for want of
        memory. Returns `(victims, num_evicted, delta_bytes)`; re-raises `error` where whole
        chunks would go below one `max_model_len` sequence."""
        uncut = min(self.executor.collective_rpc("kv_cache_reachable_blocks", num_blocks))
        if uncut < self.floor:
            raise error
        logger.info("shrinking the KV cache to %d blocks copies a chunk's kept part, and the "
                    "device has no memory for it: going down to %d blocks (whole chunks) and "
                    "back up", num_blocks, uncut)
        victims = self.scheduler.preempt_tail_holders(uncut)
        num_evicted = self.scheduler.block_manager.shrink(uncut)
        delta = self._commit(uncut)[0]
        try:
            delta += self._commit(num_blocks)[0]
        except VmmError as grow_error:
            logger.warning("the KV cache could not grow back from %d to %d blocks (%s); it "
                           "holds %d", uncut, num_blocks, grow_error, self.num_blocks)
            return victims, num_evicted, delta
        self.scheduler.block_manager.grow(num_blocks)
        return victims, num_evicted, delta

    def grow(self, num_blocks: int) -> tuple[int, int, int]:
        """Commit `num_blocks` on every worker, then hand the new blocks out; returns
        `(delta_bytes, num_preempted, num_evicted)` (both counts 0 but for a one-chunk cache).
        On a failure every worker gives back what it grew, and it raises. A one-chunk cache is
        recommitted (`recommit`: every sequence preempted, the prefix cache evicted), which
        releases its pages before it maps the new ones: so every worker first checks that
        its device holds what the grow adds (`check_kv_cache_room`), and where one does not,
        it raises with nothing touched (no sequence preempted, the prefix cache kept). Where
        the memory went meanwhile (another process took it), it raises `KVCacheResizeError`
        once the cache holds the largest size that fits (the old one, or less)."""
        if self.one_chunk():
            self.executor.collective_rpc("check_kv_cache_room", num_blocks)
            before = self.num_blocks
            result = self.recommit(num_blocks, fallback=before)
            if self.num_blocks < num_blocks:
                raise KVCacheResizeError(
                    f"could not grow the KV cache from {before} to {num_blocks} blocks: no "
                    f"memory for it; it holds {self.num_blocks} blocks ({result[0]:+d} bytes)")
            return result
        delta = self._commit(num_blocks)[0]
        self.scheduler.block_manager.grow(num_blocks)
        self.config.cache_config.num_gpu_blocks = num_blocks
        return delta, 0, 0

    def one_chunk(self) -> bool:
        """Whether the cache's segments must each stay one physical chunk (a KV connector
        registered them), so that it resizes by `recommit`."""
        return any(self.executor.collective_rpc("kv_cache_one_chunk"))

    def recommit(self, num_blocks: int, fallback: int | None = None) -> tuple[int, int, int]:
        """Resize a one-chunk cache: preempt every running sequence (recomputed later; their
        full prompt blocks come back from the connector's store), evict the whole prefix
        cache, then have every worker release its pages and commit `num_blocks` as one new
        zeroed chunk per segment, registered with the connector again. Returns
        `(delta_bytes, num_preempted, num_evicted)` on rank 0.

        Device memory: none beyond the new chunks (the old ones are released first). Where the
        commit finds no memory it retries smaller (`fallback` first, if given, then halving
        down to the floor), so the cache stays usable; where even the floor fails, the cache
        is left released (`on_released`: the engine backs it again by itself, `restore`), at
        the size it would have had (`num_blocks`, or a grow's old size), and it raises
        `KVCacheResizeError`.
        """
        rpc, bm = self.executor.collective_rpc, self.scheduler.block_manager
        num_blocks_was = bm.num_blocks
        victims = self.scheduler.preempt_tail_holders(0)
        num_evicted = len(bm.hash_to_block)
        bm.reset_prefix_cache()
        before = rpc("kv_cache_bytes")[0][0]
        error: VmmError | None = None
        sizes = self._recommit_sizes(num_blocks, fallback)
        for size in sizes:
            try:
                rpc("recommit_kv_cache", size)
            except VmmOutOfMemoryError as e:
                logger.warning("could not commit the KV cache as %d blocks (%s); trying "
                               "fewer", size, e)
                error = e
                continue
            except VmmError as e:
                # Not a want of memory (a failed map or set-access): fewer blocks would not
                # help, and taking them would leave the cache small for good.
                if not before:  # released already (a wake): it stays so, at its size
                    self._set_blocks(num_blocks_was)
                    self.on_released()
                    raise KVCacheResizeError(
                        f"could not commit the KV cache as {size} blocks: {e.call} failed "
                        f"with code {e.code} (not out of memory); it stays released") from e
                self._recommit_as_it_was(num_blocks_was, e)
                raise KVCacheResizeError(
                    f"could not commit the KV cache as {size} blocks: {e.call} failed with "
                    f"code {e.code} (not out of memory); it holds {self.num_blocks} blocks, "
                    f"as it was") from e
            self._set_blocks(size)
            return rpc("kv_cache_bytes")[0][0] - before, len(victims), num_evicted
        # Released at the size this resize would have left (the one asked; a grow's, the old
        # one), not the floor: `restore` backs that, halving down where memory is short.
        self._set_blocks(min(num_blocks, num_blocks_was))
        self.on_released()
        raise KVCacheResizeError(
            f"could not commit the KV cache even as {sizes[-1]} blocks (one max_model_len "
            f"sequence) after releasing it: {error}; it is released until the device has the "
            f"memory again (the engine retries)") from error

    def _recommit_as_it_was(self, num_blocks: int, error: VmmError) -> None:
        """After a recommit failed with a driver error other than out of memory, back the
        `num_blocks` the cache held before it (its pages are gone: they come back zeroed).
        Where that fails too, the cache is left released (`on_released`) and it raises
        `KVCacheResizeError` naming the failed call and its code."""
        logger.error("committing the KV cache failed (%s: code %d), not for want of memory: "
                     "backing its %d blocks again", error.call, error.code, num_blocks)
        try:
            self.executor.collective_rpc("recommit_kv_cache", num_blocks)
        except VmmError as again:
            self._set_blocks(num_blocks)
            self.on_released()
            raise KVCacheResizeError(
                f"could not commit the KV cache: {error.call} failed with code {error.code} "
                f"(not out of memory), and backing its {num_blocks} blocks again failed too "
                f"({again}); it is released until it can be backed") from again
        self._set_blocks(num_blocks)

    def wake(self) -> KVCacheResize | None:
        """Back the released (asleep) cache again, zeroed (`wake_up`): at its size, or where
        the device lacks the memory for it (another process took it meanwhile), at the most
        blocks that fit, halving down to one `max_model_len` sequence, logged and counted as a
        shrink (the governor or `resize_kv_cache` grows it back). Returns that shrink, if any
        (cause `wake`; its `delta_bytes`: what the wake committed, from nothing).

        Raises `KVCacheResizeError` where not even one sequence fits: the cache then stays
        asleep, at its size, for the next `wake_up`."""
        before, start = self.num_blocks, time.perf_counter()
        try:
            delta = self.recommit(before)[0]
        except KVCacheResizeError as error:
            self._set_blocks(before)  # the next wake_up tries the whole size again
            if not isinstance(error.__cause__, VmmOutOfMemoryError):
                raise KVCacheResizeError(f"wake_up(): {error}; call wake_up() again") from (
                    error.__cause__)
            raise KVCacheResizeError(
                f"wake_up(): no device memory for the KV cache, not even for one max_model_len "
                f"({self.config.scheduler_config.max_model_len}) sequence "
                f"({error.__cause__}); it stays asleep: free device memory and call wake_up() "
                f"again, or lower max_model_len") from error.__cause__
        if self.num_blocks == before:
            return None
        event = KVCacheResize("wake", before, self.num_blocks, delta, 0, 0,
                              time.perf_counter() - start, time.monotonic())
        self.events.append(event)
        self.num_shrinks += 1
        logger.warning("woke the KV cache at %d blocks, not the %d it had: the device no longer "
                       "has the memory for them; resize_kv_cache() grows it back once it has",
                       self.num_blocks, before)
        return event

    def _recommit_sizes(self, num_blocks: int, fallback: int | None) -> list[int]:
        """`num_blocks`, then `fallback`, then halvings with segments ending on a granule,
        down to the floor rounded up to such a size (which takes the floor's memory)."""
        granule = self._granule()
        spec, floor = self.config.kv_cache_spec(), self._granule_ceil(self.floor, granule)
        sizes = [num_blocks] + ([fallback] if fallback is not None else [])
        while sizes[-1] > floor:
            sizes.append(max(spec.granule_aligned_blocks(sizes[-1] // 2, granule), floor))
        return list(dict.fromkeys(s for s in sizes if s <= num_blocks)) or [num_blocks]

    def _set_blocks(self, num_blocks: int) -> None:
        """Size the block manager (every block free) and the config to `num_blocks`."""
        bm = self.scheduler.block_manager
        if num_blocks < bm.num_blocks:
            bm.shrink(num_blocks)
        elif num_blocks > bm.num_blocks:
            bm.grow(num_blocks)
        self.config.cache_config.num_gpu_blocks = num_blocks

    def _commit(self, num_blocks: int) -> list[int]:
        try:
            deltas = self.executor.collective_rpc("resize_kv_cache", num_blocks)
        except BaseException:
            self._reconcile()
            raise
        return deltas

    def _reconcile(self) -> None:
        """After a commit failed on some worker: the block manager takes what every worker
        backs, and workers backing more give it back (whole chunks: no memory needed)."""
        bm = self.scheduler.block_manager
        committed = [c for c, _, _ in self.executor.collective_rpc("kv_cache_blocks")]
        if min(committed) > bm.num_blocks:  # a shrink that failed: its blocks are still there
            bm.grow(min(committed))
        self.config.cache_config.num_gpu_blocks = bm.num_blocks
        if max(committed) > bm.num_blocks:
            try:
                self.executor.collective_rpc("resize_kv_cache", bm.num_blocks)
            except Exception as error:  # the pages stay mapped, unused, until the next resize
                logger.warning("KV cache workers disagree after a failed resize and could not "
                               "be brought to %d blocks: %s", bm.num_blocks, error)

    # -- the governor ------------------------------------------------------------------------

    def govern(self, governor: KVCacheGovernor, settle: Callable[[], None],
               now: float, read_usage: Callable[[], KVUsage] | None = None,
               board: DemandBoard | None = None) -> KVCacheResize | None:
        """One poll of `governor` (no-op between poll intervals): read device free memory and
        shrink or grow as it decides, given the cache's usage (`read_usage`, called only on a
        poll: what it reports, preemptions included, is since the last poll); with a demand
        `board`, say what this cache lacks there, and let an idle one give back only what its
        peers lack. `settle` applies the step in flight, called only right before a resize.
        Never raises for want of memory: a shrink falls back to unmapping whole chunks. A
        resize that fails is retried after the governor's backoff (`KVCacheGovernor.failed`: a
        grow's first is its interval), which doubles with each consecutive failure."""
        if not governor.due(now):
            return None
        usage = None if read_usage is None else read_usage()
        free, total = self._device_memory()
        peers_keep = None
        if usage is not None and board is not None:
            self._publish_demand(board, usage, now)
            peers_keep = self._peers_keep(board, usage, governor.spare_bytes(free, total))
        want = governor.decide(free, total, now, usage)
        if want > 0:
            return self._govern_shrink(governor, settle, want, free)
        if want < 0:
            event = self._govern_grow(governor, settle, -want, free)
            if event is not None and usage is not None and board is not None:
                # What it still lacks, at once: an idle peer that read the want from before
                # this grow would give it a second time.
                grown = replace(usage, num_blocks=event.num_blocks_after, short=False)
                self._publish_demand(board, grown, now)
            return event
        if usage is None:
            return None
        target, cause = governor.idle_shrink(usage, now, peers_keep), "idle"
        if target is None:
            target, cause = governor.share_shrink(usage, now, peers_keep), "share"
        if target is not None and (target := self.shrink_size(target)) < self.num_blocks:
            return self._idle_shrink(governor, settle, target, free, cause)
        return None

    def _device_memory(self) -> tuple[int, int]:
        """Device free and total bytes, the least over the workers (the tightest one decides)."""
        memory = self.executor.collective_rpc("device_memory")
        return min(f for f, _ in memory), min(t for _, t in memory)

    def _publish_demand(self, board: DemandBoard, usage: KVUsage, now: float) -> None:
        """Say on `board` the bytes this cache lacks, up to its budget (0 unless it needs
        more: `KVUsage.needs_more`)."""
        budget = min(self.limits()[1:]) if usage.needs_more else usage.num_blocks
        board.publish(usage.shortfall(budget) * self.config.kv_cache_spec().block_bytes, now)

    def _peers_keep(self, board: DemandBoard, usage: KVUsage, spare: int) -> int | None:
        """The blocks this cache keeps once its peers on `board` have what they lack beyond the
        `spare` free bytes they can take themselves (None: no peer on the device, or a cache
        short of blocks itself): a size whose pages free at least that, so the give is one
        shrink, not one per poll while the freed bytes fall short by a chunk's remainder. A
        want under one `max_model_len` sequence is not worth a resize: it keeps all. A busy
        cache (not idle by its use) keeps at least its demand plus one such sequence and
        every block a running sequence holds (`share_shrink`: it gives its free tail only)."""
        if usage.short:
            return None
        peers_short = board.peers_short_bytes()
        if peers_short is None:
            return None
        give, block_bytes = peers_short - spare, self.config.kv_cache_spec().block_bytes
        if give < usage.floor * block_bytes:
            return usage.num_blocks
        # Fewer blocks by the want, and no more than leave the pages it frees (a chunk's
        # unused remainder frees nothing).
        keep = min(usage.num_blocks - -(-give // block_bytes),
                   *self.executor.collective_rpc("kv_cache_blocks_at", -give))
        if usage.is_low:
            return keep
        return max(keep, usage.demand_blocks + usage.floor, self._live_end())

    def _live_end(self) -> int:
        """One past the highest block id a running sequence holds: a shrink to it preempts
        nothing. Live blocks need not lie at the front (the block manager hands out blocks
        without a prefix-cache entry first, never-used tail blocks among them), so a busy
        cache gives what lies past its last live block, or nothing."""
        return 1 + max((max(seq.block_table, default=-1) for seq in self.scheduler.running),
                       default=-1)

    def _idle_shrink(self, governor: KVCacheGovernor, settle: Callable[[], None],
                     target: int, free: int, cause: str = "idle") -> KVCacheResize | None:
        """An idle cache's give-back (`cause` "idle"), or a busy one's tail to its peers
        ("share", which holds this cache's grows back for the interval: the peer takes it)."""
        settle()
        try:
            event = self.resize(target, cause, free)
        except KVCacheResizeError as error:
            logger.error("the %s KV cache could not shrink to %d blocks (%s); it holds %d; %s",
                         "idle" if cause == "idle" else "busy", target, error, self.num_blocks,
                         self._backoff(governor, False))
            return None
        if cause == "idle":
            self.num_idle_shrinks += 1
        else:
            self.num_share_shrinks += 1
        governor.resized(event.time, idle=cause == "idle")
        return event

    def _govern_shrink(self, governor: KVCacheGovernor, settle: Callable[[], None],
                       nbytes: int, free: int) -> KVCacheResize | None:
        # (A shrink that finds no memory to cut a chunk goes through whole chunks: `shrink`.)
        target = max(min(self.executor.collective_rpc("kv_cache_blocks_at", -nbytes)),
                     self.shrink_floor())
        if target >= self.num_blocks:  # at one max_model_len sequence: nothing to give
            if not self._warned_at_floor:
                logger.warning("device free memory (%s) is under the low watermark and the KV "
                               "cache holds one max_model_len sequence (%d blocks), the least "
                               "it may: it cannot give more", format_bytes(free),
                               self.num_blocks)
                self._warned_at_floor = True
            return None
        settle()
        try:
            event = self.resize(target, "governor", free)
        except KVCacheResizeError as error:
            logger.error("the governor could not shrink the KV cache to %d blocks (%s); it "
                         "holds %d; %s", target, error, self.num_blocks,
                         self._backoff(governor, False))
            return None
        governor.resized(event.time)
        return event

    def _govern_grow(self, governor: KVCacheGovernor, settle: Callable[[], None],
                     nbytes: int, free: int) -> KVCacheResize | None:
        holds_back = True  # an attempt that grew nothing: the next waits the interval
        try:
            _, capacity, budget = self.limits()
            if min(capacity, budget) <= self.num_blocks:
                return None  # at the budget
            fits = min(self.executor.collective_rpc("kv_cache_blocks_at", nbytes))
            if fits <= self.num_blocks:
                # Free memory a few MiB over the band's floor (torch's allocator or a peer
                # moved a little) holds no further block or chunk: nothing was tried, so
                # nothing holds the next grow back. A peer that gives back its cache a moment
                # later is taken at the next poll, not an interval on.
                holds_back = False
                return None
            settle()
            try:
                event = self.resize(min(fits, capacity, budget), "governor", free)
            except KVCacheResizeError as error:
                logger.warning("%s; %s", error, self._backoff(governor, True))
                return None
            holds_back = False
            governor.resized(event.time, grew=True)
            return event
        finally:
            if holds_back:
                governor.grow_attempted(time.monotonic())

    @staticmethod
    def _backoff(governor: KVCacheGovernor, grow: bool) -> str:
        """Note a failed resize on `governor` (its backoff grows); what to log about it."""
        wait = governor.failed(time.monotonic(), grow)
        n = governor.num_failed_grows if grow else governor.num_failed_shrinks
        return (f"the governor retries in {wait:.1f} s ({n} "
                f"{'grows' if grow else 'shrinks'} failed in a row)")

    # -- a cache a failure released ------------------------------------------------------------

    def restore(self, free_bytes: int | None = None,
                max_blocks: int | None = None) -> KVCacheResize:
        """Back a cache that a failed resize left released (`on_released`), zeroed, at the size
        it was left at, or `max_blocks` if fewer (the free memory holds no more), halving down
        to one `max_model_len` sequence where the memory is short, as a wake does (both
        `recommit`); logged and counted as a grow (cause `restore`; `num_blocks_before` 0:
        nothing was backed). Raises `KVCacheResizeError`, counted as a failed grow, where not
        even one sequence fits or a driver call failed: the cache stays released, at its
        size, which the next attempt tries again."""
        target, start = self.num_blocks, time.perf_counter()
        try:
            delta = self.recommit(target if max_blocks is None else min(target, max_blocks))[0]
        except KVCacheResizeError:
            self._set_blocks(target)  # the next attempt tries the whole size again
            self.num_failed_grows += 1
            raise
        event = KVCacheResize("restore", 0, self.num_blocks, delta, 0, 0,
                              time.perf_counter() - start, time.monotonic(), free_bytes)
        self.events.append(event)
        self.num_grows += 1
        self._warned_at_floor = False
        logger.warning(
            "KV cache backed again (restore) after a failed resize released it: %d blocks (+%s) "
            "in %.1f ms%s", self.num_blocks, format_bytes(delta), 1e3 * event.seconds,
            "" if free_bytes is None else f"; device free memory {format_bytes(free_bytes)}")
        return event

    def govern_restore(self, governor: KVCacheGovernor, now: float) -> KVCacheResize | None:
        """The governor's poll while a failure left the cache released: back it again
        (`restore`) once `governor.grow_due` (the minimum interval since the release, and
        the backoff of the attempts that failed) and the device's free memory holds one
        `max_model_len` sequence with the low watermark to spare: at its size or the most
        blocks that fit there, so the next poll does not take it back (the governor grows it
        later). Never raises: a failed attempt is retried after the governor's backoff, which
        doubles with each consecutive failure."""
        if not governor.due(now) or not governor.grow_due(now):
            return None
        free, total = self._device_memory()
        low, _ = governor.config.watermarks(total)
        # The cache holds no pages: what fits in the free memory above the low watermark.
        fits = min(self.executor.collective_rpc("kv_cache_blocks_at", free - low))
        if fits < self.floor:
            return None
        try:
            event = self.restore(free, max_blocks=fits)
        except KVCacheResizeError as error:
            logger.warning("%s; %s", error, self._backoff(governor, True))
            governor.grow_attempted(time.monotonic())
            return None
        governor.resized(event.time, grew=True)
        return event

    # -- reporting ---------------------------------------------------------------------------

    def state(self, governor: KVCacheGovernor | None) -> dict[str, Any]:
        """The cache's size, bounds, resize counts, governor settings and latest resizes (what
        `GET /kv_cache` answers)."""
        floor, capacity, budget = self.limits()
        bm = self.scheduler.block_manager
        committed, reserved = self.executor.collective_rpc("kv_cache_bytes")[0]
        state: dict[str, Any] = {
            "num_blocks": bm.num_blocks, "num_free_blocks": bm.num_free_blocks,
            "block_size": bm.block_size, "min_blocks": floor, "max_blocks": min(capacity, budget),
            "capacity_blocks": capacity, "committed_bytes": committed, "reserved_bytes": reserved,
            "num_shrinks": self.num_shrinks, "num_grows": self.num_grows,
            "num_failed_grows": self.num_failed_grows,
            "num_failed_shrinks": self.num_failed_shrinks,
            "num_idle_shrinks": self.num_idle_shrinks,
            "num_share_shrinks": self.num_share_shrinks, "elastic": None,
            "latest_resizes": [asdict(e) for e in list(self.events)[-16:]],
        }
        if governor is not None:
            c = governor.config
            state["elastic"] = {"low_watermark": str(c.low_watermark),
                                "high_watermark": str(c.high_watermark),
                                "min_interval_s": c.min_interval_s, "idle_s": c.idle_s,
                                "demand_dir": c.demand_dir}
        return state
