"""Triton decode attention with its input fused: q/k RMSNorm, neox rotary and the K/V store.

A decode step's layer otherwise runs `_attention_input_kernel` (one program per token) and then
the split decode kernel: two graph nodes, the first ~2.7 us at batch 1 on an H100 for ~16 KB
of work (docs/results/decode-profile-trigger-h100-2026-12-05.txt). Here each decode program
normalises and rotates its own query group from the QKV projection's output (a few hundred
FLOPs, repeated per split), and the program whose split ends at the step's own token also
normalises and rotates that token's key, stores its K/V at the slot, and starts its softmax
with the token from registers, so no program reads a page this launch writes. The rounding
points are `_attention_input_kernel`'s: the stored K/V are its bits, and the attention differs
from the unfused pair only in the order it sums (and rounds) the new token's term. 107
registers at head dim 128 on sm_90 (the plain decode kernel: 128), no spills.

Decode rows only (every row a query of one token) and 16-bit caches: an FP8 cache would be
read back quantised by the other path, and its decode has a kernel of its own.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvfit.ops.pdl import pdl_launch, release_late, wait_then_release
from kvfit.ops.triton_attention import (
    MAX_SPLITS,
    DecodeSplits,
    _attend_pages,
    _combine_parts,
    _decode_config,
    _decode_program,
    _decode_range,
    _num_seq_splits,
    _store_decode_out,
    decode_order_arg,
    decode_shape,
)
from kvfit.ops.triton_kv_write import slot_offset
from kvfit.ops.triton_tickets import last_to_arrive

if TYPE_CHECKING:
    from kvfit.ops.attention import AttentionMetadata


@triton.jit
def _rope_row(cos_sin_cache, positions, row, d, HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """cos and sin `[1, HEAD_DIM_P2]` at the row's position for each dim `d` (dim i and i + HALF
    share an angle); padding is 0."""
    pos = tl.load(positions + row).to(tl.int64)
    base = cos_sin_cache + pos * 2 * HALF + d % HALF
    mask = d < HEAD_DIM
    return tl.load(base, mask=mask, other=0.0), tl.load(base + HALF, mask=mask, other=0.0)


@triton.jit
def _normed_rotated(src, rows, row_mask, d, stride_d, cos, sin, norm_weight, eps,
                    HALF: tl.constexpr, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """`[R, HEAD_DIM_P2]` heads at `src + rows` (`rows` [R, 1] offsets), RMS-normalised with the
    weight when QK_NORM and neox-rotated, rounded as `_rms_norm_halves` and `_rotate_halves`
    round them. Each dim is computed with its rotate-half partner (i + HALF or i - HALF),
    loaded a second time (an L1 hit) rather than shuffled across the tile."""
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    mask = row_mask & (d < HEAD_DIM)
    x = tl.load(src + rows + d * stride_d, mask=mask, other=0.0)
    xp = tl.load(src + rows + partner * stride_d, mask=mask, other=0.0)
    a, b = x.to(tl.float32), xp.to(tl.float32)
    if QK_NORM:
        inv_rms = tl.rsqrt(tl.sum(a * a, axis=1) / HEAD_DIM + eps)[:, None]
        w = tl.load(norm_weight + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        wp = tl.load(norm_weight + partner, mask=d < HEAD_DIM, other=0.0).to(tl.float32)
        a = ((a * inv_rms).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
        b = ((b * inv_rms).to(x.dtype).to(tl.float32) * wp).to(x.dtype).to(tl.float32)
    return tl.where(d < HALF, a * cos - b * sin, a * cos + b * sin).to(x.dtype)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_input_kernel(
    q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, slot_mapping,
    k_cache, v_cache, out, part_out, part_lse, tickets,
    query_start_loc, seq_lens, block_table, decode_order,
    scale_log2, num_splits, max_splits, split_tokens,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    QK_NORM: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    TICKETS: tl.constexpr,
    ORDERED: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = True,
):  # fmt: skip
    wait_then_release(PDL, PDL_EARLY)  # first: q, k and v are the kernel before's output
    seq, kv_head, split = _decode_program(decode_order, num_splits, NUM_HEADS // QUERY_GROUP,
                                          ORDERED)
    q_row, start, end, active = _decode_range(query_start_loc, seq_lens, seq, split, max_splits,
                                              split_tokens, BLOCK_N)
    if not active:
        return
    seq_len = tl.load(seq_lens + seq)

    g = tl.arange(0, GROUP_P2)
    head = kv_head * QUERY_GROUP + g
    g_mask = g < QUERY_GROUP
    dims = tl.arange(0, HEAD_DIM_P2)
    d = dims[None, :]
    cos, sin = _rope_row(cos_sin_cache, positions, q_row, d, HALF, HEAD_DIM)
    query = _normed_rotated(q + q_row * stride_qt, head[:, None] * stride_qh, g_mask[:, None], d,
                            stride_qd, cos, sin, q_norm_weight, eps, HALF, HEAD_DIM, QK_NORM)
    # The split holding the step's own token takes it from registers, first (its key and value
    # are dead before the loop, which then holds what the plain decode kernel's does), and
    # reads the rest from the pages.
    owns_new = (end == seq_len) & (start < end)  # not an empty split past the last tile
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    if owns_new:
        row = tl.zeros([1, 1], tl.int64) + kv_head * stride_kh  # the KV head's one row
        key = _normed_rotated(k + q_row * stride_kt, row, row >= 0, d, stride_kd, cos, sin,
                              k_norm_weight, eps, HALF, HEAD_DIM, QK_NORM)  # fmt: skip
        value = tl.load(v + q_row * stride_vt + kv_head * stride_vh + d * stride_vd,
                        mask=d < HEAD_DIM, other=0.0)
        slot = tl.load(slot_mapping + q_row)
        if slot >= 0:  # a padded CUDA-graph row stores nothing
            dst = (slot_offset(slot, BLOCK_SIZE, stride_cb, stride_cs) + kv_head * stride_ch
                   + d * stride_cd)
            tl.store(k_cache + dst, key.to(k_cache.dtype.element_ty), mask=d < HEAD_DIM)
            tl.store(v_cache + dst, value.to(v_cache.dtype.element_ty), mask=d < HEAD_DIM)
        # The first term of an online softmax: its weight is exp2(0) = 1, exact in any dtype.
        m_i = tl.sum(query.to(tl.float32) * key.to(tl.float32), axis=1) * scale_log2
        l_i = tl.full([GROUP_P2], 1.0, tl.float32)
        acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32) + value.to(tl.float32)
    stop = tl.where(owns_new, end - 1, end)

    m_i, l_i, acc = _attend_pages(query, k_cache, v_cache, block_table + seq * stride_bt, start,
                                  stop, kv_head, dims, scale_log2, m_i, l_i, acc, stride_cb,
                                  stride_cs, stride_ch, stride_cd, BLOCK_SIZE, BLOCK_N,
                                  HEAD_DIM, HEAD_DIM_P2, False)  # fmt: skip

    # An empty split (or a zero-length padded sequence) has l_i == 0: emit zeros, not NaN.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    release_late(PDL, PDL_EARLY)
    part = (seq * NUM_HEADS + head) * num_splits + split
    _store_decode_out(o, dims, out, part_out, q_row, head, g_mask, part,
                      stride_ot, stride_oh, stride_od, HEAD_DIM, HEAD_DIM_P2, SPLIT)  # fmt: skip
    if SPLIT:
        tl.store(part_lse + part, m_i + tl.log2(l_i), mask=g_mask)
        if TICKETS:
            _reduce_if_last(out, part_out, part_lse, tickets, seq, kv_head, q_row,
                            _num_seq_splits(seq_len, max_splits, split_tokens), num_splits,
                            stride_ot, stride_oh, stride_od, NUM_HEADS, QUERY_GROUP, HEAD_DIM,
                            HEAD_DIM_P2, SPLITS_P2)  # fmt: skip


@triton.jit
def _reduce_if_last(out, part_out, part_lse, tickets, seq, kv_head, q_row, seq_splits,
                    num_splits, stride_ot, stride_oh, stride_od, NUM_HEADS: tl.constexpr,
                    QUERY_GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    HEAD_DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr):  # fmt: skip
    """The split reduction of one (sequence, KV head)'s query heads, by whichever of its split
    programs finishes last, instead of a kernel of its own (a graph node fewer a layer).

    Each program takes a ticket after storing its part: the acq_rel atomic releases its stores
    and acquires everyone's before it, and the one holding the last ticket reads every part
    past L1 and writes the rows. Rows are combined as `_reduce_splits_kernel` combines them
    (`_combine_parts`), so which program comes last changes no bit. It sets the counter back
    to 0 for the next launch (`last_to_arrive`): the tickets stay zero between launches,
    graph replays included."""
    if last_to_arrive(tickets, seq * (NUM_HEADS // QUERY_GROUP) + kv_head, seq_splits):
        d = tl.arange(0, HEAD_DIM_P2)
        for g in tl.static_range(QUERY_GROUP):
            head = kv_head * QUERY_GROUP + g
            o = _combine_parts(part_out, part_lse, (seq * NUM_HEADS + head) * num_splits,
                               seq_splits, HEAD_DIM, HEAD_DIM_P2, SPLITS_P2, ".cg")
            tl.store(out + q_row * stride_ot + head * stride_oh + d * stride_od,
                     o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention_input_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    max_splits: int = MAX_SPLITS,
    split_tokens: int | None = None,
) -> torch.Tensor:
    """The fused kernel behind `kvfit.ops.attention_input.decode_attention` (which validates
    the arguments and keeps the rest off this path): a decode step's attention input and its
    split decode in one launch. The split reduction rides in it where `metadata.split_tickets`
    holds a counter per (sequence, KV head) (`_reduce_if_last`), else follows as its own
    kernel. Scratch: `DecodeSplits.plan`'s, the same as `paged_attention_triton`'s decode."""
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, num_kv_heads = metadata.seq_lens.shape[0], k.shape[1]
    if num_tokens == 0 or num_seqs == 0:
        return out
    plan = DecodeSplits.plan(q, k_cache, metadata, max_splits, split_tokens)
    tickets = metadata.split_tickets
    in_kernel = (plan.split and tickets is not None
                 and tickets.numel() >= num_seqs * num_kv_heads)
    qk_norm = q_norm_weight is not None
    pdl = pdl_launch(num_tokens, q.device)
    order, ordered = decode_order_arg(metadata)
    _decode_input_kernel[(num_seqs * plan.num_splits * num_kv_heads,)](
        q, k, v, positions, cos_sin_cache.contiguous(),
        q_norm_weight.contiguous() if qk_norm else q,  # never read without QK_NORM
        k_norm_weight.contiguous() if qk_norm else k,
        eps, slot_mapping, k_cache, v_cache, out, plan.part_out, plan.part_lse,
        tickets if in_kernel else plan.part_lse,  # never read without TICKETS
        metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
        order, scale * math.log2(math.e), plan.num_splits, max_splits, plan.split_tokens,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *k_cache.stride(),
        metadata.block_table.stride(0),
        **decode_shape(num_heads, num_heads // num_kv_heads, head_dim, k_cache.shape[1]),
        HALF=head_dim // 2, SPLIT=plan.split, QK_NORM=qk_norm,
        SPLITS_P2=triton.next_power_of_2(max_splits), TICKETS=in_kernel, ORDERED=ordered,
        **_decode_config(head_dim), **pdl,
    )  # fmt: skip
    if not in_kernel:
        plan.reduce(out, metadata, max_splits, pdl)
    return out
