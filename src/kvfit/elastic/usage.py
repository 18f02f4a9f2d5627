"""How much of its KV cache an engine uses: what the co-tenancy governor reads, besides device
free memory, to move memory between engines that share one device."""

from __future__ import annotations

import math
from dataclasses import dataclass

IDLE_HEADROOM = 2.0
"""An idle shrink keeps this many times the blocks in use: room for the sequences running to
grow and a few to arrive before the next grow."""


@dataclass(frozen=True)
class KVUsage:
    """One engine's KV cache between steps: `num_blocks` committed, `used_blocks` referenced by
    live sequences (free prefix-cache blocks are not: they may be evicted), `floor` the blocks
    of one `max_model_len` sequence, `short`: sequences were preempted, or a waiting one
    does not fit in the free blocks, and `need_blocks`: what the next full batch will hold
    at its sequences' length limit (prompt + max_tokens, capped at max_model_len): the running
    sequences and the waiting ones that fill the batch up to max_num_seqs.

    The governor reads the larger of use and that need as the cache's demand: a burst of
    young sequences uses a fraction of what it is about to take, and a shrink to its current
    use would only be undone a few steps later, after preempting some of it. Waiting
    sequences count because a burst arriving at a small cache mostly waits (a cache just
    grown for it has admitted few of them yet): by its use alone it would look idle."""

    num_blocks: int
    used_blocks: int
    floor: int
    short: bool = False
    need_blocks: int = 0

    @property
    def demand_blocks(self) -> int:
        """Blocks the live sequences use now, or the next full batch will use before it
        finishes."""
        return max(self.used_blocks, self.need_blocks)

    @property
    def idle_target(self) -> int:
        """Blocks an idle shrink keeps: the demand plus headroom, never below `floor`."""
        return max(self.floor, math.ceil(self.demand_blocks * IDLE_HEADROOM))

    @property
    def is_low(self) -> bool:
        """Use low enough that an idle shrink would give back at least half the cache (and
        nothing waits for blocks)."""
        return not self.short and 2 * self.idle_target <= self.num_blocks

    def shortfall(self, budget: int) -> int:
        """Blocks the cache lacks, up to `budget` blocks in all: its demand beyond its size,
        or one `floor` more when it is short with its demand in hand (preempted, or a waiting
        sequence that does not fit). What it asks co-tenant engines for (`DemandBoard`)."""
        want = max(self.demand_blocks, (self.num_blocks + self.floor) if self.short else 0)
        return max(0, min(want, budget) - self.num_blocks)

    @property
    def needs_more(self) -> bool:
        """Short of blocks, or with less than the headroom an idle shrink keeps: what a grow
        waits for. Between this and `is_low` (a quarter to half of the cache used) the cache
        neither shrinks nor grows by its use: hysteresis."""
        return self.short or self.demand_blocks * IDLE_HEADROOM > self.num_blocks
