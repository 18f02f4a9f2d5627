"""The co-tenancy governor (`elastic_kv_cache`) against a simulated co-tenant: the engine's
worker reads a scripted device whose other process allocates whenever memory is free. The
cache shrinks until the co-tenant has what it asked for, holds still while nothing changes,
grows back once it frees (not before the minimum interval, retrying a grow that failed), and
no request fails or changes its greedy output meanwhile."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfit import LLM, SamplingParams
from kvfit.kv.monitor import HostMemoryMonitor
from kvfit.vmm import VmmOutOfMemoryError

from .test_oom_guard import assert_nothing_leaked, make_prompts, runner

MiB = 1 << 20
LOW, HIGH, MIN_INTERVAL = 4 * MiB, 10 * MiB, 0.5
MIDDLE = (LOW + HIGH) // 2
# 64 sequences of 512 tokens: a 2048-block (32 MiB) cache on the host, sixteen 2 MiB granules.
ENGINE = dict(max_num_seqs=64, max_num_batched_tokens=256, elastic_kv_cache=True,
              elastic_low_watermark="4MiB", elastic_high_watermark=f"{HIGH}",
              elastic_min_interval=MIN_INTERVAL, elastic_idle_s=0)  # free memory alone
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = make_prompts((1, 17, 40, 100, 150, 200))
DEADLINE_S = 60.0


class CoTenantDevice(HostMemoryMonitor):
    """A device shared by the engine's KV cache, the engine's other use (`other`) and a
    co-tenant process that allocates 1 MiB at a time whenever memory is free, until it holds
    `wants`, and frees at once. Free memory starts at the middle of the watermarks."""

    def __init__(self, llm: LLM) -> None:
        self.cache = runner(llm).kv_cache
        total = 128 * MiB
        super().__init__(total, "cpu_kv_cache_space_bytes")
        self.other = total - self.cache.physical_bytes - MIDDLE
        self.wants = self.holds = 0

    def free(self) -> int:
        return self.budget_bytes - self.other - self.cache.physical_bytes - self.holds

    def free_and_total(self) -> tuple[int, int]:
        self.holds = min(self.holds, self.wants)
        while self.holds < self.wants and self.free() >= MiB:
            self.holds += MiB
        return self.free(), self.budget_bytes


@pytest.fixture
def elastic(qwen3: Path) -> Iterator[tuple[LLM, CoTenantDevice, list[list[int]]]]:
    """An elastic engine on a co-tenant device, and its greedy tokens before any resize."""
    llm = LLM(str(qwen3), device="cpu", **ENGINE)
    expected = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    device = CoTenantDevice(llm)
    llm.engine.executor.workers[0].monitor = device
    yield llm, device, expected
    llm.shutdown()


def tokens(outputs: list[Any]) -> list[list[int]]:
    assert all(o.finished for o in outputs)
    return [list(o.outputs[0].token_ids) for o in outputs]


def serve_until(llm: LLM, expected: list[list[int]], done: Callable[[], bool]) -> None:
    """Generate, checking every output, until `done()` (the governor polls between steps)."""
    deadline = time.monotonic() + DEADLINE_S
    while not done():
        assert time.monotonic() < deadline, "the governor did not get there in time"
        assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False)) == expected


def scripted(llm: LLM, monkeypatch: pytest.MonkeyPatch, free: Callable[[], int]) -> list[float]:
    """The engine's device reads `free()` bytes free (of 128 MiB) and its governor polls at
    every step on a fake clock (`clock[0]`, returned), which starts at 1000 s: after every
    real time the governor noted."""
    import dataclasses
    import math

    from kvfit.engine import engine_core

    class Scripted(HostMemoryMonitor):
        def free_and_total(self) -> tuple[int, int]:
            return free(), self.budget_bytes

    llm.engine.executor.workers[0].monitor = Scripted(128 * MiB, "cpu_kv_cache_space_bytes")
    governor = llm.engine.kv_cache_governor
    governor.config = dataclasses.replace(governor.config, poll_interval_s=0.0)
    governor.last_poll = governor.last_resize = governor.last_grow_attempt = -math.inf
    clock = [1000.0]
    monkeypatch.setattr(engine_core.time, "monotonic", lambda: clock[0])
    return clock


def test_the_governor_shrinks_for_a_co_tenant_and_grows_back_once_it_frees(
    elastic: tuple[LLM, CoTenantDevice, list[list[int]]],
) -> None:
    llm, device, expected = elastic
    resizer, cache = llm.engine.kv_resizer, runner(llm).kv_cache
    start_blocks = cache.committed_blocks
    serve_until(llm, expected, lambda: True)
    assert not resizer.events  # free memory in the band: nothing to do

    device.wants = 16 * MiB
    serve_until(llm, expected, lambda: device.holds == device.wants)
    shrinks = list(resizer.events)
    assert shrinks and all(e.cause == "governor" and e.delta_bytes < 0 for e in shrinks)
    assert all(e.free_bytes < LOW for e in shrinks)  # each one prompted by a shortage
    assert LOW <= device.free() <= HIGH
    assert cache.committed_blocks < start_blocks
    assert cache.committed_blocks == llm.engine.scheduler.block_manager.num_blocks

    device.wants = 0  # at once: the grow still waits for the interval after the last shrink
    serve_until(llm, expected, lambda: cache.committed_blocks == start_blocks)
    [grow] = list(resizer.events)[len(shrinks):]
    assert grow.cause == "governor" and grow.free_bytes > HIGH
    assert grow.time - shrinks[-1].time >= MIN_INTERVAL
    assert LOW <= device.free() <= HIGH

    # Nothing changes while the co-tenant holds still: no oscillation.
    steady = time.monotonic() + 3 * MIN_INTERVAL
    serve_until(llm, expected, lambda: time.monotonic() > steady)
    assert list(resizer.events) == [*shrinks, grow]
    stats = llm.engine.stats()
    assert (stats.kv_cache_shrinks, stats.kv_cache_grows) == (len(shrinks), 1)
    assert_nothing_leaked(llm)


def test_a_grow_that_finds_no_memory_leaves_the_cache_and_retries_after_the_interval(
    elastic: tuple[LLM, CoTenantDevice, list[list[int]]],
) -> None:
    llm, device, expected = elastic
    resizer, cache = llm.engine.kv_resizer, runner(llm).kv_cache
    start_blocks = cache.committed_blocks
    device.wants = 16 * MiB
    serve_until(llm, expected, lambda: device.holds == device.wants)
    shrunk = cache.committed_blocks
    worker = llm.engine.executor.workers[0]
    commit, failed_at = worker.resize_kv_cache, []

    def fail_first_grow(num_blocks: int) -> int:
        if num_blocks > cache.committed_blocks and not failed_at:
            failed_at.append(time.monotonic())
            raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        return commit(num_blocks)

    worker.resize_kv_cache = fail_first_grow  # type: ignore[method-assign]
    device.wants = 0
    serve_until(llm, expected, lambda: bool(failed_at))
    assert cache.committed_blocks == shrunk == llm.engine.scheduler.block_manager.num_blocks
    assert llm.engine.stats().kv_cache_failed_grows == 1
    serve_until(llm, expected, lambda: cache.committed_blocks == start_blocks)
    grow = resizer.events[-1]
    assert grow.time - failed_at[0] >= MIN_INTERVAL
    assert llm.engine.stats().kv_cache_grows == 1
    assert_nothing_leaked(llm)


def test_the_governor_never_shrinks_below_one_max_model_len_sequence(
    elastic: tuple[LLM, CoTenantDevice, list[list[int]]], caplog: pytest.LogCaptureFixture,
) -> None:
    llm, device, expected = elastic
    device.wants = 1 << 30  # more than there is
    floor = llm.engine.kv_resizer.floor

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "cannot give more" in r.getMessage()]

    with caplog.at_level(logging.WARNING, logger="kvfit.engine.kv_resize"):
        serve_until(llm, expected, lambda: runner(llm).kv_cache.committed_blocks == floor)
        # A poll at the floor, still short of memory, warns: serve until one has come.
        serve_until(llm, expected, lambda: bool(warnings()))
        # Several more polls at the floor (one every poll interval, between steps).
        end = time.monotonic() + 4 * llm.engine.kv_cache_governor.config.poll_interval_s
        serve_until(llm, expected, lambda: time.monotonic() > end)
    assert llm.engine.scheduler.block_manager.num_blocks == floor  # and serves on at the floor
    [warning] = warnings()  # once, not at every poll
    assert f"one max_model_len sequence ({floor} blocks)" in warning


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"num_gpu_blocks_override": 512}, "num_gpu_blocks_override"),
    ({"enable_extensible_kv_cache": False}, "enable_extensible_kv_cache=False"),
    ({"elastic_low_watermark": "2GB"}, "elastic_low_watermark"),
    ({"elastic_low_watermark": "8GiB", "elastic_high_watermark": "4GiB"},
     "elastic_low_watermark .* must be below elastic_high_watermark"),
    ({"elastic_min_interval": -1.0}, "elastic_min_interval"),
    ({"elastic_idle_s": -1.0}, "elastic_idle_s"),
    # Not numbers: refused naming the setting, not a bare TypeError, nor a bool taken as 1 s.
    ({"elastic_idle_s": "5"}, "elastic_idle_s must be a number of seconds"),
    ({"elastic_idle_s": True}, "elastic_idle_s must be a number of seconds"),
    ({"elastic_min_interval": None}, "elastic_min_interval must be a number of seconds"),
    ({"elastic_min_interval": float("nan")}, "elastic_min_interval"),
])
def test_elastic_settings_are_checked_at_config_time(qwen3: Path, kwargs: dict,
                                                     match: str) -> None:
    from kvfit.engine.config import EngineArgs

    args = EngineArgs(model=str(qwen3), device="cpu", elastic_kv_cache=True, **kwargs)
    with pytest.raises(ValueError, match=match):
        args.create_engine_config()


@pytest.mark.parametrize(("low", "high", "shown"), [
    ("0.5", "0.1", "(0.5 of device memory) must be below elastic_high_watermark (0.1 of"),
    ("0.1", "0.1", "(0.1 of device memory) must be below elastic_high_watermark (0.1 of"),
    ("8GiB", "4GiB", "(8.00 GiB) must be below elastic_high_watermark (4.00 GiB)"),
])
def test_watermarks_of_one_kind_in_the_wrong_order_name_no_device(
        qwen3: Path, low: str, high: str, shown: str) -> None:
    """Two fractions (or two byte counts) are compared as given, before any device is known:
    the message shows them, not bytes of a made-up device."""
    from kvfit.engine.config import EngineArgs

    args = EngineArgs(model=str(qwen3), device="cpu", elastic_kv_cache=True,
                      elastic_low_watermark=low, elastic_high_watermark=high)
    with pytest.raises(ValueError) as raised:
        args.create_engine_config()
    message = str(raised.value)
    assert shown in message and "device of" not in message, message


@pytest.mark.parametrize(("flag", "value"), [
    ("--elastic-low-watermark", "0.02"), ("--elastic-high-watermark", "4GiB"),
    ("--elastic-min-interval", "1"), ("--elastic-idle-s", "5"),
    ("--elastic-demand-dir", "none"),
])
def test_an_elastic_setting_without_the_elastic_cache_is_said_to_be_ignored(
        qwen3: Path, caplog: pytest.LogCaptureFixture, flag: str, value: str) -> None:
    """Set without --elastic-kv-cache, a watermark is ignored: the cache never resizes while
    its owner thinks it does. A warning names the flag and the one missing."""
    import argparse

    from kvfit.engine.config import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(qwen3), "--device", "cpu", flag, value])
    with caplog.at_level(logging.WARNING, logger="kvfit.engine.config"):
        assert EngineArgs.from_cli_args(args).create_engine_config().elastic is None
    (warning,) = [r.getMessage() for r in caplog.records if "elastic" in r.getMessage()]
    assert flag in warning and "ignored" in warning and "add --elastic-kv-cache" in warning
    caplog.clear()
    args.elastic_kv_cache = True
    with caplog.at_level(logging.WARNING, logger="kvfit.engine.config"):
        assert EngineArgs.from_cli_args(args).create_engine_config().elastic is not None
    assert not [r for r in caplog.records if "ignored" in r.getMessage()]


def test_watermarks_the_device_contradicts_fail_before_loading_and_hold_nothing(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Watermarks of two kinds are checked against the device at startup: before the weights
    load, and with nothing left allocated."""
    from kvfit.engine.worker import Worker

    loaded = []
    load_model = Worker.load_model
    monkeypatch.setattr(Worker, "load_model", lambda w: (loaded.append(w), load_model(w)))
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ValueError, match="elastic_low_watermark .* below elastic_high_watermark"):
        LLM(str(qwen3), device="cpu", elastic_kv_cache=True, elastic_low_watermark="0.5",
            elastic_high_watermark="64MiB", cpu_kv_cache_space_bytes=1 << 30)
    assert not loaded and len(os.listdir("/proc/self/fd")) == fds


def test_the_flags_reach_the_engine_config(qwen3: Path) -> None:
    import argparse

    from kvfit.elastic import ElasticConfig, MemoryAmount
    from kvfit.engine.config import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(qwen3), "--device", "cpu", "--elastic-kv-cache",
                              "--elastic-low-watermark", "1GiB", "--elastic-high-watermark",
                              "0.5", "--elastic-min-interval", "3", "--elastic-idle-s", "7",
                              "--elastic-demand-dir", "/tmp/board"])
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.elastic == ElasticConfig(MemoryAmount(nbytes=1 << 30),
                                           MemoryAmount(fraction=0.5), min_interval_s=3.0,
                                           idle_s=7.0, demand_dir="/tmp/board")
    args.elastic_demand_dir = "none"
    assert EngineArgs.from_cli_args(args).create_engine_config().elastic.demand_dir is None
    assert EngineArgs(model=str(qwen3), device="cpu").create_engine_config().elastic is None


@pytest.mark.parametrize("elastic_kv_cache", [False, True])
def test_an_elastic_engine_commits_its_cache_in_small_chunks_from_startup(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch, elastic_kv_cache: bool
) -> None:
    """Under the governor the startup commit maps chunks of `ELASTIC_CHUNK_BYTES` over all
    segments, as its resizes do, so its first shrink under pressure gives back (unmapping
    whole chunks) little more than it needs; without it startup maps large chunks."""
    from kvfit.kv import cache as cache_module

    # The 32 MiB cache fits in one 2 GiB chunk: scale the chunk down to a granule a segment,
    # and leave out the small chunks every bulk grow ends with (`TAIL_BYTES`).
    monkeypatch.setattr(cache_module, "ELASTIC_CHUNK_BYTES", 1)
    monkeypatch.setattr(cache_module, "TAIL_BYTES", 0)
    llm = LLM(str(qwen3), device="cpu", **{**ENGINE, "elastic_kv_cache": elastic_kv_cache})
    try:
        cache = runner(llm).kv_cache
        largest = max(c.size for c in cache.tensor._live().chunks.values())
        assert (largest == cache.granularity) is elastic_kv_cache
        assert tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    finally:
        llm.shutdown()


def test_an_out_of_memory_guards_shrink_holds_the_next_grow_back_for_the_interval(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard's shrink is a shrink like the governor's: the governor grows back into that
    memory no sooner than `min_interval_s` after it (the step that ran out of memory may need
    it again at once), not at its next poll."""
    from .test_oom_guard import inject

    llm = LLM(str(qwen3), device="cpu", **ENGINE)
    try:
        core, cache = llm.engine, runner(llm).kv_cache
        expected = tokens(llm.generate(make_prompts((5, 9)), PARAMS, use_tqdm=False))
        budget = cache.committed_blocks
        assert core.kv_resizer.limits()[2] == budget  # the governor cannot grow it now

        clock = scripted(llm, monkeypatch, lambda: 64 * MiB)  # above the high watermark
        requests = [llm.make_request(p, PARAMS, str(i))
                    for i, p in enumerate(make_prompts((5, 9)))]
        for seqs in requests:
            core.add_request(seqs[0])
        core.step()  # the prefill; a grow attempt at the budget: none before 1000.5
        inject(llm, "decode_forward")
        clock[0] = 1000.4
        core.step()  # the first decode runs out of memory: the guard shrinks
        [oom] = core.oom_guard.events
        assert cache.committed_blocks == oom.num_blocks_after < budget
        clock[0] = 1000.6  # the interval passed since the grow attempt, not since the shrink
        core.step()
        assert cache.committed_blocks == oom.num_blocks_after, "grew back 0.2 s after the guard"
        clock[0] = 1000.9
        outputs = {}
        while core.has_unfinished():
            outputs.update((seq.request_id, seq) for seq in core.step())
        assert cache.committed_blocks == budget  # grown back once the interval passed
        [grow] = core.kv_resizer.events
        assert (grow.cause, grow.time) == ("governor", 1000.9)
        assert [outputs[str(i)].output_token_ids for i in range(2)] == expected
    finally:
        llm.shutdown()


def test_a_resize_to_the_current_size_does_not_hold_the_next_grow_back(
    elastic: tuple[LLM, CoTenantDevice, list[list[int]]],
) -> None:
    """A no-op `resize_kv_cache` (the size it has) changes nothing, so it must not delay the
    governor's next grow by `min_interval_s` as a real resize does."""
    llm, _, _ = elastic
    governor, cache = llm.engine.kv_cache_governor, runner(llm).kv_cache
    num_blocks = cache.committed_blocks
    governor.last_grow_attempt = -float("inf")  # the fixture's polls tried one at the budget
    event = llm.resize_kv_cache(num_blocks)
    assert event.num_blocks_after == num_blocks == cache.committed_blocks
    assert governor.grow_due(time.monotonic())
    assert not llm.engine.kv_resizer.events
    llm.resize_kv_cache(num_blocks // 2)  # a real one does
    assert not governor.grow_due(time.monotonic())


def test_a_grow_that_finds_less_than_a_block_free_holds_no_later_grow_back(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A short cache whose device has a few KiB over the band's lower quarter free (torch's
    allocator or a peer moved a little) has nothing to grow into: that poll tried nothing, so
    the memory a peer gives back a moment later is taken at the next poll, not
    `min_interval_s` on (on an H100 pair, 2.2-2.7 s of every 16 s phase spent at 256 blocks)."""
    llm = LLM(str(qwen3), device="cpu", **{**ENGINE, "elastic_idle_s": 60.0})
    try:
        core, cache = llm.engine, runner(llm).kv_cache
        prompts = make_prompts((200,) * 48)  # 13 blocks each: most wait on a small cache
        expected = tokens(llm.generate(prompts, PARAMS, use_tqdm=False))
        llm.resize_kv_cache(core.kv_resizer.floor)
        # Free memory just over the band's lower quarter, less what the cache maps beyond now.
        base = [LOW + (HIGH - LOW) // 4 + 1024 + cache.physical_bytes]

        clock = scripted(llm, monkeypatch, lambda: base[0] - cache.physical_bytes)
        for i, prompt in enumerate(prompts):
            core.add_request(llm.make_request(prompt, PARAMS, str(i))[0])
        outputs: dict[str, Any] = {}
        for k in range(8):  # short of blocks (a waiting one does not fit), nothing to grow into
            clock[0] = 1000.0 + 0.01 * k
            outputs.update((seq.request_id, seq) for seq in core.step())
        small, num_grows = cache.committed_blocks, core.kv_resizer.num_grows
        assert core.scheduler.waiting and small <= 4 * core.kv_resizer.floor  # one granule
        base[0] += 40 * MiB  # the peer gave its cache back
        clock[0] = 1000.1
        outputs.update((seq.request_id, seq) for seq in core.step())
        assert cache.committed_blocks > small, "the grow waited for the interval"
        assert core.kv_resizer.num_grows == num_grows + 1
        clock[0] = 1001.0
        while core.has_unfinished():
            outputs.update((seq.request_id, seq) for seq in core.step())
        assert [outputs[str(i)].output_token_ids for i in range(len(prompts))] == expected
    finally:
        llm.shutdown()
