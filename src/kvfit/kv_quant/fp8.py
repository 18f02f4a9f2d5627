"""The e4m3 KV format: quantise (divide by the scale, saturate, round to nearest) and
dequantise (widen, multiply by the scale). The torch reference of what the kernels do in
registers, and the CPU path."""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0
"""Largest finite e4m3fn value. Quantisation saturates here: e4m3fn has no infinity, and a
cast of a larger value is NaN in some torch versions."""


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` saturated to +-448 and rounded to nearest e4m3fn (`scale` a [1] float32
    tensor, read on the device). Computed in float32, as the kernels do."""
    scaled = x.float() / scale
    return scaled.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x * scale` in `dtype` (e4m3 widens exactly to float32; one rounding to `dtype`)."""
    return (x.float() * scale).to(dtype)
