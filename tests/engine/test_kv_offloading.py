"""The host-memory tier (`--kv-offloading-size`) in an engine on the CPU (host driver): prefixes
that left the KV cache load from host memory with identical greedy outputs; a cache too small
for the batch reloads what it evicted; resizes keep the cache's chunks (no recommit) and the
tier follows them; the settings' errors name the setting."""

from __future__ import annotations

import argparse
import gc
import weakref
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams
from kvfit.connectors import HostConnector
from kvfit.engine.config import EngineArgs

from .test_kv_connector import (
    BLOCK_SIZE,
    SETTINGS,
    fine_tuned,
    fresh_outputs,
    outputs,
    reference,  # noqa: F401 (a fixture: the outputs of an engine without a connector)
    replace_weights,
    saved_as,
    worker,
)
from .test_kv_connector import FULL_PREFIX_BLOCKS as PROMPT_BLOCKS

FULL_PREFIX_BLOCKS = sum(PROMPT_BLOCKS)


def tier(llm: LLM) -> tuple[HostConnector, HostConnector]:
    """The scheduler side and the worker side."""
    return llm.engine.scheduler.kv_connector, worker(llm).kv_connector


@pytest.fixture
def offloading(qwen3: Path) -> LLM:
    llm = LLM(str(qwen3), kv_offloading_size=0.01, **SETTINGS)
    yield llm
    llm.shutdown()


def test_prefixes_the_cache_lost_load_from_host_memory_with_identical_outputs(
        offloading, reference) -> None:  # noqa: F811
    scheduler_side, worker_side = tier(offloading)
    assert isinstance(scheduler_side, HostConnector)
    assert outputs(offloading) == reference
    assert scheduler_side.num_cached_blocks >= FULL_PREFIX_BLOCKS
    assert worker_side.stats.loaded_blocks == 0
    offloading.reset_prefix_cache()  # the device cache forgets every prefix
    assert outputs(offloading) == reference
    assert worker_side.stats.loaded_blocks == FULL_PREFIX_BLOCKS
    assert offloading.engine.stats().kv_connector_hit_tokens == FULL_PREFIX_BLOCKS * BLOCK_SIZE
    # Loaded blocks are local prefix hits from then on: a repeat loads nothing more.
    assert outputs(offloading) == reference
    assert worker_side.stats.loaded_blocks == FULL_PREFIX_BLOCKS


@pytest.mark.parametrize("max_tokens", [40, 39])
def test_a_conversations_next_turn_loads_the_replies_blocks_too(
        qwen3, offloading, max_tokens) -> None:
    # The tier's case: the history of a conversation, replies included, left the cache. The
    # blocks a decode fills end with a token still pending on the host (the step before is
    # in flight): they must be saved once it is known, not skipped. The reply's final decode
    # (40 tokens: 96 computed) fills the last block, which no later step follows: saved as
    # the sequence finishes. One token fewer, the last block's last token was sampled and
    # never computed: its K/V are not all written, and it must not be stored.
    turn = [3, *range(20, 76)]  # 57 tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    reply = offloading.generate([{"prompt_token_ids": turn}], params,
                                use_tqdm=False)[0].outputs[0].token_ids
    history = [*turn, *reply]
    offloading.reset_prefix_cache()
    follow_up = [*history, *range(100, 120)]
    answer = offloading.generate([{"prompt_token_ids": follow_up}], params,
                                 use_tqdm=False)[0].outputs[0].token_ids
    # Every block of the history whose K/V were all computed.
    hits = offloading.engine.stats().kv_connector_hit_tokens
    assert hits == (len(history) - 1) // BLOCK_SIZE * BLOCK_SIZE == {40: 96, 39: 80}[max_tokens]
    plain = LLM(str(qwen3), **SETTINGS)
    try:
        assert plain.generate([{"prompt_token_ids": follow_up}], params,
                              use_tqdm=False)[0].outputs[0].token_ids == answer
    finally:
        plain.shutdown()


def test_a_request_aborted_at_a_blocks_end_keeps_that_block_in_the_tier(
        qwen3, offloading) -> None:
    # Aborted between steps while the step in flight computes a block's last token (sampled
    # by the step before, so its key is known only now): the block is saved as it finishes.
    engine = offloading.engine
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    [seq] = offloading.make_request({"prompt_token_ids": [3, *range(20, 76)]}, params, "r")
    engine.add_request(seq)
    while seq.num_computed_tokens % BLOCK_SIZE or seq.num_computed_tokens < 80:
        engine.step()
    assert engine._in_flight is not None
    engine.abort_request("r")
    history = list(seq.token_ids)
    assert len(history) == seq.num_computed_tokens == 80
    while engine.has_unfinished():
        engine.step()
    offloading.reset_prefix_cache()
    follow_up = {"prompt_token_ids": [*history, *range(100, 120)]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    answer = offloading.generate([follow_up], params, use_tqdm=False)[0].outputs[0].token_ids
    assert engine.stats().kv_connector_hit_tokens == len(history)
    plain = LLM(str(qwen3), **SETTINGS)
    try:
        assert plain.generate([follow_up], params,
                              use_tqdm=False)[0].outputs[0].token_ids == answer
    finally:
        plain.shutdown()


def test_a_failed_step_saves_no_block_of_what_it_aborts(offloading) -> None:
    # After a step raised, the state of the step in flight is unknown: the block it was to
    # complete may hold no K/V, and its id is soon another sequence's.
    engine, (scheduler_side, _) = offloading.engine, tier(offloading)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    [seq] = offloading.make_request({"prompt_token_ids": [3, *range(20, 76)]}, params, "r")
    engine.add_request(seq)
    while seq.num_computed_tokens % BLOCK_SIZE or seq.num_computed_tokens < 80:
        engine.step()
    cached = scheduler_side.num_cached_blocks
    assert engine.fail_step() == ["r"]
    assert scheduler_side.build_finished_meta() is None
    assert scheduler_side.num_cached_blocks == cached
    assert outputs(offloading)  # the tier goes on


def test_a_cache_too_small_for_the_batch_reloads_what_it_evicted(
        qwen3, reference) -> None:  # noqa: F811
    # Room for about two prompts at once: each round evicts the others' prefixes.
    llm = LLM(str(qwen3), kv_offloading_size=0.01, num_gpu_blocks_override=16,
              enable_extensible_kv_cache=False, **SETTINGS)
    try:
        for _ in range(3):
            assert outputs(llm) == reference
        assert tier(llm)[1].stats.loaded_blocks > 0
        assert llm.engine.scheduler.num_external_hit_tokens > 0
    finally:
        llm.shutdown()


def test_resizes_keep_the_caches_chunks_and_the_tier_follows_them(
        offloading, reference) -> None:  # noqa: F811
    w, worker_side = worker(offloading), tier(offloading)[1]
    assert not w.kv_cache_one_chunk()  # no recommit: resizes cut or map chunks
    assert outputs(offloading) == reference
    cache, before = w.runner.kv_cache, offloading.engine.scheduler.block_manager.num_blocks
    floor = offloading.engine.kv_resizer.floor
    offloading.resize_kv_cache(max(floor, before // 2))
    views = worker_side._caches
    assert views[0].shape[0] == cache.committed_blocks == max(floor, before // 2)
    offloading.resize_kv_cache(before)
    assert worker_side._caches[0].shape[0] == before
    offloading.reset_prefix_cache()
    assert outputs(offloading) == reference
    assert worker_side.stats.loaded_blocks == FULL_PREFIX_BLOCKS


def test_shutdown_frees_the_host_pool(qwen3) -> None:
    # LLM.shutdown() is how another engine starts in the same process: the pool's
    # kv_offloading_size of (pinned) host memory must go with it, not with the LLM object.
    llm = LLM(str(qwen3), kv_offloading_size=0.01, **SETTINGS)
    _, worker_side = tier(llm)
    pieces = [weakref.ref(piece) for piece in worker_side._pieces]
    assert pieces
    llm.shutdown()
    gc.collect()
    assert all(piece() is None for piece in pieces)


def test_after_load_weights_the_tier_serves_only_the_new_weights_blocks(
        qwen3, tmp_path, reference) -> None:  # noqa: F811
    # An RL loop: the tier holds the old weights' blocks, which must not answer the prompts
    # again after the trainer's update; the tier works on for the new weights, in its pool.
    weights = fine_tuned(qwen3)
    expect = fresh_outputs(qwen3, weights, tmp_path / "model")
    llm = LLM(str(qwen3), kv_offloading_size=0.01, **SETTINGS)
    try:
        scheduler_side, worker_side = tier(llm)
        pieces = list(worker_side._pieces)
        assert outputs(llm) == reference
        llm.reset_prefix_cache()
        llm.load_weights(weights)
        assert tier(llm) == (scheduler_side, worker_side) and worker_side._pieces == pieces
        assert scheduler_side.num_cached_blocks == 0
        assert outputs(llm) == expect
        assert worker_side.stats.loaded_blocks == 0
        llm.reset_prefix_cache()
        assert outputs(llm) == expect
        assert worker_side.stats.loaded_blocks == FULL_PREFIX_BLOCKS
        assert llm.engine.stats().kv_connector_hit_tokens == FULL_PREFIX_BLOCKS * BLOCK_SIZE
    finally:
        llm.shutdown()


def test_reset_connector_after_apply_model_serves_only_the_new_weights_blocks(
        offloading, qwen3, tmp_path, reference) -> None:  # noqa: F811
    # An RL framework's update through apply_model, which the engine does not see: the
    # tier must drop the old weights' blocks at reset_connector, and work on in its pool.
    weights = fine_tuned(qwen3)
    expect = fresh_outputs(qwen3, weights, tmp_path / "model")
    scheduler_side, worker_side = tier(offloading)
    pieces = list(worker_side._pieces)
    assert outputs(offloading) == reference
    replace_weights(offloading, weights, "apply_model")
    assert offloading.reset_prefix_cache(reset_connector=True)
    assert scheduler_side.num_cached_blocks == 0 and worker_side._pieces == pieces
    assert outputs(offloading) == expect
    assert worker_side.stats.loaded_blocks == 0
    offloading.reset_prefix_cache()
    assert outputs(offloading) == expect
    assert worker_side.stats.loaded_blocks == FULL_PREFIX_BLOCKS


@pytest.mark.parametrize("running", ["preempted", "aborted"])
def test_saves_in_flight_at_reset_connector_are_never_served(
        offloading, qwen3, tmp_path, running) -> None:
    # The weights change while a request decodes with a step in flight, whose block saves
    # (the old weights' K/V) are queued: none may answer a prompt after the reset, whether
    # the request is preempted by it or aborted before it.
    engine, (scheduler_side, worker_side) = offloading.engine, tier(offloading)
    weights = fine_tuned(qwen3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    [seq] = offloading.make_request({"prompt_token_ids": [3, *range(20, 76)]}, params, "r")
    engine.add_request(seq)
    while seq.num_computed_tokens % BLOCK_SIZE or seq.num_computed_tokens < 80:
        engine.step()
    assert engine._in_flight is not None and scheduler_side.num_cached_blocks >= 4
    replace_weights(offloading, weights, "collective_rpc")
    if running == "aborted":
        engine.abort_request("r")
        assert offloading.reset_prefix_cache(reset_connector=True)
    else:
        assert not offloading.reset_prefix_cache(reset_connector=True)  # it holds blocks
        assert offloading.reset_prefix_cache(reset_running_requests=True,
                                             reset_connector=True)
    while engine.has_unfinished():
        engine.step()
    follow_up = {"prompt_token_ids": [3, *range(20, 76), *range(100, 140)]}
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fresh = LLM(str(saved_as(qwen3, weights, tmp_path / "model")), **SETTINGS)
    try:
        expect = fresh.generate([follow_up], short, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        fresh.shutdown()
    for _ in range(2):  # the second time from the tier: what the first saved
        offloading.reset_prefix_cache()
        assert offloading.generate([follow_up], short,
                                   use_tqdm=False)[0].outputs[0].token_ids == expect
    assert worker_side.stats.loaded_blocks > 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_connector="host"), r"needs the host memory .* set kv_offloading_size"),
    (dict(kv_connector="host", kv_offloading_size=1.0, kv_connector_path="x"),
     "drop kv_connector_path"),
    (dict(kv_connector="shared_storage", kv_connector_path="x", kv_offloading_size=1.0),
     "kv_offloading_size keeps blocks in host memory"),
    (dict(kv_offloading_size=0.0), "kv_offloading_size must be a positive number of GiB"),
    (dict(kv_offloading_size=float("nan")), "kv_offloading_size must be a positive"),
    (dict(kv_offloading_size=1e-9), r"kv_offloading_size .* holds no KV block"),
    (dict(kv_offloading_size=1.0, tensor_parallel_size=2),
     r"kv_offloading_size=1.0 .* does not support tensor_parallel_size > 1"),
    (dict(kv_offloading_size=1.0, kv_cache_layout="head_major"),
     "KV connector cannot register"),
    (dict(kv_offloading_size=1.0, kv_offloading_backend="lmcache"),
     r"kv_offloading_backend='lmcache' is not supported: .* pass kv_offloading_backend='native'"),
])
def test_bad_offloading_settings_name_the_setting(qwen3, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(qwen3), **{**SETTINGS, **kwargs})


def test_a_tier_of_no_block_is_refused_with_the_config_before_a_model_loads(qwen3) -> None:
    from kvfit.engine.config import EngineArgs

    with pytest.raises(ValueError, match=r"kv_offloading_size .* holds no KV block"):
        EngineArgs(model=str(qwen3), kv_offloading_size=1e-9, **SETTINGS).create_engine_config()


@pytest.mark.parametrize("kv_offloading_size", [0.99, 2.0])
def test_a_tier_that_leaves_the_cpu_cache_too_little_names_kv_offloading_size(
        qwen3, kv_offloading_size) -> None:
    # On the CPU the tier comes out of the cache's budget: all of it (2.0, refused at
    # profiling) or all but a few MiB (0.99, too few blocks once measured).
    with pytest.raises(ValueError, match="lower kv_offloading_size"):
        LLM(str(qwen3), kv_offloading_size=kv_offloading_size,
            cpu_kv_cache_space_bytes=1 << 30, **SETTINGS)


def test_the_cli_flag_reaches_the_engine_args() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-offloading-size", "2.5"]))
    assert (args.kv_offloading_size, args.kv_connector) == (2.5, None)


def test_vllms_offloading_command_line_is_taken() -> None:
    # vLLM's documented pair: --kv-offloading-backend native (its default) with the size.
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--kv-offloading-backend", "native", "--kv-offloading-size", "2.5"]))
    assert (args.kv_offloading_backend, args.kv_offloading_size) == ("native", 2.5)
    config = EngineArgs(model="kvfit-tiny", device="cpu", kv_offloading_size=0.01,
                        kv_offloading_backend="native").create_engine_config()
    assert config.kv_connector_config.kv_connector == "host"


def test_after_sleep_and_wake_prefixes_load_from_host_memory(qwen3, reference) -> None:  # noqa: F811
    # Sleep drops the KV cache's pages and the prefix cache with them; the tier keeps its copy.
    llm = LLM(str(qwen3), kv_offloading_size=0.01, enable_sleep_mode=True, **SETTINGS)
    try:
        assert outputs(llm) == reference
        llm.sleep(level=1)
        llm.wake_up()
        assert outputs(llm) == reference
        assert tier(llm)[1].stats.loaded_blocks == FULL_PREFIX_BLOCKS
    finally:
        llm.shutdown()


def test_the_tier_works_across_processes_with_the_multiprocess_executor(
        qwen3, reference) -> None:  # noqa: F811
    # The worker side runs in the worker's process: the metadata crosses a pipe each step.
    llm = LLM(str(qwen3), kv_offloading_size=0.01, distributed_executor_backend="mp",
              **SETTINGS)
    try:
        assert outputs(llm) == reference
        llm.reset_prefix_cache()
        assert outputs(llm) == reference
        assert llm.engine.stats().kv_connector_hit_tokens == FULL_PREFIX_BLOCKS * BLOCK_SIZE
    finally:
        llm.shutdown()


def test_a_prefix_the_device_cache_keeps_serving_stays_in_the_tier(qwen3) -> None:
    # A shared head that every prompt hits in the device cache is used by each of them: the
    # tier must not evict it as least recently used, or every block after it, which it
    # keeps, can never be a hit once the device cache loses the head.
    from kvfit.connectors.host import least_offloading_gib
    from kvfit.engine.config import EngineArgs

    spec = EngineArgs(model=str(qwen3), **SETTINGS).create_engine_config().kv_cache_spec()
    slots = 6  # a prompt's 4 full blocks and 2 more: each later prompt evicts
    llm = LLM(str(qwen3), kv_offloading_size=least_offloading_gib(spec) * slots, **SETTINGS)
    try:
        scheduler_side, worker_side = tier(llm)
        assert scheduler_side.num_slots == slots
        head = list(range(3, 35))  # 2 blocks
        prompts = [{"prompt_token_ids": [*head, *range(100 + 40 * i, 133 + 40 * i)]}
                   for i in range(4)]  # 65 tokens: 4 full blocks each, 2 of them the head
        params = SamplingParams(temperature=0.0, max_tokens=1)
        for prompt in prompts:
            llm.generate([prompt], params, use_tqdm=False)
        llm.reset_prefix_cache()
        llm.generate(prompts[-1:], params, use_tqdm=False)
        assert worker_side.stats.loaded_blocks == 4  # the head and the last prompt's own
    finally:
        llm.shutdown()
