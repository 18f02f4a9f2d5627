"""Triton kernel storing each new token's K/V into a paged cache of any strides (FP8 caches:
quantised with the layer's scale as they are stored)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfit.kv_quant import FP8_E4M3_MAX, is_fp8

FP8_MAX = tl.constexpr(FP8_E4M3_MAX)


@triton.jit
def slot_offset(slot, block_size, stride_cb, stride_cs):
    """Where cache slot `slot` (block id x block_size + position in the block) starts, from
    the cache's base: its block's stride plus its position's (any shape of slots)."""
    return (slot // block_size) * stride_cb + (slot % block_size) * stride_cs


@triton.jit
def to_cache(x, scale_ptr, cache, FP8: tl.constexpr):
    """`x` as `cache` stores it: cast, or for FP8 divided by the scale (IEEE-rounded, as torch
    divides), saturated to +-448 and rounded to nearest (`kvfit.kv_quant.quantize_fp8`)."""
    if FP8:
        scaled = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr))
        scaled = tl.minimum(tl.maximum(scaled, -FP8_MAX), FP8_MAX)
        return scaled.to(cache.dtype.element_ty)
    return x.to(cache.dtype.element_ty)


@triton.jit
def _write_kv_kernel(
    key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    FP8: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # token * row stride may pass 2**31
    slot = tl.load(slot_mapping + token)
    if slot < 0:  # padded CUDA-graph slot
        return
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, DIM_P2)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = slot_offset(slot, block_size, stride_cb, stride_cs) + h * stride_ch + d * stride_cd
    k = tl.load(key + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    tl.store(k_cache + dst, to_cache(k, k_scale, k_cache, FP8), mask=mask)
    v = tl.load(value + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    tl.store(v_cache + dst, to_cache(v, v_scale, v_cache, FP8), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """One program per token; K and V caches must share strides (views of one layout). An FP8
    cache needs the [1] float32 scales (read on the device: graph safe)."""
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    fp8 = is_fp8(k_cache.dtype)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else slot_mapping, v_scale if fp8 else slot_mapping,  # unread unless FP8
        *key.stride(), *value.stride(), *k_cache.stride(),
        k_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_P2=triton.next_power_of_2(num_kv_heads),
        DIM_P2=triton.next_power_of_2(head_dim),
        FP8=fp8,
    )  # fmt: skip
