"""Triton kernel for the attention input: q/k RMSNorm, neox rotary and the K/V cache store fused.

One program per token handles all its heads. It replaces up to four launches per layer
(`q_norm`, `k_norm`, rotary, `write_kv`); each launch costs host time in eager steps and a node
in every decode CUDA graph. The rounding points are those of the unfused kernels in
`triton_layers.py` and `triton_kv_write.py`, so results match them. Launch shape comes from
tensor shapes only and nothing is read back or allocated per value: graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfit.kv_quant import is_fp8
from kvfit.ops.pdl import pdl_launch, release_late, wait_then_release
from kvfit.ops.triton_kv_write import slot_offset, to_cache
from kvfit.ops.triton_layers import (
    _cos_sin,
    _load_halves,
    _num_warps,
    _rotate_halves,
    _store_halves,
)


@triton.jit
def _rms_norm_halves(x1, x2, weight, eps, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """Per-head RMSNorm, rounded like `_rms_norm_kernel`: normalise in fp32, round to x's dtype,
    scale by the weight in fp32, round again."""
    d = tl.arange(0, HALF_P2)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
    a = (a * inv_rms[:, None]).to(x1.dtype).to(tl.float32)
    b = (b * inv_rms[:, None]).to(x2.dtype).to(tl.float32)
    w1 = tl.load(weight + d, mask=d < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(weight + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    return (a * w1).to(x1.dtype), (b * w2).to(x2.dtype)


@triton.jit
def _attention_input_kernel(
    positions, cos_sin_cache, q, k, v, q_norm_weight, k_norm_weight, eps,
    k_cache, v_cache, slot_mapping, q_out, k_scale, v_scale,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    block_size,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_P2: tl.constexpr,
    KV_HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = True,
):  # fmt: skip
    wait_then_release(PDL, PDL_EARLY)  # first: q, k and v are the kernel before's output
    token = tl.program_id(0).to(tl.int64)  # token * row stride may pass 2**31
    cos, sin = _cos_sin(cos_sin_cache, positions, token, HALF, HALF_P2)

    q1, q2 = _load_halves(q, token, stride_qt, stride_qh, stride_qd,
                          NUM_HEADS, HEADS_P2, HALF, HALF_P2)  # fmt: skip
    if QK_NORM:
        q1, q2 = _rms_norm_halves(q1, q2, q_norm_weight, eps, HALF, HALF_P2)
    q1, q2 = _rotate_halves(q1, q2, cos, sin)
    release_late(PDL, PDL_EARLY)
    _store_halves(q_out, token, q1, q2, NUM_HEADS, HEADS_P2, HALF, HALF_P2)

    slot = tl.load(slot_mapping + token)
    if slot < 0:  # padded CUDA-graph slot: its K/V are not stored, so not computed either
        return
    k1, k2 = _load_halves(k, token, stride_kt, stride_kh, stride_kd,
                          NUM_KV_HEADS, KV_HEADS_P2, HALF, HALF_P2)  # fmt: skip
    if QK_NORM:
        k1, k2 = _rms_norm_halves(k1, k2, k_norm_weight, eps, HALF, HALF_P2)
    k1, k2 = _rotate_halves(k1, k2, cos, sin)
    v1, v2 = _load_halves(v, token, stride_vt, stride_vh, stride_vd,
                          NUM_KV_HEADS, KV_HEADS_P2, HALF, HALF_P2)  # fmt: skip
    h = tl.arange(0, KV_HEADS_P2)[:, None]
    mask = (h < NUM_KV_HEADS) & (tl.arange(0, HALF_P2)[None, :] < HALF)
    dst = slot_offset(slot, block_size, stride_cb, stride_cs) + h * stride_ch
    _store_kv_halves(k_cache, dst, k1, k2, k_scale, mask, stride_cd, HALF, HALF_P2, FP8)
    _store_kv_halves(v_cache, dst, v1, v2, v_scale, mask, stride_cd, HALF, HALF_P2, FP8)


@triton.jit
def _store_kv_halves(cache, dst, x1, x2, scale, mask, stride_cd, HALF: tl.constexpr,
                     HALF_P2: tl.constexpr, FP8: tl.constexpr):  # fmt: skip
    """Both rotate-half halves `[R, HALF_P2]` into `cache` as it stores them (`to_cache`),
    each row's head starting at offset `dst` `[R, 1]`."""
    lo = dst + tl.arange(0, HALF_P2)[None, :] * stride_cd
    tl.store(cache + lo, to_cache(x1, scale, cache, FP8), mask=mask)
    tl.store(cache + lo + HALF * stride_cd, to_cache(x2, scale, cache, FP8), mask=mask)


@triton.jit
def _store_kv_rows(cache, x1, x2, scale, slots, kv_head, mask, stride_cb, stride_cs, stride_ch,
                   stride_cd, block_size, HALF: tl.constexpr, HALF_P2: tl.constexpr,
                   FP8: tl.constexpr):  # fmt: skip
    """Both halves `[ROWS, HALF_P2]` of one KV head of each row at the row's cache slot; rows
    of slot -1 (a graph's padding) and masked rows store nothing."""
    dst = slot_offset(slots, block_size, stride_cb, stride_cs)[:, None]
    _store_kv_halves(cache, dst + kv_head * stride_ch, x1, x2, scale,
                     mask & (slots >= 0)[:, None], stride_cd, HALF, HALF_P2, FP8)


@triton.jit
def attention_input_epilogue(
    qkv, head, M, N, positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps,
    k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_cb, stride_cs, stride_ch, stride_cd, block_size,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    QK_NORM: tl.constexpr,
    FP8: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """The attention input of one head of a QKV projection's output `qkv` [M, N] (q heads,
    then k, then v; M <= ROWS), run by the projection's own kernel once the head's columns are
    stored (`triton_skinny`'s epilogue): a q head normalised and rotated in place, a k head
    normalised, rotated and stored at each row's slot, a v head stored. The rounding points
    are `_attention_input_kernel`'s, on the same rounded projection. The head's columns were
    written by other programs of this launch: read past L1 (".cg"), after the ticket that
    made them visible."""
    rm = tl.arange(0, ROWS)
    d = tl.arange(0, HALF_P2)[None, :]
    mask = (rm < M)[:, None] & (d < HALF)
    src = qkv + rm.to(tl.int64)[:, None] * N + head * 2 * HALF + d
    x1 = tl.load(src, mask=mask, other=0.0, cache_modifier=".cg")
    x2 = tl.load(src + HALF, mask=mask, other=0.0, cache_modifier=".cg")
    slots = tl.load(slot_mapping + rm, mask=rm < M, other=-1)
    if head >= NUM_HEADS + NUM_KV_HEADS:
        _store_kv_rows(v_cache, x1, x2, v_scale, slots, head - NUM_HEADS - NUM_KV_HEADS, mask,
                       stride_cb, stride_cs, stride_ch, stride_cd, block_size, HALF, HALF_P2,
                       FP8)  # fmt: skip
    else:
        pos = tl.load(positions + rm, mask=rm < M, other=0).to(tl.int64)
        row = cos_sin_cache + pos[:, None] * 2 * HALF + d
        cos = tl.load(row, mask=mask, other=0.0)
        sin = tl.load(row + HALF, mask=mask, other=0.0)
        if head < NUM_HEADS:
            if QK_NORM:
                x1, x2 = _rms_norm_halves(x1, x2, q_norm_weight, eps, HALF, HALF_P2)
            x1, x2 = _rotate_halves(x1, x2, cos, sin)
            tl.store(src, x1, mask=mask)
            tl.store(src + HALF, x2, mask=mask)
        else:
            if QK_NORM:
                x1, x2 = _rms_norm_halves(x1, x2, k_norm_weight, eps, HALF, HALF_P2)
            x1, x2 = _rotate_halves(x1, x2, cos, sin)
            _store_kv_rows(k_cache, x1, x2, k_scale, slots, head - NUM_HEADS, mask, stride_cb,
                           stride_cs, stride_ch, stride_cd, block_size, HALF, HALF_P2,
                           FP8)  # fmt: skip


def attention_input_triton(
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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused kernel behind `kvfit.ops.attention_input` (which validates the arguments).

    Returns the normalised, rotated q as a new contiguous `[T, num_heads, head_dim]`. An FP8
    cache stores k (rounded to q's dtype after rope, as unfused) quantised with the scales.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    qk_norm = q_norm_weight is not None
    half = head_dim // 2
    heads_p2 = triton.next_power_of_2(num_heads)
    fp8 = is_fp8(k_cache.dtype)
    _attention_input_kernel[(num_tokens,)](
        positions, cos_sin_cache.contiguous(), q, k, v,
        q_norm_weight.contiguous() if qk_norm else q,  # never read without QK_NORM
        k_norm_weight.contiguous() if qk_norm else k,
        eps, k_cache, v_cache, slot_mapping, q_out,
        k_scale if fp8 else q, v_scale if fp8 else q,  # never read without FP8
        *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(),
        k_cache.shape[1],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEADS_P2=heads_p2, KV_HEADS_P2=triton.next_power_of_2(num_kv_heads),
        HALF=half, HALF_P2=triton.next_power_of_2(half), QK_NORM=qk_norm, FP8=fp8,
        num_warps=_num_warps(heads_p2 * triton.next_power_of_2(head_dim)),
        **pdl_launch(num_tokens, q.device),
    )  # fmt: skip
    return q_out
