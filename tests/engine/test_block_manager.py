"""BlockManager: lowest ids first, prefix-cache hits over computed full blocks, ref counts."""

from __future__ import annotations

import pytest

from kvfit.engine.block_manager import BlockManager
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import Sequence

BLOCK_SIZE = 4


def make_seq(token_ids: list[int], **params: object) -> Sequence:
    return Sequence(token_ids, SamplingParams(**params))


def start(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> None:
    """Admit `seq` and pretend the model computed `num_tokens` of it (default: all but none)."""
    bm.allocate(seq)
    num_new = (len(seq) if num_tokens is None else num_tokens) - seq.num_computed_tokens
    assert bm.append_slots(seq, num_new)
    seq.num_computed_tokens += num_new
    bm.cache_computed_blocks(seq)


def test_hands_out_lowest_free_ids_first() -> None:
    bm = BlockManager(num_blocks=10, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    seqs = [make_seq(list(range(100 * i, 100 * i + 8))) for i in range(3)]
    for seq in seqs:
        start(bm, seq)
    assert [seq.block_table for seq in seqs] == [[0, 1], [2, 3], [4, 5]]
    bm.free(seqs[1])
    bm.free(seqs[0])
    late = make_seq(list(range(1000, 1012)))
    start(bm, late)
    assert late.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 10 - 5


def test_uncached_free_blocks_go_before_freshly_freed_cached_ones() -> None:
    bm = BlockManager(num_blocks=6, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(9)))  # two full blocks get hashed, the third is partial
    start(bm, first)
    assert first.block_table == [0, 1, 2]
    bm.free(first)
    # Lowest uncached ids first (the partial block 2, then 3, 4, 5); the cached 0 and 1 last.
    other = make_seq(list(range(100, 116)))
    start(bm, other)
    assert other.block_table == [2, 3, 4, 5]
    hit = make_seq(list(range(9)))
    bm.allocate(hit)
    assert hit.num_cached_tokens == 8  # the prefix survived a request that needed 4 blocks
    bm.free(hit)
    # Only cached blocks left: the lowest one is evicted.
    late = make_seq(list(range(200, 204)))
    start(bm, late)
    assert late.block_table == [0]
    assert bm.hash_to_block.get(bm.blocks[1].hash) == 1


def test_free_returns_every_block_and_usage_tracks_it() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    seqs = [make_seq(list(range(10 * i, 10 * i + 6))) for i in range(4)]
    for seq in seqs:
        start(bm, seq)
    assert bm.num_free_blocks == 0
    assert bm.usage == 1.0
    for seq in seqs:
        bm.free(seq)
        assert seq.block_table == []
    assert bm.num_free_blocks == 8
    assert bm.usage == 0.0
    again = make_seq(list(range(500, 532)))
    start(bm, again)
    assert sorted(again.block_table) == list(range(8))


def test_append_slots_refuses_without_side_effects() -> None:
    bm = BlockManager(num_blocks=3, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    seq = make_seq(list(range(10)))
    bm.allocate(seq)
    assert not bm.append_slots(seq, 13)
    assert seq.block_table == []
    assert bm.num_free_blocks == 3
    assert bm.append_slots(seq, 10)
    assert len(seq.block_table) == 3


def test_prefix_hit_reuses_computed_full_blocks() -> None:
    bm = BlockManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(10)))  # 2 full blocks + 2 tokens
    start(bm, first)
    second = make_seq([*range(8), 77, 78, 79])  # same first 2 blocks, then different
    bm.allocate(second)
    assert second.num_cached_tokens == second.num_computed_tokens == 8
    assert second.block_table == first.block_table[:2]
    assert [bm.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    other = make_seq([1, *range(1, 10)])  # first block differs, so nothing after it can hit
    bm.allocate(other)
    assert other.num_cached_tokens == 0


def test_hit_never_covers_the_whole_prompt() -> None:
    bm = BlockManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(8)))  # exactly 2 full blocks
    start(bm, first)
    twin = make_seq(list(range(8)))
    bm.allocate(twin)
    assert twin.num_computed_tokens == 4
    assert twin.num_uncomputed_tokens >= 1


def test_blocks_hash_only_once_computed() -> None:
    bm = BlockManager(num_blocks=16, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(12)))
    bm.allocate(first)
    assert bm.append_slots(first, 12)  # scheduled, but the step has not run yet
    twin = make_seq(list(range(12)))
    bm.allocate(twin)
    assert twin.num_cached_tokens == 0
    bm.free(twin)
    first.num_computed_tokens = 12
    bm.cache_computed_blocks(first)  # the step ran: its full blocks become hits
    again = make_seq(list(range(12)))
    bm.allocate(again)
    assert again.num_cached_tokens == 8


def test_freed_cached_blocks_stay_hittable_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(9)))
    start(bm, first)
    cached = first.block_table[:2]
    bm.free(first)
    assert bm.num_free_blocks == 4  # cached blocks with ref 0 count as free
    hit = make_seq(list(range(9)))
    bm.allocate(hit)
    assert hit.block_table == cached
    assert bm.num_free_blocks == 2
    bm.free(hit)
    # A prompt needing the whole cache evicts the cached blocks by reusing their ids.
    filler = make_seq(list(range(100, 116)))
    start(bm, filler)
    assert sorted(filler.block_table) == [0, 1, 2, 3]
    bm.free(filler)
    evicted = make_seq(list(range(9)))
    bm.allocate(evicted)
    assert evicted.num_cached_tokens == 0
    bm.free(evicted)
    # The reused blocks now cache the filler's tokens instead.
    filler_again = make_seq(list(range(100, 116)))
    bm.allocate(filler_again)
    assert filler_again.num_cached_tokens == 12


def test_shared_block_is_freed_only_by_its_last_user() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(9)))
    start(bm, first)
    second = make_seq(list(range(9)))
    start(bm, second)
    shared = first.block_table[:2]
    assert second.block_table[:2] == shared
    free_before = bm.num_free_blocks
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in shared] == [1, 1]
    assert bm.num_free_blocks == free_before + 1  # only first's own tail block
    # A shared block is never handed out while a sequence still holds it.
    third = make_seq(list(range(200, 220)))
    bm.allocate(third)
    assert bm.append_slots(third, 20)
    assert not set(third.block_table) & set(shared)


def test_generated_tokens_fill_and_hash_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    seq = make_seq(list(range(3)))
    start(bm, seq)
    for token in (50, 51, 52, 53, 54):  # decode past the first block boundary
        seq.append_token(token)
        assert bm.append_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_computed_blocks(seq)
    bm.free(seq)
    follow_up = make_seq([0, 1, 2, 50, 51, 52, 53, 54, 99])
    bm.allocate(follow_up)
    assert follow_up.num_cached_tokens == 8


def test_prompt_logprobs_requests_and_disabled_caching_get_no_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    start(bm, make_seq(list(range(9))))
    wants_prompt_logprobs = make_seq(list(range(9)), prompt_logprobs=1)
    bm.allocate(wants_prompt_logprobs)
    assert wants_prompt_logprobs.num_cached_tokens == 0

    off = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=False)
    first = make_seq(list(range(9)))
    start(off, first)
    off.free(first)
    again = make_seq(list(range(9)))
    off.allocate(again)
    assert again.num_cached_tokens == 0


def test_heap_stays_bounded_under_repeated_hits() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    for _ in range(50):
        seq = make_seq(list(range(9)))
        start(bm, seq)
        bm.free(seq)
    assert sum(map(len, bm._free_heaps)) <= bm.num_blocks
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0)])
def test_rejects_empty_cache_or_blocks(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="num_blocks|block_size"):
        BlockManager(num_blocks, block_size, enable_prefix_caching=True)


def assert_consistent(bm: BlockManager) -> None:
    """Ref counts, free count, heaps and hash table agree, and nothing names a dropped id."""
    assert len(bm.blocks) == len(bm._in_heap) == bm.num_blocks
    free = {b.block_id for b in bm.blocks if b.ref_count == 0}
    assert bm.num_free_blocks == len(free)
    in_heaps = [i for heap in bm._free_heaps for i in heap]
    assert len(in_heaps) == len(set(in_heaps))  # each id at most once
    assert set(in_heaps) == {i for i, flag in enumerate(bm._in_heap) if flag}
    assert free <= set(in_heaps)  # every free block can be handed out
    for h, block_id in bm.hash_to_block.items():
        assert block_id < bm.num_blocks and bm.blocks[block_id].hash == h


def test_shrink_drops_the_free_tail_and_evicts_its_cache_entries() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    low, high = make_seq(list(range(9))), make_seq(list(range(100, 113)))
    start(bm, low)  # blocks 0-2, two of them hashed
    start(bm, high)  # blocks 3-6, three of them hashed
    assert high.block_table == [3, 4, 5, 6]
    bm.free(high)
    assert bm.shrink(4) == 2  # blocks 4 and 5 held entries; 6 was partial
    assert bm.num_blocks == 4 and bm.num_free_blocks == 1
    assert_consistent(bm)
    again = make_seq(list(range(100, 113)))
    bm.allocate(again)
    assert again.num_cached_tokens == 4  # block 3 survives; the tail's entries are gone
    bm.free(again)
    hit = make_seq(list(range(9)))
    bm.allocate(hit)
    assert hit.num_cached_tokens == 8  # entries below the cut are kept
    bm.free(hit)
    bm.free(low)
    late = make_seq(list(range(200, 216)))
    start(bm, late)
    assert sorted(late.block_table) == [0, 1, 2, 3]  # never an id past the cut
    bm.free(late)
    assert bm.num_free_blocks == bm.num_blocks == 4
    assert_consistent(bm)


def test_shrink_refuses_blocks_in_use_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=6, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    seq = make_seq(list(range(20)))  # blocks 0-4
    start(bm, seq)
    with pytest.raises(RuntimeError, match="in use"):
        bm.shrink(3)
    assert bm.num_blocks == 6 and bm.num_free_blocks == 1
    assert_consistent(bm)
    for bad in (0, 7):
        with pytest.raises(ValueError):
            bm.shrink(bad)


def test_reset_prefix_cache_forgets_every_hit_and_refuses_blocks_in_use() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(9)))
    start(bm, first)
    with pytest.raises(RuntimeError, match="in use"):
        bm.reset_prefix_cache()
    bm.free(first)
    bm.reset_prefix_cache()
    assert not bm.hash_to_block and bm.num_free_blocks == 8
    again = make_seq(list(range(9)))
    bm.allocate(again)
    assert again.num_cached_tokens == 0 and again.block_table == []


def test_grow_appends_free_uncached_blocks_handed_out_after_lower_ones() -> None:
    bm = BlockManager(num_blocks=8, block_size=BLOCK_SIZE, enable_prefix_caching=True)
    first = make_seq(list(range(9)))
    start(bm, first)  # blocks 0-2
    bm.shrink(4)
    bm.grow(8)
    assert bm.num_blocks == 8 and bm.num_free_blocks == 5
    assert_consistent(bm)
    low = make_seq(list(range(100, 104)))
    start(bm, low)
    assert low.block_table == [3]  # the lowest free id, below every grown one
    rest = make_seq(list(range(200, 216)))
    start(bm, rest)
    assert rest.block_table == [4, 5, 6, 7]
    assert_consistent(bm)
    bm.free(first)
    hit = make_seq(list(range(9)))
    bm.allocate(hit)
    assert hit.num_cached_tokens == 8  # a grow keeps every entry
    with pytest.raises(ValueError):
        bm.grow(7)
