"""Shared fixtures of the kv tests: the devices the cache suite runs on, index arithmetic."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfit.kv.spec import KVCacheSpec

LayoutOffsets = Callable[[KVCacheSpec, int, int, int], torch.Tensor]


def _layout_offsets(spec: KVCacheSpec, num_blocks: int, layer: int, kv: int) -> torch.Tensor:
    """Element offsets, in a contiguous tensor of the spec's layout, of one layer's K (kv=0) or
    V (kv=1) entries, as a `[num_blocks, block_size, num_kv_heads, head_dim]` tensor.

    Computed by hand from row-major strides, independently of `KVCacheSpec.layer_views`.
    """
    grids = {
        "layer": torch.tensor(layer),
        "kv": torch.tensor(kv),
        "block": torch.arange(num_blocks).view(-1, 1, 1, 1),
        "slot": torch.arange(spec.block_size).view(-1, 1, 1),
        "head": torch.arange(spec.num_kv_heads).view(-1, 1),
        "dim": torch.arange(spec.head_dim),
    }
    offsets = torch.tensor(0)
    for name, size in zip(spec.dims, spec.shape(num_blocks), strict=True):
        offsets = offsets * size + grids[name]
    return offsets


@pytest.fixture
def layout_offsets() -> LayoutOffsets:
    return _layout_offsets


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param
