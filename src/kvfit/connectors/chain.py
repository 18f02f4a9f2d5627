"""Names for full KV blocks that stores outside the engine share: a block's key is the chained
hash of its tokens and every token before it, rooted at a namespace that hashes the model and
the KV layout, dtype and shape. Equal keys mean equal prefixes on an equal model."""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Callable

from kvfit.connectors.base import ScheduledSeq
from kvfit.kv.spec import KVCacheSpec


def store_namespace(model_id: str, spec: KVCacheSpec) -> str:
    """The hex root of every key of a store for `model_id`'s K/V in a cache of `spec`."""
    described = {"model": model_id, "layout": "/".join(spec.dims), "dtype": str(spec.dtype),
                 "num_segments": spec.num_segments, "block_shape": list(spec.block_shape)}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()


class BlockChains:
    """The keys of each sequence's full blocks, in order, kept per sequence and extended as it
    grows (a key costs one sha256 of its block's tokens)."""

    def __init__(self, namespace: str, block_size: int) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self._chains: dict[int, list[str]] = {}  # seq_id -> keys of its leading full blocks

    def keys_for(self, token_ids: list[int]) -> list[str]:
        """Keys of the full blocks of `token_ids`, in order."""
        return self._extend([], token_ids, len(token_ids) // self.block_size)

    def block_keys(self, seq: ScheduledSeq, num_blocks: int) -> list[str]:
        """Keys of `seq`'s first `num_blocks` full blocks, fewer where a block holds a token
        not sampled yet (negative)."""
        keys = self._chains.setdefault(seq.seq_id, [])
        return self._extend(keys, seq.token_ids, num_blocks)[:num_blocks]

    def fill_keys(self, seq: ScheduledSeq, num_new: int) -> tuple[int, list[str]]:
        """`(first, keys)`: the keys of `seq`'s blocks `first`, `first + 1`, ... that a step
        computing its next `num_new` tokens leaves full and computed, for a store to save.
        They start one block early where `seq` starts the step at a block's end: the step
        before filled that block with the token it read pending on the device (a decode with
        a step in flight), whose key only now is known."""
        bs, start = self.block_size, seq.num_computed_tokens
        first = start // bs - (start % bs == 0 and start > 0)
        return first, self.block_keys(seq, (start + num_new) // bs)[first:]

    def unsaved_tail(self, seq: ScheduledSeq) -> tuple[int, str] | None:
        """`(index, key)` of the block a finished `seq`'s last step filled, where that step
        ended at the block's end: a store may lack it, as its last token may have been pending
        when the step was built (no key yet) and no later step of `seq` ran to save it
        (`fill_keys`'s look back). None where `seq` ended inside a block or a token of it is
        unknown (an aborted sequence's)."""
        bs, num_full = self.block_size, seq.num_computed_tokens // self.block_size
        if num_full == 0 or seq.num_computed_tokens % bs:
            return None
        keys = self.block_keys(seq, num_full)
        return (num_full - 1, keys[-1]) if len(keys) == num_full else None

    def num_hit_tokens(self, seq: ScheduledSeq, holds: Callable[[str], bool]) -> int:
        """Tokens past `seq.num_computed_tokens` (block aligned) in the leading whole blocks
        whose keys a store `holds`; never the last token (it is sampled from)."""
        bs = self.block_size
        hits = 0
        for key in self.block_keys(seq, (len(seq.token_ids) - 1) // bs)[
                seq.num_computed_tokens // bs :]:
            if not holds(key):
                break
            hits += 1
        return hits * bs

    def hit_blocks(self, seq: ScheduledSeq, num_hit_tokens: int) -> list[tuple[int, str]]:
        """`(index, key)` of the blocks of `seq`'s `num_hit_tokens` store hits, the ones right
        before its `num_computed_tokens` (which counts them): what the store loads."""
        end = seq.num_computed_tokens // self.block_size
        keys = self.block_keys(seq, end)
        return [(i, keys[i]) for i in range(end - num_hit_tokens // self.block_size, end)]

    def forget(self, seq_id: int) -> None:
        """Drop what was kept for a finished sequence."""
        self._chains.pop(seq_id, None)

    def _extend(self, keys: list[str], token_ids: list[int], num_blocks: int) -> list[str]:
        """Append the keys of blocks `len(keys)..num_blocks` to `keys` (each hashes its tokens
        onto its parent's key; the first onto the namespace), stopping at an unknown token."""
        bs = self.block_size
        parent = bytes.fromhex(keys[-1] if keys else self.namespace)
        for i in range(len(keys), num_blocks):
            tokens = token_ids[i * bs : (i + 1) * bs]
            if len(tokens) < bs or min(tokens) < 0:
                break
            parent = hashlib.sha256(parent + array("q", tokens).tobytes()).digest()
            keys.append(parent.hex())
        return keys
