"""The host-memory tier (`HostConnector`) without an engine: its index (hits, least recently
used slots, entries only once their step was launched), the device ordering it writes into
each step's metadata, and the worker side's copies through pieces of host memory."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest
import torch

from kvfit.connectors import KVConnectorConfig
from kvfit.connectors import host as host_module
from kvfit.connectors.host import MAX_SAVES_IN_FLIGHT, HostConnector, HostConnectorMetadata
from kvfit.kv.spec import KVCacheSpec

BS = 4
SPEC = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=1, head_dim=8, dtype=torch.float32)


@dataclass
class Seq:
    """What a connector reads from a sequence."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


def config(num_blocks: int, spec: KVCacheSpec = SPEC) -> KVConnectorConfig:
    return KVConnectorConfig("host", kv_offloading_bytes=num_blocks * spec.block_bytes)


def scheduler_side(num_blocks: int) -> HostConnector:
    return HostConnector("scheduler", config(num_blocks), SPEC, "model")


def prefill(conn: HostConnector, seq: Seq, launch: bool = True) -> HostConnectorMetadata:
    """One step computing all of `seq`'s tokens from `num_computed_tokens`, then advanced."""
    num_new = len(seq.token_ids) - seq.num_computed_tokens
    meta = conn.build_connector_meta([seq], [num_new])
    if launch:
        conn.launched(meta)
        seq.num_computed_tokens += num_new
    return meta


def prompt(first: int, num_blocks: int) -> list[int]:
    """`num_blocks` full blocks and one token more (the last token is never a hit)."""
    return list(range(first, first + num_blocks * BS + 1))


def test_a_prefix_saved_once_is_a_hit_for_the_next_sequence_and_loads_from_its_slots() -> None:
    conn = scheduler_side(8)
    first = Seq(0, prompt(100, 3), block_table=[5, 6, 7, 8])
    meta = prefill(conn, first)
    assert [(t.block_id, t.slot) for t in meta.saves] == [(5, 0), (6, 1), (7, 2)]
    assert meta.save_id == 0 and meta.loads == []
    conn.request_finished(first)

    # Two blocks of the same prefix, then its own tokens: the local hit was one block.
    second = Seq(1, prompt(100, 2) + [7] * 9, [5, 10, 11, 12], num_computed_tokens=BS)
    assert conn.get_num_new_matched_tokens(second) == BS  # block 1 of the chain, not block 2
    second.num_computed_tokens += BS
    conn.update_state_after_alloc(second, BS)
    meta = conn.build_connector_meta([second], [len(second.token_ids) - 2 * BS])
    assert [(t.block_id, t.slot, t.first_token) for t in meta.loads] == [(10, 1, BS)]
    # Its third and fourth blocks are new (its own tokens): saved to the next free slots.
    assert [(t.block_id, t.slot) for t in meta.saves] == [(11, 3), (12, 4)]


def test_the_least_recently_used_slot_makes_room_and_its_key_is_no_hit() -> None:
    conn = scheduler_side(4)
    a, b = Seq(0, prompt(0, 2), [0, 1, 2]), Seq(1, prompt(1000, 2), [3, 4, 5])
    prefill(conn, a)
    prefill(conn, b)  # four slots in use
    assert conn.num_cached_blocks == 4
    # `a` comes back (a hit, so its blocks are the most recent), then a third prompt needs two
    # slots: `b`'s, the least recently used.
    again = Seq(2, prompt(0, 2), [6, 7, 8])
    assert conn.get_num_new_matched_tokens(again) == 2 * BS
    again.num_computed_tokens = 2 * BS
    conn.update_state_after_alloc(again, 2 * BS)
    prefill(conn, again)
    c = Seq(3, prompt(5000, 2), [9, 10, 11])
    meta = prefill(conn, c)
    assert sorted(t.slot for t in meta.saves) == [2, 3]  # b's
    assert conn.get_num_new_matched_tokens(Seq(4, prompt(1000, 2))) == 0
    assert conn.get_num_new_matched_tokens(Seq(5, prompt(0, 2))) == 2 * BS


def test_a_full_pool_evicts_a_chain_from_its_end_so_its_prefix_stays_a_hit() -> None:
    # A block is a hit only after its parent: evicting a chain's head would strand the rest.
    conn = scheduler_side(3)
    prefill(conn, Seq(0, prompt(0, 3), [0, 1, 2, 3]))  # the pool is full: one chain
    assert conn.get_num_new_matched_tokens(Seq(1, prompt(0, 3))) == 3 * BS
    meta = prefill(conn, Seq(2, prompt(900, 1), [4, 5]))
    assert [t.slot for t in meta.saves] == [2]  # the chain's third block's slot
    assert conn.get_num_new_matched_tokens(Seq(3, prompt(0, 3))) == 2 * BS
    # Loaded again, the chain is touched from its end: its head is the last to go.
    again = Seq(4, prompt(0, 2), [6, 7, 8])
    again.num_computed_tokens = conn.get_num_new_matched_tokens(again)
    conn.update_state_after_alloc(again, again.num_computed_tokens)
    prefill(conn, again)
    # Two blocks to save: the other prompt's (least recent), then the chain's second.
    prefill(conn, Seq(5, prompt(2000, 2), [9, 10, 11]))
    assert conn.get_num_new_matched_tokens(Seq(6, prompt(0, 2))) == BS


def test_blocks_a_step_fills_again_are_not_the_room_its_new_blocks_take() -> None:
    conn = scheduler_side(2)
    prefill(conn, Seq(0, prompt(0, 1), [0, 1]))
    prefill(conn, Seq(1, prompt(500, 1), [2, 3]))  # full: the first prompt's block is oldest
    # One step: the first prompt computed again (no hit taken, as with prompt logprobs) and
    # a new prompt whose block needs a slot: the second prompt's is the one to go.
    meta = conn.build_connector_meta([Seq(2, prompt(0, 1), [4, 5]), Seq(3, prompt(900, 1),
                                                                       [6, 7])], [BS + 1] * 2)
    conn.launched(meta)
    assert [(t.block_id, t.slot) for t in meta.saves] == [(6, 1)]
    assert conn.get_num_new_matched_tokens(Seq(4, prompt(0, 1))) == BS
    assert conn.get_num_new_matched_tokens(Seq(5, prompt(500, 1))) == 0


def test_a_step_whose_launch_failed_leaves_no_entry_and_frees_its_slots() -> None:
    # A device out of memory fails the launch; the engine schedules the step again.
    conn = scheduler_side(4)
    seq = Seq(0, prompt(0, 2), [0, 1, 2])
    failed = prefill(conn, seq, launch=False)
    assert [t.slot for t in failed.saves] == [0, 1]
    assert conn.get_num_new_matched_tokens(Seq(1, prompt(0, 2))) == 0  # nothing saved yet
    retried = prefill(conn, seq)
    assert sorted(t.slot for t in retried.saves) == [0, 1]  # the same slots, free again
    assert conn.num_cached_blocks == 2
    assert conn.get_num_new_matched_tokens(Seq(1, prompt(0, 2))) == 2 * BS


def test_a_step_that_overwrites_a_block_still_being_saved_waits_for_that_save() -> None:
    conn = scheduler_side(64)
    prefill(conn, Seq(0, prompt(0, 2), [0, 1, 2]))  # save 0 reads blocks 0 and 1
    quiet = prefill(conn, Seq(1, prompt(500, 1), [3, 4]))  # save 1: block 3
    assert quiet.wait_save_id is None and quiet.save_id == 1
    # Block 1 freed and handed to another sequence, which writes it.
    reuse = prefill(conn, Seq(2, prompt(900, 1), [1, 5]))
    assert reuse.wait_save_id == 0 and bool(reuse)
    # Saves older than the last MAX_SAVES_IN_FLIGHT are done (the worker waits for them).
    for n in range(MAX_SAVES_IN_FLIGHT):
        prefill(conn, Seq(10 + n, prompt(2000 + 100 * n, 1), [20 + 2 * n, 21 + 2 * n]))
    assert prefill(conn, Seq(30, prompt(7000, 1), [0, 40])).wait_save_id is None


def test_a_plan_that_never_launched_takes_no_place_among_the_saves_in_flight() -> None:
    # The worker keeps the last MAX_SAVES_IN_FLIGHT saves it ran unfinished; a plan dropped
    # before it reached the worker (a failed launch; a failed step's finished saves) is none
    # of them, and must not push a real one out of the saves a later step may wait for.
    conn = scheduler_side(64)
    for n in range(MAX_SAVES_IN_FLIGHT):  # saves 0..3 run; block 2 * n is save n's
        prefill(conn, Seq(n, prompt(1000 * n, 1), [2 * n, 2 * n + 1]))
    prefill(conn, Seq(10, prompt(9000, 1), [40, 41]), launch=False)  # its launch failed
    conn.request_finished(Seq(11, prompt(8000, 1)[:BS], [42], num_computed_tokens=BS))
    conn.build_finished_meta()  # a failed step's: taken and dropped
    # Block 0 handed out again: its save (0) may still run on the device.
    assert prefill(conn, Seq(12, prompt(7000, 1), [0, 43])).wait_save_id == 0


def test_a_load_from_a_slot_still_being_written_waits_for_that_save() -> None:
    conn = scheduler_side(64)
    prefill(conn, Seq(0, prompt(0, 2), [0, 1, 2]))  # save 0 writes slots 0 and 1
    seq = Seq(1, prompt(0, 2), [7, 8, 9])
    seq.num_computed_tokens = conn.get_num_new_matched_tokens(seq)
    conn.update_state_after_alloc(seq, seq.num_computed_tokens)
    meta = conn.build_connector_meta([seq], [1])
    assert [t.slot for t in meta.loads] == [0, 1] and meta.wait_save_id == 0


def test_a_block_a_decode_fills_with_a_pending_token_is_saved_by_the_next_step() -> None:
    # With a step in flight, a decode computes the token that step samples (read on the
    # device; -1 on the host): its block's key is known one step later, and so is its save.
    conn = scheduler_side(8)
    seq = Seq(0, list(range(BS - 1)), [3, 4])
    prefill(conn, seq)
    seq.token_ids.append(-1)  # the prefill's sample, pending
    meta = conn.build_connector_meta([seq], [1])  # fills block 0 with it
    conn.launched(meta)
    assert meta.saves == []
    seq.num_computed_tokens += 1
    seq.token_ids[-1] = 7  # the prefill's output arrived
    seq.token_ids.append(-1)  # the decode's sample, pending
    meta = conn.build_connector_meta([seq], [1])
    conn.launched(meta)
    assert [(t.block_id, t.slot) for t in meta.saves] == [(3, 0)]
    assert conn.get_num_new_matched_tokens(Seq(1, [*range(BS - 1), 7, 9])) == BS
    # Saved once: the step after does not save it again.
    seq.num_computed_tokens += 1
    seq.token_ids[-1] = 8
    seq.token_ids.append(-1)
    assert conn.build_connector_meta([seq], [1]).saves == []


def test_a_finished_sequences_last_block_is_saved_as_it_finishes_and_only_once() -> None:
    # The decode that fills block 1 is built while the block's last token is pending; that
    # token's own sample ends the sequence (by length), so no step follows to save block 1.
    conn = scheduler_side(8)
    seq = Seq(0, list(range(2 * BS - 1)), [3, 4, 5])
    prefill(conn, seq)
    seq.token_ids.append(-1)
    assert prefill(conn, seq).saves == []  # computes the pending token: block 1 is full
    seq.token_ids[-1] = 7
    seq.token_ids.append(9)  # the last token, sampled and never computed
    assert conn.get_num_new_matched_tokens(Seq(1, [*seq.token_ids, 1])) == BS
    conn.request_finished(seq)
    meta = conn.build_finished_meta()
    assert [(t.block_id, t.slot) for t in meta.saves] == [(4, 1)] and meta.save_id == 1
    conn.launched(meta)
    assert conn.get_num_new_matched_tokens(Seq(1, [*seq.token_ids, 1])) == 2 * BS
    assert conn.build_finished_meta() is None  # taken
    # A step that writes block 4 (handed out again) waits for that save on the device.
    assert prefill(conn, Seq(2, prompt(500, 1), [4, 6])).wait_save_id == 1
    # Already held (a second sequence of the same tokens): not saved again.
    again = Seq(3, list(seq.token_ids), [8, 9, 10], num_computed_tokens=2 * BS)
    conn.request_finished(again)
    assert conn.build_finished_meta() is None


@pytest.mark.parametrize("num_computed", [2 * BS - 1, 2 * BS + 1])
def test_a_sequence_that_ends_inside_a_block_plans_no_finished_save(num_computed) -> None:
    # 2 * BS - 1: the block's last token was sampled and never computed (its K/V are not
    # written); 2 * BS + 1: a later step ran, which saved the block.
    conn = scheduler_side(8)
    conn.request_finished(Seq(0, list(range(2 * BS + 2)), [3, 4, 5], num_computed))
    assert conn.build_finished_meta() is None


def test_new_weights_empty_the_index_and_name_the_same_tokens_blocks_anew() -> None:
    conn = scheduler_side(4)
    old = prefill(conn, Seq(0, prompt(0, 2), [0, 1, 2]))
    prefill(conn, Seq(1, prompt(500, 2), [3, 4, 5]))  # the pool is full
    conn.weights_replaced("model+update")
    assert conn.num_cached_blocks == 0
    assert conn.get_num_new_matched_tokens(Seq(2, prompt(0, 2))) == 0
    new = prefill(conn, Seq(3, prompt(0, 2), [6, 7, 8]))
    assert [t.slot for t in new.saves] == [0, 1]  # every slot free again
    assert not {t.key for t in new.saves} & {t.key for t in old.saves}
    assert conn.get_num_new_matched_tokens(Seq(4, prompt(0, 2))) == 2 * BS


def worker_side(num_slots: int, num_blocks: int = 16, spec: KVCacheSpec = SPEC,
                ) -> tuple[HostConnector, list[torch.Tensor]]:
    conn = HostConnector("worker", config(num_slots, spec), spec, "model")
    caches = [torch.randn(num_blocks, *spec.block_shape).to(spec.dtype)
              for _ in range(spec.num_segments)]
    conn.register_kv_caches(caches)
    return conn, caches


@pytest.mark.parametrize("layout", ["block_outer", "layer_outer"])
def test_blocks_saved_and_loaded_come_back_exactly_across_pieces(layout, monkeypatch) -> None:
    spec = KVCacheSpec(num_layers=2, block_size=BS, num_kv_heads=2, head_dim=8,
                       dtype=torch.bfloat16, layout=layout)
    monkeypatch.setattr(host_module, "PIECE_BYTES", 3 * spec.block_bytes)  # 3 slots a piece
    conn, caches = worker_side(7, spec=spec)
    assert [p.shape[1] for p in conn._pieces] == [3, 3, 1]
    # Runs of consecutive blocks and slots, one crossing a piece boundary, one out of order.
    pairs = [(2, 1), (3, 2), (4, 3), (5, 4), (9, 6), (0, 0)]
    before = [c.clone() for c in caches]
    conn.wait_for_save(HostConnectorMetadata(saves=[
        host_module.BlockTransfer(b, f"k{b}", slot=s) for b, s in pairs], save_id=0))
    for c in caches:
        c.zero_()
    targets = [(10, 1), (11, 2), (12, 3), (13, 4), (14, 6), (15, 0)]
    conn.start_load_kv(HostConnectorMetadata(loads=[
        host_module.BlockTransfer(b, f"k{b}", slot=s) for b, s in targets]))
    source = dict((s, b) for b, s in pairs)
    for cache, old in zip(caches, before, strict=True):
        for b, s in targets:
            assert torch.equal(cache[b], old[source[s]])
    assert conn.stats.saved_blocks == conn.stats.loaded_blocks == len(pairs)


def test_the_pool_is_whole_blocks_in_power_of_two_pieces(monkeypatch) -> None:
    monkeypatch.setattr(host_module, "PIECE_BYTES", 4 * SPEC.block_bytes)
    cfg = KVConnectorConfig("host", kv_offloading_bytes=10 * SPEC.block_bytes + 5)
    assert host_module.num_slots(cfg, SPEC) == 10
    assert HostConnector.host_buffer_bytes(cfg, SPEC) == 10 * SPEC.block_bytes
    conn = HostConnector("worker", cfg, SPEC, "model")
    conn.register_kv_caches([torch.zeros(4, *SPEC.block_shape)])
    assert sum(p.nbytes for p in conn._pieces) == 10 * SPEC.block_bytes
    conn.unregister_kv_caches()
    conn.register_kv_caches([torch.zeros(6, *SPEC.block_shape)])  # a resize: the pool stays
    assert len(conn._pieces) == 3


def test_a_size_under_one_block_names_the_setting_and_a_size_that_is_accepted() -> None:
    with pytest.raises(ValueError, match="kv_offloading_size .* holds no KV block") as error:
        HostConnector("scheduler", KVConnectorConfig("host", kv_offloading_bytes=8), SPEC, "m")
    least = float(str(error.value).rsplit(" ", 1)[1])  # GiB, as the setting takes it
    config = KVConnectorConfig.create(None, None, "block_outer", kv_offloading_size=least)
    assert HostConnector("scheduler", config, SPEC, "m").num_slots >= 1


def test_a_pool_larger_than_the_hosts_available_memory_names_the_setting(monkeypatch) -> None:
    # On a GPU the pool is pinned host memory, outside the device's budget: checked up front.
    conn = HostConnector("worker", config(8), SPEC, "model")
    monkeypatch.setattr(host_module.psutil, "virtual_memory",
                        lambda: type("Memory", (), {"available": 7 * SPEC.block_bytes})())
    with pytest.raises(ValueError, match="lower kv_offloading_size"):
        conn._allocate_pool(torch.device("cuda"))
    assert conn._pieces == []


def test_a_pool_that_cannot_be_pinned_warns_once_and_is_pageable(monkeypatch, caplog) -> None:
    # This machine has no pinned allocator: every pin fails, as a capped `ulimit -l` does.
    monkeypatch.setattr(host_module, "PIECE_BYTES", 2 * SPEC.block_bytes)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: "copy stream")
    conn = HostConnector("worker", config(7), SPEC, "model")
    with caplog.at_level(logging.WARNING, logger="kvfit.connectors.host"):
        conn._allocate_pool(torch.device("cuda"))
    assert [p.shape[1] for p in conn._pieces] == [2, 2, 2, 1]
    assert not any(p.is_pinned() for p in conn._pieces)
    [message] = [r.getMessage() for r in caplog.records]
    assert "no pinned host memory" in message
    assert conn._stream == "copy stream"  # saves still leave the compute stream
