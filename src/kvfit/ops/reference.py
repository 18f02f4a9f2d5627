"""Torch reference for the cache write and paged attention: the CPU path and the GPU oracle.
Also the sort-based sampling filters, the oracle of `filter_thresholds` (tests and benchmarks
only: its float copy, sort and scatter are what the threshold search replaces)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvfit.kv_quant import dequantize_fp8, is_fp8, quantize_fp8
from kvfit.ops.sampling import temperature_divisor

if TYPE_CHECKING:
    from kvfit.ops.attention import AttentionMetadata

GROUP_BYTES = 32 << 20
"""Float32 bytes of context (tokens x query heads x head dim) one batched attention call
gathers; the reference attention's working set scales with this, not with the step."""


_CALL_WORTH_BYTES = 512 << 10
"""Float32 products (query rows x keys x heads x head dim) whose time one SDPA call's overhead
is worth on the CPU: a batch attending row by row runs about 3.5x slower per product than one
sequence at a time, so it pays only where it saves many calls over short contexts (256
prompts of 8 tokens: 2.5x faster; 32 tails at a 2k context: 3.5x slower)."""


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's K/V at its slot; slots of -1 are skipped. Any cache strides.
    An FP8 cache stores `quantize_fp8(x, scale)` (the scales are [1] float32 tensors)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = _to_cache(key[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = _to_cache(value[keep], v_cache.dtype, v_scale)


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    return quantize_fp8(x, scale) if is_fp8(dtype) else x.to(dtype)


def _from_cache(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8(x, scale, dtype) if is_fp8(x.dtype) else x.to(dtype)


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


def _gather_group(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [n, max_blocks]
    seq_lens: torch.Tensor,  # [n] int64
    dtype: torch.dtype,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[n, kv_heads, context, d]` of n sequences in `dtype`, padded with zeros to the
    longest. FP8 pages are dequantised as gathered (the group's copy, never the whole cache)."""
    context_len = int(seq_lens.max())
    cols = torch.arange(context_len, device=seq_lens.device)
    # Slots past a sequence's length were never written (garbage, possibly NaN, on reused device
    # memory); a masked score does not stop 0 * NaN from reaching the output, so zero them.
    unwritten = (cols[None, :] >= seq_lens[:, None])[:, None, :, None]  # [n, 1, context, 1]
    # The gathered tensors are fresh copies: zero them in place.
    k = _from_cache(_gather_context(k_cache, block_table, context_len), k_scale, dtype)
    v = _from_cache(_gather_context(v_cache, block_table, context_len), v_scale, dtype)
    return k.masked_fill_(unwritten, 0), v.masked_fill_(unwritten, 0)


def _attend_rows(
    query: torch.Tensor,  # [n, r, heads, d]: rows first_row .. first_row + r of each query
    k: torch.Tensor,  # [n, kv_heads, context, d] from `_gather_group`
    v: torch.Tensor,
    seq_lens: torch.Tensor,  # [n] int64
    q_len: int,
    first_row: int,
    scale: float,
) -> torch.Tensor:
    """Attention of some query rows of n sequences sharing one query length `q_len`."""
    rows = torch.arange(first_row, first_row + query.shape[1], device=query.device)
    cols = torch.arange(k.shape[2], device=query.device)
    # Lower-right aligned causal mask: query row i sits at position seq_len - q_len + i.
    last_visible = seq_lens[:, None] - q_len + rows[None, :]  # [n, r]
    mask = cols[None, None, :] <= last_visible[:, :, None]  # [n, r, context_len]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2),
        k,
        v,
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather each sequence's pages and run SDPA. Sequences of one query length are batched,
    as many at once as keep the gathered context within `GROUP_BYTES` (at least one); a batch
    of longer queries attends one row at a time over its gathered context, or, where that
    takes more calls, one sequence at a time.

    Extra memory: that of the largest decode batch (about 6 x `GROUP_BYTES`: K and V gathered,
    widened to the query heads, the scores), which a batch attending row by row also takes, or
    that of one sequence alone (its context and its [query rows, context] mask), whichever is
    more: warmup's `max_num_seqs` decodes at `max_model_len` and its longest prefill chunk
    measure both. Batching every decode of a step at once would take memory in proportion to
    rows x `max_model_len` (gigabytes on the CPU for a few hundred decodes of a 4k window);
    attending every row of a batch at once would hold many contexts and their masks together
    (many short chunks behind a shared cached prefix), a combination no warmup step makes.

    Reads the metadata on the host, so it is not CUDA-graph safe: it is the CPU path and the
    oracle for the Triton kernels.
    """
    if out is None:
        out = torch.empty_like(query)
    starts = metadata.query_start_loc.long().cpu()
    query_lens = starts[1:] - starts[:-1]
    seq_lens = metadata.seq_lens.long()
    host_lens = seq_lens.cpu()
    num_heads, head_dim = query.shape[1], query.shape[2]
    for q_len in query_lens.unique().tolist():
        if q_len == 0:
            continue
        group = (query_lens == q_len).nonzero().flatten()
        per_seq = int(host_lens[group].max()) * num_heads * (head_dim + 1) * 4
        for seqs in group.split(max(1, GROUP_BYTES // per_seq)):
            # Several sequences attend one row at a time, a decode batch's memory, where that
            # saves calls (short contexts); otherwise one sequence at a time, whole.
            n = len(seqs)
            work = n * q_len * int(host_lens[seqs].max()) * num_heads * head_dim * 4
            batched = q_len == 1 or (n > q_len and work < (n - q_len) * _CALL_WORTH_BYTES)
            for part in [seqs] if batched else seqs.split(1):
                rows_per_call = q_len if len(part) == 1 else 1
                on_device = part.to(query.device)
                k, v = _gather_group(k_cache, v_cache, metadata.block_table[on_device],
                                     seq_lens[on_device], query.dtype, k_scale, v_scale)
                for first in range(0, q_len, rows_per_call):
                    rows = (starts[part][:, None]
                            + torch.arange(first, first + rows_per_call)).to(query.device)
                    out[rows] = _attend_rows(query[rows], k, v, seq_lens[on_device], q_len,
                                             first, scale).to(out.dtype)
                del k, v  # before the next part's are gathered
    return out


def sort_filter_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """`logits / temperature` in float32 with -inf outside each row's min-p, top-k and top-p
    sets, by sorting the vocabulary (the sampler's former `apply_top_k_top_p`, plus min-p).

    On p = softmax(logits / T): min-p drops p_i < min_p * max(p), top-k keeps the k largest,
    and top-p then keeps the smallest set of the most likely survivors whose probability,
    renormalised over them, reaches top_p. Among equal logits the sort's choice is arbitrary.
    Rows with temperature <= 0 (greedy) are divided by 1 and not filtered. [N, V] float32.
    """
    sample = temperature > 0
    tempered = logits.float() / temperature_divisor(temperature)[:, None]
    vocab_size = logits.shape[-1]
    sorted_logits, order = tempered.sort(dim=-1)  # ascending: the most likely token is last
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if min_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        drop |= probs < (min_p * probs[:, -1])[:, None]
    if top_k is not None:
        drop |= torch.arange(vocab_size, device=logits.device) < (vocab_size - top_k)[:, None]
    sorted_logits.masked_fill_(drop & sample[:, None], float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = (cumulative <= (1 - top_p)[:, None]) & sample[:, None]
        outside[:, -1] = False
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(tempered).scatter_(-1, order, sorted_logits)
