"""Resizing a KV cache that a connector registered as one physical chunk per segment: the
out-of-memory guard and `LLM.resize_kv_cache` recommit it whole (every sequence preempted, the
prefix cache evicted) at the size asked, not at the floor, with identical outputs; a recommit
that finds no memory falls back smaller and the engine keeps serving. CPU, host VMM driver."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfit import LLM
from kvfit.engine.kv_resize import KVCacheReleasedError, KVCacheResizeError
from kvfit.engine.oom_guard import KVCacheOutOfMemoryError
from kvfit.vmm import VmmError, VmmOutOfMemoryError

from .test_oom_guard import (
    LONG_LENGTHS,
    PARAMS,
    PROMPT_LENGTHS,
    REQUESTED,
    assert_nothing_leaked,
    assert_same,
    generate,
    inject,
    make_llm,  # noqa: F401 (a fixture)
    make_prompts,
    reference,  # noqa: F401 (a fixture)
    runner,
)


@pytest.fixture
def connected(make_llm: Callable[..., LLM], tmp_path: Path) -> Callable[..., LLM]:  # noqa: F811
    return lambda **kw: make_llm(kv_connector="shared_storage", kv_connector_path=str(tmp_path),
                                 **kw)


def assert_one_chunk_registered(llm: LLM) -> None:
    """One physical chunk per segment, registered with the connector exactly as committed;
    the block manager and the config agree with the cache."""
    worker = llm.engine.executor.workers[0]
    cache, spec = worker.runner.kv_cache, worker.runner.kv_cache_spec
    assert cache.tensor.num_physical_chunks == spec.num_segments
    views = worker.kv_connector.registered_caches
    assert [v.untyped_storage().nbytes() for v in views] == (
        [cache.committed_blocks * spec.block_stride_bytes] * spec.num_segments)
    assert sum(v.untyped_storage().nbytes() for v in views) == cache.physical_bytes
    bm = llm.engine.scheduler.block_manager
    assert cache.committed_blocks == bm.num_blocks == llm.config.cache_config.num_gpu_blocks


def add_requests(llm: LLM, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[list[Any]]:
    """Queue greedy requests (ids "0", "1", ...) of prompts of `lengths`, without stepping;
    `finish` runs them to the end."""
    requests = [llm.make_request(p, PARAMS["greedy"], str(i))
                for i, p in enumerate(make_prompts(lengths))]
    for seqs in requests:
        llm.engine.add_request(seqs[0])
    return requests


def finish(llm: LLM, requests: list[list[Any]]) -> list[list[int]]:
    """Step until every request is done; each request's first sequence's output tokens."""
    outputs = {}
    while llm.engine.has_unfinished():
        outputs.update((seq.request_id, seq) for seq in llm.engine.step())
    return [outputs[seqs[0].request_id].output_token_ids for seqs in requests]


def guard_target(llm: LLM) -> int:
    """Where the guard's first shrink lands: past the request and one granule, at a size whose
    segments end on a granule."""
    cache = runner(llm).kv_cache
    keep = cache.blocks_that_fit(cache.physical_bytes - REQUESTED - cache.granularity)
    return cache.granule_aligned_blocks(keep)


def fail_chunks_over(llm: LLM, nbytes: int) -> list[int]:
    """Make the cache's driver refuse allocations larger than `nbytes`; returns their sizes."""
    reservation = runner(llm).kv_cache.tensor._reservation
    create, refused = reservation.create, []

    def limited(size: int) -> Any:
        if size > nbytes:
            refused.append(size)
            raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        return create(size)

    reservation.create = limited
    return refused


@pytest.mark.parametrize("layout", ["block_outer", "layer_outer"])
def test_an_oom_recommits_one_chunk_at_the_guards_target_with_identical_outputs(
        connected, reference, layout) -> None:  # noqa: F811
    llm = connected(kv_cache_layout=layout)
    assert_one_chunk_registered(llm)
    cache, floor = runner(llm).kv_cache, llm.engine.kv_resizer.floor
    before, base = cache.committed_blocks, cache.tensor.base_ptr
    target = guard_target(llm)
    assert 4 * floor <= target < before  # far above one max_model_len sequence
    scheduler = llm.engine.scheduler
    running: list[int] = []
    forward = runner(llm).model.forward

    def count_running(*args: Any) -> Any:
        if args[2].max_query_len == 1 and not running:
            running.append(len(scheduler.running))
        return forward(*args)

    runner(llm).model.forward = count_running
    inject(llm, "decode_forward")
    outputs = generate(llm, PARAMS["greedy"], LONG_LENGTHS)
    assert_same(outputs, reference("greedy", LONG_LENGTHS))
    [event] = llm.engine.oom_guard.events
    assert (event.num_blocks_before, event.num_blocks_after) == (before, target)
    assert event.num_preempted == running[0] > 0  # every running sequence
    assert event.freed_bytes == cache.footprint_bytes(before) - cache.footprint_bytes(target)
    assert cache.committed_blocks == target and cache.tensor.base_ptr == base
    assert_one_chunk_registered(llm)
    # The preempted prompts' full blocks came back from the store, not recomputed.
    connector = llm.engine.executor.workers[0].kv_connector
    assert connector.stats.loaded_blocks >= event.num_preempted
    assert_nothing_leaked(llm)
    assert_same(generate(llm, PARAMS["greedy"], LONG_LENGTHS), reference("greedy", LONG_LENGTHS))


def test_resize_kv_cache_down_and_up_recommits_one_chunk(connected, reference) -> None:  # noqa: F811
    llm = connected()
    cache, bm = runner(llm).kv_cache, llm.engine.scheduler.block_manager
    before, lengths = cache.committed_blocks, LONG_LENGTHS
    expected = reference("greedy", lengths)
    assert_same(generate(llm, PARAMS["greedy"], lengths), expected)
    cached = len(bm.hash_to_block)
    assert cached > 0
    down = cache.granule_aligned_blocks(before // 2)
    event = llm.resize_kv_cache(down)
    assert (event.num_blocks_before, event.num_blocks_after) == (before, down)
    assert event.num_evicted == cached and not bm.hash_to_block
    assert event.delta_bytes == cache.footprint_bytes(down) - cache.footprint_bytes(before)
    assert_one_chunk_registered(llm)
    connector = llm.engine.executor.workers[0].kv_connector
    loaded = connector.stats.loaded_blocks
    assert_same(generate(llm, PARAMS["greedy"], lengths), expected)
    assert connector.stats.loaded_blocks > loaded  # the evicted prefixes came from the store
    cached = len(bm.hash_to_block)
    event = llm.resize_kv_cache(before)
    assert (event.num_blocks_before, event.num_blocks_after) == (down, before)
    assert event.num_evicted == cached > 0 and not bm.hash_to_block  # a grow recommits too
    assert_one_chunk_registered(llm)
    assert_same(generate(llm, PARAMS["greedy"], lengths), expected)
    assert_nothing_leaked(llm)


def test_a_recommit_without_memory_falls_back_smaller_and_keeps_serving(
        connected, reference) -> None:  # noqa: F811
    llm = connected()
    cache, floor = runner(llm).kv_cache, llm.engine.kv_resizer.floor
    target = guard_target(llm)
    # The target's chunk is refused; half of it is granted.
    refused = fail_chunks_over(llm, cache.footprint_bytes(target) - 1)
    half = cache.granule_aligned_blocks(target // 2)
    assert floor < half < target
    inject(llm, "decode_forward")
    assert_same(generate(llm, PARAMS["greedy"], LONG_LENGTHS), reference("greedy", LONG_LENGTHS))
    [event] = llm.engine.oom_guard.events
    assert refused == [cache.footprint_bytes(target)]
    assert event.num_blocks_after == half == cache.committed_blocks
    assert_one_chunk_registered(llm)
    assert_nothing_leaked(llm)
    # A grow that finds no memory falls back to the old size, usable, and says so.
    with pytest.raises(KVCacheResizeError, match=f"it holds {half} blocks"):
        llm.resize_kv_cache(target)
    assert cache.committed_blocks == half and llm.engine.kv_resizer.num_failed_grows == 1
    assert_one_chunk_registered(llm)
    assert_same(generate(llm, PARAMS["greedy"], LONG_LENGTHS), reference("greedy", LONG_LENGTHS))


def test_a_grow_that_finds_no_memory_leaves_the_cache_its_sequences_and_prefix_cache(
        connected, reference) -> None:  # noqa: F811
    """Issue #15: a grow that cannot get memory leaves the cache as it was. A one-chunk cache
    must release its pages before committing the larger chunk, so it checks first that the
    device holds what the grow adds: refused, nothing is released, no sequence preempted,
    no prefix-cache entry evicted, and the requests finish as if nothing happened."""
    llm = connected()
    core, cache = llm.engine, runner(llm).kv_cache
    bm, before = core.scheduler.block_manager, cache.committed_blocks
    down = cache.granule_aligned_blocks(before // 2)
    llm.resize_kv_cache(down)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    requests = add_requests(llm)
    for _ in range(3):
        core.step()
    core._settle()
    running = [(seq.request_id, list(seq.block_table)) for seq in core.scheduler.running]
    cached, preemptions = dict(bm.hash_to_block), core.scheduler.num_preemptions
    assert running and cached
    refused = fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match=f"from {down} to {before} blocks.*it holds "
                                                 f"{down} blocks"):
        llm.resize_kv_cache(before)
    assert refused == [cache.footprint_bytes(before) - cache.footprint_bytes(down)]
    assert not core.kv_cache_released and not cache.is_released
    assert cache.committed_blocks == bm.num_blocks == down
    assert core.scheduler.num_preemptions == preemptions
    assert [(seq.request_id, seq.block_table) for seq in core.scheduler.running] == running
    assert bm.hash_to_block == cached
    assert core.kv_resizer.num_failed_grows == 1 and not core.kv_resizer.num_grows
    assert_one_chunk_registered(llm)
    del cache.tensor._reservation.create
    assert finish(llm, requests) == [list(o.outputs[0].token_ids) for o in reference("greedy")]
    assert_nothing_leaked(llm)


def memory_back_after_retries(llm: LLM, num_failed: int) -> list[int]:
    """Let the engine retry a released cache at every step, and give the memory back (undo
    `fail_chunks_over`) once `num_failed` retries found none; returns the sizes refused."""
    core, reservation = llm.engine, runner(llm).kv_cache.tensor._reservation
    create, restore, attempts = reservation.create, core.kv_resizer.restore, []
    refused = fail_chunks_over(llm, 0)

    def counted(*args: Any, **kwargs: Any) -> Any:
        attempts.append(core.scheduler.num_steps)
        if len(attempts) > num_failed:
            reservation.create = create
        return restore(*args, **kwargs)

    core.kv_resizer.restore = counted
    core.released_retry_s = 0.0
    return refused


def assert_backed_again(llm: LLM, num_failed: int, num_blocks: int) -> None:
    """The engine backed the released cache itself at `num_blocks` (the size the failed resize
    asked for, memory allowing), after `num_failed` failed retries, logged as a `restore`."""
    core, cache = llm.engine, runner(llm).kv_cache
    assert not core.kv_cache_released and not core.is_sleeping and not cache.is_released
    assert cache.committed_blocks == num_blocks > core.kv_resizer.floor
    event = core.kv_resizer.events[-1]
    assert (event.cause, event.num_blocks_before) == ("restore", 0)
    assert event.num_blocks_after == cache.committed_blocks
    assert core.kv_resizer.num_failed_grows == num_failed
    assert_one_chunk_registered(llm)


def released_gauge(llm: LLM) -> float:
    """`kvfit:kv_cache_released` as `/metrics` would show it now."""
    from kvfit.engine.metrics import engine_metrics

    [metric] = [m for m in engine_metrics(llm.engine.stats(), llm.engine.kv_cache_report)
                if m.name.endswith("kv_cache_released")]
    return metric.value


def test_a_cache_the_guard_released_comes_back_and_its_requests_complete(
        connected, reference) -> None:  # noqa: F811
    """A guard's recommit that cannot back even one sequence releases the cache; the
    requests it preempted wait (none fails) and complete, token for token, once the engine
    backs the cache again by itself."""
    llm = connected()
    cache = runner(llm).kv_cache
    target = guard_target(llm)
    refused = memory_back_after_retries(llm, num_failed=2)
    inject(llm, "decode_forward")
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    assert refused and not llm.engine.oom_guard.num_shrinks
    assert_backed_again(llm, num_failed=2, num_blocks=target)  # the size the guard asked for
    assert cache.physical_bytes == cache.footprint_bytes(target)
    assert_nothing_leaked(llm)


def test_requests_waiting_on_a_cache_a_resize_released_complete_once_it_is_back(
        connected, reference) -> None:  # noqa: F811
    """A resize that cannot back even the floor releases the cache under the requests it
    preempted: steps run nothing (they never touch unmapped memory, never raise) until the
    engine backs it again, and then the requests complete with the same greedy output. The
    engine is not asleep: nobody called `sleep`, and requests added meanwhile wait too."""
    llm = connected()
    core, cache = llm.engine, runner(llm).kv_cache
    requests = [llm.make_request(p, PARAMS["greedy"], str(i))
                for i, p in enumerate(make_prompts(PROMPT_LENGTHS))]
    for seqs in requests[:3]:
        core.add_request(seqs[0])
    for _ in range(3):
        core.step()
    memory_back_after_retries(llm, num_failed=1)
    asked = cache.committed_blocks // 2
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(asked)
    assert core.kv_cache_released and core.stats().kv_cache_released
    assert released_gauge(llm) == 1
    assert not core.is_sleeping and cache.is_released
    for seqs in requests[3:]:
        core.add_request(seqs[0])
    with pytest.raises(RuntimeError, match="released"):
        llm.resize_kv_cache(cache.committed_blocks)
    steps = core.scheduler.num_steps
    outputs = {}
    while core.has_unfinished():
        for seq in core.step():
            outputs[seq.request_id] = seq
    assert_backed_again(llm, num_failed=1, num_blocks=asked)
    assert core.scheduler.num_steps > steps and not core.stats().kv_cache_released
    assert released_gauge(llm) == 0
    got = [outputs[str(i)].output_token_ids for i in range(len(requests))]
    assert got == [list(o.outputs[0].token_ids) for o in reference("greedy")]
    assert_nothing_leaked(llm)


@pytest.fixture
def hang_guard() -> Iterator[None]:
    """Raise TimeoutError in the test after 60 s: a wait that never ends fails the test
    instead of hanging the suite (no timing is asserted)."""

    def expire(signum: int, frame: Any) -> None:
        raise TimeoutError("still waiting after 60 s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def test_requests_on_a_cache_that_stays_released_fail_with_its_cause_not_hang(
        connected, reference, hang_guard) -> None:  # noqa: F811
    """A cache a failed resize released comes back only once the device has the memory, which
    may be never: requests waited forever (`LLM.generate` never returned). Past the engine's
    `released_timeout_s` of being released, the requests waiting on it fail with
    KVCacheReleasedError saying why and what to do, nothing is left queued or held, and once
    the memory is back the engine serves as before."""
    llm = connected()
    core = llm.engine
    core.released_retry_s, core.released_timeout_s = 0.0, 0.2
    fail_chunks_over(llm, 0)  # no memory, ever
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(runner(llm).kv_cache.committed_blocks // 2)
    with pytest.raises(KVCacheReleasedError, match="released .*failed resize.*/health"):
        generate(llm, PARAMS["greedy"])
    assert core.kv_cache_released and not core.has_unfinished()
    del runner(llm).kv_cache.tensor._reservation.create  # the memory is back
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    assert not core.kv_cache_released
    assert_nothing_leaked(llm)


def test_a_released_cache_comes_back_at_the_size_asked_halving_down_where_memory_is_short(
        connected, reference) -> None:  # noqa: F811
    """Not at the floor: the engine backs a cache a failed resize released at the size that
    resize asked for, and, where the device holds less, at the most blocks that fit, halving
    down (as a wake does); then it serves, consistent."""
    llm = connected()
    core, cache = llm.engine, runner(llm).kv_cache
    reservation, block_bytes = cache.tensor._reservation, cache.spec.block_stride_bytes
    asked = cache.granule_aligned_blocks(cache.committed_blocks // 2)
    half = cache.granule_aligned_blocks(asked // 2)
    assert core.kv_resizer.floor < half < asked
    fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(asked)
    assert core.kv_cache_released and core.kv_resizer.num_blocks == asked
    del reservation.create
    refused = fail_chunks_over(llm, half * block_bytes)  # a chunk per segment of half fits
    core._released_retry_at = 0.0
    core.step()
    assert refused == [asked * block_bytes]
    assert_backed_again(llm, num_failed=0, num_blocks=half)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    del reservation.create
    create = reservation.create

    def taken_after_the_check(size: int) -> Any:  # another process takes the memory
        if taken_after_the_check.checked:
            raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        taken_after_the_check.checked = True
        return create(size)

    taken_after_the_check.checked = False
    reservation.create = taken_after_the_check
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(asked)  # a grow: it would have held `half` had it failed alone
    assert core.kv_resizer.num_blocks == half
    del reservation.create
    core._released_retry_at = 0.0
    core.step()
    assert_backed_again(llm, num_failed=1, num_blocks=half)
    assert_nothing_leaked(llm)


def test_without_the_governor_a_released_cache_is_retried_every_few_seconds(
        connected, monkeypatch) -> None:  # noqa: F811
    """No busy retrying: a step retries at most every `released_retry_s`, and while requests
    wait it pauses for the next retry rather than spinning."""
    from kvfit.engine import engine_core

    llm = connected()
    core, cache = llm.engine, runner(llm).kv_cache
    fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(cache.committed_blocks // 2)
    clock = [1000.0]
    slept: list[float] = []
    monkeypatch.setattr(engine_core.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(engine_core.time, "sleep", slept.append)
    core._released_retry_at = clock[0] + core.released_retry_s
    attempts: list[float] = []
    restore = core.kv_resizer.restore
    core.kv_resizer.restore = lambda *a: (attempts.append(clock[0]), restore(*a))[1]
    core.add_request(llm.make_request(make_prompts((5,))[0], PARAMS["greedy"], "0")[0])
    for _ in range(3):
        core.step()
        clock[0] += 0.5
    assert attempts == [] and slept == [engine_core.RELEASED_WAIT_S] * 3
    clock[0] += core.released_retry_s
    core.step()
    core.step()
    assert attempts == [1000.0 + 1.5 + core.released_retry_s]
    assert core.kv_cache_released and core.has_unfinished()  # still no memory


def test_a_users_sleep_is_not_backed_again_by_the_engine(connected) -> None:  # noqa: F811
    """Only a cache that a failure released comes back by itself: one a user's `sleep`
    released stays released until `wake_up`, and says so."""
    llm = connected(enable_sleep_mode=True)
    llm.sleep()
    llm.engine.released_retry_s = 0.0
    assert not llm.engine.kv_cache_released and llm.engine.is_sleeping
    llm.engine.step()
    assert runner(llm).kv_cache.is_released and not llm.engine.kv_resizer.events
    with pytest.raises(RuntimeError, match=r"released by LLM.sleep\(\)"):
        generate(llm, PARAMS["greedy"])


def fail_next_map(llm: LLM) -> list[int]:
    """Make the cache's next mapping fail once with a driver error that is not out of memory
    (a transient set-access failure); returns the sizes it refused."""
    reservation = runner(llm).kv_cache.tensor._reservation
    map_at, refused = reservation.map_at, []

    def flaky(va: int, size: int, handle: Any) -> None:
        if not refused:
            refused.append(size)
            raise VmmError("cuMemSetAccess", 1, "CUDA_ERROR_INVALID_VALUE")
        map_at(va, size, handle)

    reservation.map_at = flaky
    return refused


def test_a_transient_driver_error_on_a_resize_leaves_the_cache_as_it_was(
        connected, reference) -> None:  # noqa: F811
    """Only a want of memory may make a recommit take fewer blocks: another driver error
    (here one failed set-access) backs the size the cache had, not half the one asked."""
    llm = connected()
    cache = runner(llm).kv_cache
    before = cache.committed_blocks
    target = guard_target(llm)
    refused = fail_next_map(llm)
    with pytest.raises(KVCacheResizeError, match=r"cuMemSetAccess failed with code 1 .*as it was"):
        llm.resize_kv_cache(target)
    assert refused and cache.committed_blocks == before and not llm.engine.is_sleeping
    assert llm.engine.kv_resizer.num_shrinks == 0
    assert_one_chunk_registered(llm)
    assert_same(generate(llm, PARAMS["greedy"], LONG_LENGTHS), reference("greedy", LONG_LENGTHS))


def test_a_transient_driver_error_on_wake_does_not_halve_the_cache(
        connected, reference) -> None:  # noqa: F811
    llm = connected(enable_sleep_mode=True)
    cache = runner(llm).kv_cache
    before = cache.committed_blocks
    llm.sleep()
    fail_next_map(llm)
    with pytest.raises(KVCacheResizeError, match="cuMemSetAccess failed with code 1"):
        llm.wake_up()
    assert cache.is_released and llm.engine.is_sleeping
    llm.wake_up()  # the error was transient: the whole cache comes back
    assert cache.committed_blocks == before and not llm.engine.kv_resizer.events
    assert_one_chunk_registered(llm)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))


def test_the_governor_backs_a_released_cache_once_memory_allows_and_the_interval_passed(
        connected, reference) -> None:  # noqa: F811
    """With the elastic governor a released cache is no longer skipped as asleep: its poll
    backs it again, but not before the minimum interval and not while free memory would fall
    under the low watermark (it would be taken back at once: no oscillation)."""
    import time

    from kvfit.kv.monitor import HostMemoryMonitor

    class Scripted(HostMemoryMonitor):
        free = 5 << 20  # between the watermarks, and under 2 MiB (the floor) above the low one

        def free_and_total(self) -> tuple[int, int]:
            return self.free, self.budget_bytes

    llm = connected(elastic_kv_cache=True, elastic_low_watermark="4MiB",
                    elastic_high_watermark="10MiB", elastic_min_interval=0.2)
    core, cache = llm.engine, runner(llm).kv_cache
    device = Scripted(1 << 30, "cpu_kv_cache_space_bytes")
    llm.engine.executor.workers[0].monitor = device
    reservation = cache.tensor._reservation
    create = reservation.create
    fail_chunks_over(llm, 0)
    asked = cache.committed_blocks // 2
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(asked)
    released_at = time.monotonic()
    reservation.create = create  # the driver has memory, but free memory says too little
    attempts: list[float] = []
    restore = core.kv_resizer.restore
    core.kv_resizer.restore = lambda *a, **kw: (attempts.append(time.monotonic()),
                                           restore(*a, **kw))[1]
    deadline = released_at + 0.6
    while time.monotonic() < deadline:
        core.step()
    assert not attempts and core.kv_cache_released
    device.free = 64 << 20
    while core.kv_cache_released:
        assert time.monotonic() < deadline + 30, "the governor never backed the cache"
        core.step()
    assert attempts[0] - released_at >= 0.2
    event = core.kv_resizer.events[-1]
    assert (event.cause, event.free_bytes, event.num_blocks_after) == ("restore", 64 << 20, asked)
    assert core.stats().kv_cache_grows == core.kv_resizer.num_grows >= 1
    assert_one_chunk_registered(llm)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))


def test_sleep_waiting_on_a_cache_a_failed_resize_released_says_so_instead_of_hanging(
        connected, reference, monkeypatch) -> None:  # noqa: F811
    """`sleep(mode="wait")` finishes the requests first; those waiting on a cache a failed
    resize released cannot finish until the device has the memory again, which may be never
    (the co-tenant that took it may be the one waiting for the sleep). The sleep refuses at
    once, naming mode='abort', and changes nothing: the requests complete once the cache is
    back, and a sleep then works."""
    from kvfit.engine import engine_core

    class WaitedForMemory(Exception):
        pass

    def no_waiting(seconds: float) -> None:
        raise WaitedForMemory

    llm = connected(enable_sleep_mode=True)
    core = llm.engine
    requests = add_requests(llm)
    core.step()
    memory_back_after_retries(llm, num_failed=1 << 30)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(runner(llm).kv_cache.committed_blocks // 2)
    monkeypatch.setattr(engine_core.time, "sleep", no_waiting)  # a wait would never end
    with pytest.raises(RuntimeError, match=r"4 requests wait.*sleep\(mode='abort'\)"):
        llm.sleep(mode="wait")
    assert core.kv_cache_released and not core.is_sleeping
    assert len(core.scheduler.waiting) == len(requests)
    monkeypatch.undo()
    reservation = runner(llm).kv_cache.tensor._reservation
    del reservation.create  # the instance's refusal: the memory is back
    assert finish(llm, requests) == [list(o.outputs[0].token_ids) for o in reference("greedy")]
    llm.sleep(mode="wait")
    assert core.is_sleeping and not core.kv_cache_released


def test_a_released_cache_does_not_let_requests_past_weights_never_loaded(
        connected, reference, qwen3) -> None:  # noqa: F811
    """Only the released KV cache is no reason to refuse a request: weights woken without
    contents still are. Accepted, such a request failed every step once the cache was back
    (a server's loop raising at every turn) and was never ended, as it stayed queued."""
    from safetensors.torch import load_file

    llm = connected(enable_sleep_mode=True)
    core = llm.engine
    llm.sleep(level=2)
    llm.wake_up(reload_weights=False)
    memory_back_after_retries(llm, num_failed=0)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(runner(llm).kv_cache.committed_blocks // 2)
    assert core.kv_cache_released
    seq = llm.make_request(make_prompts()[0], PARAMS["greedy"], "0")[0]
    with pytest.raises(RuntimeError, match=r"woken without contents .* LLM.load_weights"):
        core.add_request(seq)
    assert not core.has_unfinished()
    core._released_retry_at = 0.0
    core.step()  # backs the cache: the memory is back
    assert not core.kv_cache_released
    llm.load_weights(load_file(qwen3 / "model.safetensors"))
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))


def test_the_governor_backs_off_a_shrink_that_keeps_failing(
        connected, reference, monkeypatch) -> None:  # noqa: F811
    """A driver error that persists (not out of memory) on the governor's shrink of a
    one-chunk cache: every attempt preempts every sequence, so retrying it at every poll
    (50 ms) kept requests from ever finishing. The governor backs off, doubling the wait
    with each consecutive failure, counted and exported; once a shrink works the backoff
    ends."""
    import math

    from kvfit.engine import engine_core
    from kvfit.engine.metrics import engine_metrics

    llm = connected(elastic_kv_cache=True, elastic_low_watermark="4MiB",
                    elastic_high_watermark="10MiB", elastic_min_interval=0.2)
    core, governor = llm.engine, llm.engine.kv_cache_governor
    before = core.kv_resizer.num_blocks
    worker = core.executor.workers[0]
    set_free_memory(llm, 0.0)  # another process holds all the memory
    recommit, attempts, clock = worker.recommit_kv_cache, [], [1000.0]

    def broken(num_blocks: int) -> None:  # only the size the cache has can be backed
        if num_blocks != before:
            attempts.append(clock[0])
            raise VmmError("cuMemSetAccess", 1, "CUDA_ERROR_INVALID_VALUE")
        recommit(num_blocks)

    worker.recommit_kv_cache = broken
    monkeypatch.setattr(engine_core.time, "monotonic", lambda: clock[0])
    governor.last_poll = governor.last_resize = governor.last_grow_attempt = -math.inf
    requests = add_requests(llm)
    outputs: dict[str, Any] = {}
    for _ in range(200):  # ten seconds of polls
        outputs.update((seq.request_id, seq) for seq in core.step())
        clock[0] += 0.05
    gaps = [b - a for a, b in zip(attempts, attempts[1:], strict=False)]
    assert 4 <= len(attempts) <= 8, attempts
    # Two poll intervals after the first failure, doubling (a poll lands just after each).
    assert all(gap >= 0.1 * 2 ** i - 1e-6 for i, gap in enumerate(gaps)), gaps
    assert [outputs[str(i)].output_token_ids for i in range(len(requests))] == [
        list(o.outputs[0].token_ids) for o in reference("greedy")]
    stats = core.stats()
    assert stats.kv_cache_failed_shrinks == len(attempts) and not stats.kv_cache_shrinks
    assert stats.kv_cache_resize_backoff_s == 0.1 * 2 ** len(gaps)
    [gauge] = [m for m in engine_metrics(stats, core.kv_cache_report)
               if m.name.endswith("kv_cache_resize_backoff_seconds")]
    assert gauge.value == stats.kv_cache_resize_backoff_s
    worker.recommit_kv_cache = recommit  # the driver works again
    while not core.kv_resizer.num_shrinks:
        assert clock[0] < 1100, "the governor never shrank once the driver worked"
        core.step()
        clock[0] += 0.05
    assert core.kv_resizer.num_blocks < before
    assert core.stats().kv_cache_resize_backoff_s == 0 and not governor.num_failed_shrinks
    assert runner(llm).kv_cache.committed_blocks == core.scheduler.block_manager.num_blocks


def granule_ceil(llm: LLM, num_blocks: int) -> int:
    """The fewest blocks, at least `num_blocks`, at which every segment ends on a granule: the
    least a one-chunk cache asked for `num_blocks` can hold with no backed byte unusable."""
    cache = runner(llm).kv_cache
    return next(n for n in range(num_blocks, cache.capacity_blocks + 1)
                if cache.granule_aligned_blocks(n) == n)


def granule_floor(llm: LLM) -> int:
    """`granule_ceil` of one max_model_len sequence: the least a one-chunk cache may hold."""
    return granule_ceil(llm, llm.engine.kv_resizer.floor)


def assert_blocks_use_the_whole_chunk(llm: LLM) -> None:
    """Every byte the cache backs is in a block the block manager hands out."""
    cache = runner(llm).kv_cache
    assert cache.blocks_that_fit(cache.physical_bytes) == (
        llm.engine.scheduler.block_manager.num_blocks)


def test_the_governor_shrinks_a_one_chunk_cache_to_a_floor_its_blocks_fill(
        connected, reference, monkeypatch) -> None:  # noqa: F811
    """Another process takes all the memory: the governor shrinks the cache as far as it may,
    to one max_model_len sequence. A one-chunk cache's chunk is whole granules, so that floor
    is rounded up to them: shrunk to the bare floor (32 blocks of a 128-block granule), the
    connector registered the whole granule while the block manager handed out a quarter."""
    import math

    from kvfit.engine import engine_core

    llm = connected(elastic_kv_cache=True, elastic_low_watermark="4MiB",
                    elastic_high_watermark="10MiB", elastic_min_interval=0.2)
    core, governor = llm.engine, llm.engine.kv_cache_governor
    floor = granule_floor(llm)
    assert core.kv_resizer.floor < floor < core.kv_resizer.num_blocks
    set_free_memory(llm, 0.0)  # another process holds all the memory
    clock = [1000.0]
    monkeypatch.setattr(engine_core.time, "monotonic", lambda: clock[0])
    governor.last_poll = governor.last_resize = governor.last_grow_attempt = -math.inf
    for _ in range(4):  # the first poll shrinks to the floor; the next ones keep it there
        core.step()
        clock[0] += 1.0
    assert [(e.cause, e.num_blocks_after) for e in core.kv_resizer.events] == [
        ("governor", floor)]
    assert_one_chunk_registered(llm)
    assert_blocks_use_the_whole_chunk(llm)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))


def test_the_oom_guard_shrinks_a_one_chunk_cache_to_a_floor_its_blocks_fill(
        connected) -> None:  # noqa: F811
    """A step that keeps running out of memory: the guard shrinks the cache down to one
    max_model_len sequence, rounded up to whole granules for a one-chunk cache, then raises
    naming the settings; the cache left is registered whole and usable."""
    llm = connected()
    floor = granule_floor(llm)
    inject(llm, "decode_forward", times=float("inf"))
    with pytest.raises(KVCacheOutOfMemoryError, match="cannot shrink"):
        generate(llm, PARAMS["greedy"])
    assert llm.engine.oom_guard.events[-1].num_blocks_after == floor
    assert runner(llm).kv_cache.committed_blocks == floor
    assert_one_chunk_registered(llm)
    assert_blocks_use_the_whole_chunk(llm)


def poll_until(llm: LLM, done: Callable[[], bool], deadline_s: float = 30.0) -> None:
    """Step an engine with nothing to do (the governor polls on each step) until `done()`."""
    import time

    deadline = time.monotonic() + deadline_s
    while not done():
        assert time.monotonic() < deadline, "the governor did not shrink the idle cache in time"
        llm.engine.step()
        time.sleep(0.01)


def set_free_memory(llm: LLM, share: float) -> None:
    """The device's free memory as the governor reads it: `share` of a 1 GiB budget. 0: another
    process holds all of it; 1: far above the high watermark, so an idle cache shrinks by its
    use (or its peers' want) alone, never by memory pressure."""
    from kvfit.kv.monitor import HostMemoryMonitor

    class Free(HostMemoryMonitor):
        def free_and_total(self) -> tuple[int, int]:
            return int(share * self.budget_bytes), self.budget_bytes

    llm.engine.executor.workers[0].monitor = Free(1 << 30, "cpu_kv_cache_space_bytes")


def assert_idle_shrunk_to(llm: LLM, num_blocks: int) -> None:
    """The governor's first idle shrink leaves `num_blocks`, registered whole, every backed
    byte in a block."""
    core = llm.engine
    poll_until(llm, lambda: core.stats().kv_cache_idle_shrinks == 1)
    [event] = core.kv_resizer.events
    assert (event.cause, event.num_blocks_after) == ("idle", num_blocks)
    assert_one_chunk_registered(llm)
    assert_blocks_use_the_whole_chunk(llm)


ELASTIC_IDLE = dict(elastic_kv_cache=True, elastic_idle_s=0.2, elastic_min_interval=0.1,
                    elastic_low_watermark="4MiB", elastic_high_watermark="10MiB")


@pytest.mark.parametrize("need_blocks", [0, 75])
def test_an_idle_one_chunk_cache_shrinks_to_whole_granules_above_its_idle_target(
        connected, monkeypatch, need_blocks) -> None:  # noqa: F811
    """The idle shrink keeps the demand plus headroom (at least the floor): 32 blocks with
    nothing in use, 150 for a batch about to hold 75. A one-chunk cache at such a count backs
    whole granules (128 blocks) its block manager never hands out, so the governor rounds the
    target up to them: 128 and 256 blocks, every backed byte in a block."""
    from dataclasses import replace

    llm = connected(**ELASTIC_IDLE)
    core = llm.engine
    set_free_memory(llm, 1.0)
    usage = core._kv_usage  # a batch about to hold `need_blocks` (none running)
    monkeypatch.setattr(core, "_kv_usage", lambda: replace(usage(), need_blocks=need_blocks))
    target = core._kv_usage().idle_target
    assert target != granule_ceil(llm, target) < core.kv_resizer.num_blocks
    assert_idle_shrunk_to(llm, granule_ceil(llm, target))


def test_an_idle_one_chunk_cache_gives_a_peer_whole_granules_at_least_what_it_lacks(
        connected, tmp_path) -> None:  # noqa: F811
    """Through the demand board an idle cache gives back what its peer lacks (200 blocks'
    bytes of 512), keeping the rest. A one-chunk cache frees whole granules, so it keeps 312
    rounded down to them (256 blocks): the peer gets all it lacks in one give, not one short
    by a granule's remainder that it must ask again, and every backed byte is in a block."""
    from kvfit.elastic import DemandBoard

    llm = connected(**ELASTIC_IDLE, elastic_demand_dir=str(tmp_path / "board"))
    core = llm.engine
    set_free_memory(llm, 4 / 1024)  # the low watermark: the peer can take nothing by itself
    start, board = core.kv_resizer.num_blocks, core.demand_board
    keep = start - 200
    kept = max(n for n in range(keep + 1) if runner(llm).kv_cache.granule_aligned_blocks(n) == n)
    assert kept < keep < granule_ceil(llm, keep) < start
    peer = DemandBoard(tmp_path / "board", board.folder.name)  # a second engine on the device
    peer.publish(200 * llm.config.kv_cache_spec().block_bytes)
    assert_idle_shrunk_to(llm, kept)


def test_an_idle_shrink_of_a_one_chunk_cache_under_a_granule_never_grows_it(
        connected) -> None:  # noqa: F811
    """A user resized the cache under a granule (`resize_kv_cache` commits exactly what it is
    asked): the idle target rounded up to whole granules would be above the cache, a grow
    counted as a shrink; the governor's size stops at what the cache holds, so it keeps it."""
    llm = connected(**ELASTIC_IDLE)
    resizer = llm.engine.kv_resizer
    size = resizer.floor + 8
    assert size < granule_floor(llm)
    llm.resize_kv_cache(size)
    assert resizer.num_blocks == size
    assert resizer.shrink_size(resizer.floor) == size
    assert resizer.shrink_size(size - 1) == size
