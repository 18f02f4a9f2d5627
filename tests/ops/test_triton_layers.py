"""Fused Triton layer kernels against the torch compositions they replace.

Interpreter tests (tiny shapes, fp32/fp16; the interpreter's bf16 is unreliable):
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_triton_layers.py -q
GPU tests (model shapes, bf16/fp16/fp32, and a CUDA graph replay):
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_triton_layers.py -q
"""

from __future__ import annotations

import pytest
import torch

from kvfit.ops.layers import (
    RotaryEmbedding,
    add_rms_norm,
    add_rms_norm_torch,
    rms_norm,
    rms_norm_torch,
    rotary_torch,
    silu_and_mul,
    silu_and_mul_torch,
)

triton_layers = pytest.importorskip("kvfit.ops.triton_layers")

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py



def _close(got: torch.Tensor, expect: torch.Tensor, rtol: float) -> None:
    assert got.shape == expect.shape and got.dtype == expect.dtype
    torch.testing.assert_close(got.float(), expect.float(), rtol=rtol, atol=rtol)


def _qkv_split(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, **kw):
    """q and k as the model produces them: `[T, heads, head_dim]` views of one fused qkv row."""
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, _ = torch.randn(num_tokens, sum(widths), **kw).split(widths, dim=-1)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim)


# --- interpreter -------------------------------------------------------------------------------

INTERP_DTYPES = [torch.float32, torch.float16]


@interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (3, 4, 16), (0, 48), (2, 3, 2, 8), (3, 33), (4, 4, 4)])
def test_rms_norm_kernel_matches_torch(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    weight = torch.randn(shape[-1], dtype=dtype)
    _close(triton_layers.rms_norm_triton(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6), 2e-3)


@interpret
def test_rms_norm_kernel_reads_split_views():
    q, _ = _qkv_split(3, 4, 2, 16)
    assert not q.is_contiguous()
    weight = torch.randn(16)
    _close(triton_layers.rms_norm_triton(q, weight, 1e-5), rms_norm_torch(q, weight, 1e-5), 1e-5)


@interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (1, 64), (0, 48)])
def test_add_rms_norm_kernel_matches_torch(dtype, shape):
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype) * 3
    weight = torch.randn(shape[-1], dtype=dtype)
    got = triton_layers.add_rms_norm_triton(x, residual, weight, 1e-6)
    for g, e in zip(got, add_rms_norm_torch(x, residual, weight, 1e-6), strict=True):
        _close(g, e, 2e-3)


@interpret
def test_add_rms_norm_kernel_rejects_mismatched_residual():
    with pytest.raises(ValueError, match="residual"):
        triton_layers.add_rms_norm_triton(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6)


@interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 40), (2, 3, 2 * 16), (0, 2 * 16)])
def test_silu_and_mul_kernel_matches_torch(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 4
    _close(triton_layers.silu_and_mul_triton(x), silu_and_mul_torch(x), 2e-3)


@interpret
def test_silu_and_mul_kernel_rejects_odd_width():
    with pytest.raises(ValueError, match="even last dim"):
        triton_layers.silu_and_mul_triton(torch.randn(2, 7))


@interpret
@pytest.mark.parametrize("dtype", INTERP_DTYPES)
@pytest.mark.parametrize("num_tokens", [0, 1, 6])
def test_rotary_kernel_matches_torch(dtype, num_tokens):
    rope = RotaryEmbedding(16, max_position=50, base=1000.0)
    positions = torch.randint(0, 50, (num_tokens,))
    q, k = _qkv_split(num_tokens, 6, 2, 16, dtype=dtype)
    got = triton_layers.rotary_triton(positions, q, k, rope.cos_sin_cache, 16)
    expect = rotary_torch(positions, q, k, rope.cos_sin_cache, 16)
    for g, e in zip(got, expect, strict=True):
        _close(g, e, 2e-3)


@interpret
def test_rotary_kernel_keeps_flat_shape():
    rope = RotaryEmbedding(8, max_position=10, base=100.0)
    positions = torch.tensor([9, 0, 4])
    q, k = torch.randn(3, 4 * 8), torch.randn(3, 2, 8)
    got_q, got_k = triton_layers.rotary_triton(positions, q, k, rope.cos_sin_cache, 8)
    expect_q, expect_k = rotary_torch(positions, q, k, rope.cos_sin_cache, 8)
    _close(got_q, expect_q, 1e-5)
    _close(got_k, expect_k, 1e-5)


def _far_rows(num_rows: int, width: int) -> torch.Tensor:
    """float16 `[num_rows, width]` rows 2**30 + 512 elements apart, so row 2 starts past 2**31
    elements: where a program's `token * row_stride` wraps in int32. The wrapped offset lands
    2**31 elements before the view, still inside its allocation (virtual memory: only the rows
    are written), so a wrapped kernel reads wrong values rather than crashing."""
    stride = 2**30 + 512
    try:
        storage = torch.empty(2**31 + (num_rows - 1) * stride + width, dtype=torch.float16)
    except RuntimeError:
        pytest.skip("no room for an 8 GiB virtual allocation")
    rows = storage[2**31 :].as_strided((num_rows, width), (stride, 1))
    rows.copy_(torch.randn(num_rows, width))
    return rows


@interpret
def test_row_kernels_address_rows_past_2_pow_31_elements():
    """silu_and_mul, rms_norm and rotary take each token's offset in int64: in int32 it wraps
    once tokens x row width passes 2**31: a 75k-token step of an 8B model's 2 x 14336-wide
    gate_up, 37k of a 70B's."""
    x = _far_rows(3, 2 * 24)
    _close(triton_layers.silu_and_mul_triton(x), silu_and_mul_torch(x), 2e-3)
    weight = torch.randn(48, dtype=torch.float16)
    _close(triton_layers.rms_norm_triton(x, weight, 1e-6), rms_norm_torch(x, weight, 1e-6), 2e-3)
    rope = RotaryEmbedding(16, max_position=10, base=100.0)
    q = x.view(3, 3, 16)
    got = triton_layers.rotary_triton(torch.tensor([1, 5, 9]), q, q, rope.cos_sin_cache, 16)
    expect = rotary_torch(torch.tensor([1, 5, 9]), q, q, rope.cos_sin_cache, 16)
    for g, e in zip(got, expect, strict=True):
        _close(g, e, 2e-3)


# --- GPU ---------------------------------------------------------------------------------------

GPU_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOKENS = [1, 7, 256, 8192]
RTOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _poison_next(*shapes: tuple[int, ...], dtype: torch.dtype) -> None:
    """Leave NaN-filled blocks at the head of the caching allocator, so outputs allocated next
    in the same order start out as NaN and any element a kernel misses fails the comparison."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    poison = [torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape in shapes]
    del poison


def _close_rms_norm(got: torch.Tensor, expect: torch.Tensor) -> None:
    """The kernel rounds in the torch path's order, so in 16-bit dtypes only the rare element
    whose fp32 value sits on a rounding boundary (sum order, rsqrt) may land one ulp away; the
    weight multiply then rounds once more, so such an element may differ by two ulps in all
    (seen on the H200: 1 element of 16.8M in bf16, relative difference 0.012)."""
    _close(got, expect, max(RTOL[got.dtype], 2 * torch.finfo(got.dtype).eps))
    if got.dtype != torch.float32:
        assert (got != expect).float().mean().item() < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_gpu_rms_norm_hidden(dtype, num_tokens, hidden):
    x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda") * 3
    weight = torch.randn(hidden, dtype=dtype, device="cuda")
    expect = rms_norm_torch(x, weight, 1e-6)
    _poison_next(x.shape, dtype=dtype)
    _close_rms_norm(rms_norm(x, weight, 1e-6), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", [1024, 4096])
def test_gpu_add_rms_norm(dtype, num_tokens, hidden):
    x = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda")
    residual = torch.randn(num_tokens, hidden, dtype=dtype, device="cuda") * 3
    weight = torch.randn(hidden, dtype=dtype, device="cuda")
    expect_normed, expect_summed = add_rms_norm_torch(x, residual, weight, 1e-6)
    _poison_next(x.shape, x.shape, dtype=dtype)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, expect_summed)  # one rounding of an exact fp32 sum, as torch
    _close_rms_norm(normed, expect_normed)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("num_heads", [16, 32, 8])
def test_gpu_rms_norm_per_head(dtype, num_tokens, num_heads):
    q, _ = _qkv_split(num_tokens, num_heads, 8, 128, dtype=dtype, device="cuda")
    weight = torch.randn(128, dtype=dtype, device="cuda")
    expect = rms_norm_torch(q, weight, 1e-6)
    _poison_next(q.shape, dtype=dtype)
    _close_rms_norm(rms_norm(q, weight, 1e-6), expect)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [3072, 12288])
def test_gpu_silu_and_mul(dtype, num_tokens, intermediate):
    x = torch.randn(num_tokens, 2 * intermediate, dtype=dtype, device="cuda") * 4
    expect = silu_and_mul_torch(x)
    _poison_next(expect.shape, dtype=dtype)
    _close(silu_and_mul(x), expect, RTOL[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("num_heads", [16, 32])
def test_gpu_rotary(dtype, num_tokens, num_heads):
    rope = RotaryEmbedding(128, max_position=40960, base=1_000_000.0).cuda()
    positions = torch.randint(0, 40960, (num_tokens,), device="cuda")
    q, k = _qkv_split(num_tokens, num_heads, 8, 128, dtype=dtype, device="cuda")
    expect = rotary_torch(positions, q, k, rope.cos_sin_cache, 128)
    _poison_next(q.shape, k.shape, dtype=dtype)
    for got, e in zip(rope(positions, q, k), expect, strict=True):
        _close(got, e, RTOL[dtype])


@pytest.mark.gpu
def test_gpu_layers_replay_in_cuda_graph():
    num_tokens, num_heads, head_dim, dtype = 4, 16, 128, torch.bfloat16
    rope = RotaryEmbedding(head_dim, max_position=4096, base=1_000_000.0).cuda()
    weight = torch.randn(head_dim, dtype=dtype, device="cuda")
    positions = torch.zeros(num_tokens, dtype=torch.long, device="cuda")
    qkv = torch.zeros(num_tokens, (num_heads + 16) * head_dim, dtype=dtype, device="cuda")
    gate_up = torch.zeros(num_tokens, 2 * 3072, dtype=dtype, device="cuda")
    hidden, residual = (torch.zeros(num_tokens, 1024, dtype=dtype, device="cuda") for _ in "hr")
    hidden_weight = torch.randn(1024, dtype=dtype, device="cuda")

    def step() -> tuple[torch.Tensor, ...]:
        q, k, _ = qkv.split([num_heads * head_dim, 8 * head_dim, 8 * head_dim], dim=-1)
        q = rms_norm(q.view(num_tokens, num_heads, head_dim), weight, 1e-6)
        return (*rope(positions, q, k), silu_and_mul(gate_up),
                *add_rms_norm(hidden, residual, hidden_weight, 1e-6))  # fmt: skip

    step()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    positions.copy_(torch.randint(0, 4096, (num_tokens,)))
    qkv.copy_(torch.randn_like(qkv))
    gate_up.copy_(torch.randn_like(gate_up))
    hidden.copy_(torch.randn_like(hidden))
    residual.copy_(torch.randn_like(residual))
    graph.replay()
    q, k, _ = qkv.split([num_heads * head_dim, 8 * head_dim, 8 * head_dim], dim=-1)
    q = rms_norm_torch(q.view(num_tokens, num_heads, head_dim), weight, 1e-6)
    expect = (*rotary_torch(positions, q, k, rope.cos_sin_cache, head_dim),
              silu_and_mul_torch(gate_up),
              *add_rms_norm_torch(hidden, residual, hidden_weight, 1e-6))  # fmt: skip
    for got, e in zip(outputs, expect, strict=True):
        _close(got, e, RTOL[dtype])
