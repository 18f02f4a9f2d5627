"""Small model layers as functions: RMSNorm (alone or after the residual add), SiLU-and-mul and
rotary embedding (default, Llama 3, linear and YaRN scaling)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 and scaled in the input dtype (as HF does)."""
    if x.is_cuda:
        from kvfit.ops.triton_layers import rms_norm_triton  # triton is a CUDA-only dependency

        return rms_norm_triton(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch composition of `rms_norm`: the CPU path and the fused kernel's oracle."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`: the residual add and the norm that follows it.

    The decoder's residual stream passes through here twice per layer; on CUDA it is one kernel,
    which saves two graph nodes per layer of every decode step and two launches per eager step.
    """
    if x.is_cuda:
        from kvfit.ops.triton_layers import add_rms_norm_triton  # CUDA-only dependency

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch composition of `add_rms_norm`: the CPU path and the fused kernel's oracle."""
    summed = x + residual
    return rms_norm_torch(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate, up]` concatenated along the last dim."""
    if x.is_cuda:
        from kvfit.ops.triton_layers import silu_and_mul_triton  # CUDA-only dependency

        return silu_and_mul_triton(x)
    return silu_and_mul_torch(x)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch composition of `silu_and_mul`: the CPU path and the fused kernel's oracle."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _llama3_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths divided by `factor`, a smooth ramp between."""
    factor = rope_scaling["factor"]
    low_freq_factor = rope_scaling["low_freq_factor"]
    high_freq_factor = rope_scaling["high_freq_factor"]
    old_context_len = rope_scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_context_len / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_context_len / high_freq_factor) & (
        wavelen <= old_context_len / low_freq_factor
    )
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(inv_freq: torch.Tensor, rope_scaling: dict, base: float,
                   max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): high frequencies kept, low ones divided
    by `factor`, a linear ramp between; returns the frequencies and the cos/sin scale."""
    dim = 2 * len(inv_freq)
    original = rope_scaling.get("original_max_position_embeddings") or max_position
    factor = rope_scaling.get("factor") or max_position / original
    attention_factor = rope_scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope_scaling.get("mscale"), rope_scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(rope_scaling.get("beta_fast") or 32)
    high = correction_dim(rope_scaling.get("beta_slow") or 1)
    if rope_scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Rounded as transformers rounds it (1 - (1 - ramp), 1 / (factor * base^(2i/d))): positions
    # near max_position multiply a last-bit difference past float32 noise.
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    interpolated = 1.0 / (factor * pos_freqs) * (1 - extrapolation)
    return interpolated + inv_freq * extrapolation, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


ROPE_TYPES = ("default", "llama3", "linear", "yarn")
"""`rope_type`s of `rope_scaling` that `RotaryEmbedding` computes as transformers does."""


def rope_positions(max_position: int, rope_scaling: dict | None) -> int:
    """Positions a rope covers, as vLLM reads a config: `max_position_embeddings`, or the
    context its scaling extends it to where that is longer: under YaRN
    `original_max_position_embeddings` x `factor`, under linear scaling
    `max_position_embeddings` x `factor` (llama3's stays: its config already gives the long
    context). Qwen3's model card extends its 32k context to 128k by adding `rope_scaling`
    alone (max_position_embeddings stays 40960), and transformers ropes any position."""
    scaling = rope_scaling or {}
    rope_type, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor")
    if rope_type == "yarn" and factor:
        original = scaling.get("original_max_position_embeddings") or max_position
        return max(max_position, int(original * factor))
    if rope_type == "linear" and factor:
        return max(max_position, int(max_position * factor))
    return max_position


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin cache.

    `rope_scaling` is the HF dict (`rope_type` or `type`): None or one of `ROPE_TYPES`.
    `max_position` is the config's `max_position_embeddings`; the cos/sin table holds
    `rope_positions` of it. Called as `rotary(positions, q, k) -> (q, k)` with q/k
    `[T, heads, head_dim]` or `[T, heads * head_dim]`; the output keeps the input shape and
    dtype.
    """

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
        rope_type = rope_type or "default"
        scale = 1.0  # YaRN's attention factor, folded into cos and sin as transformers does
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, scale = _yarn_inv_freq(inv_freq, rope_scaling, base, max_position)
        elif rope_type != "default":
            raise ValueError(f"rope_scaling rope_type {rope_type!r} is not supported; kvfit "
                             f"supports {', '.join(ROPE_TYPES)}")
        positions = rope_positions(max_position, rope_scaling)
        freqs = torch.arange(positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        cos_sin = torch.cat([freqs.cos() * scale, freqs.sin() * scale], -1)
        self.register_buffer("cos_sin_cache", cos_sin, False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:
            from kvfit.ops.triton_layers import rotary_triton  # triton is a CUDA-only dependency

            return rotary_triton(positions, q, k, self.cos_sin_cache, self.head_dim)
        return rotary_torch(positions, q, k, self.cos_sin_cache, self.head_dim)


def rotary_torch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch composition of the neox rotary embedding: the CPU path and the fused kernel's
    oracle. `cos_sin_cache` is `[max_position, head_dim]`, cos then sin."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)
    return _rotate(q, cos, sin, head_dim), _rotate(k, cos, sin, head_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    shaped = x.reshape(x.shape[0], math.prod(x.shape[1:]) // head_dim, head_dim).float()
    x1, x2 = shaped.chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype).view(x.shape)
