"""Resizing the KV cache at runtime (`LLM.resize_kv_cache`): down and up under load with the
same greedy outputs, never under a running step, at the same addresses; the bounds and their
errors; a driver failure at any call of a grow or a shrink leaves the cache consistent. On the
CPU through the host VMM driver."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvfit import LLM, SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.engine.engine_core import EngineCore
from kvfit.engine.kv_resize import KVCacheResizeError
from kvfit.engine.outputs import RequestOutput
from kvfit.engine.sequence import Sequence
from kvfit.kv.monitor import HostMemoryMonitor
from kvfit.vmm import VmmError, VmmOutOfMemoryError
from kvfit.vmm.driver import AllocationHandle, VmmDriver

from .test_oom_guard import (
    assert_nothing_leaked,
    bound_views,
    make_prompts,
    runner,
    spy_resizes,
)

LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=256)  # 512 blocks of 16 KiB, floor 32
LONG_LENGTHS = tuple(range(380, 392))  # twelve requests of ~26 blocks with their outputs
SHORT_LENGTHS = (1, 17, 40, 100)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture
def make_llm(qwen3: Path) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(**kwargs: object) -> LLM:
        made.append(LLM(str(qwen3), device="cpu", **{**LIMITS, **kwargs}))
        return made[-1]

    yield make
    for llm in made:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(qwen3: Path) -> Iterator[Callable[[tuple[int, ...]], list[list[int]]]]:
    """Greedy tokens of a run that never resizes, per prompt lengths."""
    llm = LLM(str(qwen3), device="cpu", **LIMITS)
    done: dict[tuple[int, ...], list[list[int]]] = {}

    def get(lengths: tuple[int, ...]) -> list[list[int]]:
        if lengths not in done:
            done[lengths] = tokens(llm.generate(make_prompts(lengths), PARAMS, use_tqdm=False))
        return done[lengths]

    yield get
    llm.shutdown()


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    assert all(o.finished for o in outputs)
    return [list(o.outputs[0].token_ids) for o in outputs]


def generate_stepping(llm: LLM, lengths: tuple[int, ...],
                      between: dict[int, Callable[[], object]]) -> list[RequestOutput]:
    """`generate` by hand: `between[k]()` runs after the k-th step (one is then in flight)."""
    requests = [llm.make_request(p, PARAMS, str(i))
                for i, p in enumerate(make_prompts(lengths))]
    run_stepping(llm, requests, between)
    return [RequestOutput.from_seqs(seqs) for seqs in requests]


def run_stepping(llm: LLM, requests: list[list[Sequence]],
                 between: dict[int, Callable[[], object]]) -> None:
    """Add `requests` and step until they finish, `between[k]()` run after the k-th step."""
    for seqs in requests:
        for seq in seqs:
            llm.engine.add_request(seq)
    num_steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        num_steps += 1
        if num_steps in between:
            between.pop(num_steps)()
    assert not between, f"the run ended before the resizes after steps {sorted(between)}"


def assert_sizes_agree(llm: LLM, num_blocks: int) -> None:
    cache = runner(llm).kv_cache
    bm = llm.engine.scheduler.block_manager
    assert cache.committed_blocks == bm.num_blocks == len(bm.blocks) == num_blocks
    assert llm.config.cache_config.num_gpu_blocks == num_blocks
    assert cache.physical_bytes == cache.footprint_bytes(num_blocks)


# --- under load ------------------------------------------------------------------------------


def test_resizes_under_load_keep_greedy_outputs_addresses_and_graph_bindings(
    make_llm: Callable[..., LLM], reference: Callable[..., list[list[int]]],
) -> None:
    llm = make_llm()
    floor = llm.engine.kv_resizer.floor
    cache = runner(llm).kv_cache
    base, views = cache.tensor.base_ptr, bound_views(runner(llm))
    commits = spy_resizes(llm)
    events = []

    def resize(num_blocks: int) -> Callable[[], None]:
        def act() -> None:
            events.append(llm.resize_kv_cache(num_blocks))
            assert_sizes_agree(llm, num_blocks)
        return act

    # Prefill takes 18 steps of 256 tokens; then twelve ~26-block sequences hold ~300 blocks,
    # and a cut at 200 lands in the newest ones'.
    outputs = generate_stepping(llm, LONG_LENGTHS, {
        19: resize(200), 22: resize(512), 25: resize(floor), 30: resize(300), 34: resize(150)})
    assert tokens(outputs) == reference(LONG_LENGTHS)
    assert [(e.num_blocks_before, e.num_blocks_after) for e in events] == [
        (512, 200), (200, 512), (512, floor), (floor, 300), (300, 150)]
    assert events[0].num_preempted > 0 and events[2].num_preempted > 0
    assert events[1].num_preempted == 0 and events[1].delta_bytes > 0
    assert events[0].delta_bytes < 0 and all(e.cause == "api" for e in events)
    assert [n for n, _ in commits] == [e.num_blocks_after for e in events]
    assert not any(in_flight for _, in_flight in commits)  # never under a running step
    assert cache.tensor.base_ptr == base and bound_views(runner(llm)) == views
    stats = llm.engine.stats()
    assert (stats.kv_cache_shrinks, stats.kv_cache_grows, stats.kv_cache_failed_grows) == (3, 2, 0)
    assert stats.num_preemptions >= events[0].num_preempted + events[2].num_preempted
    assert_nothing_leaked(llm)
    # Between generate calls too; the cache serves on at its new size.
    llm.resize_kv_cache(400)
    assert tokens(llm.generate(make_prompts(LONG_LENGTHS), PARAMS, use_tqdm=False)) == \
        reference(LONG_LENGTHS)
    assert_sizes_agree(llm, 400)
    assert_nothing_leaked(llm)


def test_a_shrink_evicts_the_tails_prefix_cache_entries_and_keeps_the_rest(
    make_llm: Callable[..., LLM], reference: Callable[..., list[list[int]]],
) -> None:
    llm = make_llm()
    llm.generate(make_prompts(LONG_LENGTHS), PARAMS, use_tqdm=False)  # leaves ~290 entries
    bm = llm.engine.scheduler.block_manager
    entries = dict(bm.hash_to_block)
    event = llm.resize_kv_cache(200)
    assert event.num_preempted == 0  # nothing runs: only entries go
    assert event.num_evicted == sum(block_id >= 200 for block_id in entries.values()) > 0
    assert bm.hash_to_block == {h: b for h, b in entries.items() if b < 200}
    hits = bm.num_hit_tokens
    outputs = llm.generate(make_prompts(LONG_LENGTHS), PARAMS, use_tqdm=False)
    assert tokens(outputs) == reference(LONG_LENGTHS)
    assert bm.num_hit_tokens > hits  # the entries below the cut still hit


# --- bounds ----------------------------------------------------------------------------------


def test_resizes_out_of_bounds_raise_naming_the_setting_and_change_nothing(
    make_llm: Callable[..., LLM],
) -> None:
    # The host budget counts the process's private memory: what it holds now, the 256 MiB
    # margin and a GiB leave the cache less than the capacity, which is the estimate (it
    # keeps no margin) or 4096 sequences of 512 tokens (2 GiB), whichever is less.
    private = HostMemoryMonitor(1).snapshot().torch_allocated
    llm = make_llm(max_num_seqs=4096, cpu_kv_cache_space_bytes=private + (1280 << 20))
    floor, capacity, budget = llm.engine.kv_resizer.limits()
    assert floor == 32 and floor < budget < capacity
    assert llm.kv_cache_report.num_blocks == budget  # startup measured the same budget
    cases = [
        (floor - 1, ValueError, r"one max_model_len \(512\) sequence needs 32 blocks.*"
                                r"max_model_len"),
        (capacity + 1, ValueError, f"reserved {capacity} blocks of address space"),
        (budget + 1, ValueError, f"budget allows {budget} blocks.*cpu_kv_cache_space_bytes"),
        (1.5, ValueError, "integer"),
    ]
    for num_blocks, error, match in cases:
        with pytest.raises(error, match=match):
            llm.resize_kv_cache(num_blocks)
        assert_sizes_agree(llm, budget)
    assert llm.resize_kv_cache(floor).num_blocks_after == floor  # the bounds are inclusive
    assert llm.resize_kv_cache(budget).num_blocks_after == budget
    # A count computed with numpy (or torch) is an integer too.
    event = llm.resize_kv_cache(np.int64(floor))
    assert event.num_blocks_after == floor and type(event.num_blocks_after) is int


def test_a_capacity_short_of_a_granule_reports_the_reservation_not_less_than_committed(
    make_llm: Callable[..., LLM],
) -> None:
    # 2 sequences of 64 tokens: 8 blocks of 16 KiB, a quarter of the 2 MiB granule that the
    # first commit maps whole.
    llm = make_llm(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    for num_blocks in (4, 8):
        llm.resize_kv_cache(num_blocks)
        stats, state = llm.engine.stats(), llm.engine.kv_cache_state()
        assert 0 < stats.committed_kv_bytes <= stats.reserved_kv_bytes
        assert (state["committed_bytes"], state["reserved_bytes"]) == (
            stats.committed_kv_bytes, stats.reserved_kv_bytes)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_gpu_blocks_override": 512}, "sized by override.*num_gpu_blocks_override"),
    ({"enable_sleep_mode": True}, "asleep.*wake_up"),
])
def test_a_cache_that_cannot_resize_says_why(make_llm: Callable[..., LLM], kwargs: dict,
                                             match: str) -> None:
    llm = make_llm(**kwargs)
    if llm.config.enable_sleep_mode:
        llm.sleep()
    with pytest.raises(RuntimeError, match=match):
        llm.resize_kv_cache(100)
    state = llm.engine.kv_cache_state()  # what GET /kv_cache answers, resizable or not
    assert state["num_shrinks"] == state["num_grows"] == 0
    if "num_gpu_blocks_override" in kwargs:
        assert state["num_blocks"] == state["max_blocks"] == state["capacity_blocks"] == 512


# --- driver failures -------------------------------------------------------------------------


class FailingDriver(VmmDriver):
    """Wraps the cache's driver: fails the `fail_at`-th call of kind `fail_kind`, and tracks
    the mappings, handles and scratch ranges it sees, seeded from the chunks already mapped."""

    KINDS = ("create", "map", "set_access", "unmap")

    def __init__(self, inner: VmmDriver, chunks: dict[int, Any], va: int) -> None:
        self.inner, self.fail_kind, self.fail_at = inner, "", 0
        self.calls = dict.fromkeys(self.KINDS, 0)
        self.handles: set[AllocationHandle] = {c.handle for c in chunks.values()}
        self.mappings = {va + c.offset: c.size for c in chunks.values()}
        self.reserved: set[int] = set()

    def _count(self, kind: str) -> None:
        self.calls[kind] += 1
        if kind == self.fail_kind and self.calls[kind] == self.fail_at:
            raise VmmError(f"injected {kind}", 999)

    def granularity(self, device: int) -> int:
        return self.inner.granularity(device)

    def reserve(self, size: int) -> int:
        va = self.inner.reserve(size)
        self.reserved.add(va)
        return va

    def free_reserved(self, va: int, size: int) -> None:
        self.inner.free_reserved(va, size)
        self.reserved.discard(va)  # the cache's own range was reserved before the wrapping

    def create(self, size: int, device: int) -> AllocationHandle:
        self._count("create")
        handle = self.inner.create(size, device)
        self.handles.add(handle)
        return handle

    def map(self, va: int, size: int, handle: AllocationHandle) -> None:
        self._count("map")
        self.inner.map(va, size, handle)
        self.mappings[va] = size

    def set_access(self, va: int, size: int, device: int) -> None:
        self._count("set_access")
        self.inner.set_access(va, size, device)

    def unmap(self, va: int, size: int) -> None:
        self._count("unmap")
        self.inner.unmap(va, size)
        assert self.mappings.pop(va) == size

    def release(self, handle: AllocationHandle) -> None:
        self.inner.release(handle)
        self.handles.remove(handle)

    def dlpack_device(self, device: int) -> tuple[int, int]:
        return self.inner.dlpack_device(device)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return self.inner.mem_get_info(device)


def install_failing_driver(llm: LLM) -> FailingDriver:
    reservation = runner(llm).kv_cache.tensor._live()
    driver = FailingDriver(reservation.driver, reservation.chunks, reservation.va)
    reservation.driver = driver
    return driver


def assert_driver_matches_cache(llm: LLM, driver: FailingDriver) -> None:
    """The driver holds exactly the cache's chunks: nothing leaked, no scratch left."""
    reservation = runner(llm).kv_cache.tensor._live()
    chunks = reservation.chunks.values()
    assert driver.handles == {c.handle for c in chunks}
    assert driver.mappings == {reservation.va + c.offset: c.size for c in chunks}
    assert not driver.reserved


# Each resize starts from the floor's one 2 MiB chunk grown to `start` (one more chunk past
# 2 MiB): the grow maps one chunk; the shrink to 150 blocks (4 MiB) cuts the second (a copy
# through a scratch range) and the shrink to 100 (2 MiB) drops it whole.
RESIZES = {"grow": (64, 512), "shrink_cutting": (512, 150), "shrink_dropping": (512, 100)}


@pytest.mark.parametrize("resize", RESIZES)
def test_a_driver_failure_at_any_call_leaves_the_cache_consistent(
    make_llm: Callable[..., LLM], reference: Callable[..., list[list[int]]], resize: str,
) -> None:
    llm = make_llm()
    start, target = RESIZES[resize]

    def reset() -> None:
        llm.resize_kv_cache(llm.engine.kv_resizer.floor)
        llm.resize_kv_cache(start)

    reset()
    driver = install_failing_driver(llm)
    driver.calls = dict.fromkeys(FailingDriver.KINDS, 0)
    llm.resize_kv_cache(target)  # count the calls
    counts = dict(driver.calls)
    assert sum(counts.values()) >= (3 if resize == "grow" else 1)
    injected = 0
    for kind in FailingDriver.KINDS:
        for k in range(1, counts[kind] + 1):
            reset()
            driver.calls = dict.fromkeys(FailingDriver.KINDS, 0)
            driver.fail_kind, driver.fail_at = kind, k
            with pytest.raises(KVCacheResizeError, match=f"injected {kind}"):
                llm.resize_kv_cache(target)
            driver.fail_kind = ""
            injected += 1
            # Either size, but one size everywhere, fully backed; the contents serve on.
            num_blocks = llm.engine.scheduler.block_manager.num_blocks
            assert num_blocks in (start, target), (kind, k)
            cache = runner(llm).kv_cache
            assert cache.committed_blocks == num_blocks == llm.config.cache_config.num_gpu_blocks
            assert cache.physical_bytes >= cache.footprint_bytes(num_blocks)
            assert tokens(llm.generate(make_prompts(SHORT_LENGTHS), PARAMS, use_tqdm=False)) \
                == reference(SHORT_LENGTHS), (kind, k)
            llm.resize_kv_cache(target)  # the next resize gives back what the failure left
            assert_driver_matches_cache(llm, driver)
            assert_sizes_agree(llm, target)
    assert injected == sum(counts.values())
    stats = llm.engine.stats()
    assert stats.kv_cache_failed_grows == (injected if resize == "grow" else 0)
    assert_nothing_leaked(llm)


class OutOfMemoryDriver(FailingDriver):
    """A device out of memory for the first `num_failures` creates (a cut's copy, say)."""

    def __init__(self, inner: VmmDriver, chunks: dict[int, Any], va: int,
                 num_failures: int) -> None:
        super().__init__(inner, chunks, va)
        self.num_failures = num_failures

    def create(self, size: int, device: int) -> AllocationHandle:
        if self.num_failures:
            self.num_failures -= 1
            raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        return super().create(size, device)


@pytest.mark.parametrize("regrow", [True, False])
def test_a_shrink_with_no_memory_to_cut_a_chunk_goes_through_whole_chunks(
    make_llm: Callable[..., LLM], reference: Callable[..., list[list[int]]], regrow: bool,
) -> None:
    """Cutting a chunk copies its kept part: on a device out of memory the shrink unmaps whole
    chunks instead, preempting down to there, and maps fresh pages back up to the size asked;
    where even that finds no memory it keeps the smaller size. No request fails or changes."""
    llm = make_llm()
    llm.resize_kv_cache(llm.engine.kv_resizer.floor)
    llm.resize_kv_cache(512)  # two chunks: [0, 2 MiB) and [2 MiB, 8 MiB)
    uncut = runner(llm).kv_cache.uncut_blocks(150)
    assert llm.engine.kv_resizer.floor <= uncut < 150
    reservation = runner(llm).kv_cache.tensor._live()
    driver = OutOfMemoryDriver(reservation.driver, reservation.chunks, reservation.va,
                               num_failures=1 if regrow else 1 << 30)
    reservation.driver = driver
    events = []
    outputs = generate_stepping(llm, LONG_LENGTHS,
                                {12: lambda: events.append(llm.resize_kv_cache(150))})
    assert tokens(outputs) == reference(LONG_LENGTHS)
    [event] = events
    assert event.num_blocks_after == (150 if regrow else uncut)
    assert event.num_preempted > 0  # the long requests held blocks past `uncut`
    assert_sizes_agree(llm, 150 if regrow else uncut)
    assert_driver_matches_cache(llm, driver)
    assert_nothing_leaked(llm)


# --- GPU -------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_resizes_under_load_keep_graphs_and_outputs(gpu_model: Path) -> None:
    def make() -> LLM:
        return LLM(str(gpu_model), device="cuda", max_num_seqs=32, max_model_len=1024,
                   cuda_graph_sizes=[1, 2, 4, 8, 16, 32])

    lengths = (1, 7, 16, 33, 64, 100, 300, 500)
    reference_llm = make()
    expected = tokens(reference_llm.generate(make_prompts(lengths), PARAMS, use_tqdm=False))
    reference_llm.shutdown()
    llm = make()
    r = runner(llm)
    cache, floor = r.kv_cache, llm.engine.kv_resizer.floor
    base, views, full = cache.tensor.base_ptr, bound_views(r), cache.committed_blocks
    replays: list[int] = []
    replay = r.graphs.run
    r.graphs.run = lambda *a: (replays.append(1), replay(*a))[1]  # type: ignore[method-assign]
    commits = spy_resizes(llm)
    outputs = generate_stepping(llm, lengths, {
        4: lambda: llm.resize_kv_cache(floor), 8: lambda: llm.resize_kv_cache(full),
        12: lambda: llm.resize_kv_cache(3 * floor)})
    assert tokens(outputs) == expected
    assert [n for n, _ in commits] == [floor, full, 3 * floor]
    assert not any(in_flight for _, in_flight in commits)
    assert len(replays) > 0 and r.graphs.num_capture_passes == 1  # replayed, never recaptured
    assert cache.tensor.base_ptr == base and bound_views(r) == views
    assert_nothing_leaked(llm)
    llm.shutdown()


@pytest.mark.parametrize(("start", "target"), [(32, 512), (512, 32)])
def test_a_commit_failing_on_one_worker_is_reconciled_across_workers(
    qwen3: Path, start: int, target: int,
) -> None:
    """Rank 0 commits, rank 1 fails once: the block manager keeps what both back, and a rank
    left holding more gives it back, so every rank and the block manager agree."""
    config = EngineArgs(model=str(qwen3), device="cpu", **LIMITS).create_engine_config()
    core = EngineCore(config, None, num_workers=2)
    try:
        core.resize_kv_cache(start)
        failing = core.executor.workers[1]
        commit = failing.resize_kv_cache

        def fail_once(num_blocks: int) -> int:
            failing.resize_kv_cache = commit  # type: ignore[method-assign]
            raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")

        failing.resize_kv_cache = fail_once  # type: ignore[method-assign]
        with pytest.raises(KVCacheResizeError, match="CUDA_ERROR_OUT_OF_MEMORY"):
            core.resize_kv_cache(target)
        bm = core.scheduler.block_manager
        kept = min(start, target)  # a grow is undone; a shrink rank 0 made stays
        caches = [w.runner.kv_cache for w in core.executor.workers]
        assert [c.committed_blocks for c in caches] == [kept, kept]
        assert [c.physical_bytes for c in caches] == [caches[0].footprint_bytes(kept)] * 2
        assert bm.num_blocks == config.cache_config.num_gpu_blocks == kept
        core.resize_kv_cache(target)
        assert [c.committed_blocks for c in caches] == [target, target] and bm.num_blocks == target
    finally:
        core.shutdown()


def test_a_resize_between_steps_leaves_the_steps_it_applied_for_the_front_end(
    make_llm: Callable[..., LLM],
) -> None:
    """A resize applies the step in flight before it commits; the sequences of that step are
    among the next `step`'s `updated_seqs`, which a streaming front end visits, so a request
    that finished in it is still reported (dropping them left its stream waiting forever)."""
    llm = make_llm()
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    seqs = [seq for i, prompt in enumerate(make_prompts((5, 9)))
            for seq in llm.make_request(prompt, params, f"r{i}")]
    for seq in seqs:
        core.add_request(seq)
    core.step()  # the prefill, in flight
    core.step()  # applied; the first decode in flight
    assert core._in_flight is not None
    core.resize_kv_cache(core.kv_resizer.num_blocks - core.kv_resizer.floor)
    assert all(seq.is_finished for seq in seqs)  # the resize applied the last decode
    finished = core.step()
    assert {s.request_id for s in finished} == {"r0", "r1"}
    assert {s.request_id for s in core.updated_seqs} >= {"r0", "r1"}
