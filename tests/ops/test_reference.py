"""The torch reference (the CPU path and the GPU oracle) against a naive float64 attention."""

from __future__ import annotations

import pytest
import torch

from kvfit.ops.attention import paged_attention, write_kv

MIXED = [(0, 5), (13, 1), (0, 1), (17, 20), (40, 1), (31, 33), (0, 16), (16, 1)]


@pytest.mark.parametrize("layout", ["block_outermost", "head_major", "contiguous"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_matches_naive(paged_batch, naive, layout, num_heads, num_kv_heads, block_size):
    batch = paged_batch(
        MIXED, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=32, layout=layout,
    )  # fmt: skip
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.2)
    torch.testing.assert_close(out.double(), naive(batch, 0.2), rtol=1e-5, atol=1e-5)


def test_reference_random_batches(paged_batch, naive):
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        prefixes = torch.randint(0, 70, (n,), generator=gen).tolist()
        q_lens = torch.randint(1, 40, (n,), generator=gen).tolist()
        batch = paged_batch(list(zip(prefixes, q_lens, strict=True)), num_heads=4, num_kv_heads=2)
        out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125)
        torch.testing.assert_close(out.double(), naive(batch, 0.125), rtol=1e-5, atol=1e-5)


def test_chunked_prefill_matches_full_prefill(paged_batch):
    """Rows after a cached prefix see the same context as in one full prefill (lower-right mask)."""
    full = paged_batch([(0, 50)])
    chunk = paged_batch([(30, 20)])
    chunk.k_cache.copy_(full.k_cache)
    chunk.v_cache.copy_(full.v_cache)
    chunk.metadata.block_table = full.metadata.block_table
    chunk.query.copy_(full.query[30:])
    expect = paged_attention(full.query, full.k_cache, full.v_cache, full.metadata, 0.1)
    got = paged_attention(chunk.query, chunk.k_cache, chunk.v_cache, chunk.metadata, 0.1)
    torch.testing.assert_close(got, expect[30:])


def test_out_argument_is_filled_in_place(paged_batch, naive):
    batch = paged_batch([(3, 4), (9, 1)], dtype=torch.bfloat16)
    out = torch.full_like(batch.query, float("nan"))
    ret = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.1, out=out)
    assert ret is out
    torch.testing.assert_close(out.double(), naive(batch, 0.1), rtol=2e-2, atol=2e-2)


def _kv_views(layout: str, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1 of a two-layer block-outermost cache, or K/V of a head-major cache."""
    if layout == "block_outermost":  # [blocks, layers, 2, block_size, kv_heads, dim]
        return full[:, 1, 0], full[:, 1, 1]
    return full[0].transpose(1, 2), full[1].transpose(1, 2)  # [2, blocks, kv_heads, bs, dim]


@pytest.mark.parametrize(
    "layout,shape",
    [("block_outermost", (6, 2, 2, 16, 2, 8)), ("head_major", (2, 6, 2, 16, 8))],
)
def test_write_kv_stores_slots_and_skips_padding(layout, shape):
    torch.manual_seed(0)
    full = torch.randn(shape)
    expect = full.clone()
    slots = torch.tensor([5, -1, 16 * 3 + 15, 16 * 5, -1, 17])
    key, value = torch.randn(2, len(slots), 2, 8)
    write_kv(key, value, *_kv_views(layout, full), slots)

    k_expect, v_expect = _kv_views(layout, expect)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expect[slot // 16, slot % 16] = key[i]
            v_expect[slot // 16, slot % 16] = value[i]
    assert torch.equal(full, expect)  # every other element, other layers included, untouched


def test_write_kv_rejects_mismatched_heads():
    k_cache = v_cache = torch.zeros(4, 16, 2, 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        write_kv(torch.zeros(3, 4, 8), torch.zeros(3, 4, 8), k_cache, v_cache, torch.zeros(3))


def test_attention_rejects_heads_not_multiple_of_kv_heads(paged_batch):
    batch = paged_batch([(0, 3)], num_heads=4, num_kv_heads=2)
    query = torch.zeros(3, 3, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(query, batch.k_cache, batch.v_cache, batch.metadata, 0.1)


def test_reference_ignores_garbage_past_each_sequence(paged_batch, naive):
    # Unwritten slots of reused device memory may hold NaN; a shorter sequence batched with a
    # longer one reads them as padding and must not be poisoned.
    batch = paged_batch([(3, 1), (40, 1), (2, 5), (30, 5)], spare_blocks=0)
    clean = naive(batch, 0.5)
    written = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool)
    block_size = batch.k_cache.shape[1]
    for i, n in enumerate(batch.metadata.seq_lens.tolist()):
        for pos in range(n):
            written[batch.metadata.block_table[i, pos // block_size], pos % block_size] = True
    batch.k_cache[~written] = float("nan")
    batch.v_cache[~written] = float("nan")
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.5)
    torch.testing.assert_close(out.double(), clean, rtol=1e-5, atol=1e-5)


def test_reference_batches_only_as_many_sequences_as_fit_its_group_bytes(
    paged_batch, naive, monkeypatch: pytest.MonkeyPatch,
):
    # Many decodes of one query length: batched whole, their gathered contexts would take
    # rows x the longest context; the reference splits them so each call stays in budget.
    from kvfit.ops import reference

    lengths = ([(40 + 7 * i, 1) for i in range(9)] + [(5, 3), (60, 3)]
               + [(9 + 11 * i, 2) for i in range(3)])
    batch = paged_batch(lengths, num_heads=4, num_kv_heads=2, head_dim=16)
    calls: list[tuple[int, int, int, int]] = []  # (sequences, rows, context, query length)
    attend = reference._attend_rows

    def recording(query, k, v, seq_lens, q_len, first, scale):
        calls.append((query.shape[0], query.shape[1], k.shape[2], q_len))
        return attend(query, k, v, seq_lens, q_len, first, scale)

    per_decode = 97 * 4 * (16 + 1) * 4  # the longest decode context (40 + 7 x 8 + 1)
    monkeypatch.setattr(reference, "GROUP_BYTES", 3 * per_decode)
    monkeypatch.setattr(reference, "_attend_rows", recording)
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3)
    torch.testing.assert_close(out.double(), naive(batch, 0.3), rtol=1e-5, atol=1e-5)
    assert sorted(n for n, _, _, q_len in calls if q_len == 1) == [3, 3, 3]
    # Longer queries: several sequences attend one row at a time (a decode batch's memory),
    # else each alone; all rows of several at once would hold their contexts and masks
    # together, more than a single sequence or a decode batch (what warmup measures) takes.
    assert sorted((n, rows) for n, rows, _, q_len in calls if q_len == 3) == [(1, 3), (1, 3)]
    assert [(n, rows) for n, rows, _, q_len in calls if q_len == 2] == [(3, 1), (3, 1)]
    assert all(n * context * 4 * (16 + 1) * 4 <= 3 * per_decode or n == 1
               for n, _, context, _ in calls)
