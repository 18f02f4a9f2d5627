"""The shared-storage KV connector on the CPU (host driver): a second engine loads every full
prefix block from the store with identical outputs; registration sees exactly the committed,
defragmented cache; bad files are recomputed with a warning; startup and layout errors."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import shutil
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.connectors import SharedStorageConnector
from kvfit.connectors.block_file import BlockFormat, read_block, write_block
from kvfit.connectors.shared_storage import STAGING_BLOCKS
from kvfit.engine.config import EngineArgs
from kvfit.engine.worker import Worker
from kvfit.kv.sizing import kv_margin
from kvfit.models.weights import load_weights

BLOCK_SIZE = 16
SETTINGS = dict(device="cpu", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256,
                block_size=BLOCK_SIZE)
# Distinct first tokens: no two prompts share a block, so each block's file is one prompt's.
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 60 + 9 * i))} for i in range(4)]
FULL_PREFIX_BLOCKS = [(len(p["prompt_token_ids"]) - 1) // BLOCK_SIZE for p in PROMPTS]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def worker(llm: LLM) -> Worker:
    return llm.engine.executor.workers[0]


def connector(llm: LLM) -> SharedStorageConnector:
    return worker(llm).kv_connector


def connected(model: Path, store: Path, **kwargs: object) -> LLM:
    return LLM(str(model), kv_connector="shared_storage", kv_connector_path=str(store),
               **{**SETTINGS, **kwargs})


@pytest.fixture(scope="module")
def reference(qwen3: Path) -> list[list[int]]:
    """Greedy outputs of an engine without a connector."""
    llm = LLM(str(qwen3), **SETTINGS)
    try:
        return outputs(llm)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def filled_store(qwen3: Path, tmp_path_factory: pytest.TempPathFactory,
                 reference: list[list[int]]) -> Path:
    """A store that a first engine filled with the prompts' full blocks (it had no hits)."""
    store = tmp_path_factory.mktemp("kv-store")
    llm = connected(qwen3, store)
    try:
        assert outputs(llm) == reference
        assert llm.engine.scheduler.num_external_hit_tokens == 0
        assert connector(llm).stats.saved_blocks >= sum(FULL_PREFIX_BLOCKS)
    finally:
        llm.shutdown()
    return store


@pytest.fixture
def store(filled_store: Path, tmp_path: Path) -> Path:
    """A copy of the filled store for one test to use (and damage)."""
    return Path(shutil.copytree(filled_store, tmp_path / "store"))


@pytest.fixture
def second(qwen3: Path, store: Path) -> Iterator[LLM]:
    llm = connected(qwen3, store)
    yield llm
    llm.shutdown()


def test_second_engine_loads_every_full_prefix_block(second, reference) -> None:
    assert outputs(second) == reference
    stats = connector(second).stats
    assert stats.loaded_blocks == sum(FULL_PREFIX_BLOCKS)
    assert stats.failed_loads == 0
    assert second.engine.scheduler.num_external_hit_tokens == sum(FULL_PREFIX_BLOCKS) * BLOCK_SIZE
    # Loaded blocks are local prefix hits from then on: a repeat loads nothing more.
    assert outputs(second) == reference
    assert connector(second).stats.loaded_blocks == sum(FULL_PREFIX_BLOCKS)


@pytest.mark.parametrize("layout", ["block_outer", "layer_outer"])
def test_registered_storages_are_the_committed_bytes_in_one_chunk_per_segment(
        qwen3, tmp_path, layout) -> None:
    # 32 sequences: several granules per segment, so warmup's commit and the final one would
    # be separate chunks without the defragmenting commit.
    llm = connected(qwen3, tmp_path, kv_cache_layout=layout, enable_sleep_mode=True,
                    max_num_seqs=32)
    try:
        cache, spec = worker(llm).runner.kv_cache, worker(llm).runner.kv_cache_spec
        assert spec.num_segments == (1 if layout == "block_outer" else 2)

        def check_registration() -> None:
            views = connector(llm).registered_caches
            assert len(views) == spec.num_segments
            assert [v.untyped_storage().nbytes() for v in views] == (
                [cache.committed_blocks * spec.block_stride_bytes] * spec.num_segments)
            assert sum(v.untyped_storage().nbytes() for v in views) == cache.physical_bytes
            assert cache.tensor.num_physical_chunks == spec.num_segments
            assert [v.data_ptr() for v in views] == [
                cache.tensor.base_ptr + i * cache.tensor.segment_capacity
                for i in range(spec.num_segments)]

        check_registration()
        assert cache.physical_bytes > spec.num_segments * cache.granularity
        assert cache.capacity_blocks == cache.granule_aligned_blocks(cache.capacity_blocks)
        assert cache.committed_blocks == cache.granule_aligned_blocks(cache.committed_blocks)
        assert llm.engine.config.cache_config.num_gpu_blocks == cache.committed_blocks
        first = outputs(llm)
        llm.sleep(level=1)
        assert connector(llm).registered_caches is None  # let go before the pages went
        llm.wake_up()
        check_registration()  # recommitted one chunk per segment, registered again
        # The prefix cache went with sleep; the store did not.
        loaded = connector(llm).stats.loaded_blocks
        assert outputs(llm) == first
        assert connector(llm).stats.loaded_blocks - loaded == sum(FULL_PREFIX_BLOCKS)
    finally:
        llm.shutdown()


def test_a_replys_last_block_is_saved_as_it_finishes_and_loads_in_another_engine(
        qwen3, tmp_path) -> None:
    # 57 prompt tokens and 40 generated: 96 computed. The final decode fills block 5 while
    # the block's last token is still being sampled (no key yet), and the token it samples
    # ends the reply by length, so no later step saves it: the finish must.
    turn, store = [3, *range(20, 76)], tmp_path / "store"
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = connected(qwen3, store)
    try:
        reply = first.generate([{"prompt_token_ids": turn}], params,
                               use_tqdm=False)[0].outputs[0].token_ids
        history = [*turn, *reply]
        assert all(connector(first).path(key).exists()
                   for key in connector(first).keys_for(history))
    finally:
        first.shutdown()
    follow_up = {"prompt_token_ids": [*history, *range(100, 120)]}
    plain = LLM(str(qwen3), **SETTINGS)
    try:
        expect = plain.generate([follow_up], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        plain.shutdown()
    second = connected(qwen3, store)
    try:
        answer = second.generate([follow_up], params, use_tqdm=False)[0].outputs[0].token_ids
        assert second.engine.stats().kv_connector_hit_tokens == len(history) - 1 == 96
        assert answer == expect
    finally:
        second.shutdown()


def test_a_torch_allocated_cache_registers_and_loads_too(qwen3, store, reference) -> None:
    """Without VMM (sizing by estimate) the cache is one torch tensor: its per-segment views
    are registered and the store's blocks load the same way."""
    llm = connected(qwen3, store, enable_extensible_kv_cache=False)
    try:
        runner = worker(llm).runner
        assert runner.kv_cache is None
        num_blocks = llm.engine.config.cache_config.num_gpu_blocks
        assert [tuple(v.shape) for v in connector(llm).registered_caches] == [
            (num_blocks, *runner.kv_cache_spec.block_shape)]
        assert outputs(llm) == reference
        assert connector(llm).stats.loaded_blocks == sum(FULL_PREFIX_BLOCKS)
    finally:
        llm.shutdown()


def test_a_shrink_registers_the_smaller_cache(qwen3, tmp_path) -> None:
    """A shrink (the out-of-memory guard's) re-registers: the connector's storages follow the
    committed bytes."""
    llm = connected(qwen3, tmp_path, max_num_seqs=32)
    try:
        w = worker(llm)
        cache = w.runner.kv_cache
        target = cache.granule_aligned_blocks(cache.committed_blocks // 2)
        assert 0 < target < cache.committed_blocks
        w.resize_kv_cache(target)
        views = connector(llm).registered_caches
        assert [v.untyped_storage().nbytes() for v in views] == [cache.physical_bytes]
        assert views[0].shape[0] == target == cache.committed_blocks
    finally:
        llm.shutdown()


def _damage(kind: str, path: Path, key: str, fmt: BlockFormat) -> None:
    if kind == "corrupt":  # a whole header, flipped bytes in the data: only the checksum sees it
        raw = bytearray(path.read_bytes())
        raw[-100:] = bytes(b ^ 0xFF for b in raw[-100:])
        path.write_bytes(bytes(raw))
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:  # a valid block file written for another model, under this key
        other = BlockFormat(fmt.dtype, fmt.shape, namespace="0" * 64)
        write_block(path, other, key, torch.ones(fmt.shape, dtype=fmt.dtype),
                    {"model": "another-model"})


@pytest.mark.parametrize("kind", ["corrupt", "truncated", "foreign"])
def test_bad_files_are_skipped_with_a_warning_and_recomputed(
        second, reference, caplog, kind) -> None:
    conn = connector(second)
    damaged = [conn.keys_for(p["prompt_token_ids"])[1] for p in PROMPTS]  # each prompt's 2nd
    for key in damaged:
        _damage(kind, conn.path(key), key, conn.format)
    with caplog.at_level(logging.WARNING, logger="kvfit.connectors"):
        assert outputs(second) == reference
    warned = [r.getMessage() for r in caplog.records if "skipping" in r.getMessage()]
    assert len(warned) == len(PROMPTS) and all("recomputed" in m for m in warned)
    # Only each prompt's first block came from the store.
    assert second.engine.scheduler.num_external_hit_tokens == len(PROMPTS) * BLOCK_SIZE
    assert conn.stats.loaded_blocks == len(PROMPTS)
    assert conn.stats.failed_loads == (len(PROMPTS) if kind == "corrupt" else 0)
    # The recomputed blocks replaced the bad files.
    out = torch.empty(conn.format.shape, dtype=conn.format.dtype)
    for key in damaged:
        read_block(conn.path(key), conn.format, key, out)


def test_the_store_works_across_processes_with_the_multiprocess_executor(
        qwen3, tmp_path, reference) -> None:
    # The worker side runs in the worker's process: each step's loads and saves must cross
    # the pipe with it, and a load the worker could not do (KVLoadError) must come back as
    # itself, to be recomputed, not fail the step.
    store = tmp_path / "store"
    llm = connected(qwen3, store, distributed_executor_backend="mp")
    try:
        assert outputs(llm) == reference
    finally:
        llm.shutdown()
    assert len(list(store.glob("*.safetensors"))) >= sum(FULL_PREFIX_BLOCKS)
    llm = connected(qwen3, store, distributed_executor_backend="mp")
    try:
        hits = sum(FULL_PREFIX_BLOCKS) * BLOCK_SIZE
        assert outputs(llm) == reference  # a fresh cache: only the loads give these blocks
        assert llm.engine.stats().kv_connector_hit_tokens == hits
        conn = llm.engine.scheduler.kv_connector
        for p in PROMPTS:  # each prompt's 2nd block: its first one loads, the rest recompute
            key = conn.keys_for(p["prompt_token_ids"])[1]
            _damage("corrupt", conn.path(key), key, conn.format)
        assert llm.reset_prefix_cache()
        assert outputs(llm) == reference
        assert llm.engine.stats().kv_connector_hit_tokens == hits + len(PROMPTS) * BLOCK_SIZE
    finally:
        llm.shutdown()


def test_shutdown_ends_the_io_threads_and_frees_the_staging_buffer(qwen3, tmp_path) -> None:
    def io_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("kvfit-kv-store")]

    before = io_threads()
    llm = connected(qwen3, tmp_path / "store")
    outputs(llm)  # saves: the staging buffer and the I/O threads exist
    staging = weakref.ref(connector(llm)._staging)
    assert len(io_threads()) > len(before)
    llm.shutdown()
    gc.collect()
    assert staging() is None
    assert io_threads() == before


def test_loads_that_fail_while_a_step_is_in_flight_recompute_under_preemption_and_aborts(
        qwen3, store) -> None:
    # A cache of 10 blocks for up to 4 sequences of 7-8 blocks each, in chunks of 16 tokens:
    # sequences are preempted and come back, and store hits load while the step before
    # (other sequences' decodes) is in flight. Of each prompt's blocks, the 2nd file is
    # corrupt and the 3rd is deleted between the hit and its load: those launches raise
    # KVLoadError and are scheduled again. Greedy outputs must be the connector-less ones,
    # and every block and per-sequence entry must be given back.
    params = dataclasses.replace(GREEDY, max_tokens=40)  # decodes that need more blocks
    llm = LLM(str(qwen3), **SETTINGS)
    try:
        reference = [o.outputs[0].token_ids
                     for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    llm = connected(qwen3, store, num_gpu_blocks_override=10, max_model_len=128,
                    max_num_batched_tokens=16, max_num_seqs=4)
    try:
        engine, conn = llm.engine, connector(llm)
        scheduler = engine.scheduler
        for p in PROMPTS:
            key = conn.keys_for(p["prompt_token_ids"])[1]
            _damage("corrupt", conn.path(key), key, conn.format)
        deleted = {conn.keys_for(p["prompt_token_ids"])[2] for p in PROMPTS}
        load = conn.start_load_kv

        def load_after_deleting(meta) -> None:
            for t in meta.loads:
                if t.key in deleted:
                    conn.path(t.key).unlink(missing_ok=True)
            load(meta)

        conn.start_load_kv = load_after_deleting
        recomputes_in_flight = []
        recompute = scheduler.recompute_lost_blocks

        def recording(error) -> None:
            recomputes_in_flight.append(engine._in_flight is not None)
            recompute(error)

        scheduler.recompute_lost_blocks = recording
        requests = [(i, llm.make_request(PROMPTS[i % len(PROMPTS)], params, f"r{i}"))
                    for i in range(2 * len(PROMPTS))]
        waiting, aborted, steps = list(requests), set(), 0
        while waiting or engine.has_unfinished():
            if waiting:  # one request a step: the others' steps are in flight as it starts
                for seq in waiting.pop(0)[1]:
                    engine.add_request(seq)
            if steps == 6:  # one request mid-decode, with a step of its in flight
                i, seqs = next((i, s) for i, s in requests if s[0].output_token_ids
                               and not s[0].is_finished)
                engine.abort_request(f"r{i}")
                aborted.add(i)
            engine.step()
            steps += 1
            assert steps < 500
        for i, seqs in requests:
            if i not in aborted:
                assert seqs[0].output_token_ids == reference[i % len(PROMPTS)], i
        assert scheduler.num_preemptions > 0 and aborted
        assert conn.stats.failed_loads > 0 and any(recomputes_in_flight)
        assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
        assert not scheduler.kv_connector.chains._chains  # each sequence's keys forgotten
        # The bad blocks were recomputed and saved again.
        out = torch.empty(conn.format.shape, dtype=conn.format.dtype)
        for p in PROMPTS:
            for key in conn.keys_for(p["prompt_token_ids"])[1:3]:
                read_block(conn.path(key), conn.format, key, out)
    finally:
        llm.shutdown()


def fine_tuned(model: Path) -> dict[str, torch.Tensor]:
    """`model`'s weights with new K and V projections (a training step's update): every
    block's K/V change."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(1)
    return {name: (0.3 * torch.randn(t.shape, generator=generator)
                   if "k_proj" in name or "v_proj" in name else t)
            for name, t in load_file(model / "model.safetensors").items()}


def saved_as(model: Path, weights: dict[str, torch.Tensor], folder: Path) -> Path:
    """A copy of `model` whose checkpoint holds `weights`."""
    from safetensors.torch import save_file

    folder = Path(shutil.copytree(model, folder))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def fresh_outputs(model: Path, weights: dict[str, torch.Tensor], folder: Path) -> list[list[int]]:
    """`outputs` of a new engine on `model` with `weights` (saved in `folder`): what an engine
    given those weights must answer when its store serves nothing of the old ones."""
    fresh = LLM(str(saved_as(model, weights, folder)), **SETTINGS)
    try:
        return outputs(fresh)
    finally:
        fresh.shutdown()


def check_only_new_weights_served(llm: LLM, expect: list[list[int]], hits: int,
                                  loaded: int) -> None:
    """After a weight update the store must serve nothing (`hits`, `loaded`: its counts
    before), and then serve what the new weights computed: every prompt's blocks again."""
    conn, scheduler = connector(llm), llm.engine.scheduler
    assert outputs(llm) == expect
    assert (scheduler.num_external_hit_tokens, conn.stats.loaded_blocks) == (hits, loaded)
    assert llm.reset_prefix_cache()
    assert outputs(llm) == expect
    assert conn.stats.loaded_blocks - loaded == sum(FULL_PREFIX_BLOCKS)
    assert scheduler.num_external_hit_tokens == 2 * hits


def test_load_weights_serves_nothing_stale_and_the_store_works_for_the_new_weights(
        second, qwen3, tmp_path) -> None:
    # An RL loop: the store holds every prompt's blocks of the old weights; the trainer's
    # update must not be answered from them, and the store must go on for the new weights.
    weights = fine_tuned(qwen3)
    expect = fresh_outputs(qwen3, weights, tmp_path / "model")
    conn, scheduler = connector(second), second.engine.scheduler
    outputs(second)  # every prompt's blocks load from the store
    hits, loaded = scheduler.num_external_hit_tokens, conn.stats.loaded_blocks
    assert hits == sum(FULL_PREFIX_BLOCKS) * BLOCK_SIZE
    second.load_weights(weights)
    assert connector(second) is conn and scheduler.kv_connector is not None
    check_only_new_weights_served(second, expect, hits, loaded)


def replace_weights(llm: LLM, weights: dict[str, torch.Tensor], through: str) -> None:
    """Change `llm`'s weights in place behind the engine's back, as an RL framework does:
    on the workers (`collective_rpc`) or on the model (`apply_model`), not `load_weights`."""
    if through == "collective_rpc":
        llm.collective_rpc("load_weights", args=(list(weights.items()),))
    else:
        llm.apply_model(lambda model: load_weights(model, weights.items()))


@pytest.mark.parametrize("through", ["collective_rpc", "apply_model"])
def test_reset_connector_after_a_weight_update_serves_nothing_stale(
        second, qwen3, tmp_path, through) -> None:
    weights = fine_tuned(qwen3)
    expect = fresh_outputs(qwen3, weights, tmp_path / "model")
    conn, scheduler = connector(second), second.engine.scheduler
    outputs(second)  # every prompt's blocks load from the store
    hits, loaded = scheduler.num_external_hit_tokens, conn.stats.loaded_blocks
    assert hits == sum(FULL_PREFIX_BLOCKS) * BLOCK_SIZE
    replace_weights(second, weights, through)
    assert second.reset_prefix_cache(reset_connector=True)
    check_only_new_weights_served(second, expect, hits, loaded)


def test_without_reset_connector_the_store_serves_the_old_weights_kv(
        second, qwen3, tmp_path, reference) -> None:
    # What `reset_prefix_cache()` alone does after an update the engine did not see: the
    # device cache forgets, but the store answers the prompts with the old weights' K/V.
    weights = fine_tuned(qwen3)
    expect = fresh_outputs(qwen3, weights, tmp_path / "model")
    replace_weights(second, weights, "collective_rpc")
    assert second.reset_prefix_cache()
    assert outputs(second) != expect
    assert connector(second).stats.loaded_blocks == sum(FULL_PREFIX_BLOCKS)


def test_reset_connector_without_a_connector_warns_and_answers_false(
        qwen3, reference, caplog) -> None:
    # vLLM's: a warning and False, not an error; the prefix cache is reset all the same.
    llm = LLM(str(qwen3), **SETTINGS)
    try:
        assert outputs(llm) == reference
        with caplog.at_level(logging.WARNING, logger="kvfit"):
            assert llm.reset_prefix_cache(reset_connector=True) is False
        assert "no KV connector" in caplog.text and "kv_connector_path" in caplog.text
        assert not llm.engine.scheduler.block_manager.hash_to_block
        assert outputs(llm) == reference
    finally:
        llm.shutdown()


def test_a_store_that_stops_taking_saves_is_counted_and_requests_go_on(
        qwen3, tmp_path, reference, caplog) -> None:
    llm = connected(qwen3, tmp_path / "store")
    try:
        blocker = tmp_path / "a-file"
        blocker.write_text("")
        connector(llm).root = blocker  # the store turned unwritable after startup
        with caplog.at_level(logging.WARNING, logger="kvfit.connectors"):
            assert outputs(llm) == reference
        assert len([r for r in caplog.records if "save" in r.getMessage()]) == 1
        failed = llm.engine.stats().kv_connector_failed_saves
        assert failed == connector(llm).stats.failed_saves >= sum(FULL_PREFIX_BLOCKS)
        assert {m.name: m.value for m in llm.get_metrics()}[
            "kvfit:kv_connector_failed_saves"] == failed
    finally:
        llm.shutdown()


def test_a_store_whose_directory_was_removed_takes_saves_again(
        qwen3, tmp_path, reference) -> None:
    # Clearing the store (reset_prefix_cache's advice) by removing its directory must not
    # leave every later save failing.
    store = tmp_path / "store"
    llm = connected(qwen3, store)
    try:
        shutil.rmtree(store)
        assert outputs(llm) == reference
        assert llm.engine.stats().kv_connector_failed_saves == 0
        assert len(list(store.glob("*.safetensors"))) >= sum(FULL_PREFIX_BLOCKS)
    finally:
        llm.shutdown()


def test_cpu_sizing_keeps_the_staging_buffer_free(qwen3, tmp_path, monkeypatch) -> None:
    # Allocated after sizing, the staging buffer comes out of the host budget the cache was
    # sized in: sizing keeps its bound free on the CPU, and not on a GPU (host memory there).
    # 32 sequences: several granules of capacity, so the kept bytes cost whole granules.
    llm = connected(qwen3, tmp_path / "store", max_num_seqs=32)
    try:
        w, cc = worker(llm), llm.engine.config.cache_config
        cache, spec = w.runner.kv_cache, w.runner.kv_cache_spec
        staging = STAGING_BLOCKS * spec.block_bytes
        # A profile in which the whole capacity just fits, so any bytes kept show.
        fits = cache.footprint_bytes(cache.capacity_blocks)
        profile = w.sized_profile
        kept = profile.transient + kv_margin(profile.transient, cc.kv_cache_margin_floor_bytes,
                                             cc.kv_cache_margin_fraction)
        profile = dataclasses.replace(profile, total=1 << 50, torch_live=0, non_torch=0,
                                      free=fits + kept - profile.committed_kv)
        monkeypatch.setattr(w, "memory_profile", lambda: profile)
        capacity = cache.granule_aligned_blocks(cache.capacity_blocks)
        expected = cache.granule_aligned_blocks(cache.blocks_that_fit(fits - staging))
        assert 0 < expected < capacity
        assert w.measure_kv_cache_blocks() == expected
        monkeypatch.setattr(w, "device", torch.device("cuda"))
        assert w.measure_kv_cache_blocks() == capacity
        # The buffer the saves use stays within the bound that sizing kept.
        assert SharedStorageConnector.host_buffer_bytes(
            llm.engine.config.kv_connector_config, spec) == staging
        outputs(llm)
        assert 0 < connector(llm)._staging.nbytes <= staging
    finally:
        llm.shutdown()


def test_unwritable_store_is_an_error_at_startup(qwen3, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match=r"kv_connector_path .* is not a writable directory"):
        connected(qwen3, blocker / "store")


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_connector="shared_storage"), "set kv_connector_path"),
    (dict(kv_connector_path="x"), "kv_connector is not"),
    (dict(kv_connector="nixl", kv_connector_path="x"), "kv_connector must be one of"),
    (dict(kv_connector="shared_storage", kv_connector_path="x", kv_cache_layout="head_major"),
     r"kv_cache_layout='head_major' .*KV connector cannot register"),
    (dict(kv_connector="shared_storage", kv_connector_path="x", tensor_parallel_size=2),
     r"does not support tensor_parallel_size > 1 \(got 2\)"),
])
def test_bad_connector_settings_name_the_setting(qwen3, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(qwen3), **{**SETTINGS, **kwargs})


def test_cli_flags_reach_the_engine_args(tmp_path) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--kv-connector", "shared_storage", "--kv-connector-path", str(tmp_path),
         "--kv-cache-layout", "layer_outer"]))
    assert (args.kv_connector, args.kv_connector_path, args.kv_cache_layout) == (
        "shared_storage", str(tmp_path), "layer_outer")


def test_a_checkpoint_saved_over_the_folder_does_not_load_the_old_weights_blocks(
        qwen3, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    model, store = Path(shutil.copytree(qwen3, tmp_path / "model")), tmp_path / "store"
    first = connected(model, store)
    try:
        outputs(first)
    finally:
        first.shutdown()
    weights = load_file(model / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    save_file({name: (0.3 * torch.randn(t.shape, generator=generator)
                      if "k_proj" in name or "v_proj" in name else t)
               for name, t in weights.items()}, model / "model.safetensors",
              metadata={"format": "pt"})  # a fine-tune's step, saved in place
    fresh = LLM(str(model), **SETTINGS)
    try:
        expect = outputs(fresh)
    finally:
        fresh.shutdown()
    llm = connected(model, store)  # the store holds the old weights' K/V only
    try:
        assert outputs(llm) == expect
        assert llm.engine.scheduler.num_external_hit_tokens == 0
    finally:
        llm.shutdown()


def test_an_fp8_store_of_a_float32_model_is_not_a_bfloat16_models(qwen3, tmp_path) -> None:
    # The cache's dtype (fp8) is the same; the K/V it holds are not.
    first = connected(qwen3, tmp_path, kv_cache_dtype="fp8")
    try:
        outputs(first)
    finally:
        first.shutdown()
    llm = connected(qwen3, tmp_path, kv_cache_dtype="fp8", dtype="bfloat16")
    try:
        outputs(llm)
        assert llm.engine.scheduler.num_external_hit_tokens == 0
    finally:
        llm.shutdown()


def test_a_level_2_wake_that_reloads_changed_files_names_blocks_by_the_new_files(
        qwen3, tmp_path) -> None:
    from safetensors.torch import save_file

    model, store = Path(shutil.copytree(qwen3, tmp_path / "model")), tmp_path / "store"
    llm = connected(model, store, enable_sleep_mode=True)
    try:
        expect = outputs(llm)
        llm.sleep(level=2)
        llm.wake_up()  # the same files: the store still holds these weights' K/V
        assert outputs(llm) == expect
        hits = llm.engine.scheduler.num_external_hit_tokens
        assert hits > 0
        llm.sleep(level=2)
        weights = fine_tuned(model)
        new = saved_as(model, weights, tmp_path / "new")
        fresh = LLM(str(new), **SETTINGS)
        try:
            new_outputs = outputs(fresh)
        finally:
            fresh.shutdown()
        # A trainer's checkpoint, saved while it slept.
        save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
        llm.wake_up()  # reloads the new files
        assert outputs(llm) == new_outputs
        assert llm.engine.scheduler.num_external_hit_tokens == hits
    finally:
        llm.shutdown()
    # The blocks it saved since are named by the files, as another engine on them names them.
    llm = connected(model, store)
    try:
        assert outputs(llm) == new_outputs
        assert llm.engine.scheduler.num_external_hit_tokens == hits
    finally:
        llm.shutdown()
