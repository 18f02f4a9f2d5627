"""The e4m3 KV format's torch reference, the cache dtype names and the scale calculation."""

from __future__ import annotations

import pytest
import torch

from kvfit.kv_quant import (
    FP8_E4M3_MAX,
    K_SCALE_CONSTANT,
    V_SCALE_CONSTANT,
    calculate_kv_scales_,
    dequantize_fp8,
    is_fp8,
    kv_cache_torch_dtype,
    quantize_fp8,
)

# e4m3: 3 mantissa bits, so rounding to nearest errs by at most 2^-4 of a normal value, and by
# half the subnormal spacing (2^-9) below the smallest normal (2^-6), both in scaled units.
REL_BOUND = 2.0**-4
SUBNORMAL_BOUND = 2.0**-10


@pytest.mark.parametrize("scale", [1.0, 0.0173, 3.5])
def test_round_trip_error_is_within_e4m3_rounding(scale: float) -> None:
    g = torch.Generator().manual_seed(0)
    # Magnitudes from deep subnormal to the top of the range (log-uniform), both signs.
    magnitude = 10 ** (torch.rand(20000, generator=g) * 6.6 - 4)  # 1e-4 .. 398
    x = torch.where(torch.rand(20000, generator=g) < 0.5, -magnitude, magnitude) * scale
    s = torch.tensor([scale])
    q = quantize_fp8(x, s)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize_fp8(q, s, torch.float32)
    err = (back - x).abs()
    assert bool((err <= torch.maximum(REL_BOUND * x.abs(), torch.tensor(SUBNORMAL_BOUND * scale))
                 * (1 + 1e-6)).all())
    normal = x.abs() / scale >= 2.0**-6
    # Tight: the worst normal error is close to the bound (a coarser format would break it,
    # a finer one would not come near it).
    assert (err[normal] / x.abs()[normal]).max() > REL_BOUND * 0.9


def test_quantisation_saturates_instead_of_overflowing() -> None:
    s = torch.tensor([2.0])
    x = torch.tensor([1.0, 3.0, 500.0, 896.0, 1e6, -1e6, 0.0])
    back = dequantize_fp8(quantize_fp8(x, s), s, torch.float32)
    assert back.tolist() == [1.0, 3.0, 512.0, 896.0, 2 * FP8_E4M3_MAX, -2 * FP8_E4M3_MAX, 0.0]


def test_dequantisation_rounds_once_to_the_target_dtype() -> None:
    s = torch.tensor([0.1])
    q = quantize_fp8(torch.tensor([1.3, -7.0]), s)
    expect = (q.float() * 0.1).to(torch.bfloat16)
    assert torch.equal(dequantize_fp8(q, s, torch.bfloat16), expect)


def test_cache_dtype_names_follow_vllm() -> None:
    assert kv_cache_torch_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert kv_cache_torch_dtype("auto", torch.float32) == torch.float32
    assert kv_cache_torch_dtype("fp8", torch.bfloat16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("fp8_e4m3", torch.float16) == torch.float8_e4m3fn
    assert kv_cache_torch_dtype("bfloat16", torch.float32) == torch.bfloat16
    assert is_fp8(torch.float8_e4m3fn) and not is_fp8(torch.bfloat16)
    with pytest.raises(ValueError, match=r"--kv-cache-dtype.*auto, bfloat16, fp8, fp8_e4m3.*"
                                         r"'fp8_e5m2'"):
        kv_cache_torch_dtype("fp8_e5m2", torch.bfloat16)


def test_calculated_scales_store_the_amax_at_the_constants() -> None:
    k_scale, v_scale = torch.ones(1), torch.ones(1)
    key = torch.tensor([[0.5, -30.0], [2.0, 1.0]])
    value = torch.tensor([[0.25, 4.0], [-8.0, 1.0]])
    calculate_kv_scales_(k_scale, v_scale, key, value)
    assert k_scale.item() == pytest.approx(30.0 / K_SCALE_CONSTANT)
    assert v_scale.item() == pytest.approx(8.0 / V_SCALE_CONSTANT)
    # The first step's largest K is stored at 200, leaving headroom to 448.
    stored = dequantize_fp8(quantize_fp8(key, k_scale), torch.ones(1), torch.float32)
    assert stored.abs().max().item() == pytest.approx(K_SCALE_CONSTANT, rel=REL_BOUND)


def test_an_empty_or_zero_step_never_gives_a_zero_scale() -> None:
    k_scale, v_scale = torch.full((1,), 0.5), torch.full((1,), 0.5)
    calculate_kv_scales_(k_scale, v_scale, torch.empty(0, 2), torch.empty(0, 2))
    assert (k_scale.item(), v_scale.item()) == (0.5, 0.5)
    calculate_kv_scales_(k_scale, v_scale, torch.zeros(3, 2), torch.zeros(3, 2))
    assert k_scale.item() > 0 and v_scale.item() > 0
    assert torch.isfinite(quantize_fp8(torch.ones(2), k_scale).float()).all()
