"""The small-batch linear kernels (`ops/triton_skinny.py`) against torch.

Interpreter tests (tiny odd shapes, fp16; the interpreter's bf16 is unreliable):
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_triton_skinny.py -q
GPU tests (the 0.6B and 8B layer shapes, bf16/fp16):
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_triton_skinny.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfit.ops.layers import add_rms_norm_torch, rms_norm_torch, silu_and_mul_torch

triton_skinny = pytest.importorskip("kvfit.ops.triton_skinny")

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py

ROWS = [1, 3, 16]  # the M = 1 path (FMAs), and the tensor-core path partly and fully used


def _weights(n: int, k: int, dtype: torch.dtype, device: str = "cpu", bias: bool = True):
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype=dtype, device=device)
    b = torch.randn(n, generator=g).to(dtype=dtype, device=device) if bias else None
    return w, b


def _linear_fp32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The product accumulated in fp32 and rounded once, as the kernel (and cuBLAS) do."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _close(got: torch.Tensor, expect: torch.Tensor) -> None:
    """Equal to one rounding of the output dtype: only the fp32 summation order differs."""
    assert got.shape == expect.shape and got.dtype == expect.dtype
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), expect.float(), rtol=2 * eps, atol=2 * eps)


# --- interpreter -------------------------------------------------------------------------------


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(37, 100), (300, 1000), (16, 256)])
@pytest.mark.parametrize("bias", [True, False])
def test_skinny_linear_matches_torch(rows: int, n: int, k: int, bias: bool) -> None:
    """N and K off the tiles (37 of 16-row tiles, K 100 and 1000 of 128/256) and on them."""
    w, b = _weights(n, k, torch.float16, bias=bias)
    x = torch.randn(rows, k, dtype=torch.float16)
    _close(triton_skinny.skinny_linear_triton(x, w, b), _linear_fp32(x, w, b))


@interpret
@pytest.mark.parametrize("row_gemv", [True, False])
def test_one_row_takes_either_path(row_gemv: bool) -> None:
    """At one row the plain kernel takes FMAs or the 16-row MMA tile (`ROW_GEMV`), off-tile N
    and K included; both give the product."""
    w, b = _weights(70, 200, torch.float16)
    x = torch.randn(1, 200, dtype=torch.float16)
    got = triton_skinny.skinny_linear_triton(
        x, w, b, config=dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2,
                             ROW_GEMV=row_gemv))
    _close(got, _linear_fp32(x, w, b))


@interpret
def test_skinny_linear_takes_a_config_and_a_strided_input() -> None:
    """The bench's configs are launch overrides, and a row-strided x (a slice) is read right."""
    w, b = _weights(70, 96, torch.float16)
    x = torch.randn(5, 200, dtype=torch.float16)[:, 8:104]
    got = triton_skinny.skinny_linear_triton(
        x, w, b, config=dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2))
    _close(got, _linear_fp32(x, w, b))


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(37, 100), (48, 256)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("norm_block_k", [None, 64])
def test_rms_norm_linear_matches_the_unfused_chain(rows: int, n: int, k: int,
                                                  with_residual: bool,
                                                  norm_block_k: int | None) -> None:
    """The norm's output, rounded as `add_rms_norm` rounds it, feeds the product: the result
    is the chain's to one rounding; the residual sum is the chain's bit for bit. The rms pass
    in one wide block (the default here) or in several, the last one partial."""
    w, b = _weights(n, k, torch.float16)
    x = torch.randn(rows, k, dtype=torch.float16)
    residual = torch.randn(rows, k, dtype=torch.float16) * 3 if with_residual else None
    norm = torch.randn(k, dtype=torch.float16)
    config = (None if norm_block_k is None
              else dict(triton_skinny.skinny_config(n, k), NORM_BLOCK_K=norm_block_k))
    got, summed = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, w, b,
                                                       config=config)
    if with_residual:
        normed, expect_sum = add_rms_norm_torch(x, residual, norm, 1e-6)
        assert torch.equal(summed, expect_sum)
    else:
        normed = rms_norm_torch(x, norm, 1e-6)
        assert summed is x
    _close(got, _linear_fp32(normed, w, b))


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(37, 100), (48, 256)])
def test_silu_and_mul_linear_matches_the_unfused_chain(rows: int, n: int, k: int) -> None:
    w, b = _weights(n, k, torch.float16)
    gate_up = torch.randn(rows, 2 * k, dtype=torch.float16) * 2
    got = triton_skinny.silu_and_mul_linear_triton(gate_up, w, b)
    _close(got, _linear_fp32(silu_and_mul_torch(gate_up), w, b))


@interpret
@pytest.mark.parametrize("rows", [1, 3])  # the FMA path (the model's) and the MMA path
@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
def test_fused_prologues_round_where_the_unfused_kernels_round(prologue: str, rows: int
                                                              ) -> None:
    """An identity weight makes the product exact (one non-zero term per output), so the
    output is the prologue's own result: rounded to fp16 before the norm's scale (and after
    the SiLU, before the product with up), as `_rms_norm_kernel` and `_silu_and_mul_kernel`
    round. The tolerance tests above cannot see a rounding dropped; here about one element in
    ten would differ. One may differ where fp32 rsqrt/exp round otherwise than torch's."""
    k = 256
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, k, generator=g) * 3).half()
    eye = torch.eye(k, dtype=torch.float16)
    if prologue == "silu_and_mul":
        gate_up = torch.cat([x, (torch.randn(rows, k, generator=g) * 3).half()], dim=-1)
        got = triton_skinny.silu_and_mul_linear_triton(gate_up, eye)
        expect = silu_and_mul_torch(gate_up)
    else:
        residual = (torch.randn(rows, k, generator=g) * 3).half() if prologue != "rms_norm" \
            else None
        norm = (torch.rand(k, generator=g) + 0.5).half()
        got, _ = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, eye)
        expect = (rms_norm_torch(x, norm, 1e-6) if residual is None
                  else add_rms_norm_torch(x, residual, norm, 1e-6)[0])
    assert (got != expect).sum() <= 1, (got != expect).sum()


def test_skinny_linear_refuses_what_it_does_not_compute() -> None:
    w, _ = _weights(16, 32, torch.float16)
    with pytest.raises(ValueError, match="M <= 16"):
        triton_skinny.skinny_linear_triton(torch.randn(17, 32, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bf16/fp16"):
        triton_skinny.skinny_linear_triton(torch.randn(2, 32), w.float())
    with pytest.raises(ValueError, match=r"\[N, 32\]"):
        triton_skinny.skinny_linear_triton(torch.randn(2, 32, dtype=torch.float16), w[:, :16])
    assert triton_skinny.skinny_linear_triton(torch.empty(0, 32, dtype=torch.float16),
                                              w).shape == (0, 16)
    x = torch.randn(2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="norm weight"):
        triton_skinny.rms_norm_linear_triton(x, None, torch.ones(32), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        triton_skinny.rms_norm_linear_triton(x, x[:1], torch.ones(32, dtype=x.dtype), 1e-6, w)
    with pytest.raises(ValueError, match="even last dim"):
        triton_skinny.silu_and_mul_linear_triton(torch.randn(2, 33, dtype=torch.float16), w)


def test_skinny_config_gives_every_sm_a_program_and_keeps_block_k_a_divisor() -> None:
    """At the model shapes: BLOCK_N as wide as leaves one program per SM, and BLOCK_K divides
    every K, so the loop runs without a mask."""
    for n in (1024, 4096, 6144, 24576, 151936):
        for k in (1024, 2048, 3072, 4096, 12288):
            cfg = triton_skinny.skinny_config(n, k, num_sms=132)
            assert k % cfg["BLOCK_K"] == 0
            assert -(-n // cfg["BLOCK_N"]) >= 132 or cfg["BLOCK_N"] == 16
    assert triton_skinny.skinny_config(24576, 4096)["BLOCK_N"] == 64
    # One row: FMAs up to 32-row tiles, the MMA for the 64-row ones (timed per shape).
    assert [triton_skinny.skinny_config(n, 4096)["ROW_GEMV"] for n in (4096, 6144, 24576)
            ] == [True, True, False]
    assert triton_skinny.skinny_config(1024, 3072)["BLOCK_N"] == 16
    # A prologue's buffers fit two programs a SM at four stages: a grid beyond that takes three.
    assert triton_skinny.skinny_config(24576, 4096, prologue=True)["num_stages"] == 3
    assert triton_skinny.skinny_config(24576, 4096)["num_stages"] == 4
    assert triton_skinny.skinny_config(6144, 4096, prologue=True)["num_stages"] == 4


# --- GPU ---------------------------------------------------------------------------------------

SHAPES_0_6B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down
SHAPES_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("n", "k"), [*SHAPES_0_6B, *SHAPES_8B, (151936, 1024)])
def test_gpu_skinny_linear_matches_torch(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    w, b = _weights(n, k, dtype, "cuda")
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    _close(triton_skinny.skinny_linear_triton(x, w, b), _linear_fp32(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (6144, 1024), (24576, 4096)])
def test_gpu_rms_norm_linear_matches_the_unfused_chain(dtype: torch.dtype, rows: int, n: int,
                                                      k: int) -> None:
    w, b = _weights(n, k, dtype, "cuda", bias=False)
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    residual = torch.randn(rows, k, dtype=dtype, device="cuda") * 3
    norm = torch.randn(k, dtype=dtype, device="cuda")
    got, summed = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, w, b)
    normed, expect_sum = add_rms_norm_torch(x, residual, norm, 1e-6)
    assert torch.equal(summed, expect_sum)
    _close(got, _linear_fp32(normed, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("n", "k"), [(1024, 3072), (4096, 12288)])
def test_gpu_silu_and_mul_linear_matches_the_unfused_chain(dtype: torch.dtype, rows: int,
                                                          n: int, k: int) -> None:
    w, b = _weights(n, k, dtype, "cuda", bias=False)
    gate_up = torch.randn(rows, 2 * k, dtype=dtype, device="cuda") * 2
    got = triton_skinny.silu_and_mul_linear_triton(gate_up, w, b)
    _close(got, _linear_fp32(silu_and_mul_torch(gate_up), w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_pdl_chain_in_a_graph_gives_the_bits_without_pdl(
        rows: int, early: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's chain of skinny kernels, each reading its predecessor's output, launched with
    programmatic dependent launch and replayed from a CUDA graph: the same bits as without, on
    every replay (a read before `gdc_wait` would see the predecessor's output half written),
    with the successor released early or late (`PDL_EARLY`)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    from kvfit.ops import pdl as ops_pdl

    monkeypatch.setattr(ops_pdl, "PDL_EARLY", early)
    dtype, hidden, inter = torch.bfloat16, 1024, 3072
    qkv, _ = _weights(4096, hidden, dtype, "cuda", bias=False)
    o, _ = _weights(hidden, 4096, dtype, "cuda", bias=False)
    gate_up, _ = _weights(2 * inter, hidden, dtype, "cuda", bias=False)
    down, _ = _weights(hidden, inter, dtype, "cuda", bias=False)
    norm = torch.randn(hidden, dtype=dtype, device="cuda")
    x = torch.randn(rows, hidden, dtype=dtype, device="cuda")

    def layer(pdl: bool) -> torch.Tensor:
        h, residual = x, x
        for _ in range(4):
            q, residual = triton_skinny.rms_norm_linear_triton(h, residual, norm, 1e-6, qkv,
                                                               pdl=pdl)
            h = triton_skinny.skinny_linear_triton(q, o, pdl=pdl)
            g, residual = triton_skinny.rms_norm_linear_triton(h, residual, norm, 1e-6,
                                                               gate_up, pdl=pdl)
            h = triton_skinny.silu_and_mul_linear_triton(g, down, pdl=pdl)
        return h

    expect = layer(False)
    layer(True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = layer(True)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, expect)
