"""Attention, cache-write, layer and sampling kernels: Triton on the GPU, torch on the CPU."""

from kvfit.ops.attention import AttentionMetadata, paged_attention, write_kv
from kvfit.ops.attention_input import attention_input
from kvfit.ops.layers import RotaryEmbedding, rms_norm, silu_and_mul
from kvfit.ops.sampling import argmax_scratch, filter_thresholds, greedy_argmax, gumbel_sample

__all__ = [
    "AttentionMetadata",
    "RotaryEmbedding",
    "argmax_scratch",
    "attention_input",
    "filter_thresholds",
    "greedy_argmax",
    "gumbel_sample",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "write_kv",
]
