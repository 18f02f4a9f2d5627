"""KV cache block allocation with prefix caching over hashed full blocks."""

from __future__ import annotations

import hashlib
import heapq
from array import array
from dataclasses import dataclass

from kvfit.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Chain hash of the block's tokens and every token before it; None until the block is full
    # and its K/V computed, and again once the id is handed out for new tokens.
    hash: bytes | None = None


def block_hash(parent: bytes, token_ids: list[int]) -> bytes:
    """Hash of one full block, chained on its parent's hash so equal hashes mean equal prefixes."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Hands out cache blocks to sequences and shares full blocks with equal prefixes.

    A freed block keeps its hash and can be hit again until its id is handed out for new tokens
    (eviction happens on reuse). Free ids wait in two min-heaps: blocks holding no prefix-cache
    entry are handed out first, so freshly freed cached blocks survive as hits as long as any
    other block is free; within each heap the lowest id goes first, so live blocks pack at the
    front of the cache and a shrink only loses its tail.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockManager needs block_size >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[bytes, int] = {}
        self.num_free_blocks = num_blocks
        # (uncached, cached). A prefix hit takes a block without removing it from its heap (that
        # would cost O(n)); such stale ids are skipped when popped. `_in_heap` keeps each id in
        # the heaps at most once, so together they never outgrow num_blocks.
        self._free_heaps: tuple[list[int], list[int]] = (list(range(num_blocks)), [])
        self._in_heap = [True] * num_blocks
        # Prefix-cache lookups, in tokens, for metrics: what started sequences asked for and
        # hit (`record_prefix_lookup`).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, seq: Sequence) -> None:
        """Start a waiting `seq`: take the cached blocks of its longest hashed prefix.

        Sets `num_computed_tokens` to the tokens those blocks hold, and `num_cached_tokens`
        too the first time the sequence starts. The last token is never a hit, so the first
        step always has a token to sample from. Requests with prompt logprobs get no hits:
        their prompt must run through the model.
        """
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        if self.enable_prefix_caching and seq.sampling_params.prompt_logprobs is None:
            parent = b""
            for i in range((len(seq) - 1) // self.block_size):
                h = block_hash(parent, self._block_tokens(seq, i))
                block_id = self.hash_to_block.get(h)
                if block_id is None:
                    break
                self._take(self.blocks[block_id])
                seq.block_table.append(block_id)
                parent = h
        seq.num_computed_tokens = num_hit = len(seq.block_table) * self.block_size
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_hit

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a started sequence's prefix-cache lookup in the metrics. The scheduler calls
        it once per sequence, when it first starts: not for an attempt that found too few free
        blocks (it looks up again next step), nor for a preempted sequence hitting its own
        blocks as it is recomputed (no saving), as vLLM counts them."""
        if self.enable_prefix_caching:
            self.num_queried_tokens += num_tokens
            self.num_hit_tokens += num_hit_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow `seq.block_table` to hold `num_computed_tokens + num_new_tokens` tokens.

        Returns False, changing nothing, when too few blocks are free.
        """
        num_needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        num_new_blocks = num_needed - len(seq.block_table)
        if num_new_blocks > self.num_free_blocks:
            return False
        for _ in range(num_new_blocks):
            seq.block_table.append(self._pop_free().block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Release `seq`'s blocks; the cached ones stay hittable until their ids are reused."""
        for block_id in reversed(seq.block_table):
            self._release(self.blocks[block_id])
        seq.block_table = []

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Hash `seq`'s newly full blocks whose K/V are written, making them prefix hits.

        Call after advancing `num_computed_tokens`: hashing only computed blocks means a hit
        never points at K/V that a step in flight is still producing.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        first = num_full
        while first > 0 and self.blocks[seq.block_table[first - 1]].hash is None:
            first -= 1
        parent = self.blocks[seq.block_table[first - 1]].hash if first else b""
        for i in range(first, num_full):
            block = self.blocks[seq.block_table[i]]
            block.hash = parent = block_hash(parent, self._block_tokens(seq, i))
            # Two sequences may compute the same block at once; the first one stays the hit.
            self.hash_to_block.setdefault(parent, block.block_id)

    def shrink(self, num_blocks: int) -> int:
        """Drop blocks [num_blocks, self.num_blocks) so the cache can shrink to `num_blocks`;
        returns how many prefix-cache entries that evicted.

        Every dropped block must be free: preempt the sequences holding one first
        (`Scheduler.preempt_tail_holders`).
        """
        if not 1 <= num_blocks <= self.num_blocks:
            raise ValueError(f"cannot shrink {self.num_blocks} blocks to {num_blocks}")
        tail = self.blocks[num_blocks:]
        held = [block.block_id for block in tail if block.ref_count]
        if held:
            raise RuntimeError(f"cannot drop KV cache blocks still in use: {held[:8]}")
        evicted = 0
        for block in tail:
            if self._is_cached(block):
                del self.hash_to_block[block.hash]
                evicted += 1
        del self.blocks[num_blocks:], self._in_heap[num_blocks:]
        for heap in self._free_heaps:
            heap[:] = [block_id for block_id in heap if block_id < num_blocks]
            heapq.heapify(heap)
        self.num_free_blocks -= len(tail)
        self.num_blocks = num_blocks
        return evicted

    def grow(self, num_blocks: int) -> None:
        """Add blocks [self.num_blocks, num_blocks), free and uncached (the cache committed
        them). They come after every id the free heaps hold, so appending keeps each a heap."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"cannot grow {self.num_blocks} blocks to {num_blocks}")
        new = range(self.num_blocks, num_blocks)
        self.blocks.extend(Block(i) for i in new)
        self._in_heap.extend(True for _ in new)
        self._free_heaps[0].extend(new)
        self.num_free_blocks += len(new)
        self.num_blocks = num_blocks

    def reset_prefix_cache(self) -> None:
        """Forget every prefix-cache entry: the KV contents are gone (sleep) or were computed
        by other weights. Every block must be free."""
        held = [block.block_id for block in self.blocks if block.ref_count]
        if held:
            raise RuntimeError(f"cannot reset the prefix cache while blocks are in use: "
                               f"{held[:8]}")
        for block in self.blocks:
            block.hash = None
        self.hash_to_block.clear()
        self._free_heaps = (list(range(self.num_blocks)), [])
        self._in_heap = [True] * self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _block_tokens(self, seq: Sequence, i: int) -> list[int]:
        return seq.token_ids[i * self.block_size : (i + 1) * self.block_size]

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            self.num_free_blocks -= 1
        block.ref_count += 1

    def _is_cached(self, block: Block) -> bool:
        """Whether `block` is the prefix-cache entry of its hash (a hit can find it)."""
        return block.hash is not None and self.hash_to_block.get(block.hash) == block.block_id

    def _pop_free(self) -> Block:
        block = self._pop_unreferenced()
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block.block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
        self._take(block)
        return block

    def _pop_unreferenced(self) -> Block:
        """The lowest free uncached block, else the lowest free cached one."""
        for heap in self._free_heaps:
            while heap:
                block = self.blocks[heapq.heappop(heap)]
                self._in_heap[block.block_id] = False
                if block.ref_count == 0:
                    return block
        raise RuntimeError("no free KV cache block: check num_free_blocks before allocating")

    def _release(self, block: Block) -> None:
        block.ref_count -= 1
        if block.ref_count > 0:
            return
        self.num_free_blocks += 1
        if not self._in_heap[block.block_id]:
            heapq.heappush(self._free_heaps[self._is_cached(block)], block.block_id)
            self._in_heap[block.block_id] = True
