"""FP8 KV cache quantisation: the cache dtype names (vLLM's `kv_cache_dtype`), the e4m3 format
and its torch reference, and the per-layer k/v scales (`calculate_kv_scales`).

A leaf package (torch only): ops quantise and dequantise with it, models hold the scales, the
engine resolves `kv_cache_dtype` through it.
"""

from kvfit.kv_quant.dtypes import KV_CACHE_DTYPES, is_fp8, kv_cache_torch_dtype
from kvfit.kv_quant.fp8 import FP8_E4M3_MAX, dequantize_fp8, quantize_fp8
from kvfit.kv_quant.scales import (
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    calculate_kv_scales_,
    checkpoint_scale,
)

__all__ = [
    "FP8_E4M3_MAX",
    "KV_CACHE_DTYPES",
    "K_SCALE_CONSTANT",
    "V_SCALE_CONSTANT",
    "calculate_kv_scales_",
    "checkpoint_scale",
    "dequantize_fp8",
    "is_fp8",
    "kv_cache_torch_dtype",
    "quantize_fp8",
]
