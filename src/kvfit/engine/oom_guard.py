"""The out-of-memory guard: a step that runs the device out of memory shrinks the KV cache from
its tail and runs again instead of failing the engine (DESIGN.md, "Memory that warmup must see").

Measured sizing keeps free what warmup saw plus a margin; what warmup still missed lands here.
The cache's addresses never move, so a shrink leaves captured graphs valid. Each event is
logged with the margin that would have avoided it, and kept in `OOMGuard.events`.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvfit.engine.executor import ExecutorFailedError
from kvfit.engine.kv_resize import KVCacheResizeError
from kvfit.kv.report import format_bytes
from kvfit.vmm import VmmError, VmmOutOfMemoryError

if TYPE_CHECKING:
    from kvfit.engine.config import EngineConfig
    from kvfit.engine.kv_resize import KVCacheResizer

logger = logging.getLogger(__name__)

MAX_SHRINKS_PER_STEP = 4
"""Shrinks one step may cause before the guard gives up (each retry frees more)."""

_REQUESTED = re.compile(r"Tried to allocate (\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB)")
_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


class KVCacheOutOfMemoryError(RuntimeError):
    """A step ran the device out of memory and the KV cache could not give enough back."""


@dataclass(frozen=True)
class OOMGuardEvent:
    """One out-of-memory error absorbed by the guard.

    `requested_bytes` is the failed allocation as the error states it (0 when it does not).
    `implied_margin_bytes` is the margin startup sizing would have needed to avoid every event
    so far: the report's margin plus all the guard has freed. An event of a cache that cannot
    shrink (sized by estimate or override) has equal block counts and frees nothing.
    """

    requested_bytes: int
    num_blocks_before: int
    num_blocks_after: int
    freed_bytes: int
    num_preempted: int
    implied_margin_bytes: int
    message: str


def is_device_oom(error: BaseException) -> bool:
    """Whether `error` is the device running out of memory (torch's allocator, or a library
    such as cuBLAS failing to allocate its workspace)."""
    if isinstance(error, KVCacheOutOfMemoryError | ExecutorFailedError):
        return False  # (a dead worker's message may quote an out-of-memory error)
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "CUBLAS_STATUS_ALLOC_FAILED" in text or "out of memory" in text.lower())


def requested_bytes(message: str) -> int:
    """The size in torch's "Tried to allocate 20.00 MiB" (rounded up), else 0."""
    match = _REQUESTED.search(message)
    if match is None:
        return 0
    return math.ceil(float(match[1]) * _UNITS[match[2]])


@dataclass
class OOMGuard:
    """Makes room for a step that failed with a device out-of-memory error.

    An extensible cache shrinks from its tail by the failed request plus one commit granule
    (doubling the granules on each further retry of the same step, for errors that state no
    size), never below one `max_model_len` sequence: the tail's prefix-cache entries are
    evicted and the sequences holding tail blocks preempted (recomputed later), through the
    same `KVCacheResizer` as every other resize (a cache a KV connector registered as one
    chunk per segment is recommitted whole at that size: `KVCacheResizer.recommit`). A shrink
    that fails with a driver error other than out of memory leaves the cache consistent: the
    step just runs again. A cache that cannot shrink only gets torch's idle memory emptied,
    once per step.
    """

    config: EngineConfig
    resizer: KVCacheResizer
    margin_bytes: int  # what startup sizing kept free for the unforeseen
    max_shrinks_per_step: int = MAX_SHRINKS_PER_STEP
    events: list[OOMGuardEvent] = field(default_factory=list)
    freed_bytes: int = 0  # by every shrink so far

    @property
    def num_events(self) -> int:
        return len(self.events)

    @property
    def num_shrinks(self) -> int:
        return sum(e.num_blocks_after < e.num_blocks_before for e in self.events)

    def recover(self, message: str, attempt: int) -> OOMGuardEvent:
        """Make room after the `attempt`-th launch (0 = first) of a step failed with the device
        OOM `message`; the caller then schedules and launches again.

        No step may be in flight: a shrink unmaps memory that a running step may address.
        Raises `KVCacheOutOfMemoryError`, naming the settings that would make room, where the
        cache cannot give more.
        """
        cc = self.config.cache_config
        requested = requested_bytes(message)
        before = cc.num_gpu_blocks
        if not cc.enable_extensible_kv_cache:
            if attempt > 0:
                raise self._error(f"a step ran the device out of memory again after torch's "
                                  f"idle memory was emptied, and a KV cache sized by "
                                  f"{cc.sizing_method} cannot shrink", message)
            self.resizer.executor.collective_rpc("empty_cache")
            return self._record(requested, before, before, 0, 0, message)
        if attempt >= self.max_shrinks_per_step:
            raise self._error(f"a step still ran the device out of memory after the KV cache "
                              f"shrank for it as often as one step may (max_shrinks_per_step="
                              f"{self.max_shrinks_per_step}), to {before} blocks", message)
        after = self._shrink_target(requested, attempt)
        if after >= before:
            raise self._error(f"a step ran the device out of memory and the KV cache cannot "
                              f"shrink: it holds {before} blocks, no more than one "
                              f"max_model_len sequence needs", message)
        preempted = self.resizer.scheduler.num_preemptions
        try:
            delta, num_preempted, _ = self.resizer.shrink(after, empty_cache=True)
        except (VmmError, KVCacheResizeError) as error:
            if not self._retryable(error):
                # A shrink copies the kept part of the physical chunk it cuts, so it needs
                # memory; a one-chunk cache's recommit failed even at the floor.
                raise self._error("a step ran the device out of memory and shrinking the KV "
                                  "cache did too", f"{message}; the shrink: {error}") from error
            # The cache is consistent (as it was, or shrunk with pages still to give back):
            # the step runs again and, short of memory still, the next attempt shrinks more.
            logger.warning("shrinking the KV cache for a step that ran the device out of "
                           "memory failed, not for want of memory (%s); running the step "
                           "again", error)
            return self._record(requested, before, self.resizer.num_blocks, 0,
                                self.resizer.scheduler.num_preemptions - preempted, message)
        after = self.resizer.num_blocks  # a one-chunk cache's recommit may fall back smaller
        freed = -delta
        self.freed_bytes += freed
        return self._record(requested, before, after, freed, num_preempted, message)

    def _retryable(self, error: VmmError | KVCacheResizeError) -> bool:
        """Whether a failed shrink left the cache usable for another try: a driver error
        other than out of memory (directly, or under a one-chunk cache's recommit that backed
        the old size again), the cache not released."""
        cause = error if isinstance(error, VmmError) else error.__cause__
        if not isinstance(cause, VmmError) or isinstance(cause, VmmOutOfMemoryError):
            return False
        states = self.resizer.executor.collective_rpc("sleep_state")
        return not any(state.kv_cache_asleep for state in states)

    def _shrink_target(self, requested: int, attempt: int) -> int:
        """Blocks every worker can keep after freeing `requested` bytes and 2**attempt
        granules; never fewer than one max_model_len sequence needs (`shrink_floor`)."""
        fits = min(self.resizer.executor.collective_rpc("kv_cache_shrink_target", requested,
                                                        1 << attempt))
        return max(fits, self.resizer.shrink_floor())

    def _record(self, requested: int, before: int, after: int, freed: int, num_preempted: int,
                message: str) -> OOMGuardEvent:
        event = OOMGuardEvent(requested, before, after, freed, num_preempted,
                              self.margin_bytes + self.freed_bytes, message)
        self.events.append(event)
        logger.warning(
            "device out of memory in a step (%s requested); KV cache %d -> %d blocks, %s freed, "
            "%d sequences preempted; a startup margin of %s would have avoided it (now %s: "
            "kv_cache_margin_floor_bytes / kv_cache_margin_fraction). Error: %s",
            format_bytes(requested), before, after, format_bytes(freed), num_preempted,
            format_bytes(event.implied_margin_bytes), format_bytes(self.margin_bytes),
            message.splitlines()[0] if message else "")
        return event

    def _error(self, what: str, message: str) -> KVCacheOutOfMemoryError:
        cc, sc = self.config.cache_config, self.config.scheduler_config
        if cc.enable_extensible_kv_cache:
            keep = (f"raise kv_cache_margin_floor_bytes ({cc.kv_cache_margin_floor_bytes}) or "
                    f"kv_cache_margin_fraction ({cc.kv_cache_margin_fraction}) so sizing keeps "
                    f"more memory free")
        else:
            if cc.sizing_method == "override":
                knob = "kv_cache_memory_bytes / num_gpu_blocks_override"
            elif self.config.device.type == "cpu":
                knob = "cpu_kv_cache_space_bytes"
            else:
                knob = f"gpu_memory_utilization ({cc.memory_utilization})"
            keep = (f"lower {knob}, or use the extensible KV cache, which this guard shrinks "
                    f"and whose kv_cache_margin_floor_bytes / kv_cache_margin_fraction set what "
                    f"stays free")
        return KVCacheOutOfMemoryError(
            f"{what}; lower max_num_seqs ({sc.max_num_seqs}) or max_model_len "
            f"({sc.max_model_len}), or {keep}. The error: {message}")
