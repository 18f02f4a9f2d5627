"""Torch reference for the cache write and paged attention: the CPU path and the GPU oracle."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvfit.ops.attention import AttentionMetadata


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V at its slot; slots of -1 are skipped. Any cache strides."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = value[keep].to(v_cache.dtype)


def _gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """[n, blocks] block ids -> [n, kv_heads, context_len, head_dim] contiguous tokens."""
    num_blocks = -(-context_len // cache.shape[1])
    ids = block_table[:, :num_blocks].long()
    # index_select is several times faster than advanced indexing on strided cache views.
    pages = cache.index_select(0, ids.flatten()).unflatten(0, ids.shape)
    tokens = pages.flatten(1, 2)[:, :context_len]
    return tokens.transpose(1, 2)


def _attend_group(
    query: torch.Tensor,  # [n, q_len, heads, d]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [n, max_blocks]
    seq_lens: torch.Tensor,  # [n] int64
    scale: float,
) -> torch.Tensor:
    """Attention for n sequences sharing one query length; contexts padded to the longest."""
    q_len = query.shape[1]
    context_len = int(seq_lens.max())
    rows = torch.arange(q_len, device=query.device)
    cols = torch.arange(context_len, device=query.device)
    # Slots past a sequence's length were never written (garbage, possibly NaN, on reused device
    # memory); a masked score does not stop 0 * NaN from reaching the output, so zero them.
    unwritten = (cols[None, :] >= seq_lens[:, None])[:, None, :, None]  # [n, 1, context, 1]
    k = _gather_context(k_cache, block_table, context_len).masked_fill(unwritten, 0)
    v = _gather_context(v_cache, block_table, context_len).masked_fill(unwritten, 0)
    # Lower-right aligned causal mask: query row i sits at position seq_len - q_len + i.
    last_visible = seq_lens[:, None] - q_len + rows[None, :]  # [n, q_len]
    mask = cols[None, None, :] <= last_visible[:, :, None]  # [n, q_len, context_len]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        k.to(query.dtype),
        v.to(query.dtype),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)


def paged_attention_reference(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's pages and run SDPA; sequences of equal query length run batched.

    Reads the metadata on the host, so it is not CUDA-graph safe: it is the CPU path and the
    oracle for the Triton kernels.
    """
    if out is None:
        out = torch.empty_like(query)
    starts = metadata.query_start_loc.long().cpu()
    query_lens = starts[1:] - starts[:-1]
    seq_lens = metadata.seq_lens.long()
    for q_len in query_lens.unique().tolist():
        if q_len == 0:
            continue
        seqs = (query_lens == q_len).nonzero().flatten()
        rows = (starts[seqs][:, None] + torch.arange(q_len)).to(query.device)  # [n, q_len]
        seqs = seqs.to(query.device)
        out[rows] = _attend_group(
            query[rows],
            k_cache,
            v_cache,
            metadata.block_table[seqs],
            seq_lens[seqs],
            scale,
        ).to(out.dtype)
    return out
