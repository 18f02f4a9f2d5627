"""The host-memory tier on a CUDA device: prefixes the cache forgot come back from pinned host
memory with the outputs of a local prefix hit, in both block-compact layouts and across a
resize; a block the next step overwrites while its save is still queued reaches host memory
as it was (the step waits for that save on the device)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfit import LLM
from kvfit.connectors import BlockTransfer, HostConnector, KVConnectorConfig
from kvfit.connectors.host import HostConnectorMetadata
from kvfit.kv.spec import KVCacheSpec

from .test_kv_connector_gpu import BLOCK_SIZE, LENGTHS, outputs

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", ["block_outer", "layer_outer"])
def test_forgotten_prefixes_load_from_pinned_memory_with_a_local_hits_outputs(
        gpu_model: Path, layout: str) -> None:
    llm = LLM(str(gpu_model), device="cuda", gpu_memory_utilization=0.05, max_num_seqs=16,
              max_model_len=512, block_size=BLOCK_SIZE, kv_cache_layout=layout,
              kv_offloading_size=0.25)
    try:
        worker = llm.engine.executor.workers[0]
        conn: HostConnector = worker.kv_connector
        assert conn._pieces[0].is_pinned() and not worker.kv_cache_one_chunk()
        outputs(llm)  # computes every block, saving each full one
        # A local prefix hit runs the same kernels as a loaded one: the bits to match.
        local_hits = outputs(llm)
        full_blocks = sum((n - 1) // BLOCK_SIZE for n in LENGTHS)
        llm.reset_prefix_cache()
        assert outputs(llm) == local_hits
        assert conn.stats.loaded_blocks == full_blocks
        # A shrink and a grow (cut and mapped chunks, no recommit), then loads again.
        num_blocks = llm.engine.scheduler.block_manager.num_blocks
        llm.resize_kv_cache(max(llm.engine.kv_resizer.floor, num_blocks // 3))
        llm.resize_kv_cache(num_blocks)
        llm.reset_prefix_cache()
        assert outputs(llm) == local_hits
        assert conn.stats.loaded_blocks == 2 * full_blocks
    finally:
        llm.shutdown()


def test_a_block_overwritten_while_its_save_is_queued_reaches_host_memory_as_it_was() -> None:
    # 256 MiB of blocks: their copy to the host takes milliseconds, the overwrite microseconds.
    # Without the wait the copy reads zeros (seen on an H100 in one round of two), so three
    # rounds, each saving fresh values into the same slots.
    spec = KVCacheSpec(num_layers=8, block_size=BLOCK_SIZE, num_kv_heads=8, head_dim=128,
                       dtype=torch.bfloat16)
    num_blocks = (256 << 20) // spec.block_bytes
    conn = HostConnector("worker", KVConnectorConfig(
        "host", kv_offloading_bytes=num_blocks * spec.block_bytes), spec, "model")
    cache = torch.empty(num_blocks, *spec.block_shape, device="cuda", dtype=spec.dtype)
    conn.register_kv_caches([cache])
    every = [BlockTransfer(b, str(b), slot=b) for b in range(num_blocks)]
    for save_id in range(3):
        cache.normal_()
        expected = cache.clone()
        conn.wait_for_save(HostConnectorMetadata(saves=every, save_id=save_id))
        # The next step writes every block (what its forward would): it waits for the save.
        conn.start_load_kv(HostConnectorMetadata(wait_save_id=save_id))
        cache.zero_()
        conn.start_load_kv(HostConnectorMetadata(loads=every))
        torch.cuda.synchronize()
        assert torch.equal(cache, expected), f"round {save_id}"
