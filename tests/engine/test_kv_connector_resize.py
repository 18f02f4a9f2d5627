"""Resizing a KV cache that a connector registered as one physical chunk per segment: the
out-of-memory guard and `LLM.resize_kv_cache` recommit it whole (every sequence preempted, the
prefix cache evicted) at the size asked, not at the floor, with identical outputs; a recommit
that finds no memory falls back smaller and the engine keeps serving. CPU, host VMM driver."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfit import LLM
from kvfit.engine.kv_resize import KVCacheResizeError
from kvfit.engine.oom_guard import KVCacheOutOfMemoryError
from kvfit.vmm import VmmError, VmmOutOfMemoryError

from .test_oom_guard import (
    LONG_LENGTHS,
    PARAMS,
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


def test_a_recommit_that_fails_at_the_floor_leaves_the_cache_asleep_until_woken(
        connected, reference) -> None:  # noqa: F811
    llm = connected()
    cache, floor = runner(llm).kv_cache, llm.engine.kv_resizer.floor
    reservation = runner(llm).kv_cache.tensor._reservation
    create = reservation.create
    refused = fail_chunks_over(llm, 0)
    inject(llm, "decode_forward")
    with pytest.raises(KVCacheOutOfMemoryError, match="shrinking the KV cache did too"):
        generate(llm, PARAMS["greedy"])
    assert refused and cache.is_released and cache.tensor.num_physical_chunks == 0
    assert llm.engine.is_sleeping  # never scheduled onto unmapped memory
    with pytest.raises(RuntimeError, match="wake_up"):
        generate(llm, PARAMS["greedy"])
    reservation.create = create  # memory is back
    llm.wake_up()
    # The floor, rounded up to a size whose segments end on a granule (the same memory).
    step = cache.spec.granule_block_step(cache.granularity)
    assert cache.committed_blocks == -(-floor // step) * step >= floor
    assert cache.physical_bytes == cache.footprint_bytes(floor)
    assert_one_chunk_registered(llm)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))


def test_requests_queued_when_a_recommit_leaves_the_cache_released_fail_not_spin(
        connected, reference) -> None:  # noqa: F811
    """A resize that cannot back even the floor leaves the cache released under requests it
    preempted. No step can run until `wake_up`, so a front end failing the step
    (`fail_step`) must end those requests too: else they stay queued, and the engine loop
    retries the same failing step forever."""
    llm = connected()
    core, cache = llm.engine, runner(llm).kv_cache
    requests = [llm.make_request(p, PARAMS["greedy"], str(i))
                for i, p in enumerate(make_prompts(LONG_LENGTHS[:3]))]
    for seqs in requests:
        core.add_request(seqs[0])
    for _ in range(3):
        core.step()
    reservation = cache.tensor._reservation
    create = reservation.create
    fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(cache.committed_blocks // 2)
    assert core.is_sleeping and core.scheduler.waiting  # every sequence was preempted
    with pytest.raises(RuntimeError, match="wake_up"):
        core.step()
    assert sorted(core.fail_step()) == ["0", "1", "2"]
    assert not core.has_unfinished()
    assert all(seqs[0].finish_reason == "abort" for seqs in requests)
    reservation.create = create  # memory is back
    llm.wake_up()
    assert_nothing_leaked(llm)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))


def test_the_engine_loop_fails_requests_under_a_released_cache_as_unavailable(
        connected) -> None:  # noqa: F811
    """Requests a released cache stops are failed once, as a sleeping engine refuses new ones
    (`EngineSleepingError`: HTTP 503, retry later), not as an engine fault (500)."""
    from kvfit.server.engine_core_loop import EngineCoreLoop
    from kvfit.server.engine_messages import EngineSleepingError

    llm = connected()
    sent: list = []
    loop = EngineCoreLoop(llm, sent.append)

    def turn() -> None:
        loop._apply_commands()
        loop._step()
        loop._publish(scan=loop._stepped())

    for i, prompt in enumerate(make_prompts(LONG_LENGTHS[:2])):
        loop.submit(("add", str(i), prompt["prompt_token_ids"], None, PARAMS["greedy"]))
    turn()
    fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(runner(llm).kv_cache.committed_blocks // 2)
    turn()
    errors = {request_id: error for out in sent for request_id, error in out.errors}
    assert sorted(errors) == ["0", "1"]
    assert all(isinstance(e, EngineSleepingError) and "wake_up" in str(e)
               for e in errors.values())
    assert not llm.engine.has_unfinished() and not loop._tracked


def test_a_cache_released_by_a_resize_says_so_not_that_sleep_released_it(
        connected) -> None:  # noqa: F811
    llm = connected(enable_sleep_mode=True)
    reservation = runner(llm).kv_cache.tensor._reservation
    create = reservation.create
    fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(runner(llm).kv_cache.committed_blocks // 2)
    with pytest.raises(RuntimeError, match=r"found no device memory.*wake_up\(\)") as info:
        generate(llm, PARAMS["greedy"])
    assert "LLM.sleep()" not in str(info.value)  # nobody called it
    reservation.create = create
    llm.wake_up()
    llm.sleep()
    fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match="stays asleep"):
        llm.wake_up()  # a wake short of memory: the user's sleep released it
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
