"""`kv_cache_dtype` names (vLLM's) and the torch dtype each stores the cache in."""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,  # the model's dtype
    "bfloat16": torch.bfloat16,  # vLLM's: half a float32 model's cache, a bf16 model's as is
    "fp8": torch.float8_e4m3fn,  # vLLM's `fp8` is e4m3 on NVIDIA
    "fp8_e4m3": torch.float8_e4m3fn,
}
"""Every accepted `kv_cache_dtype` -> its storage dtype (None: the model's)."""


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype a `kv_cache_dtype` of `name` stores K/V in for a model run in `model_dtype`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype (--kv-cache-dtype) must be one of "
                         f"{', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPES[name] or model_dtype


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` holds quantised values (read and written with scales)."""
    return dtype == torch.float8_e4m3fn
