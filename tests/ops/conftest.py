"""Random paged batches and a naive float64 oracle shared by the ops tests, and the patch the
Triton interpreter needs under NumPy >= 2.4."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from kvfit.ops.attention import AttentionMetadata


@pytest.fixture(autouse=True)
def _scalar_index_under_numpy_2_4(monkeypatch: pytest.MonkeyPatch) -> None:
    """triton 3.6's interpreter turns scalars into ints with `int(ndarray)`, which NumPy >= 2.4
    rejects for its shape-(1,) scalars; loops with device-computed bounds need it."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton: nothing is interpreted
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: object) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    metadata: AttentionMetadata


def cache_views(
    layout: str,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V views `[num_blocks, block_size, kv_heads, head_dim]` of a cache in `layout`.

    `block_outermost` is the engine default `[blocks, layers, 2, block_size, kv_heads, dim]`
    (layer 1 of 2 is returned, so the block stride spans other layers); `head_major` stores
    `[blocks, kv_heads, block_size, dim]` per K and V.
    """
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if layout == "block_outermost":
        full = torch.randn(num_blocks, 2, 2, *shape[1:], dtype=dtype, device=device)
        return full[:, 1, 0], full[:, 1, 1]
    if layout == "head_major":
        full = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype,
                           device=device)  # fmt: skip
        return full[0].transpose(1, 2), full[1].transpose(1, 2)
    if layout == "contiguous":
        return (torch.randn(shape, dtype=dtype, device=device) for _ in range(2))
    raise ValueError(layout)


def make_paged_batch(
    seqs: list[tuple[int, int]],  # (cached prefix length, new query length) per sequence
    *,
    block_size: int = 16,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    layout: str = "block_outermost",
    device: str = "cpu",
    spare_blocks: int = 3,
) -> PagedBatch:
    """Sequences on randomly permuted cache blocks; block-table padding points at real blocks."""
    seq_lens = [p + q for p, q in seqs]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + spare_blocks
    k_cache, v_cache = cache_views(
        layout, num_blocks, block_size, num_kv_heads, head_dim, dtype, device
    )
    perm = torch.randperm(num_blocks)
    block_table = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[used : used + n]
        block_table[i, n:] = perm[-1]  # stale entries past the end must not be read
        used += n
    query_lens = torch.tensor([q for _, q in seqs])
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = query_lens.cumsum(0)
    num_tokens = int(query_start_loc[-1])
    query = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    metadata = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=block_table.to(device),
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_lens),
    )
    return PagedBatch(query, k_cache, v_cache, metadata)


def naive_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Per-sequence float64 attention, token by token through the block table."""
    md = batch.metadata
    query = batch.query.double().cpu()
    k_cache, v_cache = batch.k_cache.double().cpu(), batch.v_cache.double().cpu()
    block_size = k_cache.shape[1]
    group = query.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(query)
    starts = md.query_start_loc.tolist()
    for i, seq_len in enumerate(md.seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]]
        pos = torch.arange(seq_len)
        blocks = md.block_table[i].cpu().long()[pos // block_size]
        k = k_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)
        v = v_cache[blocks, pos % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = seq_len - len(q) + torch.arange(len(q))
        scores.masked_fill_(pos[None, :] > q_pos[:, None], float("-inf"))
        out[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


@pytest.fixture
def paged_batch():
    """Factory: `paged_batch(seqs, **shape)` -> PagedBatch (see `make_paged_batch`)."""
    torch.manual_seed(0)
    return make_paged_batch


@pytest.fixture
def naive():
    """The float64 oracle: `naive(batch, scale)` -> [num_tokens, num_heads, head_dim]."""
    return naive_attention
