"""FP8 KV caches in the Triton kernels on the GPU: the write's rounding is torch's, attention
over FP8 pages matches the reference and stays within e4m3's rounding of a bf16 cache, the
fused attention input stores what the unfused kernels store, and a graph reads scales set
after it was captured (`calculate_kv_scales`).

PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_fp8_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from kvfit.kv_quant import dequantize_fp8, quantize_fp8
from kvfit.ops.attention import paged_attention, write_kv
from kvfit.ops.reference import paged_attention_reference

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn
MIXED = [(0, 1000), (512, 300), (31, 1), (4000, 1), (0, 17), (30000, 2048), (7, 1), (100, 2)]


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _scales(k: float, v: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.tensor([k], device="cuda"), torch.tensor([v], device="cuda"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_write_kernel_rounds_and_saturates_as_torch(paged_batch, dtype):
    batch = paged_batch([(0, 4096)], num_kv_heads=8, head_dim=128, dtype=dtype, device="cuda")
    k8 = torch.zeros(batch.k_cache.shape, dtype=FP8, device="cuda")
    v8 = torch.zeros_like(k8)
    slots = torch.randperm(k8.shape[0] * k8.shape[1], device="cuda")[:3000]
    slots[::7] = -1
    # Every binade of e4m3 and beyond it (saturation), at a scale that is no power of two.
    magnitude = 10 ** (torch.rand(2, 3000, 8, 128, device="cuda") * 7 - 4)
    key, value = (magnitude * torch.randn_like(magnitude).sign() * 0.37).to(dtype)
    k_scale, v_scale = _scales(0.37, 0.37)
    expect_k, expect_v = k8.clone(), v8.clone()
    keep = slots >= 0
    blocks, offsets = slots[keep] // 16, slots[keep] % 16
    # Scattered as bytes: index_put of float8 is not implemented everywhere.
    expect_k.view(torch.uint8)[blocks, offsets] = quantize_fp8(key[keep], k_scale).view(torch.uint8)
    expect_v.view(torch.uint8)[blocks, offsets] = quantize_fp8(value[keep], v_scale).view(
        torch.uint8)
    write_kv(key, value, k8, v8, slots, k_scale, v_scale)
    assert torch.equal(k8.view(torch.uint8), expect_k.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), expect_v.view(torch.uint8))


@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
@pytest.mark.parametrize("head_dim", [128, 64, 96])
def test_attention_over_fp8_pages(paged_batch, layout, head_dim):
    batch = paged_batch(MIXED, num_heads=16, num_kv_heads=4, head_dim=head_dim,
                        dtype=torch.bfloat16, layout=layout, device="cuda")  # fmt: skip
    k_scale, v_scale = _scales(0.02, 0.03)
    k8, v8 = quantize_fp8(batch.k_cache, k_scale), quantize_fp8(batch.v_cache, v_scale)
    scale = head_dim**-0.5
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(batch.query, k8, v8, batch.metadata, scale, out=out, k_scale=k_scale,
                    v_scale=v_scale)
    # The oracle in float32 over the dequantised pages: only the kernel's own rounding differs.
    reference = paged_attention_reference(
        batch.query.float(), dequantize_fp8(k8, k_scale, torch.float32),
        dequantize_fp8(v8, v_scale, torch.float32), batch.metadata, scale)
    assert _rel_error(out, reference) < 1e-2
    exact = paged_attention_reference(batch.query.float(), batch.k_cache.float(),
                                      batch.v_cache.float(), batch.metadata, scale)
    assert _rel_error(out, exact) < 0.05  # within e4m3's rounding of the bf16 cache


@pytest.mark.parametrize("head_dim", [128, 64])
def test_fp8_dots_in_float16_are_as_close_as_in_the_querys_bfloat16(paged_batch, head_dim):
    from kvfit.ops.triton_attention import paged_attention_triton

    batch = paged_batch(MIXED, num_heads=16, num_kv_heads=4, head_dim=head_dim,
                        dtype=torch.bfloat16, device="cuda")  # fmt: skip
    k_scale, v_scale = _scales(0.02, 0.03)
    k8, v8 = quantize_fp8(batch.k_cache, k_scale), quantize_fp8(batch.v_cache, v_scale)
    scale = head_dim**-0.5
    reference = paged_attention_reference(
        batch.query.float(), dequantize_fp8(k8, k_scale, torch.float32),
        dequantize_fp8(v8, v_scale, torch.float32), batch.metadata, scale)
    errors = {}
    for compute in (None, torch.float16):
        out = torch.full_like(batch.query, float("nan"))
        paged_attention_triton(batch.query, k8, v8, batch.metadata, scale, out,
                               k_scale=k_scale, v_scale=v_scale, fp8_compute_dtype=compute)
        errors[compute] = _rel_error(out, reference)
    # float16 keeps 3 more mantissa bits of p than bfloat16: no worse, within the same bound.
    assert errors[torch.float16] < 1e-2 and errors[torch.float16] <= errors[None] * 1.5


@pytest.mark.parametrize("head_dim", [128, 8])
def test_bfloat16_queries_past_float16s_range_stay_finite_over_fp8_pages(paged_batch, head_dim):
    """The engine's path for a bfloat16 model with an fp8 cache computes in float16: query rows
    up to 2**17 (float16 ends at 65,504) are cast scaled by a power of two, so every output is
    finite and near the float32 reference; a tiny head dim (8, padded to 16) too."""
    batch = paged_batch(MIXED, num_heads=16, num_kv_heads=4, head_dim=head_dim,
                        dtype=torch.bfloat16, device="cuda")  # fmt: skip
    query = batch.query.clone()
    query[::3] *= 2.0**15  # powers of two: the scaled rows are exact in float16
    k_scale, v_scale = _scales(0.02, 0.03)
    k8, v8 = quantize_fp8(batch.k_cache, k_scale), quantize_fp8(batch.v_cache, v_scale)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    paged_attention(query, k8, v8, batch.metadata, scale, out=out, k_scale=k_scale,
                    v_scale=v_scale)
    assert out.isfinite().all()
    reference = paged_attention_reference(
        query.float(), dequantize_fp8(k8, k_scale, torch.float32),
        dequantize_fp8(v8, v_scale, torch.float32), batch.metadata, scale)
    assert _rel_error(out, reference) < 5e-2


@pytest.mark.parametrize("head_dim,num_heads", [(128, 16), (128, 32), (64, 4), (80, 8)])
def test_fp8_pairs_decode_matches_the_tile_kernel(paged_batch, head_dim, num_heads):
    """The decode kernel that reads e4m3 pages as uint16 pairs (its one-cvt widening, sm_89+)
    gives the tile kernel's output to float16 rounding and the dequantised reference's to e4m3's
    bound, on every decode row of a mixed batch; prefill rows are the same kernel in both."""
    from kvfit.ops.triton_attention import _has_e4m3x2_cvt, paged_attention_triton

    if not _has_e4m3x2_cvt(torch.device("cuda")):
        pytest.skip("cvt.rn.f16x2.e4m3x2 needs sm_89 or later")
    batch = paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_heads // 4 or 1,
                        head_dim=head_dim, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    k_scale, v_scale = _scales(0.02, 0.03)
    k8, v8 = quantize_fp8(batch.k_cache, k_scale), quantize_fp8(batch.v_cache, v_scale)
    scale = head_dim**-0.5
    outs = {}
    for pairs in (False, True):
        outs[pairs] = torch.full_like(batch.query, float("nan"))
        paged_attention_triton(batch.query, k8, v8, batch.metadata, scale, outs[pairs],
                               k_scale=k_scale, v_scale=v_scale, fp8_compute_dtype=torch.float16,
                               fp8_pairs=pairs)  # fmt: skip
    reference = paged_attention_reference(
        batch.query.float(), dequantize_fp8(k8, k_scale, torch.float32),
        dequantize_fp8(v8, v_scale, torch.float32), batch.metadata, scale)
    assert not outs[True].isnan().any()
    assert _rel_error(outs[True], outs[False]) < 2e-3
    assert _rel_error(outs[True], reference) < 1e-2


@pytest.mark.parametrize("qk_norm", [True, False])
def test_fused_attention_input_stores_what_the_unfused_kernels_store(qk_norm):
    from kvfit.ops.attention_input import attention_input
    from kvfit.ops.layers import RotaryEmbedding
    from kvfit.ops.triton_layers import rms_norm_triton, rotary_triton

    torch.manual_seed(6)
    tokens, heads, kv_heads, dim = 512, 16, 8, 128
    kw = dict(dtype=torch.bfloat16, device="cuda")
    q, k, v = (torch.randn(tokens, h, dim, **kw) * 3 for h in (heads, kv_heads, kv_heads))
    weight = (1 + 0.3 * torch.randn(dim, **kw)) if qk_norm else None
    positions = torch.randint(0, 4096, (tokens,), device="cuda")
    cos_sin = RotaryEmbedding(dim, 4096, base=1e6).to("cuda").cos_sin_cache
    caches = [torch.zeros(40, 16, kv_heads, dim, dtype=FP8, device="cuda") for _ in range(4)]
    slots = torch.randperm(640, device="cuda")[:tokens]
    k_scale, v_scale = _scales(0.05, 0.02)
    attention_input(positions, q, k, v, weight, weight, 1e-6, cos_sin, caches[0], caches[1],
                    slots, k_scale, v_scale)
    q2, k2 = (rms_norm_triton(q, weight, 1e-6), rms_norm_triton(k, weight, 1e-6)) if qk_norm \
        else (q, k)
    _, k_rot = rotary_triton(positions, q2, k2, cos_sin, dim)
    write_kv(k_rot, v, caches[2], caches[3], slots, k_scale, v_scale)
    assert torch.equal(caches[1].view(torch.uint8), caches[3].view(torch.uint8))
    got, expect = caches[0].float(), caches[2].float()
    if not qk_norm:
        assert torch.equal(got.view(torch.uint8), expect.view(torch.uint8))
        return
    # A norm summed in another order moves a rare bf16 element by an ulp, which can move its
    # e4m3 rounding by one step (2^-3 relative at most).
    differ = got != expect
    assert differ.sum().item() <= max(4, 1e-3 * got.numel())
    assert ((got - expect).abs() <= 2**-3 * expect.abs() + 2**-9).all()


def test_a_captured_graph_reads_scales_set_after_capture(paged_batch):
    batch = paged_batch([(2000, 1), (300, 1), (0, 64)], num_heads=32, num_kv_heads=8,
                        head_dim=128, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    k_scale, v_scale = _scales(1.0, 1.0)
    k8 = torch.zeros(batch.k_cache.shape, dtype=FP8, device="cuda")
    v8 = torch.zeros_like(k8)
    key, value = torch.randn(2, 66, 8, 128, dtype=torch.bfloat16, device="cuda") * 30
    slots = torch.arange(66, device="cuda") + 16 * 3
    out = torch.empty_like(batch.query)

    def step() -> None:
        write_kv(key, value, k8, v8, slots, k_scale, v_scale)
        paged_attention(batch.query, k8, v8, batch.metadata, 0.1, out=out, k_scale=k_scale,
                        v_scale=v_scale)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    k_scale.fill_(0.25)  # as calculate_kv_scales does after capture
    v_scale.fill_(0.125)
    graph.replay()
    replayed = out.clone()
    step()
    assert torch.equal(replayed, out)
    expect_k = quantize_fp8(key, k_scale).view(torch.uint8)
    assert torch.equal(k8.view(torch.uint8).view(-1, 8, 128)[slots], expect_k)
