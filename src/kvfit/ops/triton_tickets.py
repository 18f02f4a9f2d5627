"""A launch's programs counting in, so that the last of a group does the group's final step in
the same launch rather than in a kernel of its own (one graph node fewer)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(arrived, index, count):
    """Whether this program is the last of the `count` programs counting at `arrived + index`
    (int32, zero before the launch); the last one sets it back to zero for the next launch,
    graph replays included.

    acq_rel makes every other program's global writes before its ticket visible to the last
    one (the fused decode's reduction also reads them past L1, ".cg"; the sampling filters'
    passes read them plainly after the acquire). One thread takes the ticket, so a CTA barrier
    comes first: it orders this program's other warps' writes before that thread's release."""
    tl.debug_barrier()
    last = tl.atomic_add(arrived + index, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.store(arrived + index, 0)
    return last
