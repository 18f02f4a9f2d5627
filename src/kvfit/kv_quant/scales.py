"""Per-layer k/v scales of an FP8 KV cache.

The default scale is 1.0, as in vLLM: the stored value is the activation itself. Qwen and Llama
K/V activations sit well inside e4m3's +-448 (Qwen3's k-norm bounds each key head's RMS; V is a
projection of normalised hidden states), so 1.0 only saturates outliers no real checkpoint
shows, while e4m3's relative precision (3 mantissa bits) is the same at any magnitude above its
subnormals (2^-6). A scale must also be fixed before the first block is written: every block of
a layer is read with one scale, so changing it would mean rewriting the whole cache.

`calculate_kv_scales` (vLLM's semantics) sets each layer's scales once, from the first real
step's K/V: scale = amax / constant, leaving headroom (448 / 200 for K, 448 / 100 for V) for
later activations larger than the first prompt's; after that they are fixed. Under tensor
parallelism the amax is taken over every rank's heads, so each rank stores with the scale one
rank would (and TP=2 quantizes as TP=1 does).

A checkpoint's own k/v scales (vLLM's names: `self_attn.k_scale`, `k_proj.output_scale`, ...;
what llm-compressor calibrates) replace 1.0 when the cache is FP8 and `calculate_kv_scales` is
off, as in vLLM; one per layer (`checkpoint_scale`).
"""

from __future__ import annotations

import math

import torch

from kvfit.distributed import all_reduce

K_SCALE_CONSTANT = 200.0
"""amax(K) of the first step is stored as this value (vLLM's K_SCALE_CONSTANT)."""
V_SCALE_CONSTANT = 100.0
"""amax(V) of the first step is stored as this value (vLLM's V_SCALE_CONSTANT)."""
MIN_SCALE = 1e-6
"""Floor of a calculated scale: an all-zero first step must not divide by zero later."""


def calculate_kv_scales_(k_scale: torch.Tensor, v_scale: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor) -> None:
    """Set `k_scale` / `v_scale` ([1] float32) in place from the amax of `key` / `value` (the
    values as they would be stored, unscaled; this rank's heads), the amax over every
    tensor-parallel rank. Device ops and one all-reduce: no host sync, graph safe. An empty
    step leaves them as they are (on every rank: all see the same step's tokens)."""
    if key.numel() == 0:
        return
    amax = all_reduce(torch.stack([key.abs().amax().float(), value.abs().amax().float()]),
                      op="max")
    k_scale.copy_((amax[0] / K_SCALE_CONSTANT).clamp_min(MIN_SCALE).view(1))
    v_scale.copy_((amax[1] / V_SCALE_CONSTANT).clamp_min(MIN_SCALE).view(1))


def checkpoint_scale(name: str, value: torch.Tensor) -> float:
    """The per-layer scale checkpoint tensor `name` gives (a scalar, or per-head values that are
    all equal); raises, naming what to set instead, where it is per-head or not a scale."""
    values = value.detach().float().flatten()
    if values.numel() == 0 or not bool((values == values[0]).all()):
        raise ValueError(f"checkpoint tensor {name!r} holds {values.numel()} different k/v "
                         f"scales (per head); kvfit's fp8 KV cache takes one per layer: use "
                         f"--kv-cache-dtype auto, or --calculate-kv-scales to set them from the "
                         f"first step")
    scale = float(values[0])
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"checkpoint tensor {name!r} is {scale}, not a positive k/v scale: fix "
                         f"the checkpoint, or use --calculate-kv-scales or --kv-cache-dtype auto")
    return scale
