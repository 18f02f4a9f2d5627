"""`ExtensibleKVCache`: a KV cache of any layout on one `ExtensibleTensor` reservation.

The whole capacity is reserved up front and the views over it never move, so kernels and CUDA
graphs bound early stay valid while physical pages are committed, shrunk, released and
recommitted underneath. Segment i of the reservation is the i-th index of the dimensions before
`block` in the layout; all segments hold the same block prefix.
"""

from __future__ import annotations

import torch

from kvfit.kv.spec import KVCacheSpec
from kvfit.vmm import BULK_CHUNK_BYTES, ExtensibleTensor

ELASTIC_CHUNK_BYTES = 2 << 30
"""The physical chunks of a runtime grow, over all segments together. A shrink under memory
pressure unmaps whole chunks (copying needs memory the device lacks), so this bounds what it
gives back beyond its need, and what a cutting shrink copies. Startup commits 1 GiB chunks per
segment instead (but for its last `TAIL_BYTES`): fewer driver calls (~50 us each), so a 100 GiB
grow on 72 segments maps ~3,600 chunks here (~0.2 s) against ~140."""

TAIL_BYTES = 8 << 30
"""The end of the committed cache, over all segments, that a bulk grow (startup, wake) still
maps in `ELASTIC_CHUNK_BYTES` chunks: the out-of-memory guard's shrink, which must not copy,
then gives back at most ~2 GiB beyond what it needs where 1 GiB chunks would give back up to
1 GiB in every segment. Costs four more chunks a segment (~30 ms on 72 segments)."""


class ExtensibleKVCache:
    """A KV cache with `capacity_blocks` reserved and `committed_blocks` backed by memory.

    Lifetime: `allocate()` reserves; `free()` (or dropping the cache and every view) returns
    the reservation. Blocks at or beyond `committed_blocks` must not be touched.
    """

    def __init__(self, spec: KVCacheSpec, capacity_blocks: int, device: torch.device | str) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        self.spec = spec
        self.capacity_blocks = capacity_blocks
        self.device = torch.device(device)
        self.committed_blocks = 0
        self._tensor: ExtensibleTensor | None = None
        self._cache: torch.Tensor | None = None

    def allocate(self) -> torch.Tensor:
        """The allocator hook: reserve the capacity, commit block 0, return the whole cache.

        Block 0 is what dummy block tables address before warmup; the returned tensor is in
        the spec's layout and dtype, shaped `spec.shape(capacity_blocks)`.
        """
        if self._tensor is not None:
            raise RuntimeError("ExtensibleKVCache.allocate() was already called")
        capacity_bytes = self.capacity_blocks * self.spec.block_bytes
        segments = self.spec.num_segments
        self._tensor = ExtensibleTensor(capacity_bytes, self.device, segments,
                                        tail_bytes=TAIL_BYTES // segments,
                                        tail_chunk_bytes=ELASTIC_CHUNK_BYTES // segments)
        self.commit(1)
        raw = self._tensor.full_view()
        self._cache = raw.view(self.spec.dtype).view(self.spec.shape(self.capacity_blocks))
        return self._cache

    @property
    def tensor(self) -> ExtensibleTensor:
        """The reservation under the cache."""
        if self._tensor is None:
            raise RuntimeError("call ExtensibleKVCache.allocate() first")
        return self._tensor

    @property
    def granularity(self) -> int:
        """Bytes per commit granule."""
        return self.tensor.granularity

    @property
    def physical_bytes(self) -> int:
        """Device memory the cache holds now."""
        return self.tensor.physical_bytes

    @property
    def reserved_bytes(self) -> int:
        """Address space the cache reserved (its capacity, rounded up to the granule)."""
        return self.tensor.reserved_bytes

    def commit(self, num_blocks: int, defragment: bool = False, elastic: bool = False) -> None:
        """Back exactly `num_blocks` blocks, growing or shrinking; the prefix is kept.

        `defragment=True` remaps each segment as one physical allocation and discards the
        contents (for connectors whose transfers cannot span allocations). `elastic=True` (a
        resize at runtime) grows in chunks of `ELASTIC_CHUNK_BYTES` over all segments, which a
        later shrink under memory pressure can give back one at a time. A failure leaves the
        old size, or the new one where only a shrink's clean-up failed
        (`ExtensibleTensor.commit`).
        """
        if not 0 <= num_blocks <= self.capacity_blocks:
            raise ValueError(
                f"cannot commit {num_blocks} KV blocks: capacity_blocks is {self.capacity_blocks}"
            )
        before = self.tensor.committed_bytes
        chunk = self.tensor.tail_chunk_bytes if elastic else BULK_CHUNK_BYTES
        try:
            self.tensor.commit(num_blocks * self.spec.block_stride_bytes, defragment=defragment,
                               max_chunk_bytes=chunk)
        except BaseException:
            if self.tensor.committed_bytes != before:  # resized; only the clean-up failed
                self.committed_blocks = num_blocks
            raise
        self.committed_blocks = num_blocks

    def ensure_blocks(self, num_blocks: int) -> None:
        """Back at least `num_blocks` blocks (warmup commits the prefix it addresses)."""
        if num_blocks > self.committed_blocks:
            self.commit(num_blocks)

    def footprint_bytes(self, num_blocks: int) -> int:
        """Physical bytes that backing `num_blocks` blocks takes.

        Each segment commits its prefix rounded up to a granule (capped at the segment); every
        granule those ranges touch is mapped once, also one straddling two segments.
        """
        if num_blocks == 0:
            return 0
        granule = self.granularity
        segment_bytes = self.capacity_blocks * self.spec.block_stride_bytes
        prefix_bytes = min(
            -(-num_blocks * self.spec.block_stride_bytes // granule) * granule, segment_bytes
        )
        granules, mapped_end = 0, 0
        for start in range(0, self.spec.num_segments * segment_bytes, segment_bytes):
            first = max(start // granule, mapped_end)
            mapped_end = -(-(start + prefix_bytes) // granule)
            granules += mapped_end - first
        return granules * granule

    def blocks_that_fit(self, nbytes: int) -> int:
        """The most blocks whose granule-rounded footprint over all segments fits in `nbytes`."""
        lo, hi = 0, self.capacity_blocks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.footprint_bytes(mid) <= nbytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def uncut_blocks(self, num_blocks: int) -> int:
        """The most blocks <= `num_blocks` that a shrink reaches by unmapping whole physical
        chunks, with no copy (`ExtensibleTensor.uncut_bytes`): how to shrink when the device is
        out of memory. Never more than are committed."""
        stride = self.spec.block_stride_bytes
        num_blocks = min(num_blocks, self.committed_blocks)
        return self.tensor.uncut_bytes(num_blocks * stride) // stride

    def granule_aligned_blocks(self, num_blocks: int) -> int:
        """Largest count <= num_blocks at which every segment starts and ends on a granule."""
        return self.spec.granule_aligned_blocks(num_blocks, self.granularity)

    def layer_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer `(k_cache, v_cache)` over the whole reservation, for kernels.

        Each is `[capacity_blocks, block_size, num_kv_heads, head_dim]` with the layout's strides.
        """
        if self._cache is None:
            raise RuntimeError("call ExtensibleKVCache.allocate() first")
        return self.spec.layer_views(self._cache)

    def committed_views(self) -> list[torch.Tensor]:
        """Per segment `[committed_blocks, *block_shape]`, at the same addresses as
        `layer_views()`, each storage spanning exactly the committed bytes of its segment
        (what a connector registers)."""
        numel = self.committed_blocks * self.spec.block_stride_bytes // self.spec.dtype.itemsize
        shape = (self.committed_blocks, *self.spec.block_shape)
        return [
            self.tensor.segment_view(i).view(self.spec.dtype)[:numel].view(shape)
            for i in range(self.spec.num_segments)
        ]

    def release_physical(self) -> None:
        """Drop every physical page (sleep); the reservation and every view's address stay."""
        self.tensor.release_physical()

    def check_room(self, num_blocks: int) -> None:
        """Raise `VmmOutOfMemoryError`, changing nothing, unless the device holds the memory
        that recommitting `num_blocks` takes beyond what the cache holds now
        (`ExtensibleTensor.check_room`)."""
        self.tensor.check_room(num_blocks * self.spec.block_stride_bytes)

    def recommit(self, defragment: bool = False, num_blocks: int | None = None) -> None:
        """Back the same blocks again after `release_physical()` (`num_blocks`: that many
        instead, the new committed count), zeroed, in large chunks (one per segment with
        `defragment`, for a connector); a failure leaves the cache released (retry, or
        `free()`)."""
        if num_blocks is None:
            self.tensor.recommit(defragment)
            return
        if not 0 <= num_blocks <= self.capacity_blocks:
            raise ValueError(
                f"cannot commit {num_blocks} KV blocks: capacity_blocks is {self.capacity_blocks}"
            )
        if not self.is_released:
            raise RuntimeError("recommit(num_blocks=...) needs release_physical() first")
        self.committed_blocks = num_blocks  # also when it fails: the size a retry backs
        self.tensor.recommit(defragment, num_blocks * self.spec.block_stride_bytes)

    @property
    def is_released(self) -> bool:
        """Whether the pages are dropped (asleep) and not yet recommitted."""
        return self.tensor.is_released

    def free(self) -> None:
        """Return the reservation. Views over it must not be used afterwards."""
        if self._tensor is not None:
            self._tensor.free()
        self._tensor = self._cache = None
        self.committed_blocks = 0
