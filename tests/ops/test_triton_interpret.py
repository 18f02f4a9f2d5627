"""Triton kernels on tiny shapes through the Triton interpreter (no GPU needed).

Runs only with `TRITON_INTERPRET=1` set before Python starts and triton installed:
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_triton_interpret.py -q
"""

from __future__ import annotations

import math

import pytest
import torch

from kvfit.ops.reference import paged_attention_reference, write_kv_reference

pytestmark = [
    pytest.mark.interpret,
    # Empty KV splits take log2(0) = -inf on purpose; numpy warns about it.
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
]
triton_attention = pytest.importorskip("kvfit.ops.triton_attention")
triton_kv_write = pytest.importorskip("kvfit.ops.triton_kv_write")



MIXED = [(0, 5), (13, 1), (0, 1), (17, 20), (70, 1), (3, 40)]


@pytest.mark.parametrize("max_splits", [1, 3, 32])
@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_attention_kernels_match_naive(paged_batch, naive, max_splits, layout, num_heads,
                                       num_kv_heads):  # fmt: skip
    batch = paged_batch(
        MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, layout=layout
    )
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention_triton(
        batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3, out,
        max_splits=max_splits, split_tokens=16,
    )
    torch.testing.assert_close(out.double(), naive(batch, 0.3), rtol=1e-4, atol=1e-4)


def test_decode_only_batch_with_split_reduction(paged_batch):
    batch = paged_batch([(300, 1), (5, 1), (0, 1)], num_heads=4, num_kv_heads=1, head_dim=16)
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention_triton(
        batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3, out,
        max_splits=4, split_tokens=64,
    )
    expect = paged_attention_reference(
        batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3
    )
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block_size,block_n", [(32, 16), (8, 32), (16, 16), (128, 32)])
@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
def test_decode_finds_tokens_on_pages_of_any_size(paged_batch, layout, block_size, block_n):
    """The decode kernel computes a token's page and slot once per tile for K and V: tiles
    within one page, of several pages, of exactly one, whole tiles and each split's partial
    last tile, against the reference."""
    batch = paged_batch([(200, 1), (37, 1), (block_n - 1, 1), (0, 1)], num_heads=4,
                        num_kv_heads=2, head_dim=32, block_size=block_size, layout=layout)
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention_triton(
        batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3, out, max_splits=3,
        split_tokens=64, decode_config=dict(BLOCK_N=block_n, num_warps=4, num_stages=1))
    expect = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache,
                                       batch.metadata, 0.3)
    torch.testing.assert_close(out, expect, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
def test_write_kv_kernel_matches_reference(paged_batch, layout):
    batch = paged_batch([(0, 40)], num_kv_heads=2, head_dim=16, layout=layout)
    expect_k, expect_v = batch.k_cache.clone(), batch.v_cache.clone()
    key, value = torch.randn(2, 6, 2, 16)
    slots = torch.tensor([0, -1, 17, 31, -1, 45])
    write_kv_reference(key, value, expect_k, expect_v, slots)
    triton_kv_write.write_kv_triton(key, value, batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache, expect_k)
    assert torch.equal(batch.v_cache, expect_v)


# --- FP8 caches ------------------------------------------------------------------------------
# The interpreter emulates float -> e4m3 rounding in NumPy and drops the carry when a value
# rounds up into the next power of two (31.3 -> 16), so the write kernels are checked on values
# the format holds exactly (no rounding); rounding itself is checked on the GPU.


def _e4m3_values(shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """Random values e4m3 holds exactly, times a power-of-two `scale` (so x / scale is exact)."""
    codes = torch.randint(0, 256, shape, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).float()
    return torch.where(values.isnan(), 1.0, values) * scale


@pytest.mark.parametrize("compute,pairs", [(None, None), (torch.float16, False),
                                           (torch.float16, None)])
@pytest.mark.parametrize("max_splits", [1, 3])
@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
def test_attention_kernels_read_fp8_pages_with_their_scales(paged_batch, layout, max_splits,
                                                            compute, pairs):  # fmt: skip
    """Both widenings (to the query's float32 here, and to float16 with the query cast) give
    attention over the dequantised pages; float16's 11-bit query costs ~1e-3. Float16 decode
    runs both kernels: the tile one (`fp8_pairs=False`) and the default, which reads the pages
    as uint16 pairs of dims."""
    batch = paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=16, layout=layout)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.05])
    k8 = batch.k_cache.div(k_scale).to(torch.float8_e4m3fn)
    v8 = batch.v_cache.div(v_scale).to(torch.float8_e4m3fn)
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention_triton(
        batch.query, k8, v8, batch.metadata, 0.3, out, max_splits=max_splits, split_tokens=16,
        k_scale=k_scale, v_scale=v_scale, fp8_compute_dtype=compute, fp8_pairs=pairs,
    )
    expect = paged_attention_reference(batch.query, k8, v8, batch.metadata, 0.3,
                                       k_scale=k_scale, v_scale=v_scale)
    tol = 1e-4 if compute is None else 3e-3
    torch.testing.assert_close(out, expect, rtol=tol, atol=tol)
    if compute is not None:  # the query really went through float16
        assert not torch.allclose(out, expect, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernels", ["tile", "pairs", "batch_invariant"])
def test_fp8_float16_compute_keeps_queries_past_float16s_range_finite(paged_batch, kernels):
    """A bfloat16 query above 65,504 (float16's largest) became inf in the float16 cast and the
    row's output NaN. Each row is scaled by a power of two into float16's range before the
    cast (exact) and the scores by its inverse: rows of 1e5 in one dim (the softmax picks the
    keys of the largest k there), of e4m3 values x 1024 (up to 458,752) and ordinary rows, in
    prefill and decode, match attention in float32."""
    batch = paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=32)
    k8 = _e4m3_values(batch.k_cache.shape, 1.0).to(torch.float8_e4m3fn)
    v8 = _e4m3_values(batch.v_cache.shape, 1.0).to(torch.float8_e4m3fn)
    scales = dict(k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.05]))
    query = batch.query * 0.05
    query[::3] = 0.0
    query[::3, :, 5] = 1e5
    query[1::3] = _e4m3_values(query[1::3].shape, 1024.0)
    out = torch.full_like(query, float("nan"))
    triton_attention.paged_attention_triton(
        query, k8, v8, batch.metadata, 0.3, out, max_splits=3, split_tokens=16,
        fp8_compute_dtype=torch.float16, fp8_pairs=False if kernels == "tile" else None,
        batch_invariant=kernels == "batch_invariant", **scales)
    assert out.isfinite().all()
    expect = paged_attention_reference(query, k8, v8, batch.metadata, 0.3, **scales)
    torch.testing.assert_close(out, expect, rtol=3e-3, atol=3e-3)


def test_fp8_pairs_decode_splits_and_pads_like_the_tile_kernel(paged_batch):
    """The pairs kernel against the tile kernel on decode rows alone: a long row split in
    parts, a row of one token, a zero-length padded row, 4 query heads to a KV head; e4m3
    values exact in both (the two differ only in summation order)."""
    batch = paged_batch([(300, 1), (0, 1), (5, 1)], num_heads=8, num_kv_heads=2, head_dim=32)
    batch.metadata.seq_lens[1] = 0
    k8 = _e4m3_values(batch.k_cache.shape, 1.0).to(torch.float8_e4m3fn)
    v8 = _e4m3_values(batch.v_cache.shape, 1.0).to(torch.float8_e4m3fn)
    query = batch.query * 0.05
    outs = {}
    for pairs in (False, True):
        outs[pairs] = torch.full_like(query, float("nan"))
        triton_attention.paged_attention_triton(
            query, k8, v8, batch.metadata, 0.3, outs[pairs], max_splits=4, split_tokens=64,
            k_scale=torch.ones(1), v_scale=torch.ones(1), fp8_compute_dtype=torch.float16,
            fp8_pairs=pairs)
    assert torch.equal(outs[True][1], torch.zeros_like(outs[True][1]))
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-3, atol=1e-3)


ORDER_BATCH = [(300, 1), (0, 5), (5, 1), (70, 1), (0, 1), (130, 1)]


@pytest.mark.parametrize("fp8_pairs", [None, False, True])
def test_decode_order_starts_programs_in_another_order_and_changes_no_bit(paged_batch,
                                                                          fp8_pairs):
    """A `decode_order` only reorders which program starts when: every (sequence, split, KV
    head) still runs once and writes its own part, so the output is bit for bit the batch
    order's, for the tile kernel (bf16, e4m3) and the e4m3 pairs kernel, in a mixed step
    (a prefill row among the decode rows) and a split one."""
    batch = paged_batch(ORDER_BATCH, num_heads=8, num_kv_heads=2, head_dim=32)
    kw = dict(max_splits=4, split_tokens=64)
    query, k_cache, v_cache = batch.query, batch.k_cache, batch.v_cache
    if fp8_pairs is not None:
        k_cache = _e4m3_values(k_cache.shape, 1.0).to(torch.float8_e4m3fn)
        v_cache = _e4m3_values(v_cache.shape, 1.0).to(torch.float8_e4m3fn)
        query = query * 0.05
        kw.update(k_scale=torch.ones(1), v_scale=torch.ones(1), fp8_pairs=fp8_pairs,
                  fp8_compute_dtype=torch.float16)
    outs = []
    for order in (None, [5, 3, 0, 2, 4, 1], [1, 0, 2, 3, 4, 5]):
        batch.metadata.decode_order = None if order is None else torch.tensor(
            order, dtype=torch.int32)
        out = torch.full_like(query, float("nan"))
        triton_attention.paged_attention_triton(query, k_cache, v_cache, batch.metadata, 0.3,
                                                out, **kw)
        outs.append(out)
    assert not outs[0].isnan().any()
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])


def test_decode_order_holds_one_rank_per_sequence(paged_batch):
    batch = paged_batch(ORDER_BATCH, num_heads=4, num_kv_heads=2, head_dim=16)
    batch.metadata.decode_order = torch.arange(5, dtype=torch.int32)
    with pytest.raises(ValueError, match="decode_order must hold one rank per sequence"):
        triton_attention.paged_attention_triton(batch.query, batch.k_cache, batch.v_cache,
                                                batch.metadata, 0.3,
                                                torch.empty_like(batch.query))


@pytest.mark.parametrize("block_size,block_n", [(32, 16), (8, 32), (16, 16)])
def test_fp8_pairs_decode_finds_tokens_on_pages_of_any_size(paged_batch, block_size, block_n):
    """The pairs kernel computes a token's page and slot once per tile for K and V: tiles
    within one page (32 > 16), of several pages, of exactly one, in both cache layouts,
    against the tile kernel at the same tiles (e4m3 values exact in both)."""
    for layout in ("block_outermost", "head_major"):
        batch = paged_batch([(200, 1), (37, 1)], num_heads=4, num_kv_heads=2, head_dim=32,
                            block_size=block_size, layout=layout)  # fmt: skip
        k8 = _e4m3_values(batch.k_cache.shape, 1.0).to(torch.float8_e4m3fn)
        v8 = _e4m3_values(batch.v_cache.shape, 1.0).to(torch.float8_e4m3fn)
        outs = {}
        for pairs in (False, True):
            outs[pairs] = torch.full_like(batch.query, float("nan"))
            triton_attention.paged_attention_triton(
                batch.query * 0.05, k8, v8, batch.metadata, 0.3, outs[pairs], max_splits=2,
                split_tokens=64, k_scale=torch.ones(1), v_scale=torch.ones(1),
                fp8_compute_dtype=torch.float16, fp8_pairs=pairs,
                decode_config=dict(BLOCK_N=block_n, num_warps=4, num_stages=1))
        torch.testing.assert_close(outs[True], outs[False], rtol=1e-3, atol=1e-3)


def test_fp8_decode_splits_in_parts_of_equal_bytes(paged_batch):
    """An e4m3 cache's base decode parts span twice a 16-bit cache's tokens (the same bytes;
    a launch of few sequences shortens both alike); a row longer than two fp8 parts, reduced
    from its parts, matches the same kernel run unsplit (the two differ only in summation
    order)."""
    assert triton_attention.split_tokens_for(torch.float8_e4m3fn) == 2 * (
        triton_attention.split_tokens_for(torch.bfloat16))
    tokens = triton_attention.split_tokens_for(torch.float8_e4m3fn)
    batch = paged_batch([(2 * tokens + 40, 1), (7, 1)], num_heads=4, num_kv_heads=2,
                        head_dim=32)
    k8 = _e4m3_values(batch.k_cache.shape, 1.0).to(torch.float8_e4m3fn)
    v8 = _e4m3_values(batch.v_cache.shape, 1.0).to(torch.float8_e4m3fn)
    query = batch.query * 0.05
    outs = []
    for max_splits in (triton_attention.MAX_SPLITS, 1):
        outs.append(torch.full_like(query, float("nan")))
        triton_attention.paged_attention_triton(
            query, k8, v8, batch.metadata, 0.3, outs[-1], max_splits=max_splits,
            split_tokens=tokens, k_scale=torch.ones(1), v_scale=torch.ones(1),
            fp8_compute_dtype=torch.float16)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-3, atol=1e-3)


def test_fp8_pairs_needs_a_float16_computed_fp8_cache(paged_batch):
    batch = paged_batch([(3, 1)], num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(ValueError, match="fp8_pairs needs an e4m3 cache"):
        triton_attention.paged_attention_triton(
            batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3,
            torch.empty_like(batch.query), fp8_pairs=True)


def test_fp8_compute_dtype_is_float16_or_the_querys(paged_batch):
    batch = paged_batch([(0, 5)], num_heads=4, num_kv_heads=2, head_dim=16)
    k8, v8 = batch.k_cache.to(torch.float8_e4m3fn), batch.v_cache.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_compute_dtype must be float16"):
        triton_attention.paged_attention_triton(
            batch.query, k8, v8, batch.metadata, 0.3, torch.empty_like(batch.query),
            k_scale=torch.ones(1), v_scale=torch.ones(1), fp8_compute_dtype=torch.bfloat16)


def test_write_kv_kernel_quantises_with_the_scale_and_saturates(paged_batch):
    batch = paged_batch([(0, 40)], num_kv_heads=2, head_dim=16)
    k8 = torch.zeros_like(batch.k_cache, dtype=torch.float8_e4m3fn)
    v8 = torch.zeros_like(k8)
    expect_k, expect_v = k8.clone(), v8.clone()
    key, value = _e4m3_values((6, 2, 16), 0.25), _e4m3_values((6, 2, 16), 4.0)
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 112.5])  # saturate to +-448; 450 -> 448
    k_scale, v_scale = torch.tensor([0.25]), torch.tensor([4.0])
    slots = torch.tensor([0, -1, 17, 31, -1, 45])
    write_kv_reference(key, value, expect_k, expect_v, slots, k_scale, v_scale)
    triton_kv_write.write_kv_triton(key, value, k8, v8, slots, k_scale, v_scale)
    assert torch.equal(k8.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), expect_v.view(torch.uint8))
    assert k8[0, 0, 0, :3].float().tolist() == [448.0, -448.0, 448.0]


# --- head dims that are not a power of two ------------------------------------------------------


def _attend_between_sentinels(batch, batch_invariant: bool, fp8: dict | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernels' output for `batch`, written into a buffer with a row of 7s before and
    after it, the reference's); `fp8`: the cache stored as e4m3 at scales 0.02 and 0.05, these
    kernel arguments with them."""
    k_cache, v_cache, scales = batch.k_cache, batch.v_cache, {}
    if fp8 is not None:
        scales = dict(k_scale=torch.tensor([0.02]), v_scale=torch.tensor([0.05]), **fp8)
        k_cache = k_cache.div(scales["k_scale"]).to(torch.float8_e4m3fn)
        v_cache = v_cache.div(scales["v_scale"]).to(torch.float8_e4m3fn)
    query = batch.query
    padded = torch.full((query.shape[0] + 2, *query.shape[1:]), 7.0, dtype=query.dtype)
    triton_attention.paged_attention_triton(
        query, k_cache, v_cache, batch.metadata, 0.3, padded[1:-1], max_splits=3,
        split_tokens=16, batch_invariant=batch_invariant, **scales,
    )
    expect = paged_attention_reference(query, k_cache, v_cache, batch.metadata, 0.3,
                                       k_scale=scales.get("k_scale"),
                                       v_scale=scales.get("v_scale"))  # fmt: skip
    return padded, expect


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(48, 12, 4), (80, 14, 2), (96, 3, 1)])
@pytest.mark.parametrize("kernels", ["split", "batch_invariant", "fp8_tile", "fp8_pairs"])
def test_attention_kernels_pad_head_dims_that_are_not_a_power_of_two(
    paged_batch, head_dim, num_heads, num_kv_heads, kernels
):
    """Models with head_dim 48, 80 or 96 (config.json's head_dim, or hidden_size /
    num_attention_heads) run: the tiles span the next power of two, the rest masked, and no
    output is written past each head's dims (the rows around `out` keep their sentinel)."""
    batch = paged_batch([(0, 5), (20, 1), (40, 1), (0, 1), (7, 3)], num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim)  # fmt: skip
    fp8 = (dict(fp8_compute_dtype=torch.float16, fp8_pairs=kernels == "fp8_pairs")
           if kernels.startswith("fp8") else None)
    padded, expect = _attend_between_sentinels(batch, kernels == "batch_invariant", fp8)
    tol = 3e-3 if fp8 else 1e-4
    torch.testing.assert_close(padded[1:-1], expect, rtol=tol, atol=tol)
    assert (padded[0] == 7).all() and (padded[-1] == 7).all()


@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(8, 4, 4), (4, 4, 1)])
@pytest.mark.parametrize("kernels", ["split", "batch_invariant", "f16", "fp8", "fp8_f16"])
def test_attention_kernels_pad_head_dims_below_16(paged_batch, head_dim, num_heads,
                                                  num_kv_heads, kernels):  # fmt: skip
    """Tiny test models (hidden 32 over 4 heads: head_dim 8; or 4) run: tl.dot needs 16 dims,
    so the tiles span 16 and mask the rest. fp8 over float16 runs the tile kernel (the pairs
    kernel would dot over 2 or 4 pairs). A 16-bit query in float16: the interpreter has no
    bfloat16 (tests/tools/test_triton_compile.py compiles the bfloat16 kernels)."""
    dtype = torch.float16 if kernels == "f16" else torch.float32
    batch = paged_batch([(0, 5), (20, 1), (40, 1), (0, 1), (7, 3)], num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)  # fmt: skip
    fp8 = (dict(fp8_compute_dtype=torch.float16 if kernels == "fp8_f16" else None)
           if kernels.startswith("fp8") else None)
    assert triton_attention.padded_head_dim(head_dim) == 16
    padded, expect = _attend_between_sentinels(batch, kernels == "batch_invariant", fp8)
    tol = {"f16": 2e-3, "fp8_f16": 3e-3}.get(kernels, 1e-4)
    torch.testing.assert_close(padded[1:-1], expect, rtol=tol, atol=tol)
    assert (padded[0] == 7).all() and (padded[-1] == 7).all()


def test_attention_kernels_address_query_rows_past_2_pow_31_elements(paged_batch):
    """Prefill, decode and the split reduction take a row's offset in int64: in int32,
    token x row stride wraps past 2**31 elements (a 262k-token step at 64 heads x 128).
    Query and output rows sit 2**30 + 512 elements apart (virtual memory; a wrapped offset
    stays inside the allocation, so a wrapped kernel reads and writes wrong rows, no fault)."""
    batch = paged_batch([(40, 1), (3, 2), (20, 1)], num_heads=4, num_kv_heads=2, head_dim=16,
                        dtype=torch.float16)  # rows 2 (prefill) and 3 (decode) wrap  # fmt: skip
    stride = 2**30 + 512
    try:  # untouched pages cost no memory
        storage = torch.empty(2**31 + 3 * stride + 128, dtype=torch.float16)
    except RuntimeError:
        pytest.skip("no room for a 10 GiB virtual allocation")
    # Query and output rows interleave: each output row 64 elements after its query row.
    query, out = (storage[2**31 + i :].as_strided((4, 4, 16), (stride, 16, 1))
                  for i in (0, 64))  # fmt: skip
    query.copy_(batch.query)
    triton_attention.paged_attention_triton(query, batch.k_cache, batch.v_cache, batch.metadata,
                                            0.3, out, max_splits=2, split_tokens=16)
    expect = paged_attention_reference(batch.query, batch.k_cache, batch.v_cache,
                                       batch.metadata, 0.3)  # fmt: skip
    torch.testing.assert_close(out, expect, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_prefill_grid_keeps_axes_1_and_2_within_cuda_limits(paged_batch, monkeypatch,
                                                             batch_invariant):  # fmt: skip
    """A 70k-token chunk at 16 query heads per KV head is 70k query tiles of 16 rows in the
    batch-invariant mode: past the 65,535 programs CUDA allows on grid axes 1 and 2, where a
    launch fails. The tiles go on axis 0 (2**31 - 1) with the KV heads."""
    launches: list[tuple[int, ...]] = []

    class Recorder:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *args, **kwargs: launches.append(grid)

    monkeypatch.setattr(triton_attention, "_prefill_kernel", Recorder())
    monkeypatch.setattr(triton_attention, "_decode_kernel", Recorder())
    monkeypatch.setattr(triton_attention, "_reduce_splits_kernel", Recorder())
    batch = paged_batch([(0, 5), (3, 1)], num_heads=32, num_kv_heads=2, head_dim=16)
    batch.metadata.max_query_len = 70_000  # the launch reads host ints only
    triton_attention.paged_attention_triton(
        batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3,
        torch.empty_like(batch.query), prefill_config=dict(BLOCK_M=16, BLOCK_N=16),
        batch_invariant=batch_invariant,
    )
    grid = launches[0]
    assert all(n <= 65_535 for n in grid[1:])
    assert math.prod(grid) == 2 * 70_000 * 16 // 16 * 2  # every (KV head, tile, sequence)


def test_decode_split_tokens_shorten_for_a_launch_of_few_sequences():
    """A launch of few sequences splits each one finer, so that its KV heads and splits give
    every SM a program; from enough sequences on, the dtype's base. A batch padded to its
    default CUDA graph size splits as it does eager."""
    from kvfit.engine.config import _resolve_graph_sizes

    split = triton_attention.decode_split_tokens
    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    long = triton_attention.LONG_SPLIT_TOKENS
    assert split(bf16, 1, 8, 132) == triton_attention.MIN_SPLIT_TOKENS
    assert split(bf16, 64, 8, 132) == triton_attention.split_tokens_for(bf16)
    assert split(fp8, 64, 8, 132) == triton_attention.split_tokens_for(fp8)
    # 65 sequences of 8 KV heads, padded to 128: 7.8 rows per SM, started longest first,
    # split longer, as 256 are.
    assert split(bf16, 65, 8, 132) == split(bf16, 256, 8, 132) == long == 4096
    assert split(fp8, 65, 8, 132) == long
    for dtype in (bf16, fp8):
        for kv_heads in (1, 2, 4, 8, 32):
            base = triton_attention.split_tokens_for(dtype)
            tokens = [split(dtype, n, kv_heads, 132) for n in range(1, 513)]
            assert tokens == sorted(tokens)  # more sequences, never shorter splits
            assert all(triton_attention.MIN_SPLIT_TOKENS <= t <= base or t == long
                       for t in tokens)
            for n, t in enumerate(tokens, 1):
                rows = (1 << (n - 1).bit_length()) * kv_heads
                # Below the long launches, a span of the base gives every SM a program; long
                # launches have 4 rows per SM in whole parts.
                assert (t == long) == (rows >= 4 * 132)
                assert t in (triton_attention.MIN_SPLIT_TOKENS, long) or rows * base // t >= 132
            sizes = _resolve_graph_sizes(None, 512)
            for n in range(1, 513):
                padded = min(s for s in sizes if s >= n)
                assert split(dtype, padded, kv_heads, 132) == tokens[n - 1], (n, padded)


def test_split_scratch_grows_with_the_launch_so_warmup_measures_its_largest():
    """A launch of fewer sequences may split into more (sequence, split) parts than one of
    more; the scratch is allocated for `launch_parts_bound` where that is more than the
    launch's own, so the allocation grows with the sequence count and max_seq_len, and the
    warmup's launch of the most rows at max_model_len is the largest any launch makes."""
    split = triton_attention.decode_split_tokens
    num_kv_splits = triton_attention.num_kv_splits

    def parts(n, kv_heads, max_seq_len, max_splits, sms, dtype=torch.bfloat16):
        return triton_attention.launch_parts_bound(dtype, n, kv_heads, max_seq_len,
                                                   max_splits, sms)

    own = [n * num_kv_splits(1035, 32, split(torch.bfloat16, n, 8, 132)) for n in (4, 5)]
    assert own == [68, 45]  # fewer sequences, more parts: the cases the bound exists for
    own = [n * num_kv_splits(4096, 32, split(torch.bfloat16, n, 8, 132)) for n in (64, 65)]
    assert own == [512, 65]  # the base split, then parts of LONG_SPLIT_TOKENS
    assert parts(65, 8, 4096, 32, 132) == 512
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for kv_heads in (1, 4, 8, 64, 200):
            for max_seq_len in (1, 100, 1035, 4096, 131072):
                most = last = 0
                for n in range(1, 300):
                    own = n * num_kv_splits(max_seq_len, 32, split(dtype, n, kv_heads, 132))
                    alloc = max(parts(n, kv_heads, max_seq_len, 32, 132, dtype), own)
                    most = max(most, own)
                    assert alloc >= most and alloc >= last, (kv_heads, max_seq_len, n)
                    last = alloc
                longer = max(parts(299, kv_heads, 2 * max_seq_len, 32, 132, dtype),
                             299 * num_kv_splits(2 * max_seq_len, 32,
                                                 split(dtype, 299, kv_heads, 132)))
                assert longer >= last
