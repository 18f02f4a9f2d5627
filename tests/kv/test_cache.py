"""ExtensibleKVCache on every layout, on the host driver here and on CUDA on the GPU machine."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfit.kv import cache as cache_module
from kvfit.kv.cache import ExtensibleKVCache
from kvfit.kv.spec import LAYOUTS, KVCacheSpec

MiB = 1 << 20
CAPACITY = 1000  # blocks; not a granule multiple for any layout below


def make_spec(layout: str | tuple[str, ...]) -> KVCacheSpec:
    # 4 KiB per block over all layers: a few MiB of KV per cache.
    return KVCacheSpec(
        num_layers=2, block_size=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, layout=layout
    )


@pytest.fixture(params=list(LAYOUTS))
def layout(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def cache(layout: str, device: str):
    cache = ExtensibleKVCache(make_spec(layout), CAPACITY, device)
    cache.allocate()
    yield cache
    cache.free()


def reference(cache: ExtensibleKVCache) -> torch.Tensor:
    """The reservation as a flat tensor of the spec's dtype: a contiguous tensor of the layout."""
    nbytes = cache.capacity_blocks * cache.spec.block_bytes
    return cache.tensor.full_view()[:nbytes].view(cache.spec.dtype)


def fill(cache: ExtensibleKVCache, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Random data in blocks [0, num_blocks) of every view; returns what was written."""
    gen = torch.Generator().manual_seed(seed)
    written = []
    for pair in cache.layer_views():
        for view in pair:
            data = torch.randn(view[:num_blocks].shape, generator=gen).to(view.device)
            view[:num_blocks] = data
            written.append(data)
    return written


def assert_prefix(cache: ExtensibleKVCache, written: list[torch.Tensor], num_blocks: int) -> None:
    views = [view for pair in cache.layer_views() for view in pair]
    for view, data in zip(views, written, strict=True):
        assert torch.equal(view[:num_blocks], data[:num_blocks])


def test_allocate_returns_the_whole_cache_with_block_zero_backed(cache: ExtensibleKVCache) -> None:
    spec = cache.spec
    full = cache.layer_views()[0][0]
    assert full.shape == (CAPACITY, spec.block_size, spec.num_kv_heads, spec.head_dim)
    assert full.dtype == spec.dtype and full.device.type == torch.device(cache.device).type
    assert cache.committed_blocks == 1
    assert len(cache.committed_views()) == spec.num_segments
    assert 0 < cache.physical_bytes == cache.footprint_bytes(1)
    with pytest.raises(RuntimeError, match="already"):
        cache.allocate()


def test_use_before_allocate_is_a_clear_error() -> None:
    cache = ExtensibleKVCache(make_spec("block_outer"), CAPACITY, "cpu")
    with pytest.raises(RuntimeError, match=r"allocate\(\)"):
        cache.layer_views()
    with pytest.raises(RuntimeError, match=r"allocate\(\)"):
        cache.blocks_that_fit(MiB)
    with pytest.raises(ValueError, match="capacity_blocks"):
        ExtensibleKVCache(make_spec("block_outer"), 0, "cpu")


def test_views_address_the_layout(cache: ExtensibleKVCache, layout_offsets) -> None:
    cache.commit(CAPACITY)
    flat = reference(cache)
    for layer, pair in enumerate(cache.layer_views()):
        for kv, view in enumerate(pair):
            offsets = layout_offsets(cache.spec, CAPACITY, layer, kv).to(flat.device)
            view.copy_(torch.randn(view.shape))  # write through the view, read by arithmetic
            assert torch.equal(flat[offsets], view)
            flat[offsets] = torch.randn(view.shape, device=flat.device)  # and back
            assert torch.equal(view, flat[offsets])


def test_growth_and_shrink_keep_the_prefix(cache: ExtensibleKVCache) -> None:
    base = [view.data_ptr() for pair in cache.layer_views() for view in pair]
    written = fill(cache, 1, seed=0)
    cache.ensure_blocks(300)
    assert cache.committed_blocks == 300
    assert_prefix(cache, written, 1)
    written = fill(cache, 300, seed=1)
    cache.ensure_blocks(200)  # never shrinks
    assert cache.committed_blocks == 300
    cache.commit(120)
    assert cache.committed_blocks == 120
    assert cache.physical_bytes == cache.footprint_bytes(120)
    assert_prefix(cache, written, 120)
    cache.commit(CAPACITY)
    assert_prefix(cache, written, 120)
    assert [view.data_ptr() for pair in cache.layer_views() for view in pair] == base


@pytest.mark.parametrize("num_blocks", [-1, CAPACITY + 1])
def test_commit_outside_capacity_names_it(cache: ExtensibleKVCache, num_blocks: int) -> None:
    with pytest.raises(ValueError, match="capacity_blocks is 1000"):
        cache.commit(num_blocks)
    assert cache.committed_blocks == 1


def test_committed_views_span_the_committed_bytes(cache: ExtensibleKVCache) -> None:
    spec = cache.spec
    cache.commit(77)
    views = cache.committed_views()
    segment_bytes = CAPACITY * spec.block_stride_bytes
    base = reference(cache).data_ptr()
    for i, view in enumerate(views):
        assert view.shape == (77, *spec.block_shape)
        assert view.data_ptr() == base + i * segment_bytes
        assert view.untyped_storage().nbytes() == cache.tensor.committed_bytes
        assert view.untyped_storage().nbytes() >= 77 * spec.block_stride_bytes
    # Same memory as the kernels' views: a write through one shows through the other.
    views[-1][76].fill_(3.0)
    # The last segment holds the last head of the last layer's V in every layout here.
    v = cache.layer_views()[-1][1]
    assert torch.equal(v[76, :, -1], torch.full_like(v[76, :, -1], 3.0))


def test_release_and_recommit_keep_addresses_and_zero(cache: ExtensibleKVCache) -> None:
    cache.commit(250)
    fill(cache, 250, seed=2)
    before = cache.physical_bytes
    ptrs = [view.data_ptr() for pair in cache.layer_views() for view in pair]
    cache.release_physical()
    assert cache.physical_bytes == 0
    cache.recommit()
    assert cache.physical_bytes == before
    assert cache.committed_blocks == 250
    assert [view.data_ptr() for pair in cache.layer_views() for view in pair] == ptrs
    assert all(not view[:250].any() for pair in cache.layer_views() for view in pair)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(nbytes=st.integers(0, 12 * MiB))
def test_blocks_that_fit_is_exact(cache: ExtensibleKVCache, nbytes: int) -> None:
    n = cache.blocks_that_fit(nbytes)
    assert cache.footprint_bytes(n) <= nbytes
    assert n == CAPACITY or cache.footprint_bytes(n + 1) > nbytes
    # The footprint is what the driver really maps for that many blocks.
    cache.commit(n)
    assert cache.physical_bytes == cache.footprint_bytes(n) <= nbytes
    if n < CAPACITY:
        cache.commit(n + 1)
        assert cache.physical_bytes > nbytes


def test_granules_straddling_segments_are_counted_once(device: str) -> None:
    # head_major: 8 segments of 1000 blocks x 512 B = 512,000 B, four segments to a 2 MiB
    # granule. Whatever the prefix, the segments touch granules 0 and 1 only: 4 MiB, where
    # rounding each segment separately would claim 8 x 2 MiB.
    cache = ExtensibleKVCache(make_spec("head_major"), CAPACITY, device)
    cache.allocate()
    assert cache.granularity == 2 * MiB  # the floor, on the host and on an H200
    assert cache.footprint_bytes(1) == cache.footprint_bytes(CAPACITY) == 4 * MiB
    assert cache.blocks_that_fit(4 * MiB) == CAPACITY
    assert cache.blocks_that_fit(4 * MiB - 1) == 0
    cache.commit(CAPACITY)
    assert cache.physical_bytes == 4 * MiB
    cache.free()


def test_granule_aligned_blocks_start_and_end_segments_on_granules(device: str) -> None:
    # layer_outer: 2048 B per block per segment, so 1024 blocks fill one 2 MiB granule.
    spec = make_spec("layer_outer")
    probe = ExtensibleKVCache(spec, CAPACITY, device)
    probe.allocate()
    granule = probe.granularity
    aligned = probe.granule_aligned_blocks(3000)
    probe.free()
    assert granule == 2 * MiB
    assert aligned == 2048
    cache = ExtensibleKVCache(spec, aligned, device)
    cache.allocate()
    cache.commit(aligned, defragment=True)
    base = cache.tensor.base_ptr
    for view in cache.committed_views():
        assert (view.data_ptr() - base) % granule == 0
        assert view.untyped_storage().nbytes() % granule == 0
    assert cache.tensor.num_physical_chunks == spec.num_segments
    cache.free()


def test_an_uncut_shrink_gives_back_one_small_chunk_a_segment_beyond_its_need(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shrink that must not copy (the device out of memory) unmaps whole chunks. An elastic
    grow maps `ELASTIC_CHUNK_BYTES` over all segments at a time, and a bulk grow maps its last
    `TAIL_BYTES` so, so such a shrink near the end gives back at most one of those beyond its
    need; without the tail, a bulk grow's one large chunk a segment goes back whole."""
    # layer_outer: 2 segments of 2048 B per block; 8 MiB over both: 4 MiB chunks per segment.
    monkeypatch.setattr(cache_module, "ELASTIC_CHUNK_BYTES", 8 * MiB)
    spec, capacity, mib = make_spec("layer_outer"), 16 * 512, 512  # 16 MiB per segment
    given_back = {}
    for case, elastic, tail in (("bulk", False, 0), ("tail", False, 8 * MiB),
                                ("elastic", True, 0)):
        monkeypatch.setattr(cache_module, "TAIL_BYTES", tail)
        cache = ExtensibleKVCache(spec, capacity, device)
        cache.allocate()  # block 0: the first granule of each segment
        cache.commit(capacity, elastic=elastic)
        written = fill(cache, capacity, seed=0)
        uncut = cache.uncut_blocks(capacity - mib)  # asked: 1 MiB per segment
        before = cache.physical_bytes
        cache.commit(uncut)
        assert_prefix(cache, written, uncut)
        given_back[case] = (before - cache.physical_bytes) // spec.num_segments
        cache.free()
    # bulk: [2, 16) MiB in one chunk; tail: [2, 12) then [12, 16); elastic: 4 MiB from 2 MiB.
    assert given_back == {"bulk": 14 * MiB, "tail": 4 * MiB, "elastic": 2 * MiB}
