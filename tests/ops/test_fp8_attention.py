"""FP8 KV caches through the CPU (torch reference) path of the ops: the write quantises with the
layer's scale, attention reads the pages dequantised, and the result stays within e4m3's
rounding of attention over an unquantised cache."""

from __future__ import annotations

import pytest
import torch

from kvfit.kv_quant import calculate_kv_scales_, dequantize_fp8, quantize_fp8
from kvfit.ops import attention_input, paged_attention, write_kv
from kvfit.ops.attention_input import stored_key
from kvfit.ops.layers import RotaryEmbedding, rms_norm_torch, rotary_torch

FP8 = torch.float8_e4m3fn
MIXED = [(0, 5), (13, 1), (0, 1), (17, 20), (70, 1), (3, 40)]


def _fp8_copy(batch, k_scale: torch.Tensor, v_scale: torch.Tensor):
    return quantize_fp8(batch.k_cache, k_scale), quantize_fp8(batch.v_cache, v_scale)


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def test_write_kv_stores_the_quantised_values_and_skips_minus_one() -> None:
    k_cache = torch.zeros(3, 4, 2, 8, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(2, 5, 2, 8, generator=torch.Generator().manual_seed(0)) * 40
    key[0, 0, :2] = torch.tensor([1e3, -1e4])  # beyond 448 x 0.25: saturates
    slots = torch.tensor([0, -1, 5, 11, -1])
    k_scale, v_scale = torch.tensor([0.25]), torch.tensor([3.0])
    write_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    flat_k, flat_v = k_cache.view(12, 2, 8), v_cache.view(12, 2, 8)
    for token, slot in ((0, 0), (2, 5), (3, 11)):
        assert torch.equal(flat_k[slot].view(torch.uint8),
                           quantize_fp8(key[token], k_scale).view(torch.uint8))
        assert torch.equal(flat_v[slot].view(torch.uint8),
                           quantize_fp8(value[token], v_scale).view(torch.uint8))
    untouched = [s for s in range(12) if s not in (0, 5, 11)]
    assert flat_k[untouched].float().abs().sum() == 0 == flat_v[untouched].float().abs().sum()
    assert flat_k[0, 0, :2].float().tolist() == [448.0, -448.0]  # saturated, never NaN


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 1)])
def test_attention_over_fp8_pages_is_attention_over_their_dequantised_values(
    paged_batch, num_heads: int, num_kv_heads: int
) -> None:
    batch = paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.05])
    k8, v8 = _fp8_copy(batch, k_scale, v_scale)
    out = paged_attention(batch.query, k8, v8, batch.metadata, 0.3,
                          k_scale=k_scale, v_scale=v_scale)
    dequantised = paged_attention(batch.query, dequantize_fp8(k8, k_scale, torch.float32),
                                  dequantize_fp8(v8, v_scale, torch.float32), batch.metadata, 0.3)
    torch.testing.assert_close(out, dequantised, rtol=1e-5, atol=1e-5)


def test_fp8_attention_is_within_e4m3_rounding_of_the_unquantised_cache(paged_batch) -> None:
    # A model's K/V scale: a tenth of a unit, with a few large channels (what amax sees).
    batch = paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64)
    batch.k_cache.mul_(0.1)[..., :4].mul_(20)
    k_scale, v_scale = torch.ones(1), torch.ones(1)
    calculate_kv_scales_(k_scale, v_scale, batch.k_cache, batch.v_cache)
    exact = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.125)
    for ks, vs in ((k_scale, v_scale), (torch.ones(1), torch.ones(1))):  # calculated and 1.0
        k8, v8 = _fp8_copy(batch, ks, vs)
        out = paged_attention(batch.query, k8, v8, batch.metadata, 0.125, k_scale=ks, v_scale=vs)
        assert _rel_error(out, exact) < 0.04
    # Read with the wrong V scale, the same pages are far off: the scale is applied.
    out = paged_attention(batch.query, k8, v8, batch.metadata, 0.125, k_scale=torch.ones(1),
                          v_scale=torch.full((1,), 1.5))
    assert _rel_error(out, exact) > 0.4


@pytest.mark.parametrize("missing", ["k_scale", "v_scale"])
def test_an_fp8_cache_without_its_scales_is_refused(paged_batch, missing: str) -> None:
    batch = paged_batch([(0, 3)], head_dim=16)
    k8, v8 = _fp8_copy(batch, torch.ones(1), torch.ones(1))
    scales = {"k_scale": torch.ones(1), "v_scale": torch.ones(1), missing: None}
    with pytest.raises(ValueError, match=f"{missing} as a one-element float32 tensor"):
        paged_attention(batch.query, k8, v8, batch.metadata, 0.3, **scales)
    with pytest.raises(ValueError, match=f"needs {missing}"):
        write_kv(batch.query[:, :2], batch.query[:, :2], k8, v8,
                 batch.metadata.slot_mapping, **scales)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_attention_input_stores_the_rotated_key_quantised(qk_norm: bool) -> None:
    torch.manual_seed(0)
    num_tokens, heads, kv_heads, dim = 7, 4, 2, 16
    q, k, v = (torch.randn(num_tokens, h, dim) * 3 for h in (heads, kv_heads, kv_heads))
    weight = 1 + 0.3 * torch.randn(dim) if qk_norm else None
    positions = torch.randperm(30)[:num_tokens]
    cos_sin = RotaryEmbedding(dim, 30, base=10_000.0).cos_sin_cache
    k_cache = torch.zeros(4, 4, kv_heads, dim, dtype=FP8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(16)[:num_tokens]
    k_scale, v_scale = torch.tensor([0.01]), torch.tensor([0.02])
    q_out = attention_input(positions, q, k, v, weight, weight, 1e-6, cos_sin, k_cache, v_cache,
                            slots, k_scale, v_scale)
    key = stored_key(positions, k, weight, 1e-6, cos_sin)
    normed = rms_norm_torch(k, weight, 1e-6) if qk_norm else k
    assert torch.equal(key, rotary_torch(positions, q, normed, cos_sin, dim)[1])
    blocks, offsets = slots // 4, slots % 4
    assert torch.equal(k_cache[blocks, offsets].view(torch.uint8),
                       quantize_fp8(key, k_scale).view(torch.uint8))
    assert torch.equal(v_cache[blocks, offsets].view(torch.uint8),
                       quantize_fp8(v, v_scale).view(torch.uint8))
    assert q_out.dtype == torch.float32 and q_out.shape == q.shape
