"""KVCacheSpec: layouts, segment counts, strides, and views that address the layout's bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvfit.kv.spec import LAYOUTS, KVCacheSpec

MiB = 1 << 20


def make_spec(layout: str | tuple[str, ...] = "block_outer", **kw: object) -> KVCacheSpec:
    args: dict = dict(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    args.update(kw)
    return KVCacheSpec(**args, layout=layout)


@pytest.mark.parametrize(
    ("layout", "shape", "num_segments", "block_stride_bytes"),
    [
        ("block_outer", (5, 3, 2, 4, 2, 8), 1, 3 * 2 * 4 * 2 * 8 * 2),
        ("layer_outer", (3, 5, 2, 4, 2, 8), 3, 2 * 4 * 2 * 8 * 2),
        ("head_major", (3, 2, 2, 5, 4, 8), 3 * 2 * 2, 4 * 8 * 2),
    ],
)
def test_named_layouts(
    layout: str, shape: tuple[int, ...], num_segments: int, block_stride_bytes: int
) -> None:
    spec = make_spec(layout)
    assert spec.shape(5) == shape
    assert spec.num_segments == num_segments
    assert spec.block_stride_bytes == block_stride_bytes
    # A block over all layers, K and V, is the same size whatever the layout.
    assert spec.block_bytes == 3 * 2 * 4 * 2 * 8 * 2


def test_custom_layout_with_block_innermost() -> None:
    spec = make_spec(("layer", "kv", "head", "slot", "dim", "block"))
    assert spec.num_segments == 3 * 2 * 2 * 4 * 8
    assert spec.block_stride_bytes == 2


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"layout": "blocks_first"}, "block_outer"),
        ({"layout": ("block", "layer", "kv", "slot", "head")}, "must be an order"),
        ({"layout": ("block", "block", "kv", "slot", "head", "dim")}, "must be an order"),
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": 2.0}, "head_dim"),
        ({"dtype": "bfloat16"}, "dtype"),
    ],
)
def test_bad_spec_is_a_clear_error(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec(**kw)


LAYOUT_CASES = [*LAYOUTS, ("slot", "layer", "block", "dim", "kv", "head")]


@pytest.mark.parametrize("layout", LAYOUT_CASES)
def test_layer_views_address_the_layout(layout: str | tuple[str, ...], layout_offsets) -> None:
    spec = make_spec(layout, dtype=torch.float32)
    num_blocks = 5
    cache = torch.zeros(spec.shape(num_blocks), dtype=spec.dtype)
    flat = cache.view(-1)
    views = spec.layer_views(cache)
    assert len(views) == spec.num_layers
    for layer, pair in enumerate(views):
        for kv, view in enumerate(pair):
            assert view.shape == (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
            offsets = layout_offsets(spec, num_blocks, layer, kv)
            view.copy_(torch.randn(view.shape))  # write through the view, read by arithmetic
            assert torch.equal(flat[offsets], view)
            flat[offsets] = torch.randn(view.shape)  # and back
            assert torch.equal(view, flat[offsets])
    # Together the views cover every element exactly once.
    flat.copy_(torch.arange(flat.numel()))
    seen = torch.cat([t.flatten() for pair in views for t in pair])
    assert torch.equal(seen.sort().values, flat)


def test_layer_views_reject_a_tensor_of_another_layout() -> None:
    spec = make_spec()
    with pytest.raises(ValueError, match="layout"):
        spec.layer_views(torch.zeros(5, 3, 2, 4, 2, dtype=spec.dtype))


def test_granule_aligned_blocks_by_hand() -> None:
    spec = make_spec(
        "layer_outer", block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16
    )
    assert spec.block_stride_bytes == 64 * 1024  # 32 blocks per 2 MiB granule
    assert spec.granule_aligned_blocks(100, 2 * MiB) == 96
    assert spec.granule_aligned_blocks(31, 2 * MiB) == 0
    odd = make_spec("layer_outer", block_size=3, num_kv_heads=1, head_dim=64, dtype=torch.float32)
    assert odd.block_stride_bytes == 1536  # 2 MiB / gcd = 2048 blocks per aligned step
    assert odd.granule_aligned_blocks(5000, 2 * MiB) == 4096


@given(
    n=st.integers(0, 10_000),
    block_size=st.integers(1, 32),
    head_dim=st.sampled_from([8, 24, 64, 96, 128]),
    granule_mib=st.sampled_from([2, 4, 32]),
)
def test_granule_aligned_blocks_is_the_largest_aligned_count(
    n: int, block_size: int, head_dim: int, granule_mib: int
) -> None:
    spec = make_spec("layer_outer", block_size=block_size, head_dim=head_dim)
    granule = granule_mib * MiB
    aligned = spec.granule_aligned_blocks(n, granule)
    assert 0 <= aligned <= n
    assert aligned * spec.block_stride_bytes % granule == 0
    assert all(m * spec.block_stride_bytes % granule for m in range(aligned + 1, n + 1))
