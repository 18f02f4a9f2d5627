"""Paged attention and KV-cache writes: one entry point each, dispatched by device.

CUDA tensors go to the Triton kernels, anything else to the torch reference. The signatures are
the contract models and engine are written against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfit.kv_quant import is_fp8
from kvfit.ops.fixed_tile_attention import paged_attention_fixed_tiles
from kvfit.ops.reference import paged_attention_reference, write_kv_reference


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every attention layer of the model.

    Tokens of all sequences are packed along dim 0: sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i + 1]`, which are the *last* rows of its context of
    `seq_lens[i]` tokens (cached prefix first, then these new tokens; causal, lower-right aligned).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset; -1 = skip
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int  # host-side upper bounds: no device sync needed to launch
    max_seq_len: int
    # [>= num_seqs * num_kv_heads] int32 zeros that stay zero between launches, or None: with
    # them the fused decode (`kvfit.ops.attention_input.decode_attention`) reduces its splits in
    # its own launch. The runner's, one for all layers (they run one after another).
    split_tickets: torch.Tensor | None = None
    # [num_seqs] int32, a permutation of the rows, or None (batch order): the order the decode
    # kernel starts sequences in (`kvfit.ops.decode_order`). It sets the pace only, no result.
    decode_order: torch.Tensor | None = None


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,  # [1] float32: an FP8 cache's scales, else unused
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store each token's K/V into the cache at `slot_mapping`; slots of -1 are left untouched.
    An FP8 cache stores `x / scale` saturated to +-448 (`kvfit.kv_quant.quantize_fp8`)."""
    _check_cache(k_cache, v_cache, key.shape[1:])
    check_kv_scales(k_cache, k_scale, v_scale)
    if key.is_cuda:
        from kvfit.ops.triton_kv_write import write_kv_triton  # triton is a CUDA-only dependency

        write_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
    k_scale: torch.Tensor | None = None,  # [1] float32: an FP8 cache's scales, else unused
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's new query rows over its cached context.

    Handles prefill (with or without a cached prefix) and decode sequences in one batch, and
    grouped-query attention. On CUDA it is graph safe: launch shapes come from host ints only.
    Rows of `out` outside `query_start_loc[-1]` are not written. An FP8 cache is read as
    `value * scale` in the query's dtype, dequantised tile by tile (no dequantised copy of it).

    `batch_invariant`: every row is reduced over its keys in fixed tiles from key 0, by one
    kernel for prefill and decode rows alike, so a row's output depends on its query, position
    and keys only (not on the batch, a cached prefix or a chunk border).
    """
    num_heads, head_dim = query.shape[1:]
    _check_cache(k_cache, v_cache, None)
    check_kv_scales(k_cache, k_scale, v_scale)
    if num_heads % k_cache.shape[2]:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({k_cache.shape[2]})"
        )
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {k_cache.shape[3]}")
    if out is None:
        out = torch.empty_like(query)
    if query.is_cuda:
        from kvfit.ops.triton_attention import paged_attention_triton  # CUDA-only dependency

        # A bfloat16 model's e4m3 tiles widen to float16 (one conversion per pair of values;
        # bfloat16 takes several): decode and prefill 1.08-1.12x faster on the H200
        # (bench/attention.py --sweep --kv-cache-dtype fp8, 2026-12-04), and float16 keeps 3
        # more bits of the query and p. A float32 model's stay float32.
        compute = torch.float16 if query.dtype == torch.bfloat16 else None
        return paged_attention_triton(query, k_cache, v_cache, metadata, scale, out,
                                      batch_invariant=batch_invariant,
                                      k_scale=k_scale, v_scale=v_scale,
                                      fp8_compute_dtype=compute)
    if batch_invariant:
        return paged_attention_fixed_tiles(query, k_cache, v_cache, metadata, scale, out,
                                           k_scale, v_scale)
    return paged_attention_reference(query, k_cache, v_cache, metadata, scale, out,
                                     k_scale, v_scale)


def check_kv_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None) -> None:
    """An FP8 cache needs both scales as one-element float32 tensors on its device (read there,
    so a CUDA graph sees later changes); other caches ignore them. Reads no values."""
    if not is_fp8(k_cache.dtype):
        return
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.numel() != 1 or s.dtype != torch.float32 or s.device != k_cache.device:
            got = None if s is None else f"{list(s.shape)} {s.dtype} on {s.device}"
            raise ValueError(f"a {k_cache.dtype} KV cache needs {name} as a one-element "
                             f"float32 tensor on {k_cache.device}, got {got}")


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, kv_shape: torch.Size | None) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if kv_shape is not None and tuple(kv_shape) != tuple(k_cache.shape[2:]):
        raise ValueError(
            f"key/value are [num_tokens, {', '.join(map(str, kv_shape))}] but the cache holds "
            f"[num_kv_heads, head_dim] = {list(k_cache.shape[2:])}"
        )
