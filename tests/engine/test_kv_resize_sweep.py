"""Adversarial resizes of the KV cache (issue #15's contracts), on the CPU through the host VMM
driver: a driver failure at every call of a shrink made under load, of the restore of a cache a
failed resize released and of a wake leaves the committed bytes, the block manager's free list,
the sequences' block tables and the driver's mappings in agreement; greedy outputs of requests
with `n` completions, logprobs, prompt logprobs and shared prefixes do not change across
resizes, with prefix caching on or off and with a one-chunk (KV connector) cache; a released
cache survives a sleep and a shutdown."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.engine.kv_resize import KVCacheResizeError

from .test_kv_connector_resize import (
    add_requests,
    assert_one_chunk_registered,
    connected,  # noqa: F401 (a fixture)
    fail_chunks_over,
    finish,
)
from .test_kv_resize import (
    FailingDriver,
    assert_driver_matches_cache,
    install_failing_driver,
    run_stepping,
)
from .test_oom_guard import (
    PARAMS,
    assert_nothing_leaked,
    assert_same,
    generate,
    make_llm,  # noqa: F401 (a fixture)
    make_prompts,
    reference,  # noqa: F401 (a fixture)
    runner,
)

LOAD_LENGTHS = (380, 381, 382, 383, 200, 17)  # ~100 blocks held after eight steps


def assert_block_manager_agrees(llm: LLM) -> None:
    """Each block's ref count is the number of running sequences holding it, waiting ones
    hold none, the free count and heaps list exactly the unreferenced blocks, every prefix-cache
    entry points at a block carrying its hash, and the cache backs exactly the blocks handed
    out."""
    core = llm.engine
    bm = core.scheduler.block_manager
    held: dict[int, int] = {}
    for seq in core.scheduler.running:
        for block_id in seq.block_table:
            held[block_id] = held.get(block_id, 0) + 1
    assert not any(seq.block_table for seq in core.scheduler.waiting)
    assert len(bm.blocks) == bm.num_blocks
    assert {b.block_id: b.ref_count for b in bm.blocks if b.ref_count} == held
    free = {b.block_id for b in bm.blocks if not b.ref_count}
    assert bm.num_free_blocks == len(free)
    in_heaps = [i for heap in bm._free_heaps for i in heap]
    assert len(in_heaps) == len(set(in_heaps)) and free <= set(in_heaps)
    for h, block_id in bm.hash_to_block.items():
        assert bm.blocks[block_id].hash == h
    cache = runner(llm).kv_cache
    assert cache.committed_blocks == bm.num_blocks == llm.config.cache_config.num_gpu_blocks
    assert cache.physical_bytes >= cache.footprint_bytes(bm.num_blocks)


@pytest.mark.parametrize("one_chunk", [False, True])
@pytest.mark.parametrize("kind", FailingDriver.KINDS)
def test_a_driver_failure_at_any_call_of_a_shrink_under_load_keeps_everything_in_step(
        make_llm, connected, reference, one_chunk: bool, kind: str) -> None:  # noqa: F811
    llm = connected() if one_chunk else make_llm()
    core, floor = llm.engine, llm.engine.kv_resizer.floor
    expected = [list(o.outputs[0].token_ids) for o in reference("greedy", LOAD_LENGTHS)]
    driver = install_failing_driver(llm)
    fired = True
    k = 0
    while fired:  # the k-th call of `kind` fails, until the shrink makes fewer calls than k
        k += 1
        core.resize_kv_cache(floor)  # the same chunks each time
        core.resize_kv_cache(512)
        requests = add_requests(llm, LOAD_LENGTHS)
        for _ in range(8):
            core.step()
        assert core.scheduler.running
        driver.calls = dict.fromkeys(FailingDriver.KINDS, 0)
        driver.fail_kind, driver.fail_at = kind, k
        try:
            core.resize_kv_cache(150)
        except KVCacheResizeError as error:
            assert f"injected {kind}" in str(error)
        fired, driver.fail_kind = driver.calls[kind] >= k, ""
        assert_block_manager_agrees(llm)
        assert finish(llm, requests) == expected, (kind, k)  # a shrink fails no request
        assert_nothing_leaked(llm)
        core.resize_kv_cache(512)  # gives back what a failed clean-up left
        assert_driver_matches_cache(llm, driver)
        assert_block_manager_agrees(llm)
    assert k > 1 or kind == "unmap"  # a shrink that maps nothing makes no unmap of its own


def release(llm: LLM) -> Callable[[], None]:
    """Resize with no memory to be had, so the recommit releases the cache; returns the call
    that gives the memory back."""
    reservation = runner(llm).kv_cache.tensor._reservation
    if runner(llm).kv_cache.committed_blocks < 512:
        llm.resize_kv_cache(512)
    fail_chunks_over(llm, 0)
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(256)
    assert llm.engine.kv_cache_released
    return lambda: delattr(reservation, "create")  # the instance's refusal goes


@pytest.mark.parametrize("path", ["restore", "wake"])
@pytest.mark.parametrize("kind", FailingDriver.KINDS)
def test_a_driver_failure_at_any_call_of_a_restore_or_wake_leaves_it_released_for_the_next(
        connected, reference, path: str, kind: str) -> None:  # noqa: F811
    """A non-memory driver error backing a released cache (the engine's restore, the user's
    wake) leaves it released at its size, consistent, and the next attempt backs it."""
    llm = connected(enable_sleep_mode=True)
    core = llm.engine
    driver = install_failing_driver(llm)
    fired, k = True, 0
    while fired:
        k += 1
        if path == "restore":
            release(llm)()
            core._released_retry_at = 0.0
        else:
            llm.sleep()
        driver.calls = dict.fromkeys(FailingDriver.KINDS, 0)
        driver.fail_kind, driver.fail_at = kind, k
        raised = False
        if path == "restore":
            core.step()  # never raises: it retries later
        else:
            try:
                llm.wake_up()
            except KVCacheResizeError as error:
                raised = f"injected {kind}" in str(error)
        fired, driver.fail_kind = driver.calls[kind] >= k, ""
        assert raised == (fired and path == "wake")
        cache, bm = runner(llm).kv_cache, core.scheduler.block_manager
        assert cache.committed_blocks == bm.num_blocks == llm.config.cache_config.num_gpu_blocks
        assert cache.is_released == fired
        assert (core.kv_cache_released if path == "restore" else core.is_sleeping) == fired
        if fired and path == "restore":
            core._released_retry_at = 0.0
            core.step()
        elif fired:
            llm.wake_up()
        assert not core.kv_cache_released and not core.is_sleeping
        assert_driver_matches_cache(llm, driver)
        assert_one_chunk_registered(llm)
        assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    assert k > 1 or kind == "unmap"  # backing a released cache unmaps nothing


def mixed_requests(llm: LLM) -> list[list[Any]]:
    """Four prompts sharing a 300-token prefix, two without; `n` completions, logprobs and
    prompt logprobs among them."""
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 512, (300,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 81, 3)]
    prompts += [torch.randint(3, 512, (n,), generator=g).tolist() for n in (200, 380)]
    greedy = dict(temperature=0.0, max_tokens=20, ignore_eos=True)
    params = [SamplingParams(**greedy, n=2), SamplingParams(**greedy, logprobs=2),
              SamplingParams(**greedy, prompt_logprobs=1), SamplingParams(**greedy),
              SamplingParams(**greedy, n=3), SamplingParams(**greedy)]
    return [llm.make_request({"prompt_token_ids": p}, sp, str(i))
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]


def run_mixed(llm: LLM, between: dict[int, Callable[[], object]]) -> list[Any]:
    """The mixed requests, `between[k]()` run after the k-th step; what each sequence made."""
    requests = mixed_requests(llm)
    run_stepping(llm, requests, between)
    return [[(s.output_token_ids, [sorted(entry) for entry in s.logprobs],
              len(s.prompt_logprobs or [])) for s in seqs] for seqs in requests]


@pytest.mark.parametrize("one_chunk", [False, True])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_outputs_of_n_logprobs_and_shared_prefixes_do_not_change_across_resizes(
        make_llm, connected, one_chunk: bool, prefix_caching: bool) -> None:  # noqa: F811
    expected = run_mixed(make_llm(enable_prefix_caching=prefix_caching), {})
    llm = (connected if one_chunk else make_llm)(enable_prefix_caching=prefix_caching)
    floor = llm.engine.kv_resizer.floor
    sizes = {3: 200, 5: 512, 7: floor, 9: 300, 12: floor, 14: 512, 17: 128, 20: 256}
    events = []
    got = run_mixed(llm, {k: lambda n=n: events.append(llm.resize_kv_cache(n))
                          for k, n in sizes.items()})
    assert got == expected
    assert sum(e.num_preempted for e in events) > 0  # the cuts went through running sequences
    assert_nothing_leaked(llm)


def test_a_released_cache_sleeps_wakes_and_serves(connected, reference) -> None:  # noqa: F811
    """A user's sleep takes over a cache a failed resize released (the requests waiting on it
    aborted): it is asleep, not released, and wake_up backs it, consistent."""
    llm = connected(enable_sleep_mode=True)
    core = llm.engine
    core.add_request(llm.make_request(make_prompts()[0], PARAMS["greedy"], "waits")[0])
    give_back = release(llm)
    llm.sleep(mode="abort")
    assert core.is_sleeping and not core.kv_cache_released
    assert not core.scheduler.has_unfinished()
    [aborted] = core.step()
    assert aborted.finish_reason == "abort"
    give_back()
    llm.wake_up()
    assert not core.is_sleeping and not core.kv_cache_released
    assert_one_chunk_registered(llm)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    assert_nothing_leaked(llm)


def test_shutdown_while_released_with_requests_waiting_gives_everything_back(
        connected) -> None:  # noqa: F811
    llm = connected()
    driver = install_failing_driver(llm)
    release(llm)
    llm.engine.add_request(llm.make_request(make_prompts()[0], PARAMS["greedy"], "waits")[0])
    llm.shutdown()
    assert not driver.handles and not driver.mappings and not driver.reserved


@pytest.mark.parametrize(("one_chunk", "kind"), [
    (False, "unmap"),  # the guard drops whole chunks: it only unmaps
    *((True, kind) for kind in FailingDriver.KINDS),  # a recommit: every call
])
def test_a_driver_error_in_the_out_of_memory_guards_shrink_fails_no_request(
        make_llm, connected, reference, one_chunk: bool, kind: str) -> None:  # noqa: F811
    """A driver error other than out of memory in the guard's shrink leaves the cache
    consistent (a one-chunk cache at its old size; else the new one, its dropped chunks still
    to give back): the step is scheduled again (and where it still runs out of memory, the
    guard shrinks again); no request fails."""
    from .test_oom_guard import inject

    llm = connected() if one_chunk else make_llm()
    before = llm.engine.kv_resizer.num_blocks
    driver = install_failing_driver(llm)
    driver.calls = dict.fromkeys(FailingDriver.KINDS, 0)
    driver.fail_kind, driver.fail_at = kind, 1
    # A one-chunk cache is as it was: the retried step runs out of memory again and the
    # guard's second shrink works.
    inject(llm, "decode_forward", times=2 if one_chunk else 1)
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    assert driver.calls[kind] >= 1
    events = llm.engine.oom_guard.events
    assert len(events) == (2 if one_chunk else 1)
    if one_chunk:
        assert events[0].num_blocks_after == before  # the failed recommit backed it again
    assert events[-1].num_blocks_after < before
    assert not llm.engine.kv_cache_released
    assert_block_manager_agrees(llm)
    llm.resize_kv_cache(llm.engine.kv_resizer.num_blocks)  # gives back what a failure left
    assert_driver_matches_cache(llm, driver)
    if one_chunk:
        assert_one_chunk_registered(llm)
    assert_nothing_leaked(llm)
