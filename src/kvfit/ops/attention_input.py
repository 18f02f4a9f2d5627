"""The attention input in one op: per-head q/k RMSNorm, neox rotary, and the K/V cache store.

Everything an attention layer does between its qkv GEMM and the attention kernel. CUDA tensors
go to one fused Triton kernel; anything else to the composition of the torch functions it
replaces, which is also the kernel's oracle.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from kvfit.kv_quant import is_fp8
from kvfit.ops.attention import AttentionMetadata, _check_cache, check_kv_scales, paged_attention
from kvfit.ops.layers import rms_norm_torch, rotary_torch
from kvfit.ops.reference import write_kv_reference


@dataclass(frozen=True)
class AttentionInputArgs:
    """What `attention_input` takes besides q, k and v: given these, a kernel that produces q,
    k and v can finish the attention input itself (`small_batch.qkv_attention_input`)."""

    positions: torch.Tensor  # [T] int
    q_norm_weight: torch.Tensor | None  # [head_dim], or None for no q/k norm
    k_norm_weight: torch.Tensor | None
    eps: float
    cos_sin_cache: torch.Tensor  # [max_position, head_dim]: cos then sin
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64; -1 = skip
    k_scale: torch.Tensor | None = None  # an FP8 cache's scales, else unused
    v_scale: torch.Tensor | None = None

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v `[T, heads, head_dim]`: views of a QKV projection's output `[T, (heads +
        2 x num_kv_heads) x head_dim]`, the head counts taken from the cache's shape."""
        num_kv_heads, head_dim = self.k_cache.shape[2], self.k_cache.shape[3]
        rows, kv = qkv.shape[0], num_kv_heads * head_dim
        q = qkv.shape[1] - 2 * kv
        if q <= 0 or q % head_dim:
            raise ValueError(f"a QKV projection of {qkv.shape[1]} columns is not q heads, then "
                             f"{num_kv_heads} k and v heads of {head_dim}")
        return (qkv[:, :q].view(rows, q // head_dim, head_dim),
                qkv[:, q:q + kv].view(rows, num_kv_heads, head_dim),
                qkv[:, q + kv:].view(rows, num_kv_heads, head_dim))

    def check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`attention_input`'s checks of these with q, k and v: shapes, dtypes and devices."""
        _check_inputs(self.positions, q, k, v, self.q_norm_weight, self.k_norm_weight,
                      self.cos_sin_cache, self.k_cache, self.v_cache, self.slot_mapping)
        check_kv_scales(self.k_cache, self.k_scale, self.v_scale)

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """`attention_input` of q, k and v with these arguments."""
        return attention_input(self.positions, q, k, v, self.q_norm_weight, self.k_norm_weight,
                               self.eps, self.cos_sin_cache, self.k_cache, self.v_cache,
                               self.slot_mapping, self.k_scale, self.v_scale)


_FUSED_DECODE: ContextVar[bool] = ContextVar("kvfit_fused_decode_input", default=False)


@contextmanager
def fused_decode_input(enabled: bool = True) -> Iterator[None]:
    """Run the block with decode steps' attention input fused into their attention kernel
    (`decode_attention`), or not; the previous state comes back on exit. A context variable,
    like the small-batch kernels': the model runner sets it around each step and capture."""
    token = _FUSED_DECODE.set(enabled)
    try:
        yield
    finally:
        _FUSED_DECODE.reset(token)


def fuses_decode_input(k_cache: torch.Tensor, metadata: AttentionMetadata) -> bool:
    """Whether a layer runs `decode_attention` now: the switch is on, every row of the step is a
    decode (`max_query_len` 1) and the cache is not FP8. Off CUDA that op is the unfused pair,
    so a CPU engine with the switch on runs the model's fused branch to the same results."""
    return _FUSED_DECODE.get() and metadata.max_query_len == 1 and not is_fp8(k_cache.dtype)


def attention_input(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim], any strides
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], any strides
    v: torch.Tensor,  # [T, num_kv_heads, head_dim], any strides
    q_norm_weight: torch.Tensor | None,  # [head_dim], or None for no q/k norm
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]: cos then sin
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    v_cache: torch.Tensor,  # same shape and strides as k_cache
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip
    k_scale: torch.Tensor | None = None,  # [1] float32: an FP8 cache's scales, else unused
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prepare one layer's attention input and store this step's K/V.

    Per token: RMS-normalise each q and k head when the norm weights are given (Qwen3), apply the
    neox rotary embedding at `positions` to q and k, store k and v at the token's cache slot
    (slots of -1 are left untouched; an FP8 cache stores them quantised with the scales, as
    `write_kv` does). Returns the rotated q as a new contiguous `[T, num_heads, head_dim]` in
    q's dtype. On CUDA it is one kernel launch and graph safe.
    """
    _check_inputs(positions, q, k, v, q_norm_weight, k_norm_weight, cos_sin_cache, k_cache,
                  v_cache, slot_mapping)  # fmt: skip
    check_kv_scales(k_cache, k_scale, v_scale)
    if q.is_cuda:
        from kvfit.ops.triton_attention_input import attention_input_triton  # CUDA-only dependency

        return attention_input_triton(
            positions, q, k, v, q_norm_weight, k_norm_weight, eps,
            cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        )  # fmt: skip
    return attention_input_torch(
        positions, q, k, v, q_norm_weight, k_norm_weight, eps,
        cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
    )  # fmt: skip


def decode_attention(
    positions: torch.Tensor,  # [T] int
    q: torch.Tensor,  # [T, num_heads, head_dim], any strides
    k: torch.Tensor,  # [T, num_kv_heads, head_dim], any strides
    v: torch.Tensor,  # [T, num_kv_heads, head_dim], any strides
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,  # every row a decode: max_query_len 1
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """`attention_input` then `paged_attention`, for a step whose rows are all decodes: on CUDA
    one launch for both (`triton_decode_input`), the split reduction in it too where
    `metadata.split_tickets` is given (else a kernel after it): one or two graph nodes fewer in
    every layer. The K/V stored are `attention_input`'s; the output differs from the pair's
    only in the order the new token's term is summed. 16-bit caches only (an FP8 cache takes
    the pair). Extra memory: `out` and the decode's split scratch, as `paged_attention`'s
    decode; no rotated copy of q."""
    _check_inputs(positions, q, k, v, q_norm_weight, k_norm_weight, cos_sin_cache, k_cache,
                  v_cache, metadata.slot_mapping)  # fmt: skip
    if metadata.max_query_len != 1 or is_fp8(k_cache.dtype):
        raise ValueError("decode_attention takes decode rows (max_query_len 1) over a 16-bit "
                         f"cache; got max_query_len {metadata.max_query_len}, {k_cache.dtype}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"num_heads ({q.shape[1]}) must be a multiple of num_kv_heads "
                         f"({k.shape[1]})")
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.is_cuda:
        from kvfit.ops.triton_decode_input import decode_attention_input_triton  # CUDA only

        return decode_attention_input_triton(
            positions, q, k, v, q_norm_weight, k_norm_weight, eps, cos_sin_cache,
            k_cache, v_cache, metadata.slot_mapping, metadata, scale, out,
        )  # fmt: skip
    q = attention_input_torch(positions, q, k, v, q_norm_weight, k_norm_weight, eps,
                              cos_sin_cache, k_cache, v_cache, metadata.slot_mapping)
    return paged_attention(q, k_cache, v_cache, metadata, scale, out)


def attention_input_torch(
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
    """The unfused torch composition of `attention_input`: the CPU path and the kernel's oracle."""
    if q_norm_weight is not None:
        q, k = rms_norm_torch(q, q_norm_weight, eps), rms_norm_torch(k, k_norm_weight, eps)
    q, k = rotary_torch(positions, q, k, cos_sin_cache, q.shape[-1])
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


def stored_key(
    positions: torch.Tensor,
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos_sin_cache: torch.Tensor,
) -> torch.Tensor:
    """The key `attention_input` stores, before any cache quantisation: normalised (when the
    weight is given) and rotated, in k's dtype (the torch composition, on any device).

    What `calculate_kv_scales` measures. Extra memory: at most about six float32 copies of k
    alive at once (the norm's and the rotation's intermediates), 24 x k.numel() bytes.
    """
    if k_norm_weight is not None:
        k = rms_norm_torch(k, k_norm_weight, eps)
    no_query = k[:, :0]  # rotary_torch rotates a query and a key; only the key is wanted
    return rotary_torch(positions, no_query, k, cos_sin_cache, k.shape[-1])[1]


def _check_inputs(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Shapes, dtypes, strides and devices only: reads no values (no device sync)."""
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(
            "q must be [T, num_heads, head_dim] and k, v [T, num_kv_heads, head_dim], got "
            f"{list(q.shape)}, {list(k.shape)} and {list(v.shape)}"
        )
    _check_cache(k_cache, v_cache, k.shape[1:])
    if k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}"
        )
    num_tokens, _, head_dim = q.shape
    if k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"q and k head_dim ({head_dim}, {k.shape[2]}) must be equal and even")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_dim:
        raise ValueError(
            f"cos_sin_cache must be [max_position, head_dim={head_dim}], "
            f"got {list(cos_sin_cache.shape)}"
        )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q_norm_weight and k_norm_weight must be given together or both None")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        # The fused kernel rounds the norm to q's dtype; a wider weight would promote it.
        if w is not None and (w.shape != (head_dim,) or w.dtype != q.dtype):
            raise ValueError(
                f"{name} must be [{head_dim}] {q.dtype}, got {list(w.shape)} {w.dtype}"
            )
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.shape != (num_tokens,) or t.dtype.is_floating_point:
            raise ValueError(
                f"{name} must be [{num_tokens}] integer, got {list(t.shape)} {t.dtype}"
            )
    named = {"k": k, "v": v, "positions": positions, "slot_mapping": slot_mapping,
             "cos_sin_cache": cos_sin_cache, "q_norm_weight": q_norm_weight,
             "k_norm_weight": k_norm_weight, "k_cache": k_cache, "v_cache": v_cache}  # fmt: skip
    for name, t in named.items():
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: move it to q's device")
