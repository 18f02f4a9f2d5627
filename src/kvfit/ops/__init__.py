"""Attention and cache-write kernels: Triton on the GPU, a torch reference on the CPU."""

from kvfit.ops.attention import AttentionMetadata, paged_attention, write_kv
from kvfit.ops.layers import RotaryEmbedding, rms_norm, silu_and_mul

__all__ = [
    "AttentionMetadata",
    "RotaryEmbedding",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]
