"""Triton paged attention: a varlen prefill kernel and a split-KV decode kernel with a reduction.

Both read K/V straight from the paged cache through the block table, with any cache strides.
Query heads of one KV group are packed into the rows of a tile, so each K/V byte is loaded once
per group. Launch shapes depend only on host ints, so both are CUDA-graph safe.

An FP8 cache (`FP8`, a constexpr: the other dtypes compile exactly as before) is dequantised in
registers: each tile is widened to the query's dtype after the load (exact: every e4m3 value is
a bf16/fp16 value; `fp8_compute_dtype=torch.float16` widens to float16 and casts the query),
and the scales are folded where they cost nothing per element, k_scale into the scores' scalar
factor and v_scale into the output's normalisation, which is the same sum as
multiplying every element by its scale. Decode over an e4m3 cache computed in float16 has its
own kernel (`_decode_fp8_pairs_kernel`), which reads the pages as 16-bit pairs of values.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kvfit.kv_quant import is_fp8
from kvfit.ops.pdl import pdl_launch, release_late, wait_then_release
from kvfit.ops.sm_count import DEFAULT_SMS, num_sms

if TYPE_CHECKING:
    from kvfit.ops.attention import AttentionMetadata

SPLIT_TOKENS = 512
"""Decode splits a sequence into parts of this many tokens (whole tiles), twice as many in an
FP8 cache (`split_tokens_for`) ..."""
MAX_SPLITS = 32
"""... and at most this many parts; longer sequences get longer parts. A launch of few
sequences splits shorter (`decode_split_tokens`).

How a sequence is split depends on its own length and the launch's sequence count rounded up
to a power of two, never on the launch's `max_seq_len`: eager decode and a CUDA graph captured
at max_model_len (its batch padded to a capture size, by default 1, 2, 4, 8, then multiples of
16: the same power of two) sum each sequence's attention in the same order, and their
greedy outputs agree exactly. Across batch sizes they need not (nor do the GEMMs'); the
deterministic mode's kernel never splits."""
MIN_SPLIT_TOKENS = 64
"""The shortest split `decode_split_tokens` makes: one tile of the decode kernel's BLOCK_N."""
LONG_LAUNCH_ROWS_PER_SM = 4
"""A launch of at least this many rows per SM (its sequences rounded up to a power of two,
times KV heads) splits sequences into parts of `LONG_SPLIT_TOKENS` ..."""
LONG_SPLIT_TOKENS = 4096
"""... since its programs start longest first (`kvfit.ops.decode_order`), several waves of
them balance without short parts, and fewer parts are fewer programs and a smaller split
reduction (none for sequences within one part). On an H100 (`bench/attention.py
--mixed-decode`, 2026-12-06, 128-256 sequences of 100-2,300 tokens) the launch took 4-6%
(bf16) and 8-12% (e4m3) less time unsplit than at the base split; started in batch order,
longer splits had lost 2-3.5% of the offline run (a few long programs ending the launch).
Offline (`bench/kv_dtype.py`, H100, 2026-12-06, alternated runs), parts of 4,096 tokens
from 4 rows per SM gave 3.3% (bf16) and 3.9% (e4m3) more output tok/s than 4x the base from
8 rows per SM. A cap in tokens rather than bytes: what bounds the launch's tail is one
program's length against the wave (one 32k sequence among short ones), whatever the dtype."""


@triton.jit
def _load_kv_tile(
    cache, block_table_row, n, n_mask, kv_head, d,
    stride_cb, stride_cs, stride_ch, stride_cd,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
):  # fmt: skip
    """[BLOCK_N, HEAD_DIM_P2] tile of tokens `n` of one sequence, gathered page by page; the
    columns past HEAD_DIM are 0."""
    block = tl.load(block_table_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    row = block * stride_cb + (n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    mask = _dims_mask(n_mask, d, HEAD_DIM, HEAD_DIM_P2)
    return tl.load(cache + row[:, None] + d[None, :] * stride_cd, mask=mask, other=0.0)


@triton.jit
def _load_kv_tiles(
    k_cache, v_cache, q, block_table_row, n, n_mask, kv_head, d,
    stride_cb, stride_cs, stride_ch, stride_cd,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    """The (K, V) tiles of tokens `n` (`_load_kv_tile`), an FP8 cache's widened to `q`'s
    dtype after the load (the scales are folded in outside the loop).

    Each tile reads the block table itself: one shared read compiled the prefill's unmasked
    loop 11 sm_90 instructions longer (and its masked one 131 shorter), untimed."""
    k = _load_kv_tile(k_cache, block_table_row, n, n_mask, kv_head, d,
                      stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE,
                      HEAD_DIM, HEAD_DIM_P2)  # fmt: skip
    v = _load_kv_tile(v_cache, block_table_row, n, n_mask, kv_head, d,
                      stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE,
                      HEAD_DIM, HEAD_DIM_P2)  # fmt: skip
    if FP8:
        k, v = k.to(q.dtype), v.to(q.dtype)
    return k, v


@triton.jit
def _dims_mask(row_mask, d, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr):
    """`[rows, HEAD_DIM_P2]` mask of a tile's real rows and dims. A head dim that is not a power
    of two, or is below 16, is padded (`padded_head_dim`); one that needs no padding compiles
    unmasked."""
    # One return: Triton's compiler (not the interpreter) also visits the statements after a
    # static `if` that returns, and refuses two returns of different shapes.
    if HEAD_DIM == HEAD_DIM_P2:
        mask = row_mask[:, None]
    else:
        mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    return mask


@triton.jit
def _f16_row_scale(q):
    """[rows] powers of two 2**e (e >= 0) that bring each row of `q` within float16's range
    (|q| / 2**e <= 2**15): 1 for any row float16 holds, so those rows compute as before. A
    bfloat16 query past 65,504 would otherwise cast to inf, and its output to NaN. Dividing by a
    power of two is exact; the scores take the factor back (`_f16_query`)."""
    amax = tl.max(tl.abs(q.to(tl.float32)), 1)  # 0 for padding rows: log2 -inf, scale 1
    return tl.exp2(tl.maximum(tl.ceil(tl.log2(amax)) - 15.0, 0.0))


@triton.jit
def _f16_query(q, scale_log2):
    """`q` cast to float16 row by row within its range (`_f16_row_scale`), and the scores'
    factor with each row's scale folded in, [rows, 1]: a per-row multiply costs what the
    scalar one did."""
    row_scale = _f16_row_scale(q)
    q = (q.to(tl.float32) * (1.0 / row_scale)[:, None]).to(tl.float16)
    return q, scale_log2 * row_scale[:, None]


@triton.jit
def _softmax_weights(s, m_i, l_i):
    """One online-softmax step over log2-scaled scores `s` (masked entries are -inf): the
    weights `p`, the factor `alpha` the accumulators scale by, and the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _scaled_weights(s, scale, m_i):
    """The weights, the accumulators' factor `alpha` and the new max of one online-softmax
    step over `s * scale[:, None]` (each row's scale > 0), the max taken before scaling: the
    same max (rounding is monotonic), one multiply per row instead of per score, and
    s * scale - max compiles to one FFMA."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale)
    return tl.exp2(s * scale[:, None] - m_new[:, None]), tl.exp2(m_i - m_new), m_new


@triton.jit
def _softmax_weights_scaled(s, scale, m_i, l_cols):
    """`_scaled_weights`, with the sum kept per column, `l_cols` [rows, cols] scaled like the
    accumulators and summed across columns once after the loop: a cross-warp reduction fewer
    per tile."""
    p, alpha, m_new = _scaled_weights(s, scale, m_i)
    return p, alpha, m_new, l_cols * alpha[:, None] + p


@triton.jit
def _softmax_update(s, v, m_i, l_i, acc):
    """`_softmax_weights`, with `acc` scaled and the weighted `v` added."""
    p, alpha, m_i, l_i = _softmax_weights(s, m_i, l_i)
    return m_i, l_i, acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _softmax_update_scaled(s, scale, v, m_i, l_i, acc):
    """`_scaled_weights` with the sum kept per row (a prefill tile's sums per column would
    take a register per score), `acc` scaled and the weighted `v` added in the dot: the
    scaling rides in the exponent's FFMA (a third of a prefill tile's FMULs)."""
    p, alpha, m_new = _scaled_weights(s, scale, m_i)
    return m_new, l_i * alpha + tl.sum(p, 1), tl.dot(p.to(v.dtype), v, acc * alpha[:, None])


# Arguments that change from step to step (block-table width, split counts) are not specialised:
# Triton would otherwise compile a new variant whenever one became 1 or a multiple of 16.
@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    query, k_cache, v_cache, out,
    query_start_loc, seq_lens, block_table,
    scale_log2, k_scale, v_scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    NUM_KV_HEADS: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    FP8_F16: tl.constexpr,
    BATCH_INVARIANT: tl.constexpr = False,
):  # fmt: skip
    # Axis 0 holds (query tile, KV head) pairs: CUDA caps axes 1 and 2 at 65,535 programs,
    # which a long chunk's tiles pass (a 64k-token chunk at 16 query heads per KV head in the
    # batch-invariant mode's 16-row tiles). Later query tiles see more keys (causal): start
    # them first, every head's before any shorter one (heads vary fastest in launch order),
    # so short tiles fill the tail.
    kv_head = tl.program_id(0) % NUM_KV_HEADS
    tile = tl.num_programs(0) // NUM_KV_HEADS - 1 - tl.program_id(0) // NUM_KV_HEADS
    seq = tl.program_id(1)
    q_start = tl.load(query_start_loc + seq).to(tl.int64)  # row * stride may pass 2**31
    q_len = (tl.load(query_start_loc + seq + 1) - q_start).to(tl.int32)
    # Single-token queries belong to the decode kernel, except in the batch-invariant mode,
    # where this kernel runs every row so a decode reduces exactly as a prefill row would.
    if (q_len < 2 - BATCH_INVARIANT) | (tile * BLOCK_M >= q_len * QUERY_GROUP):
        return
    prefix = tl.load(seq_lens + seq) - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tok = rows // QUERY_GROUP
    head = kv_head * QUERY_GROUP + rows % QUERY_GROUP
    row_mask = tok < q_len
    d = tl.arange(0, HEAD_DIM_P2)
    tile_mask = _dims_mask(row_mask, d, HEAD_DIM, HEAD_DIM_P2)
    q_ptrs = query + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_ptrs + d[None, :] * stride_qd, mask=tile_mask, other=0.0)
    pos = prefix + tok  # absolute position of each row: causal mask is lower-right aligned
    block_table_row = block_table + seq * stride_bt
    if FP8:
        scale_log2 = scale_log2 * tl.load(k_scale)
    if FP8_F16:  # the tiles follow the query's dtype: e4m3 -> f16 is one cvt per pair
        q, scale_log2 = _f16_query(q, scale_log2)
    # One factor per row, whether scale_log2 is a scalar or _f16_query's [rows, 1].
    row_scale = tl.max(tl.zeros([BLOCK_M, 1], tl.float32) + scale_log2, 1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    first_tok = tile * BLOCK_M // QUERY_GROUP
    last_tok = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // QUERY_GROUP, q_len - 1)
    # Keys up to the tile's first position are visible to every row: no causal mask there.
    # The batch-invariant mode masks every tile: whether a key tile fell in the unmasked loop
    # depends on where the query tile starts, and the two loops need not compile to the same
    # arithmetic (the compiler may fuse the scaling into the softmax in one and not the other).
    unmasked_end = 0 if BATCH_INVARIANT else (prefix + first_tok + 1) // BLOCK_N * BLOCK_N
    for n0 in range(0, unmasked_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < unmasked_end
        k, v = _load_kv_tiles(k_cache, v_cache, q, block_table_row, n, n_mask, kv_head, d,
                              stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE,
                              HEAD_DIM, HEAD_DIM_P2, FP8)  # fmt: skip
        s = tl.dot(q, tl.trans(k))
        m_i, l_i, acc = _softmax_update_scaled(s, row_scale, v, m_i, l_i, acc)
    end = prefix + last_tok + 1
    for n0 in range(unmasked_end, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k, v = _load_kv_tiles(k_cache, v_cache, q, block_table_row, n, n_mask, kv_head, d,
                              stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE,
                              HEAD_DIM, HEAD_DIM_P2, FP8)  # fmt: skip
        s = tl.where(n[None, :] <= pos[:, None], tl.dot(q, tl.trans(k)), float("-inf"))
        m_i, l_i, acc = _softmax_update_scaled(s, row_scale, v, m_i, l_i, acc)

    o = acc / l_i[:, None]
    if FP8:
        o = o * tl.load(v_scale)
    o_ptrs = out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh
    tl.store(o_ptrs + d[None, :] * stride_od, o.to(out.dtype.element_ty), mask=tile_mask)


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    query, k_cache, v_cache, out, part_out, part_lse,
    query_start_loc, seq_lens, block_table, decode_order,
    scale_log2, k_scale, v_scale, num_splits, max_splits, split_tokens,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    FP8_F16: tl.constexpr,
    ORDERED: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = True,
):  # fmt: skip
    wait_then_release(PDL, PDL_EARLY)  # first: the query is the kernel before's output
    seq, kv_head, split = _decode_program(decode_order, num_splits, NUM_HEADS // QUERY_GROUP,
                                          ORDERED)
    q_row, start, end, active = _decode_range(query_start_loc, seq_lens, seq, split, max_splits,
                                              split_tokens, BLOCK_N)
    if not active:
        return

    g = tl.arange(0, GROUP_P2)
    head = kv_head * QUERY_GROUP + g
    g_mask = g < QUERY_GROUP
    d = tl.arange(0, HEAD_DIM_P2)
    q_ptrs = query + q_row * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=_dims_mask(g_mask, d, HEAD_DIM, HEAD_DIM_P2), other=0.0)
    block_table_row = block_table + seq * stride_bt
    if FP8:
        scale_log2 = scale_log2 * tl.load(k_scale)
    if FP8_F16:
        q, scale_log2 = _f16_query(q, scale_log2)

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM_P2], tl.float32)
    m_i, l_i, acc = _attend_pages(q, k_cache, v_cache, block_table_row, start, end, kv_head, d,
                                  scale_log2, m_i, l_i, acc, stride_cb, stride_cs, stride_ch,
                                  stride_cd, BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_P2, FP8)

    # An empty split (or a zero-length padded sequence) has l_i == 0: emit zeros, not NaN.
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8:  # the split reduction is linear in o: scaling each part scales the sum
        o = o * tl.load(v_scale)
    release_late(PDL, PDL_EARLY)
    part = (seq * NUM_HEADS + head) * num_splits + split
    _store_decode_out(o, d, out, part_out, q_row, head, g_mask, part,
                      stride_ot, stride_oh, stride_od, HEAD_DIM, HEAD_DIM_P2, SPLIT)  # fmt: skip
    if SPLIT:
        tl.store(part_lse + part, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _decode_program(decode_order, num_splits, NUM_KV_HEADS: tl.constexpr,
                    ORDERED: tl.constexpr):
    """(sequence, KV head, split) of one decode program. Programs are numbered (rank, split,
    KV head), KV head fastest, so the hardware starts a sequence's programs together and the
    sequences in rank order: with `ORDERED` the rank-th is `decode_order[rank]` (longest
    parts first: `decode_order`), else the batch's rank-th row. One grid axis: a launch of
    many sequences passes no 65,535 limit."""
    pid = tl.program_id(0)
    rank = pid // (NUM_KV_HEADS * num_splits)
    seq = tl.load(decode_order + rank) if ORDERED else rank
    return seq, pid % NUM_KV_HEADS, pid // NUM_KV_HEADS % num_splits


@triton.jit
def _attend_pages(q, k_cache, v_cache, block_table_row, start, end, kv_head, d, scale_log2,
                  m_i, l_i, acc, stride_cb, stride_cs, stride_ch, stride_cd,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_P2: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """The online softmax `(m_i, l_i, acc)` of the query rows `q` carried over tokens
    [start, end) of one KV head's pages, BLOCK_N at a time."""
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k, v = _load_kv_tiles(k_cache, v_cache, q, block_table_row, n, n_mask, kv_head, d,
                              stride_cb, stride_cs, stride_ch, stride_cd, BLOCK_SIZE,
                              HEAD_DIM, HEAD_DIM_P2, FP8)  # fmt: skip
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = _softmax_update(s, v, m_i, l_i, acc)
    return m_i, l_i, acc


@triton.jit
def _decode_range(query_start_loc, seq_lens, seq, split, max_splits, split_tokens,
                  BLOCK_N: tl.constexpr):  # fmt: skip
    """(query row, first token, end token, active) of one decode program. Inactive: the row is
    not a decode row, or the split is past its sequence's own split count (the reduction never
    reads those). The split layout is a function of seq_len (read on the device) alone."""
    q_row = tl.load(query_start_loc + seq).to(tl.int64)  # row * stride may pass 2**31
    seq_len = tl.load(seq_lens + seq)
    seq_splits = _num_seq_splits(seq_len, max_splits, split_tokens)
    active = (tl.load(query_start_loc + seq + 1) - q_row == 1) & (split < seq_splits)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), seq_splits)
    start = split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
    return q_row, start, end, active


@triton.jit
def _store_decode_out(o, d, out, part_out, q_row, head, g_mask, part,
                      stride_ot, stride_oh, stride_od,
                      HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                      SPLIT: tl.constexpr):  # fmt: skip
    """Columns `d` of a program's [GROUP_P2, len(d)] output: its split's part, or the row.
    Columns at or past HEAD_DIM (padding) are not stored."""
    mask = _dims_mask(g_mask, d, HEAD_DIM, HEAD_DIM_P2)
    if SPLIT:
        tl.store(part_out + part[:, None] * HEAD_DIM + d[None, :], o, mask=mask)
    else:
        o_ptrs = out + q_row * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3x2_to_f16(x, ASM: tl.constexpr):
    """A uint16 holding two e4m3 values -> (low byte's, high byte's) as float16. `ASM`: one
    `cvt.rn.f16x2.e4m3x2` per pair (sm_89 and later); else bit operations (the interpreter).

    The asm takes two neighbouring pairs in one 32-bit register and permutes its bytes first
    (lows, then highs), so each cvt writes two low (or two high) values into one register, the
    layout a dot's operand wants: one PRMT per two pairs, where widening pair by pair took one
    PRMT per pair to regroup the halves (sm_90, a 64-token tile of dim 128: 32 PRMT, not 64)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 e, o; prmt.b32 t, $2, 0, 0x3120; mov.b32 {e, o}, t;"
            " cvt.rn.f16x2.e4m3x2 $0, e; cvt.rn.f16x2.e4m3x2 $1, o; }",
            "=r,=r,r", [x], dtype=(tl.float16, tl.float16), is_pure=True, pack=2,
        )  # fmt: skip
    lo = (x & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    hi = (x >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def _pair_rows(block_table_row, n0, offs, n_mask, kv_head, stride_cb, stride_cs, stride_ch,
               BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Offsets of the rows of tokens `n0 + offs` of one KV head, K's and V's alike, in the
    strides' unit. A tile starts at a multiple of BLOCK_N: with whole pages per tile, its
    tokens sit at the same in-page slots every iteration, and that part is loop-invariant."""
    if BLOCK_N % BLOCK_SIZE == 0:
        page = n0 // BLOCK_SIZE + offs // BLOCK_SIZE
        slot = offs % BLOCK_SIZE
    else:
        page = (n0 + offs) // BLOCK_SIZE
        slot = (n0 + offs) % BLOCK_SIZE
    # A block id is >= 0: widened as unsigned, its product with the stride needs no sign fix-up.
    block = tl.load(block_table_row + page, mask=n_mask, other=0).to(tl.uint32).to(tl.int64)
    return block * stride_cb + (slot * stride_cs + kv_head * stride_ch)


@triton.jit
def _load_pair_tile(pairs, rows, n_mask, d2, PAIRS: tl.constexpr, PAIRS_P2: tl.constexpr):
    """[BLOCK_N, PAIRS_P2] uint16 tile at `rows` of an e4m3 cache whose head dim is
    contiguous: element i holds dims 2i (low byte) and 2i + 1; 0 from pair PAIRS on."""
    mask = _dims_mask(n_mask, d2, PAIRS, PAIRS_P2)
    return tl.load(pairs + rows[:, None] + d2[None, :], mask=mask, other=0)


@triton.jit
def _fp8_pairs_step(
    state, q_even, q_odd, k_pairs, v_pairs, block_table_row, n0, end, kv_head, d2, scale_log2,
    stride_cb, stride_cs, stride_ch,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr,
    PAIRS_P2: tl.constexpr, ASM: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One tile of `_decode_fp8_pairs_kernel`: tokens n0 .. n0 + BLOCK_N into the online
    softmax `state` (m_i, l_cols, acc_even, acc_odd). Unless MASKED, every token is below `end`:
    the mask is then constant and compiles away (no per-row predicates, no -inf select)."""
    m_i, l_cols, acc_even, acc_odd = state
    offs = tl.arange(0, BLOCK_N)
    n_mask = n0 + offs < end if MASKED else offs < BLOCK_N  # unmasked: all true, folded
    rows = _pair_rows(block_table_row, n0, offs, n_mask, kv_head, stride_cb, stride_cs,
                      stride_ch, BLOCK_SIZE, BLOCK_N)  # fmt: skip
    k_even, k_odd = _e4m3x2_to_f16(_load_pair_tile(k_pairs, rows, n_mask, d2, PAIRS, PAIRS_P2),
                                   ASM)  # fmt: skip
    v_even, v_odd = _e4m3x2_to_f16(_load_pair_tile(v_pairs, rows, n_mask, d2, PAIRS, PAIRS_P2),
                                   ASM)  # fmt: skip
    s = tl.dot(q_odd, tl.trans(k_odd), tl.dot(q_even, tl.trans(k_even)))
    s = tl.where(n_mask[None, :], s, float("-inf"))
    p, alpha, m_i, l_cols = _softmax_weights_scaled(s, scale_log2, m_i, l_cols)
    p = p.to(tl.float16)
    acc_even = tl.dot(p, v_even, acc_even * alpha[:, None])
    acc_odd = tl.dot(p, v_odd, acc_odd * alpha[:, None])
    return m_i, l_cols, acc_even, acc_odd


@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_fp8_pairs_kernel(
    query, k_cache, v_cache, out, part_out, part_lse,
    query_start_loc, seq_lens, block_table, decode_order,
    scale_log2, k_scale, v_scale, num_splits, max_splits, split_tokens,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    QUERY_GROUP: tl.constexpr,
    GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    ASM: tl.constexpr,
    ORDERED: tl.constexpr = False,
    PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = True,
):  # fmt: skip
    """`_decode_kernel` over an e4m3 cache, computing in float16, that reads the cache as
    uint16 pairs of dims (2i, 2i + 1) and splits each dot by parity: q.k = q_even.k_even +
    q_odd.k_odd, and p.v fills the even and odd columns of the output in two dots.

    Why: an e4m3 tile feeding a dot is staged in shared memory as bytes, which ldmatrix cannot
    read transposed, so Triton 3.6 reads it back with scalar loads and widens it there: the
    sm_90 loop over 64 tokens compiles to 788 instructions (112 LDS, 225 IMAD) at 162
    registers, against bf16's 498 for twice the bytes. As 16-bit pairs the tile takes bf16's
    path (ldmatrix), and one cvt widens each pair: 320 instructions, 128 registers
    (`tools/triton_sass.py`). Same splits, so the same reduction order in every launch.

    The cache strides (stride_cb, stride_cs, stride_ch) count uint16 pairs: the host halves
    them (they are even, `_use_fp8_pairs`), so no row offset is divided in the loop."""
    wait_then_release(PDL, PDL_EARLY)
    seq, kv_head, split = _decode_program(decode_order, num_splits, NUM_HEADS // QUERY_GROUP,
                                          ORDERED)
    q_row, start, end, active = _decode_range(query_start_loc, seq_lens, seq, split, max_splits,
                                              split_tokens, BLOCK_N)
    if not active:
        return

    g = tl.arange(0, GROUP_P2)
    head = kv_head * QUERY_GROUP + g
    g_mask = g < QUERY_GROUP
    PAIRS: tl.constexpr = HEAD_DIM // 2
    PAIRS_P2: tl.constexpr = HEAD_DIM_P2 // 2
    d2 = tl.arange(0, PAIRS_P2)
    q_mask = _dims_mask(g_mask, d2, PAIRS, PAIRS_P2)
    q_ptrs = query + q_row * stride_qt + head[:, None] * stride_qh + 2 * d2[None, :] * stride_qd
    q_even = tl.load(q_ptrs, mask=q_mask, other=0.0)
    q_odd = tl.load(q_ptrs + stride_qd, mask=q_mask, other=0.0)
    # Each row within float16's range, as `_f16_query` (one scale for both halves of a row).
    row_scale = tl.maximum(_f16_row_scale(q_even), _f16_row_scale(q_odd))
    q_even = (q_even.to(tl.float32) * (1.0 / row_scale)[:, None]).to(tl.float16)
    q_odd = (q_odd.to(tl.float32) * (1.0 / row_scale)[:, None]).to(tl.float16)
    block_table_row = block_table + seq * stride_bt
    scale_log2 = scale_log2 * tl.load(k_scale) * row_scale  # [GROUP_P2]
    k_pairs = k_cache.to(tl.pointer_type(tl.uint16), bitcast=True)
    v_pairs = v_cache.to(tl.pointer_type(tl.uint16), bitcast=True)

    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    l_cols = tl.zeros([GROUP_P2, BLOCK_N], tl.float32)
    acc_even = tl.zeros([GROUP_P2, PAIRS_P2], tl.float32)
    acc_odd = tl.zeros([GROUP_P2, PAIRS_P2], tl.float32)
    state = m_i, l_cols, acc_even, acc_odd
    # Whole tiles first, unmasked; then the split's last partial tile (a sequence's last split
    # alone has one), masked. Tiles and their order are as in one masked loop. The tail is a
    # loop of at most one tile: Triton pipelines it like the first, and straight-line code
    # took more registers (sm_90: 140 at BLOCK_N 64 and 2 stages, against 126).
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, full_end, BLOCK_N):
        state = _fp8_pairs_step(state, q_even, q_odd, k_pairs, v_pairs, block_table_row, n0,
                                end, kv_head, d2, scale_log2, stride_cb, stride_cs, stride_ch,
                                BLOCK_SIZE, BLOCK_N, PAIRS, PAIRS_P2, ASM, False)  # fmt: skip
    for n0 in range(full_end, end, BLOCK_N):
        state = _fp8_pairs_step(state, q_even, q_odd, k_pairs, v_pairs, block_table_row,
                                n0, end, kv_head, d2, scale_log2, stride_cb, stride_cs,
                                stride_ch, BLOCK_SIZE, BLOCK_N, PAIRS, PAIRS_P2, ASM,
                                True)  # fmt: skip
    m_i, l_cols, acc_even, acc_odd = state
    l_i = tl.sum(l_cols, 1)

    # As `_decode_kernel`: zeros for an empty split; v_scale folded into the output.
    norm = tl.load(v_scale) / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    release_late(PDL, PDL_EARLY)
    part = (seq * NUM_HEADS + head) * num_splits + split
    _store_decode_out(acc_even * norm, 2 * d2, out, part_out, q_row, head, g_mask, part,
                      stride_ot, stride_oh, stride_od, HEAD_DIM, HEAD_DIM_P2, SPLIT)  # fmt: skip
    _store_decode_out(acc_odd * norm, 2 * d2 + 1, out, part_out, q_row, head, g_mask, part,
                      stride_ot, stride_oh, stride_od, HEAD_DIM, HEAD_DIM_P2, SPLIT)  # fmt: skip
    if SPLIT:
        tl.store(part_lse + part, m_i + tl.log2(l_i), mask=g_mask)


@triton.jit
def _num_seq_splits(seq_len, max_splits, split_tokens):
    return tl.maximum(tl.minimum(tl.cdiv(seq_len, split_tokens), max_splits), 1)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out, part_out, part_lse, query_start_loc, seq_lens,
    num_splits, max_splits, split_tokens,
    stride_ot, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = True,
):  # fmt: skip
    """One (sequence, query head): its splits' parts weighted by their log-sum-exps.

    All of a sequence's parts are read at once, as a [SPLITS_P2, HEAD_DIM_P2] tile: one round
    trip to L2, where a loop over them took one per split (at 17-32 splits, what the finer
    splits of a launch of few sequences make, the loop was longer than the decode itself).
    The tile is `max_splits` wide rounded up to a power of two, a constant of the engine, not
    the launch's split count: a tree reduction's order follows its width, so a row sums its
    parts in one order whatever `max_seq_len` the launch had (eager and graphs agree).
    Splits past the sequence's own are masked to a weight of 0."""
    wait_then_release(PDL, PDL_EARLY)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc + seq).to(tl.int64)  # row * stride may pass 2**31
    if tl.load(query_start_loc + seq + 1) - q_row != 1:
        return
    seq_splits = _num_seq_splits(tl.load(seq_lens + seq), max_splits, split_tokens)
    o = _combine_parts(part_out, part_lse, (seq * NUM_HEADS + head) * num_splits, seq_splits,
                       HEAD_DIM, HEAD_DIM_P2, SPLITS_P2, "")
    release_late(PDL, PDL_EARLY)
    d = tl.arange(0, HEAD_DIM_P2)
    o_ptrs = out + q_row * stride_ot + head * stride_oh + d * stride_od
    tl.store(o_ptrs, o.to(out.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _combine_parts(part_out, part_lse, base, seq_splits, HEAD_DIM: tl.constexpr,
                   HEAD_DIM_P2: tl.constexpr, SPLITS_P2: tl.constexpr,
                   CACHE: tl.constexpr):  # fmt: skip
    """One row's output [HEAD_DIM_P2] from its `seq_splits` parts at `base`: each weighted by
    its log-sum-exp, as one [SPLITS_P2, HEAD_DIM_P2] tile. `CACHE`: the loads' cache modifier
    ("" as the JIT picks; ".cg" past L1, for parts other SMs wrote during this launch)."""
    d = tl.arange(0, HEAD_DIM_P2)
    s = tl.arange(0, SPLITS_P2)
    s_mask = s < seq_splits
    lse = tl.load(part_lse + base + s, mask=s_mask, other=float("-inf"), cache_modifier=CACHE)
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # 0 for masked and empty splits
    parts = tl.load(part_out + (base + s)[:, None] * HEAD_DIM + d[None, :],
                    mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0,
                    cache_modifier=CACHE)  # fmt: skip
    acc = tl.sum(w[:, None] * parts, axis=0)
    return acc / tl.maximum(tl.sum(w, axis=0), 1e-30)


def split_tokens_for(kv_dtype: torch.dtype) -> int:
    """Tokens per decode split in a cache of `kv_dtype`: parts of equal bytes. 512 tokens was
    the 16-bit sweep's choice; an e4m3 token is half the bytes, and its sweep favours 1,024
    (H200, `bench/attention.py --sweep --kv-cache-dtype fp8`, 2026-12-05: 64 x 4,096 decode
    0.178 ms at 1,024 tokens against 0.188 at 512, one 32k sequence 0.049 against 0.048-0.052).
    A launch of few sequences shortens it (`decode_split_tokens`)."""
    return SPLIT_TOKENS * 2 if is_fp8(kv_dtype) else SPLIT_TOKENS


@functools.cache  # on every attention call of an eager step: keep its host time off the step
def decode_split_tokens(kv_dtype: torch.dtype, num_seqs: int, num_kv_heads: int,
                        sms: int = DEFAULT_SMS) -> int:
    """Tokens per decode split for a launch of `num_seqs` sequences of `num_kv_heads` KV heads
    on `sms` SMs: `split_tokens_for` the dtype, divided (by a power of two, down to
    `MIN_SPLIT_TOKENS`) until each such span of a sequence gives every SM a program.

    Why: one program reads one split of one KV head, its tiles one after the other, each
    paced by a DRAM round trip. At batch 1 (8 KV heads, 1k tokens) 512-token splits made 24
    programs for 132 SMs, and the kernel took 12.3 us for 4.2 MB (H100, `bench/throughput.py
    --profile-decode`, 2026-12-05): 1/9 of copy bandwidth, a quarter of the 0.6B shape's
    batch-1 step. A launch of enough rows to give every SM a program at the base keeps it,
    until it holds `LONG_LAUNCH_ROWS_PER_SM` rows per SM (65 sequences and more at 8 KV heads
    on 132 SMs): then its splits are `LONG_SPLIT_TOKENS` long. The count is rounded up to a
    power of two so that a batch padded to its CUDA graph's size splits as it would eager
    (`MAX_SPLITS`)."""
    base = tokens = split_tokens_for(kv_dtype)
    rows = triton.next_power_of_2(max(1, num_seqs)) * num_kv_heads
    if rows >= LONG_LAUNCH_ROWS_PER_SM * sms:
        return max(base, LONG_SPLIT_TOKENS)
    while tokens > MIN_SPLIT_TOKENS and rows * (base // tokens) < sms:
        tokens //= 2
    return tokens


def launch_parts_bound(kv_dtype: torch.dtype, num_seqs: int, num_kv_heads: int,
                       max_seq_len: int, max_splits: int = MAX_SPLITS,
                       sms: int = DEFAULT_SMS) -> int:
    """The most (sequence, split) parts a decode launch of at most `num_seqs` sequences at this
    `max_seq_len` can make with `decode_split_tokens`' splits; the split scratch is allocated
    for this many parts where the launch's own are fewer.

    Memory: the scratch takes 4 bytes x heads x (head_dim + 1) a part, for max(this bound,
    num_seqs x splits). A launch of fewer sequences may split into more parts (4 sequences
    of 8 KV heads split 1k tokens 17 ways, 5 sequences 9 ways: 68 parts against 45; 64
    sequences split 4k tokens at the base, 8 ways, 65 into `LONG_SPLIT_TOKENS`, 1 way), so the
    launch's own count alone does not grow with `num_seqs` and warmup's step of the most rows
    would not meet the largest scratch. Launches of at most `short` sequences split below the
    base, each sequence into at most `num_kv_splits(max_seq_len, max_splits,
    MIN_SPLIT_TOKENS)` parts; launches of at most `based` at the base; longer launches split
    longer still. Each regime's most parts grow with `num_seqs`, so the bound, their maximum,
    grows with `num_seqs` and `max_seq_len`, and warmup's launch of the most rows at
    `max_model_len` measures every launch's."""
    short = _most_seqs_under(num_kv_heads, sms)
    based = _most_seqs_under(num_kv_heads, LONG_LAUNCH_ROWS_PER_SM * sms)
    return max(min(num_seqs, short) * num_kv_splits(max_seq_len, max_splits, MIN_SPLIT_TOKENS),
               min(num_seqs, based) * num_kv_splits(max_seq_len, max_splits,
                                                    split_tokens_for(kv_dtype)))


@functools.cache
def _most_seqs_under(num_kv_heads: int, rows: int) -> int:
    """The largest power of two of sequences whose KV heads make fewer than `rows` rows (0
    when none does): the most a launch may have and stay in the regime below `rows`."""
    most = 0
    while max(1, 2 * most) * num_kv_heads < rows:
        most = max(1, 2 * most)
    return most


def num_kv_splits(max_seq_len: int, max_splits: int = MAX_SPLITS,
                  split_tokens: int = SPLIT_TOKENS) -> int:
    """Split programs to launch per sequence: enough for the longest sequence the launch may
    see (host ints only: under a CUDA graph `max_seq_len` is the capture-time bound)."""
    return max(1, min(max_splits, -(-max_seq_len // split_tokens)))


def padded_head_dim(head_dim: int) -> int:
    """Dims a tile spans: a power of two (tl.arange's lengths are) and at least 16 (tl.dot's
    compiler, not the interpreter, refuses K < 16: a tiny model's head_dim 8 or 4 otherwise
    fails at its first GPU step). The dims past `head_dim` are masked."""
    return max(16, triton.next_power_of_2(head_dim))


def _use_fp8_pairs(requested: bool | None, k_cache: torch.Tensor, computes_f16: bool) -> bool:
    """Whether decode runs `_decode_fp8_pairs_kernel`: an e4m3 cache computed in float16 whose
    head dim is contiguous and even, at even strides (its dim pairs are then whole uint16
    words), and above 16: each dot spans half the padded head dim, and tl.dot's compiler
    (not the interpreter) refuses K < 16."""
    even = all(s % 2 == 0 for s in k_cache.stride()[:3]) and k_cache.shape[3] % 2 == 0
    possible = (computes_f16 and is_fp8(k_cache.dtype) and k_cache.stride(3) == 1 and even
                and k_cache.shape[3] > 16)
    if requested and not possible:
        raise ValueError("fp8_pairs needs an e4m3 cache with a contiguous, even head dim above "
                         "16, computed in float16")
    return possible and requested is not False


def _has_e4m3x2_cvt(device: torch.device) -> bool:
    """PTX's cvt.rn.f16x2.e4m3x2 needs sm_89 or later (Ada, Hopper); the interpreter has none."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


# Tile configs: the best of `bench/attention.py --sweep` on an H200 (bf16, 32/8 heads, dim 128).
def _prefill_config(head_dim: int) -> dict[str, int]:
    if head_dim <= 128:
        return dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=32, num_warps=8, num_stages=2)


def _batch_invariant_config(head_dim: int) -> dict[str, int]:
    """The mode's one config, for every row (prefill and decode alike). BLOCK_M 16: a decode
    row's tile holds its query group alone, and in a bigger tile the rest is padding. The
    mode's decode at 256 x 1k context runs 0.93x the split-KV default at BLOCK_M 16, 1.12x at
    64, 1.96x at 128; its prefill (8 x 1k) 2.26x, 0.95x and 1.08x (`bench/attention.py
    --batch-invariant`, H200, 2026-12-04). Decode steps carry 98% of the offline workload's
    attention time (its profile, same day), so the small tile wins; long prompts pay for it.
    Four warps: a 16-row tile has no rows for more."""
    return dict(_prefill_config(head_dim), BLOCK_M=16, num_warps=4)


def _decode_config(head_dim: int) -> dict[str, int]:
    if head_dim <= 128:
        return dict(BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_N=32, num_warps=4, num_stages=2)


def decode_block_n(head_dim: int) -> int:
    """Tokens per tile of the decode kernels at their default config."""
    return _decode_config(head_dim)["BLOCK_N"]


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    max_splits: int = MAX_SPLITS,
    split_tokens: int | None = None,
    prefill_config: dict[str, int] | None = None,
    decode_config: dict[str, int] | None = None,
    batch_invariant: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    fp8_compute_dtype: torch.dtype | None = None,
    fp8_pairs: bool | None = None,
) -> torch.Tensor:
    """Launch the prefill kernel (query length > 1) and the decode kernel (query length 1).

    Decode splits a sequence of n tokens into min(max_splits, ceil(n / split_tokens)) parts
    (default `decode_split_tokens` for the cache's dtype and the launch's sequences).
    The split settings and tile configs override the defaults (tests and `bench/attention.py
    --sweep` use them). An FP8 cache is read with the [1] float32 scales (on the device).
    `fp8_compute_dtype` is the 16-bit dtype its tiles widen to for the dots (default the
    query's); float16 casts the query once per program and widens e4m3 in one conversion per
    pair of values instead of bf16's several (`bench/attention.py --sweep --kv-cache-dtype
    fp8` times both). float16 holds every e4m3 value exactly; a query row past its range
    (65,504) is cast scaled by a power of two, which the row's scores take back.
    `fp8_pairs`: decode over such a float16-computed e4m3 cache runs `_decode_fp8_pairs_kernel`
    (None: wherever the head dim is contiguous, even and above 16; False: `_decode_kernel`,
    for timing).

    `batch_invariant`: the prefill kernel alone runs every row (decodes too), each over key
    tiles of BLOCK_N from key 0 with the causal mask on every tile: no split-KV, so a row's
    reduction order is fixed by its position alone. No scratch memory.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    num_seqs = metadata.seq_lens.shape[0]
    fp8 = is_fp8(k_cache.dtype)
    if fp8_compute_dtype not in (None, query.dtype, torch.float16):
        raise ValueError(f"fp8_compute_dtype must be float16 or the query's dtype "
                         f"({query.dtype}), got {fp8_compute_dtype}")
    fp8_f16 = fp8 and fp8_compute_dtype == torch.float16 and query.dtype != torch.float16
    if k_cache.stride() != v_cache.stride() or (query.dtype != k_cache.dtype and not fp8):
        raise ValueError(
            "k_cache and v_cache must share strides and the query's dtype (or be FP8); got "
            f"strides {k_cache.stride()} / {v_cache.stride()}, dtypes {query.dtype} / "
            f"{k_cache.dtype}"
        )
    # Unread unless FP8: any pointer will do.
    k_scale, v_scale = (k_scale, v_scale) if fp8 else (metadata.seq_lens, metadata.seq_lens)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    dims = dict(HEAD_DIM=head_dim, HEAD_DIM_P2=padded_head_dim(head_dim))
    scale_log2 = scale * math.log2(math.e)
    common = (
        *query.stride(), *out.stride(), *k_cache.stride(), metadata.block_table.stride(0),
    )  # fmt: skip
    if metadata.max_query_len > 1 or batch_invariant:
        cfg = prefill_config or (_batch_invariant_config if batch_invariant
                                 else _prefill_config)(head_dim)
        tiles = triton.cdiv(metadata.max_query_len * group, cfg["BLOCK_M"])
        _prefill_kernel[(num_kv_heads * tiles, num_seqs)](
            query, k_cache, v_cache, out,
            metadata.query_start_loc, metadata.seq_lens, metadata.block_table,
            scale_log2, k_scale, v_scale, *common,
            NUM_KV_HEADS=num_kv_heads, QUERY_GROUP=group, **dims, BLOCK_SIZE=block_size,
            FP8=fp8, FP8_F16=fp8_f16,
            BATCH_INVARIANT=batch_invariant, **cfg,
        )  # fmt: skip
    if batch_invariant:
        return out
    plan = DecodeSplits.plan(query, k_cache, metadata, max_splits, split_tokens)
    grid = (num_seqs * plan.num_splits * num_kv_heads,)
    pdl = pdl_launch(num_tokens, query.device)
    order, ordered = decode_order_arg(metadata)
    args = (query, k_cache, v_cache, out, plan.part_out, plan.part_lse,
            metadata.query_start_loc, metadata.seq_lens, metadata.block_table, order,
            scale_log2, k_scale, v_scale, plan.num_splits, max_splits,
            plan.split_tokens)  # fmt: skip
    shape = dict(decode_shape(num_heads, group, head_dim, block_size), SPLIT=plan.split,
                 ORDERED=ordered,
                 **(decode_config or _decode_config(head_dim)))  # fmt: skip
    if _use_fp8_pairs(fp8_pairs, k_cache, fp8_f16 or (fp8 and query.dtype == torch.float16)):
        _decode_fp8_pairs_kernel[grid](
            *args, *query.stride(), *out.stride(), *(s // 2 for s in k_cache.stride()[:3]),
            metadata.block_table.stride(0), ASM=_has_e4m3x2_cvt(query.device), **shape, **pdl,
        )  # fmt: skip
    else:
        _decode_kernel[grid](*args, *common, FP8=fp8, FP8_F16=fp8_f16, **shape, **pdl)
    plan.reduce(out, metadata, max_splits, pdl)
    return out


def decode_order_arg(metadata: AttentionMetadata) -> tuple[torch.Tensor, bool]:
    """The decode kernels' `decode_order` argument and their ORDERED flag: the metadata's order,
    checked to hold one rank per sequence, or any int32 tensor (unread) where it has none."""
    order, num_seqs = metadata.decode_order, metadata.seq_lens.shape[0]
    if order is None:
        return metadata.seq_lens, False
    if order.shape != (num_seqs,):
        raise ValueError(f"decode_order must hold one rank per sequence ({num_seqs}), got "
                         f"shape {tuple(order.shape)}")
    return order, True


def decode_shape(num_heads: int, group: int, head_dim: int, block_size: int) -> dict[str, int]:
    """The constexprs every decode kernel takes from the model's and cache's shapes."""
    return dict(NUM_HEADS=num_heads, QUERY_GROUP=group,
                GROUP_P2=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
                HEAD_DIM_P2=padded_head_dim(head_dim), BLOCK_SIZE=block_size)


@dataclass(frozen=True)
class DecodeSplits:
    """One decode launch's split of each sequence and the scratch its parts go to."""

    num_splits: int  # split programs per sequence (the grid's third axis)
    split_tokens: int
    part_out: torch.Tensor  # [num_seqs * num_heads * num_splits * head_dim] float32
    part_lse: torch.Tensor  # [num_seqs * num_heads * num_splits] float32

    @property
    def split(self) -> bool:
        return self.num_splits > 1

    @classmethod
    def plan(cls, query: torch.Tensor, k_cache: torch.Tensor, metadata: AttentionMetadata,
             max_splits: int, split_tokens: int | None) -> DecodeSplits:
        """`split_tokens` (default `decode_split_tokens`) and the launch's split count; the
        scratch, `launch_parts_bound` long at the least, so warmup's largest launch measures
        every launch's (graph safe: its shapes come from host ints)."""
        num_seqs, (num_heads, head_dim) = metadata.seq_lens.shape[0], query.shape[1:]
        parts = 0  # beyond this launch's own: none where split_tokens is given (tests, sweeps)
        if split_tokens is None:
            sms = num_sms(query.device)
            split_tokens = decode_split_tokens(k_cache.dtype, num_seqs, k_cache.shape[2], sms)
            parts = launch_parts_bound(k_cache.dtype, num_seqs, k_cache.shape[2],
                                       metadata.max_seq_len, max_splits, sms)
        num_splits = num_kv_splits(metadata.max_seq_len, max_splits, split_tokens)
        used = num_seqs * num_splits if num_splits > 1 else 0
        parts = max(parts, used) if used else 0
        # The launch uses the first num_seqs * num_splits parts of each.
        part_out = torch.empty(parts * num_heads * head_dim, dtype=torch.float32,
                               device=query.device)[: used * num_heads * head_dim]
        part_lse = torch.empty(parts * num_heads, dtype=torch.float32,
                               device=query.device)[: used * num_heads]
        return cls(num_splits, split_tokens, part_out, part_lse)

    def reduce(self, out: torch.Tensor, metadata: AttentionMetadata, max_splits: int,
               pdl: dict[str, bool]) -> None:
        """Combine the parts into `out` (nothing to do for a launch of one split)."""
        if not self.split:
            return
        num_seqs, (num_heads, head_dim) = metadata.seq_lens.shape[0], out.shape[1:]
        _reduce_splits_kernel[(num_seqs, num_heads)](
            out, self.part_out, self.part_lse, metadata.query_start_loc, metadata.seq_lens,
            self.num_splits, max_splits, self.split_tokens, *out.stride(),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_P2=padded_head_dim(head_dim),
            SPLITS_P2=triton.next_power_of_2(max_splits), **pdl,
        )  # fmt: skip
