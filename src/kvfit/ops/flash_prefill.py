"""Prefill rows without a cached prefix through PyTorch's FlashAttention-2 varlen kernel.

A prompt's first chunk attends to its own new tokens only, and the step holds those keys and
values contiguous (the QKV projection's output, the keys rotated in place by
`attention_input`): the causal attention SDPA's flash backend runs on contiguous K/V, which
kvfit's paged Triton prefill kernel reaches 60-68% of on the H200 (its loop cannot overlap one
warpgroup's softmax with the other's products in Triton 3.6: docs/benchmarks.md). Those rows
run FlashAttention-2 here, through `torch.ops.aten._flash_attention_forward`, the kernel behind
SDPA's flash backend; rows that continue a cached prefix (later chunks, prefix-cache hits) and
decode rows stay with the paged kernels, which write their rows after this one.

Only where the cache holds the query's own 16-bit dtype: an FP8 cache's prefill reads the
quantised K/V, as its decode does, so an engine's outputs do not depend on which kernel a row
took. A context variable, like the small-batch kernels': the model runner sets it around each
step and capture (`EngineConfig.flash_prefill`, on by default; off in the deterministic mode).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # `ops.attention` calls into this module
    from kvfit.ops.attention import AttentionMetadata

FLASH_DTYPES = (torch.bfloat16, torch.float16)
MAX_HEAD_DIM = 256  # FlashAttention-2's largest head dim; it also needs a multiple of 8

_ENABLED: ContextVar[bool] = ContextVar("kvfit_flash_prefill", default=False)


@contextmanager
def flash_prefill(enabled: bool = True) -> Iterator[None]:
    """Run the block with fresh prefill rows on FlashAttention (or not); the previous state
    comes back on exit."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def runs_flash_prefill(dtype: torch.dtype, k_cache: torch.Tensor,
                       metadata: AttentionMetadata) -> bool:
    """Whether a layer computing in `dtype` over `k_cache` runs this step's fresh prefill rows
    on FlashAttention: the switch is on, the step has prefill rows (`max_query_len` > 1), the
    cache is a CUDA cache of `dtype` (16-bit), its head dim one FlashAttention-2 takes, and
    the device has the kernel (sm_80 and later)."""
    head_dim = k_cache.shape[-1]
    return (_ENABLED.get() and metadata.max_query_len > 1 and k_cache.is_cuda
            and k_cache.dtype == dtype and dtype in FLASH_DTYPES
            and head_dim % 8 == 0 and head_dim <= MAX_HEAD_DIM
            and _has_flash_attention(k_cache.device))


@functools.cache
def _has_flash_attention(device: torch.device) -> bool:
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def fresh_query_lens(metadata: AttentionMetadata) -> torch.Tensor:
    """[num_seqs] int32: the query length of each prefill row whose context is all new (no
    cached prefix, more than one token), 0 for every other row. Computed on the device by the
    first layer that asks and kept on the metadata for the step's other layers."""
    if metadata.fresh_query_lens is None:
        q_lens = metadata.query_start_loc.diff()
        fresh = (q_lens == metadata.seq_lens) & (q_lens > 1)
        metadata.fresh_query_lens = torch.where(fresh, q_lens, 0).to(torch.int32)
    return metadata.fresh_query_lens


def flash_attention_fresh(
    query: torch.Tensor,  # [T, num_heads, head_dim], rotated
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]: this step's keys as stored, rotated
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each fresh row's queries over its own keys (`fresh_query_lens`),
    into `out` (new when None). Every other row's output is left for the paged kernels to
    write (FlashAttention gives a row of no keys zeros).

    The kernel's varlen layout is the step's: rows at `query_start_loc`, keys packed like the
    queries; a row whose key count is 0 (`seqused_k`) is skipped inside the kernel. q, k and v
    need a contiguous last dim only (the QKV output's views qualify).

    Memory: FlashAttention allocates its output `[T, num_heads, head_dim]` in the query's dtype
    and its log-sum-exp `[num_heads, T]` float32 (and copies the output into `out` when given),
    T the step's tokens, at most `max_num_batched_tokens`: warmup's profiling step, a fresh
    prefill of that many tokens, measures both at their largest.
    """
    max_len = metadata.max_query_len
    result = torch.ops.aten._flash_attention_forward(
        query, key, value, metadata.query_start_loc, metadata.query_start_loc, max_len, max_len,
        0.0, True, False, scale=scale, seqused_k=fresh_query_lens(metadata),
    )[0]
    return result if out is None else out.copy_(result)
