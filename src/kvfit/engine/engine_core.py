"""The engine core: starts the workers in DESIGN.md's order, sizes the KV cache, then runs
scheduler steps. The only place that knows the startup order."""

from __future__ import annotations

import itertools
import logging
import time
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvfit.connectors import KVConnector, KVLoadError, create_kv_connector, model_identity
from kvfit.elastic import DemandBoard, KVCacheGovernor, KVUsage
from kvfit.engine.async_output import AsyncModelOutput
from kvfit.engine.block_manager import BlockManager
from kvfit.engine.config import EngineConfig
from kvfit.engine.detokenizer import Detokenizer
from kvfit.engine.executor import create_executor
from kvfit.engine.kv_resize import (
    KVCacheReleasedError,
    KVCacheResize,
    KVCacheResizeError,
    KVCacheResizer,
)
from kvfit.engine.oom_guard import KVCacheOutOfMemoryError, OOMGuard, is_device_oom
from kvfit.engine.scheduler import Scheduler
from kvfit.engine.sequence import ScheduledBatch, Sequence
from kvfit.engine.sleep import (
    MODES,
    SleepReport,
    SleepState,
    WakeUpOutOfMemoryError,
    check_sleep_args,
    resolve_tags,
)
from kvfit.kv.report import KVCacheReport, format_bytes
from kvfit.kv.sizing import min_over_workers
from kvfit.vmm import VmmOutOfMemoryError

logger = logging.getLogger(__name__)

RELEASED_RETRY_S = 2.0
"""Without the elastic governor, how often a step retries backing a KV cache that a failed
resize released: often enough that requests waiting on it resume within seconds of the memory
coming back, rarely enough that a device still short of it costs nothing."""
RELEASED_TIMEOUT_S = 60.0
"""Most seconds requests wait on a KV cache a failed resize released: past it they fail
(`KVCacheReleasedError`; a server's 503) rather than wait for memory that may never come back,
and requests added later fail at once until the engine backs the cache again. A co-tenant's
passing spike is over well within it."""
RELEASED_WAIT_S = 0.5
"""Most a step waits for the next retry while requests wait on a released cache (a front end's
commands are served in between)."""

MAX_PREFIX_CACHE_BLOCKS = 1 << 18
"""Most blocks a device cache holds beyond what its sequences can use (see `_capacity`)."""


@contextmanager
def _stage(stages: dict[str, float], name: str, what: str) -> Iterator[None]:
    """Log a startup stage as it starts and ends (the progress a front end, the CLI or the
    server, shows while a large model starts), and add its seconds to `stages[name]`."""
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    elapsed = time.perf_counter() - start
    stages[name] = stages.get(name, 0.0) + elapsed
    logger.info("%s: done in %.2f s", what, elapsed)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state for metrics (sequences, not requests: a request with
    `n` completions counts `n`)."""

    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    committed_kv_bytes: int
    reserved_kv_bytes: int
    num_preemptions: int
    oom_guard_events: int
    oom_guard_shrinks: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    # Resizes at runtime (`resize_kv_cache`, the governor; the guard's are `oom_guard_shrinks`).
    kv_cache_shrinks: int = 0
    kv_cache_grows: int = 0
    kv_cache_failed_grows: int = 0
    kv_cache_failed_shrinks: int = 0
    kv_cache_resize_backoff_s: float = 0.0  # the governor's wait after failed resizes
    kv_cache_idle_shrinks: int = 0  # of the shrinks: an idle cache giving back (`elastic_idle_s`)
    kv_cache_share_shrinks: int = 0  # of the shrinks: a busy cache's free tail to its peers
    num_steps: int = 0  # steps launched since startup
    num_step_tokens: int = 0  # tokens those steps computed, prompt and output
    num_decode_steps: int = 0  # of the steps: one token per sequence (no prompt chunk)
    # The steps by tokens computed: a count per `ITERATION_TOKENS_BUCKETS` bound, then +Inf's.
    step_token_counts: tuple[int, ...] = ()
    # Tokens sampled, and prompt tokens of the sequences prefilled (at their first token).
    num_generated_tokens: int = 0
    num_prefilled_tokens: int = 0
    kv_connector_failed_saves: int | None = None  # blocks not saved; None: no connector
    # Prompt tokens whose K/V the connector's store gave (loaded, not computed); None: none.
    kv_connector_hit_tokens: int | None = None
    # A failed resize left the KV cache released: requests wait until the engine backs it
    # again (a server's /health answers 503 meanwhile).
    kv_cache_released: bool = False
    # `pause` holds new requests back (counted in `num_waiting`) until `resume`.
    paused: bool = False


class EngineCore:
    """Workers, KV cache sizing, scheduler and detokenizer of one engine.

    Startup: probe VMM (fall back to the estimate where any worker cannot back the cache), load
    and profile, reserve the capacity and commit the minimum, warm up, capture graphs once,
    size the cache (measured, estimate or override) and commit that.

    Steps overlap: step k + 1 is scheduled and launched before step k's tokens are read, so
    the host's work hides behind the device's (see `step`). A step that runs the device out of
    memory shrinks the cache and runs again (`oom_guard`).
    """

    def __init__(self, config: EngineConfig, tokenizer: object | None = None,
                 num_workers: int = 1) -> None:
        start = time.perf_counter()
        self.config = config
        # Seconds per startup stage, in the order they ran, then "total" (see `startup_stages`).
        self.startup_stages: dict[str, float] = {}
        # What names the weights in a KV connector's store, taken before they load (a
        # checkpoint saved over the folder later is another model) and given to every side.
        self._kv_store_model_id = (None if config.kv_connector_config is None else
                                   self._model_identity())
        with _stage(self.startup_stages, "start_workers", "starting workers"):
            self.executor = create_executor(config, num_workers)
        self._in_flight: tuple[ScheduledBatch, AsyncModelOutput] | None = None
        self._shut_down = False  # `shutdown` freed the workers' models: nothing runs again
        self._sleep_state = SleepState()
        # The KV cache was released by a resize that could not back even one sequence (not
        # by `sleep`): the engine backs it again by itself (`_restore_released`), and requests
        # wait meanwhile.
        self._kv_released_by_resize = False
        # A fixed-size cache stays through a sleep: waking it by name is then a no-op, so
        # vLLM-style code (weights first, then the KV cache) runs whatever the sizing.
        self._kv_cache_kept = False
        self.released_retry_s = RELEASED_RETRY_S  # without the governor (tests shorten it)
        self._released_retry_at = 0.0  # monotonic time of the next retry without the governor
        self.released_timeout_s = RELEASED_TIMEOUT_S  # (tests shorten it)
        self._released_at = 0.0  # monotonic time the cache was released
        # Sequences finished between steps (a sleep drained or aborted them, a resize applied
        # the step in flight) that no `step` has returned yet.
        self._finished_early: list[Sequence] = []
        # The sequences of the batches applied since the step before the last returned (by
        # the last `step`, or between steps by a resize or the governor settling the step in
        # flight): their tokens are the ones made ready, so a front end streaming them visits
        # these rather than every request.
        self.updated_seqs: list[Sequence] = []
        self._applied: list[Sequence] = []  # applied since the last `step` returned
        try:
            if config.elastic is not None:  # watermarks of two kinds meet the device only now
                config.elastic.watermarks(self._device_total(),
                                          free_bounded=config.device.type != "cpu")
            self.kv_cache_report = self._initialize_kv_cache()
        except BaseException:
            self.shutdown()  # a failed startup must not keep the model and cache alive
            raise
        cc, sc = config.cache_config, config.scheduler_config
        self.scheduler = Scheduler(
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            max_model_len=sc.max_model_len,
            long_prefill_token_threshold=sc.long_prefill_token_threshold,
            scheduling_policy=sc.scheduling_policy,
            block_manager=BlockManager(cc.num_gpu_blocks, cc.block_size, cc.enable_prefix_caching),
            eos_token_id=config.model_config.eos_token_ids,
            detokenizer=Detokenizer(tokenizer),
            kv_connector=self._create_kv_connector(),
        )
        self.kv_resizer = KVCacheResizer(config, self.executor, self.scheduler,
                                         on_released=self._on_kv_released)
        self.oom_guard = OOMGuard(config, self.kv_resizer, self.kv_cache_report.margin)
        self.kv_cache_governor = self._kv_cache_governor()
        self.demand_board = self._demand_board()
        self._preemptions_seen = 0  # the scheduler's count at the governor's last poll
        self.startup_stages["total"] = time.perf_counter() - start

    def _kv_cache_governor(self) -> KVCacheGovernor | None:
        """The co-tenancy governor (`elastic_kv_cache`), its watermarks checked on this device;
        None when off, or when the cache fell back to a fixed size."""
        elastic = self.config.elastic
        if elastic is None:
            return None
        if not self.config.cache_config.enable_extensible_kv_cache:
            logger.warning("elastic_kv_cache needs the extensible KV cache, which is off on "
                           "this device (see above): the cache keeps its size")
            return None
        low, high = elastic.watermarks(self._device_total())
        logger.info("elastic KV cache: shrinks under %s free, grows above %s free (at most "
                    "once per %.1f s)", format_bytes(low), format_bytes(high),
                    elastic.min_interval_s)
        return KVCacheGovernor(elastic)

    def _demand_board(self) -> DemandBoard | None:
        """This engine's entry on its devices' demand board (`elastic_demand_dir`), where
        elastic engines sharing the devices say what their caches lack."""
        elastic = self.config.elastic
        if self.kv_cache_governor is None or elastic is None or elastic.demand_dir is None:
            return None
        keys = sorted({key for key in self.executor.collective_rpc("device_key")})
        return DemandBoard(elastic.demand_dir, "+".join(keys))

    def _device_total(self) -> int:
        """The smallest device's memory over the workers (what watermarks are fractions of)."""
        return min(t for _, t in self.executor.collective_rpc("device_memory"))

    def _initialize_kv_cache(self) -> KVCacheReport:
        cc = self.config.cache_config
        rpc = self.executor.collective_rpc
        if cc.enable_extensible_kv_cache:
            reasons = [(rank, r) for rank, r in enumerate(rpc("vmm_unavailable_reason"))
                       if r is not None]
            if reasons:
                # Every rank falls back, so all of them size (and warm up) the same way; an
                # unset utilization follows, back to the estimate's 0.92.
                cc.enable_extensible_kv_cache = False
                logger.warning("extensible KV cache unavailable on rank %d (%s); sizing every "
                               "worker by estimate at memory utilization %s", *reasons[0],
                               cc.memory_utilization)
        method = cc.sizing_method
        extensible = method == "measured"
        stages = self.startup_stages
        with _stage(stages, "load_weights", "loading weights"):
            rpc("load_model")
        with _stage(stages, "profile", "profiling"):
            estimate = min_over_workers(rpc("profile", method == "estimate"))
        capacity = self._capacity(method, estimate)
        if method == "override":  # a fixed size: too small is known before any warmup
            self._check_max_model_len_fits(capacity)
        with _stage(stages, "allocate_kv_cache", "allocating the KV cache"):
            committable = min_over_workers(rpc("initialize_kv_cache", capacity, extensible))
        # Every rank's commit granule (0 without the extensible cache); the largest, so a size
        # aligned to it is aligned on every rank (connectors align segments to it).
        self.kv_commit_granule = max(rpc("kv_cache_commit_granule"))
        with _stage(stages, "warm_up", "warming up"):
            rpc("warm_up", committable)
        # Eager (always so on the CPU) captures nothing: no stage to show.
        with (nullcontext() if self.config.enforce_eager
              else _stage(stages, "capture_graphs", "capturing CUDA graphs")):
            rpc("capture_cuda_graphs")
        with _stage(stages, "size_kv_cache", f"sizing the KV cache ({method})"):
            num_blocks = (min_over_workers(rpc("measure_kv_cache_blocks")) if extensible
                          else capacity)
            self._check_max_model_len_fits(num_blocks)
            if extensible:
                rpc("extend_kv_cache", num_blocks)
            if self.config.kv_connector_config is not None:  # it sees the final size only
                rpc("init_kv_connector", self._kv_store_model_id)
        cc.num_gpu_blocks = num_blocks
        report = rpc("kv_cache_report", method, num_blocks, self._max_blocks(method))[0]
        logger.info("KV cache:\n%s", report.format_table())
        return report

    def _create_kv_connector(self) -> KVConnector | None:
        """The scheduler side of the configured connector (after the workers registered)."""
        cfg = self.config.kv_connector_config
        if cfg is None:
            return None
        return create_kv_connector(cfg, "scheduler", self.config.kv_cache_spec(),
                                   self._kv_store_model_id)

    def _capacity(self, method: str, estimate: int) -> int:
        """Blocks to allocate: the override when one is set, else the estimate (which the
        measured path reserves as capacity and measures within), capped by `_max_blocks`."""
        cc = self.config.cache_config
        if method == "override":
            if cc.num_gpu_blocks_override is not None:
                return cc.num_gpu_blocks_override
            return cc.kv_cache_memory_bytes // self.config.kv_cache_spec().block_bytes
        return max(min(estimate, self._max_blocks(method)), 1)

    def _max_blocks(self, method: str) -> int | None:
        """The most blocks worth holding (None under an override, which is taken as given).

        Blocks beyond what `max_num_seqs` sequences of `max_model_len` hold only keep
        prefix-cache entries alive. On the host, whose memory other processes need too, the
        cache stops there. A device is the engine's, so the rest serves the prefix cache up to
        `MAX_PREFIX_CACHE_BLOCKS`, past which the block manager's bookkeeping, not memory,
        becomes the cost (kvfit-tiny on 141 GB: 8.5M blocks); real models stay below it.
        """
        if method == "override":
            return None
        cc, sc = self.config.cache_config, self.config.scheduler_config
        cap = sc.max_num_seqs * -(-sc.max_model_len // cc.block_size)
        if self.config.device.type != "cpu":
            cap = max(cap, MAX_PREFIX_CACHE_BLOCKS)
        return cap

    def _check_max_model_len_fits(self, num_blocks: int) -> None:
        """Refuse a cache that cannot hold one `max_model_len` sequence, naming what to
        change; under `max_model_len` "auto", lower it to what the cache holds instead."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        mc = self.config.model_config
        fits = num_blocks * cc.block_size
        if fits >= sc.max_model_len:
            return
        if mc.max_model_len_auto and fits >= 2:  # a prompt token and one generated
            logger.warning("max_model_len auto: the model's context of %d tokens does not fit "
                           "the KV cache (%d blocks of %d tokens); serving with "
                           "max_model_len=%d", sc.max_model_len, num_blocks, cc.block_size, fits)
            # Warmup ran at the longer length: every step at the shorter one is within it.
            mc.max_model_len = sc.max_model_len = fits
            return
        if cc.enable_extensible_kv_cache:
            # Measured sizing already takes all that is free (utilization 1.0): what is left
            # to change is what the transient and graphs take, which these two bound.
            hint = "lower max_model_len or max_num_seqs"
            if self.config.device.type == "cpu":
                hint += ", or raise cpu_kv_cache_space_bytes"
        elif cc.num_gpu_blocks_override is not None:
            hint = "raise num_gpu_blocks_override or lower max_model_len"
        elif cc.kv_cache_memory_bytes is not None:
            hint = "raise kv_cache_memory_bytes or lower max_model_len"
        elif self.config.device.type == "cpu":
            hint = "raise cpu_kv_cache_space_bytes or lower max_model_len"
        else:
            hint = "raise gpu_memory_utilization or lower max_model_len"
        kc = self.config.kv_connector_config
        if (self.config.device.type == "cpu" and cc.sizing_method != "override"
                and kc is not None and kc.kv_offloading_bytes):
            hint += (", or lower kv_offloading_size (on the CPU its host tier comes out of the "
                     "same budget)")
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks of {cc.block_size} tokens = "
            f"{num_blocks * cc.block_size} tokens, fewer than one max_model_len "
            f"({sc.max_model_len}) sequence needs; {hint}"
        )

    def add_request(self, seq: Sequence) -> None:
        """Queue `seq`; raises `ValueError` if it can never be scheduled, `RuntimeError` while
        asleep or while woken weights are not loaded (`check_can_run`). While a failed resize
        left the KV cache released, `seq` waits until the engine backs it again, or fails once
        the cache has been released for `released_timeout_s` (`step`)."""
        self.check_can_run()
        self.scheduler.add(seq)

    def check_can_run(self) -> None:
        """Raise `RuntimeError` naming the call to make if a step could not run now (shut
        down, asleep, or weights woken without contents). A KV cache that a failed resize
        released is no reason: requests wait for the engine to back it again."""
        self._check_not_shut_down("generate()")
        state = self._sleep_state
        if self._kv_released_by_resize:  # only the cache: weights never loaded still refuse
            state = replace(state, kv_cache_asleep=False)
        state.check_can_run()

    def worker_rpc(self, call: str, method: str, *args: Any) -> list[Any]:
        """`Worker.method(*args)` on every worker, answers in rank order, for `call` (the
        `LLM` method asking: named in the error after `shutdown`)."""
        self._check_not_shut_down(call)
        return self.executor.collective_rpc(method, *args)

    def _check_not_shut_down(self, call: str) -> None:
        if self._shut_down:
            raise RuntimeError(f"{call} after shutdown(): the engine freed its model and KV "
                               f"cache; create a new LLM")

    @property
    def kv_cache_released(self) -> bool:
        """Whether a failed resize (not `sleep`) left the KV cache released: no step runs, and
        requests wait, until the engine backs it again (`step` retries: through the governor
        when it is on, else every `released_retry_s` seconds); past `released_timeout_s` of
        it, `step` raises `KVCacheReleasedError` while requests wait."""
        return self._kv_released_by_resize

    def _on_kv_released(self) -> None:
        now = time.monotonic()
        if not self._kv_released_by_resize:
            self._released_at = now
        self._kv_released_by_resize = True
        self._released_retry_at = now + self.released_retry_s
        if self.kv_cache_governor is not None:
            # Backing it again waits the interval, as a grow after a shrink does.
            self.kv_cache_governor.resized(now)
        self._refresh_sleep_state()

    def _restore_released(self, now: float) -> None:
        """Try to back the KV cache that a failed resize released: on the governor's poll
        once its interval has passed and free memory allows, else at most every
        `released_retry_s` seconds. A failure leaves it released for the next try."""
        if self.kv_cache_governor is not None:
            self.kv_resizer.govern_restore(self.kv_cache_governor, now)
        elif now >= self._released_retry_at:
            self._released_retry_at = now + self.released_retry_s
            try:
                self.kv_resizer.restore()
            except KVCacheResizeError as error:
                logger.warning("%s; retrying in %.1f s", error, self.released_retry_s)
        self._refresh_sleep_state()

    def _released_too_long(self, now: float) -> KVCacheReleasedError:
        """What the requests waiting on a cache released past `released_timeout_s` fail with
        (`step` raises it; `fail_step` then aborts them all)."""
        num_requests = len({seq.request_id for queue in (self.scheduler.waiting,
                                                         self.scheduler.running)
                            for seq in queue})
        return KVCacheReleasedError(
            f"the KV cache has been released for {now - self._released_at:.1f} s, since a "
            f"failed resize found no device memory for even one max_model_len sequence: "
            f"{num_requests} waiting request(s) fail rather than wait longer "
            f"(released_timeout_s {self.released_timeout_s:g}). The engine goes on retrying; "
            f"send them again once it has backed the cache (/health answers 200)")

    def _wait_for_restore(self, now: float) -> None:
        """While requests wait on a released cache, pause until the next retry (at most
        `RELEASED_WAIT_S`) instead of spinning through empty steps."""
        governor = self.kv_cache_governor
        retry_at = (governor.last_poll + governor.config.poll_interval_s if governor is not None
                    else self._released_retry_at)
        time.sleep(min(max(0.0, retry_at - now), RELEASED_WAIT_S))

    # -- sleep mode ---------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are released (`sleep`, partly woken); not a KV
        cache that a failed resize released (`kv_cache_released`)."""
        return self._sleep_state.is_sleeping and not self._kv_released_by_resize

    def sleep(self, level: int = 1, mode: str = "wait") -> SleepReport:
        """Release the KV cache's pages and the weights' (level 1: to a host copy; level 2:
        discarded), keeping every address and graph; the workers' reports summed.

        Requests still queued or running are first finished (`mode="wait"`: stepped to the end)
        or aborted (`"abort"`); either way the step in flight completes before any page goes,
        and the sequences are returned by the next `step`. The prefix cache is invalidated.
        `"wait"` raises `RuntimeError`, changing nothing, while requests wait on a KV cache a
        failed resize released (`kv_cache_released`): they finish only once the device has
        the memory again.
        """
        check_sleep_args(level, mode)
        self._check_not_shut_down("sleep()")
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep() needs the weights in a VMM arena: create the engine with "
                             "enable_sleep_mode=True")
        if self.is_sleeping:
            raise RuntimeError(f"sleep() but the engine is already asleep "
                               f"({', '.join(self._sleep_state.asleep_tags())}); call "
                               f"wake_up() first")
        self._drain(mode, "sleep")
        self.scheduler.block_manager.reset_prefix_cache()
        self._kv_released_by_resize = False  # the user's sleep holds it now: wake_up backs it
        try:
            reports = self.executor.collective_rpc("sleep", level)
        finally:
            self._refresh_sleep_state()
        report = SleepReport.merge(reports)
        self._kv_cache_kept = "kv_cache" in report.kept and "kv_cache" not in report.released
        logger.info("asleep (level %d): released %s, kept %s", level, report.released,
                    report.kept)
        return report

    def _drain(self, mode: str, call: str) -> None:
        """Finish (`mode="wait"`: step them to the end) or abort every request queued or
        running, for `call`; the next `step` returns them. Held requests (`pause`) stay."""
        finished: list[Sequence] = []
        try:
            if mode == "wait":
                while self.scheduler.has_unfinished() or self._in_flight is not None:
                    self._check_can_drain(call)
                    finished += self.step()  # also takes what an earlier sleep left to return
            else:
                if self._in_flight is not None:
                    finished += self._apply_in_flight()  # waits for the device
                queued = (self.scheduler.waiting, self.scheduler.running)
                for request_id in dict.fromkeys(s.request_id for queue in queued for s in queue):
                    finished += self.scheduler.abort(request_id)
                self._save_finished_blocks()  # before sleep releases the pages
        finally:
            self._finished_early += finished

    def _check_can_drain(self, call: str) -> None:
        """Refuse to wait for requests that wait on a cache a failed resize released: they
        finish only once the device has the memory again, maybe never (the co-tenant that took
        it may be the one waiting for this sleep), and the wait would hold the engine's
        thread meanwhile."""
        if self._kv_released_by_resize and self.scheduler.has_unfinished():
            num_requests = len({seq.request_id for seq in self.scheduler.waiting})
            raise RuntimeError(
                f"{call}(mode='wait'): a failed resize left the KV cache released and "
                f"{num_requests} requests wait for it, which cannot finish until the engine "
                f"backs it again (once the device has the memory); call {call}(mode='abort') "
                f"to end them, or {call}() again once they finished")

    # -- pausing generation ------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        """Whether `pause` holds new requests back from scheduling."""
        return self.scheduler.paused

    def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop taking requests into steps until `resume`, e.g. to replace the weights between
        two steps (vLLM's `pause_generation`). The requests queued or running now are aborted
        (`mode="abort"`) or run to their end (`"wait"`), as `sleep` drains them, and the next
        `step` returns them; `clear_cache` then forgets the prefix cache, whose K/V the
        current weights computed. Requests added while paused are held, not refused, and
        queued by `resume`. Pausing again drains nothing (held requests stay held). Raises
        `ValueError` for another mode (vLLM's `"keep"`, which freezes running requests in
        place, is not supported) and, in mode `"wait"`, `RuntimeError` while requests wait on
        a KV cache a failed resize released (as `sleep`)."""
        if mode not in MODES:
            raise ValueError(f"pause_generation(mode={mode!r}): mode is 'abort' (abort the "
                             f"requests in flight) or 'wait' (finish them first); vLLM's "
                             f"'keep' (freeze them in place) is not supported")
        self._check_not_shut_down("pause_generation()")
        self._drain(mode, "pause_generation")
        if clear_cache:
            self.scheduler.block_manager.reset_prefix_cache()
        self.scheduler.pause()
        logger.info("generation paused (mode %s%s)", mode,
                    ", prefix cache cleared" if clear_cache else "")

    def resume(self) -> None:
        """Schedule again after `pause`: the requests held meanwhile are queued, in the order
        they came (a no-op when not paused). While asleep they then fail as any request
        would: `wake_up` first."""
        self._check_not_shut_down("resume_generation()")
        if self.scheduler.paused:
            logger.info("generation resumed (%d held requests queued)",
                        len({seq.request_id for seq in self.scheduler.held}))
        self.scheduler.resume()

    def wake_up(self, tags: list[str] | None = None, reload_weights: bool = True) -> None:
        """Wake `tags` (`weights`, `kv_cache`; None: all that sleep) at the same addresses.

        Weights come back from their host copy (level 1) or, after level 2, are reloaded from
        the model's source unless `reload_weights=False` (an RL trainer's `load_weights` then
        fills them; generating refuses to run until every weight is loaded). The KV cache comes
        back at its size, or smaller where the device no longer has the memory
        (`KVCacheResizer.wake`). Raises if a tag is not asleep; a failed recommit leaves that
        part asleep. A KV cache the sleep kept (a fixed size) wakes as a no-op.
        """
        self._check_not_shut_down("wake_up()")
        wake_all, kept_woken = tags is None, False
        if self._kv_cache_kept and tags is not None:
            tags = [tags] if isinstance(tags, str) else list(tags)
            if "kv_cache" in tags:
                logger.info("wake_up(tags=%s): the KV cache was kept through the sleep (a "
                            "fixed size): nothing to wake there", tags)
                tags = [t for t in tags if t != "kv_cache"]
                # Once per sleep, before the weights or after them (vLLM's order: the
                # engine is then awake already, and the kept cache's wake is still a no-op).
                kept_woken = True
                if not tags and not self.is_sleeping:
                    self._kv_cache_kept = False
                    return
        tags = resolve_tags(tags, self._sleep_state)
        if kept_woken:  # not before: a call refused for its other tags woke nothing
            self._kv_cache_kept = False
        by_resize = self._kv_released_by_resize  # a failed wake leaves the cause as it was
        try:
            if "weights" in tags:  # first: the KV cache takes what memory they leave
                try:
                    reloaded = any(self.executor.collective_rpc("wake_up_weights",
                                                                reload_weights))
                except VmmOutOfMemoryError as error:
                    raise WakeUpOutOfMemoryError(
                        f"wake_up(): no device memory for the weights ({error}); they stay "
                        f"asleep (the KV cache too): free device memory and call wake_up() "
                        f"again") from error
                if reloaded and self._kv_store_model_id is not None:  # the files' weights
                    self._rename_kv_store(self._model_identity(), "wake_up() reloaded the "
                                          "weights from files that changed")
            if "kv_cache" in tags:
                self.kv_resizer.wake()
        finally:
            self._refresh_sleep_state()
            self._kv_released_by_resize = by_resize and self._sleep_state.kv_cache_asleep
            self._kv_cache_kept &= not wake_all  # until its tag is named (above)
        if self._sleep_state.missing_weights and not self._sleep_state.weights_asleep:
            logger.warning("weights woken without contents: %d not loaded; generating refuses "
                           "to run until LLM.load_weights() fills them",
                           len(self._sleep_state.missing_weights))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint-named tensors into the weights in place (asleep weights are woken
        for it, the KV cache stays as it is); invalidates the prefix cache, whose K/V the old
        weights computed, and gives a KV connector's store a new namespace (`_rename_kv_store`),
        so it serves nothing the old weights computed and keeps working for the new ones. No
        request may be unfinished."""
        self._check_not_shut_down("load_weights()")
        if self.scheduler.has_unfinished() or self._in_flight is not None:
            raise RuntimeError("load_weights() while requests are unfinished; finish or abort "
                               "them first (or sleep(mode='abort'))")
        if len(self.executor.workers) != 1:
            weights = list(weights)  # every worker reads them, or they are pickled to them
        try:
            self.executor.collective_rpc("load_weights", weights)
        finally:
            # Even when a tensor is refused, those before it were copied: the prefix cache's
            # K/V (and the connector's store) belong to weights the model no longer has.
            self._refresh_sleep_state()
            self.scheduler.block_manager.reset_prefix_cache()
            if self._kv_store_model_id is not None:
                # No file names these weights, and a count of updates could name another
                # process's: a name of their own, which only this engine's blocks carry.
                self._rename_kv_store(f"{self._model_identity()}+load_weights:"
                                      f"{uuid.uuid4().hex}", "load_weights()")

    def _model_identity(self) -> str:
        """What names the model's weights in a KV connector's store, now (`model_identity`)."""
        mc = self.config.model_config
        return model_identity(mc.model, mc.load_format, mc.dtype)

    def _rename_kv_store(self, model_id: str, why: str) -> None:
        """Have both sides of the KV connector name blocks by `model_id` from now on
        (`KVConnector.weights_replaced`): the store's blocks of the weights the engine had
        are never served again, and those of its weights now are saved and found."""
        if model_id == self._kv_store_model_id:
            return
        self._kv_store_model_id = model_id
        self.scheduler.kv_connector.weights_replaced(model_id)
        self.executor.collective_rpc("kv_connector_weights_replaced", model_id)
        logger.info("%s: the KV connector's store no longer serves the old weights' blocks",
                    why)

    def _refresh_sleep_state(self) -> None:
        self._sleep_state = SleepState.merge(self.executor.collective_rpc("sleep_state"))
        self._kv_released_by_resize &= self._sleep_state.kv_cache_asleep  # until it wakes

    def abort_request(self, request_id: str) -> None:
        """Drop a queued or running request (a no-op for unknown ids)."""
        self.scheduler.abort(request_id)
        self._save_finished_blocks()

    def step(self) -> list[Sequence]:
        """Schedule and launch one step, then apply the step launched before it; returns the
        sequences that finished.

        A sequence the in-flight step samples is scheduled with its token still pending (read
        on the device). If that token stops it, the new step computed one token for nothing,
        which is dropped; stops by length are known in advance and never scheduled. Sampling
        that reads earlier output tokens on the host (penalties, multi-token bad words) cannot
        wait for its token on the device: while such a sequence runs, the step in flight is
        applied before the next one is scheduled.
        """
        now = time.monotonic()
        if self._kv_released_by_resize:
            self._restore_released(now)
        elif self.kv_cache_governor is not None and not self.is_sleeping:
            self.kv_resizer.govern(self.kv_cache_governor, self._settle, now,
                                   self._kv_usage, self.demand_board)
        finished, self._finished_early = self._finished_early, []
        if self._kv_released_by_resize:  # still: nothing runs on unmapped memory; requests wait
            self.updated_seqs, self._applied = self._applied, []
            if self.scheduler.has_unfinished():
                if now - self._released_at > self.released_timeout_s:
                    self._finished_early = finished  # returned by the next step
                    raise self._released_too_long(now)
                self._wait_for_restore(now)
            return finished
        if self.scheduler.has_unfinished():
            self.check_can_run()  # never schedule onto released memory or unloaded weights
        if self._in_flight is not None and self._pending_tokens_needed():
            finished += self._apply_in_flight()
        batch, launched = self._launch_next(finished)
        if self._in_flight is not None:
            finished += self._apply_in_flight()
        if batch is not None:
            self.scheduler.advance(batch)
            self._in_flight = (batch, launched)
        self.updated_seqs, self._applied = self._applied, []
        return finished

    def _pending_tokens_needed(self) -> bool:
        return any(seq.sampling_params.needs_output_history and seq.has_pending_token
                   for seq in self.scheduler.running)

    def _launch_next(
        self, finished: list[Sequence]
    ) -> tuple[ScheduledBatch | None, AsyncModelOutput | None]:
        """Schedule and launch the next step. On a device out-of-memory error, apply the step
        in flight (adding what finishes to `finished`), let the guard make room and schedule
        again: the failed batch was not advanced, so scheduling it again recomputes it."""
        attempt = 0
        while True:
            batch = self.scheduler.schedule()
            if batch is None:
                return None, None
            try:
                launched = self.executor.launch(batch)
            except KVLoadError as error:  # raised before the step ran: compute those blocks
                self.scheduler.recompute_lost_blocks(error)
                continue
            except RuntimeError as error:
                if not is_device_oom(error):
                    raise
                message = str(error)
            else:
                # Now, not once the step is advanced: the step in flight is applied first,
                # and the saves of what it finishes must see these saves as planned.
                if self.scheduler.kv_connector is not None and batch.kv_connector_meta is not None:
                    self.scheduler.kv_connector.launched(batch.kv_connector_meta)
                return batch, launched
            # Outside the except block the traceback is gone, and with it the failed step's
            # tensors, so the guard's empty_cache can return them.
            if self._in_flight is not None:
                finished += self._apply_in_flight()  # never shrink under a running step
            try:
                event = self.oom_guard.recover(message, attempt)
            except KVCacheOutOfMemoryError:
                if not self._kv_released_by_resize:
                    raise
                # The guard's recommit could not back even one sequence: every sequence is
                # waiting again, until the engine backs the cache (`_restore_released`).
                logger.error("the out-of-memory guard left the KV cache released; requests "
                             "wait until the device has the memory for it again")
                return None, None
            governor = self.kv_cache_governor
            if governor is not None and event.num_blocks_after < event.num_blocks_before:
                # A shrink like the governor's: the step may need that memory again at once,
                # so the governor grows back into it only after its interval.
                governor.resized(time.monotonic())
            self.kv_cache_report = replace(self.kv_cache_report,
                                           oom_guard_shrinks=self.oom_guard.num_shrinks)
            attempt += 1

    # -- resizing the KV cache at runtime ----------------------------------------------------

    def resize_kv_cache(self, num_blocks: int) -> KVCacheResize:
        """Grow or shrink the committed KV cache to `num_blocks` between steps (the step in
        flight is applied first; what it finishes, the next `step` returns), keeping every
        address, so graphs stay valid. A shrink evicts the tail's prefix-cache entries, then
        preempts the sequences holding tail blocks (recomputed later). Raises `ValueError`
        naming the setting below one max_model_len sequence or above the capacity or memory
        budget, `KVCacheResizeError` for a grow that found no memory (the cache stays) and
        while a failed resize left the cache released (for now: the engine backs it again by
        itself), `RuntimeError` for a cache that cannot resize (fixed size, asleep). With the
        governor on, its next grow waits its interval from here, unless the size did not
        change."""
        self._check_not_shut_down("resize_kv_cache()")
        cc = self.config.cache_config
        if not cc.enable_extensible_kv_cache:
            raise RuntimeError(f"resize_kv_cache() needs the extensible KV cache, and this one "
                               f"is sized by {cc.sizing_method}; leave num_gpu_blocks_override "
                               f"and kv_cache_memory_bytes unset on a device with VMM")
        if self._kv_released_by_resize:  # a state that passes: not the caller's mistake
            raise KVCacheResizeError("resize_kv_cache() while a failed resize left the KV "
                                     "cache released: the engine backs it again once the "
                                     "device has the memory (the governor, or a retry every "
                                     "few seconds); resize then")
        if self.is_sleeping:
            raise RuntimeError("resize_kv_cache() while asleep: call wake_up() first")
        self._settle()
        event = self.kv_resizer.resize(num_blocks, "api")
        changed = event.num_blocks_after != event.num_blocks_before
        if self.kv_cache_governor is not None and changed:  # a no-op holds nothing back
            self.kv_cache_governor.resized(time.monotonic())
        return event

    def _kv_usage(self) -> KVUsage:
        """The cache's use, for the governor: blocks referenced, whether it is short
        (sequences preempted since the last poll, or the first waiting one does not fit), and
        the blocks the next full batch needs to finish: the running sequences and the first
        waiting ones up to max_num_seqs (those behind them run only as these finish)."""
        bm, scheduler = self.scheduler.block_manager, self.scheduler
        preempted = scheduler.num_preemptions > self._preemptions_seen
        self._preemptions_seen = scheduler.num_preemptions
        waiting = scheduler.waiting[0] if scheduler.waiting else None
        starved = waiting is not None and bm.blocks_for(len(waiting)) > bm.num_free_blocks
        limit = scheduler.max_model_len
        admits = max(0, scheduler.max_num_seqs - len(scheduler.running))
        batch = itertools.chain(scheduler.running, itertools.islice(scheduler.waiting, admits))
        need = sum(bm.blocks_for(min(limit, seq.num_prompt_tokens + seq.sampling_params.max_tokens))
                   for seq in batch)
        return KVUsage(bm.num_blocks, bm.num_blocks - bm.num_free_blocks,
                       self.kv_resizer.floor, preempted or starved, need)

    def kv_cache_state(self) -> dict[str, Any]:
        """The KV cache's size, bounds, resize counts and governor settings (`GET /kv_cache`);
        call it between steps."""
        return self.kv_resizer.state(self.kv_cache_governor)

    def _settle(self) -> None:
        """Apply the step in flight (no resize happens under a running step)."""
        if self._in_flight is not None:
            self._finished_early += self._apply_in_flight()

    def _apply_in_flight(self) -> list[Sequence]:
        batch, launched = self._in_flight
        self._in_flight = None
        self._applied += batch.seqs
        finished = self.scheduler.update(batch, launched.result())
        self._save_finished_blocks()
        return finished

    def _save_finished_blocks(self) -> None:
        """Have the KV connector save, now, the last full blocks of sequences that just
        finished which no step could save (`KVConnector.build_finished_meta`): their blocks
        are free, and the next step or a resize may take them. On the device the copies
        follow the steps already launched, which wrote them."""
        connector = self.scheduler.kv_connector
        if connector is None or (meta := connector.build_finished_meta()) is None:
            return
        self.executor.collective_rpc("save_kv", meta)
        connector.launched(meta)

    def fail_step(self) -> list[str]:
        """After `step` raised: drop the step in flight and abort every request it or the
        scheduler's running set holds (their state is unknown); returns their request ids.
        `updated_seqs` then holds what the failed step applied before it raised.
        Waiting requests never ran and stay queued, so the engine can go on stepping, unless
        it is asleep (`sleep`) or a failed resize released the cache (which fails a step only
        once requests waited on it past `released_timeout_s`): then they are aborted too, as no
        step runs until `wake_up` or the engine backs the cache again."""
        seqs = list(self.scheduler.running)
        if self._sleep_state.is_sleeping:  # else every later step fails the same way, at once
            seqs += self.scheduler.waiting
        # What the failed step applied before it raised (the step in flight, which may have
        # finished requests) is ready: a front end reads `updated_seqs` for it.
        self.updated_seqs, self._applied = self._applied, []
        if self._in_flight is not None:
            batch, launched = self._in_flight
            self._in_flight = None
            seqs += batch.seqs
            # Let the dropped step end before its blocks and staging buffers are reused (an
            # interrupt, not a device fault, is the common cause); a failed device raises
            # here too, and then nothing of it will run anyway.
            with suppress(Exception):
                launched.result()
        request_ids = list(dict.fromkeys(seq.request_id for seq in seqs))
        for request_id in request_ids:
            self.scheduler.abort(request_id)
        if self.scheduler.kv_connector is not None:  # taken and dropped: a failed step's
            self.scheduler.kv_connector.build_finished_meta()  # blocks may hold no K/V
        return request_ids

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds blocks,
        unless `reset_running_requests`: the step in flight is applied and every running
        sequence preempted first (recomputed later, as after any preemption: no output
        changes), as vLLM's does. `reset_connector` also has the KV connector's store serve
        nothing it holds now (`_reset_kv_store`); without a connector it only logs a warning
        and the answer is False, as vLLM's."""
        if reset_running_requests and (self.scheduler.running or self._in_flight is not None):
            self._settle()
            self.scheduler.preempt_tail_holders(0)
        try:
            self.scheduler.block_manager.reset_prefix_cache()
        except RuntimeError:
            return False
        return self._reset_kv_store() if reset_connector else True

    def _reset_kv_store(self) -> bool:
        """Give the KV connector's store a name no block of it carries (`_rename_kv_store`),
        for weights changed where the engine could not see it (`apply_model`,
        `collective_rpc`); False where no connector is configured."""
        if self._kv_store_model_id is None:
            logger.warning("reset_prefix_cache(reset_connector=True): no KV connector is "
                           "configured (kv_connector_path, kv_offloading_size); only the "
                           "prefix cache was reset")
            return False
        # No file names the weights now: a name of their own, as `load_weights` gives.
        self._rename_kv_store(f"{self._model_identity()}+reset:{uuid.uuid4().hex}",
                              "reset_prefix_cache(reset_connector=True)")
        return True

    def stats(self) -> EngineStats:
        """The scheduler's, block manager's and KV cache's figures now; call it between steps
        (from the thread that steps)."""
        self._check_not_shut_down("stats() / get_metrics()")
        bm = self.scheduler.block_manager
        rpc = self.executor.collective_rpc
        committed, reserved = rpc("kv_cache_bytes")[0]
        # A connector runs on one rank (no tensor parallelism); asked only when configured.
        failed_saves = (rpc("kv_connector_failed_saves")[0]
                        if self.config.kv_connector_config is not None else None)
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + len(self.scheduler.held),
            num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            committed_kv_bytes=committed,
            reserved_kv_bytes=reserved,
            num_preemptions=self.scheduler.num_preemptions,
            oom_guard_events=self.oom_guard.num_events,
            oom_guard_shrinks=self.oom_guard.num_shrinks,
            prefix_cache_queried_tokens=bm.num_queried_tokens,
            prefix_cache_hit_tokens=bm.num_hit_tokens,
            kv_cache_shrinks=self.kv_resizer.num_shrinks,
            kv_cache_grows=self.kv_resizer.num_grows,
            kv_cache_failed_grows=self.kv_resizer.num_failed_grows,
            kv_cache_failed_shrinks=self.kv_resizer.num_failed_shrinks,
            kv_cache_resize_backoff_s=(0.0 if self.kv_cache_governor is None
                                       else self.kv_cache_governor.backoff_s),
            kv_cache_idle_shrinks=self.kv_resizer.num_idle_shrinks,
            kv_cache_share_shrinks=self.kv_resizer.num_share_shrinks,
            num_steps=self.scheduler.num_steps,
            num_step_tokens=self.scheduler.num_step_tokens,
            num_decode_steps=self.scheduler.num_decode_steps,
            step_token_counts=tuple(self.scheduler.step_token_counts),
            num_generated_tokens=self.scheduler.num_generated_tokens,
            num_prefilled_tokens=self.scheduler.num_prefilled_tokens,
            kv_connector_failed_saves=failed_saves,
            kv_connector_hit_tokens=(None if self.config.kv_connector_config is None
                                     else self.scheduler.num_external_hit_tokens),
            kv_cache_released=self._kv_released_by_resize,
            paused=self.scheduler.paused,
        )

    def has_unfinished(self) -> bool:
        """Whether any request is still queued, running or in a step in flight, or a sleep
        finished sequences that `step` has not returned yet."""
        return (self.scheduler.has_unfinished() or self._in_flight is not None
                or bool(self._finished_early))

    def shutdown(self) -> None:
        """Free every worker's model and KV cache; the engine cannot run afterwards. A step
        still in flight is dropped (the cache waits for the device before it unmaps)."""
        self._in_flight = None
        self._shut_down = True
        if getattr(self, "demand_board", None) is not None:
            self.demand_board.close()
        self.executor.shutdown()

