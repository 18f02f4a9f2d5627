"""KV cache shape and layout: which dimension order the bytes follow, and what that implies.

A layout is an order of the six dimensions of a KV cache. The dimensions before `block` split the
reservation into segments that grow in lockstep (`ExtensibleTensor` segments); within a segment,
blocks are laid out at a fixed stride, so the committed prefix of every segment holds blocks
`[0, committed_blocks)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch

# `slot` is a token position inside a block (`block_size` of them), as in `slot_mapping`.
DIMS = ("block", "layer", "kv", "slot", "head", "dim")

LAYOUTS: dict[str, tuple[str, ...]] = {
    # One segment; one block of every layer is one contiguous region (what connectors want).
    "block_outer": ("block", "layer", "kv", "slot", "head", "dim"),
    # One segment per layer.
    "layer_outer": ("layer", "block", "kv", "slot", "head", "dim"),
    # One segment per (layer, k/v, head): proves the segment mechanism is general.
    "head_major": ("layer", "kv", "head", "block", "slot", "dim"),
}

# The order `layer_views()` hands to kernels: [layer][k/v] -> [block, slot, head, dim].
_VIEW_ORDER = ("layer", "kv", "block", "slot", "head", "dim")


@dataclass(frozen=True)
class KVCacheSpec:
    """What one KV cache holds and in which order its bytes lie.

    `layout` is a name from `LAYOUTS` or any order of the dimension names in `DIMS`.
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: str | tuple[str, ...] = "block_outer"

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ValueError(f"KVCacheSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        if isinstance(self.layout, str) and self.layout not in LAYOUTS:
            raise ValueError(
                f"unknown KV cache layout {self.layout!r}; choose one of {sorted(LAYOUTS)} "
                f"or give an order of {DIMS}"
            )
        if not isinstance(self.layout, str) and sorted(self.layout) != sorted(DIMS):
            raise ValueError(f"KV cache layout {self.layout!r} must be an order of {DIMS}")

    @cached_property
    def dims(self) -> tuple[str, ...]:
        """The layout as an order of dimension names, outermost first."""
        return LAYOUTS[self.layout] if isinstance(self.layout, str) else tuple(self.layout)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of the whole cache in layout order."""
        sizes = {
            "block": num_blocks,
            "layer": self.num_layers,
            "kv": 2,
            "slot": self.block_size,
            "head": self.num_kv_heads,
            "dim": self.head_dim,
        }
        return tuple(sizes[d] for d in self.dims)

    @cached_property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block inside one segment: the dimensions after `block`."""
        return self.shape(1)[self.dims.index("block") + 1 :]

    @cached_property
    def num_segments(self) -> int:
        """Segments of the reservation: the product of the dimensions before `block`."""
        return math.prod(self.shape(1)[: self.dims.index("block")])

    @cached_property
    def block_stride_bytes(self) -> int:
        """Bytes between consecutive blocks of one segment."""
        return math.prod(self.block_shape) * self.dtype.itemsize

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V (all segments)."""
        return self.num_segments * self.block_stride_bytes

    def layer_views(self, cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer `(k_cache, v_cache)`, each `[num_blocks, block_size, num_kv_heads, head_dim]`.

        `cache` is the whole cache in layout order; the views share its memory and keep the
        strides the layout gives.
        """
        if cache.dim() != len(self.dims) or cache.dtype != self.dtype:
            raise ValueError(
                f"expected a {len(self.dims)}-d {self.dtype} tensor in layout {self.dims}, "
                f"got {tuple(cache.shape)} {cache.dtype}"
            )
        by_layer = cache.permute(*(self.dims.index(d) for d in _VIEW_ORDER))
        return [(layer[0], layer[1]) for layer in by_layer]

    def granule_aligned_blocks(self, num_blocks: int, granularity: int) -> int:
        """Largest count <= num_blocks whose per-segment extent is a granule multiple.

        With a capacity of that many blocks every segment starts on a granule; with that many
        committed blocks every segment also ends on one, so each segment is its own physical
        allocation (RDMA registration cannot span a granule shared by two segments).
        """
        step = self.granule_block_step(granularity)
        return num_blocks // step * step

    def granule_block_step(self, granularity: int) -> int:
        """The fewest blocks whose per-segment extent is a whole number of granules."""
        return granularity // math.gcd(granularity, self.block_stride_bytes)
