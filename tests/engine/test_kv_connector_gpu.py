"""The shared-storage connector on a CUDA device: the CPU test's two engines (the second loads
every full prefix block, with the outputs of a local prefix-cache hit), the registration of
the committed, defragmented cache, its release and registration again around sleep, and the
out-of-memory guard recommitting it as one chunk per segment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.connectors import SharedStorageConnector

from .test_oom_guard import Fault

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
LENGTHS = (1, 7, 16, 33, 64, 100)


def prompts() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
            for n in LENGTHS]


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def connected(model: Path, store: Path, layout: str) -> LLM:
    return LLM(str(model), device="cuda", gpu_memory_utilization=0.05, max_num_seqs=16,
               max_model_len=512, block_size=BLOCK_SIZE, kv_cache_layout=layout,
               enable_sleep_mode=True, kv_connector="shared_storage",
               kv_connector_path=str(store))


def connector(llm: LLM) -> SharedStorageConnector:
    return llm.engine.executor.workers[0].kv_connector


@pytest.mark.parametrize("layout", ["block_outer", "layer_outer"])
def test_second_engine_loads_every_full_prefix_block_on_gpu(gpu_model, tmp_path, layout) -> None:
    first = connected(gpu_model, tmp_path, layout)
    try:
        outputs(first)  # computes every block and fills the store
        # A local prefix hit runs the same kernels as an external one: the bits to match.
        local_hits = outputs(first)
    finally:
        first.shutdown()
    second = connected(gpu_model, tmp_path, layout)
    try:
        runner = second.engine.executor.workers[0].runner
        cache, spec = runner.kv_cache, runner.kv_cache_spec

        def check_registration() -> None:
            views = connector(second).registered_caches
            assert sum(v.untyped_storage().nbytes() for v in views) == cache.physical_bytes
            assert cache.tensor.num_physical_chunks == spec.num_segments == len(views)

        check_registration()
        assert outputs(second) == local_hits
        full_blocks = sum((n - 1) // BLOCK_SIZE for n in LENGTHS)
        assert connector(second).stats.loaded_blocks == full_blocks
        assert second.engine.scheduler.num_external_hit_tokens == full_blocks * BLOCK_SIZE
        # Sleep lets go of the cache; wake registers it again, one chunk per segment, and the
        # store (not the prefix cache, which sleep dropped) serves the prompts once more.
        second.sleep(level=1)
        assert connector(second).registered_caches is None
        second.wake_up()
        check_registration()
        assert outputs(second) == local_hits
        assert connector(second).stats.loaded_blocks == 2 * full_blocks
    finally:
        second.shutdown()


def test_an_oom_in_a_replayed_decode_recommits_one_chunk_at_the_guards_target(
        gpu_model, tmp_path) -> None:
    """The out-of-memory guard on a connector's cache: recommitted as one chunk per segment at
    the guard's target (far above one max_model_len sequence), registered again, the graphs
    captured at startup replaying on, every request with the outputs of a run without it."""
    reference = connected(gpu_model, tmp_path / "reference", "block_outer")
    try:
        expected = outputs(reference)
    finally:
        reference.shutdown()
    llm = connected(gpu_model, tmp_path / "store", "block_outer")
    try:
        runner = llm.engine.executor.workers[0].runner
        cache, graphs = runner.kv_cache, runner.graphs
        assert graphs is not None
        before, base = cache.committed_blocks, cache.tensor.base_ptr
        floor = llm.engine.kv_resizer.floor
        requested = 64 << 20
        keep = cache.blocks_that_fit(cache.physical_bytes - requested - cache.granularity)
        target = cache.granule_aligned_blocks(keep)
        assert 4 * floor <= target < before
        graphs.run = Fault(graphs.run, error=torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 64.00 MiB."))
        assert outputs(llm) == expected
        assert graphs.run.fired == 1 and graphs.num_capture_passes == 1
        [event] = llm.engine.oom_guard.events
        assert (event.num_blocks_before, event.num_blocks_after) == (before, target)
        assert event.num_preempted > 0 and event.freed_bytes >= requested
        views = connector(llm).registered_caches
        assert sum(v.untyped_storage().nbytes() for v in views) == cache.physical_bytes
        assert cache.tensor.num_physical_chunks == 1 and cache.tensor.base_ptr == base
        assert outputs(llm) == expected
    finally:
        llm.shutdown()
