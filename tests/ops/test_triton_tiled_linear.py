"""The tiled linear kernel for decode batches past 16 rows (`ops/triton_tiled_linear.py`)
against torch.

Interpreter tests (small odd shapes, fp16; the interpreter's bf16 is unreliable):
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_triton_tiled_linear.py -q
GPU tests (the 0.6B and 8B layer shapes at 17-256 rows, bf16/fp16):
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_triton_tiled_linear.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton_tiled = pytest.importorskip("kvfit.ops.triton_tiled_linear")

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py

SMALL = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2)
"""Small tiles, so that the interpreter's runs stay short and every edge is crossed."""


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
@pytest.mark.parametrize("rows", [17, 40, 64, 70])
@pytest.mark.parametrize(("n", "k"), [(37, 100), (96, 64)])
@pytest.mark.parametrize("bias", [True, False])
def test_tiled_linear_matches_torch(rows: int, n: int, k: int, bias: bool) -> None:
    """M, N and K off their tiles (rows past M and N read clamped, K masked) and on them."""
    w, b = _weights(n, k, torch.float16, bias=bias)
    x = torch.randn(rows, k, dtype=torch.float16)
    _close(triton_tiled.tiled_linear_triton(x, w, b, config=SMALL), _linear_fp32(x, w, b))


@interpret
def test_tiled_linear_takes_its_default_config_and_strided_inputs() -> None:
    """`tiled_config`'s tiles (BLOCK_M 64 at 33-64 rows), a row-strided x (a slice) and a
    column-strided one (a transpose, copied)."""
    w, b = _weights(70, 96, torch.float16)
    x = torch.randn(50, 200, dtype=torch.float16)[:, 8:104]
    _close(triton_tiled.tiled_linear_triton(x, w, b), _linear_fp32(x, w, b))
    xt = torch.randn(96, 40, dtype=torch.float16).t()
    _close(triton_tiled.tiled_linear_triton(xt, w, b), _linear_fp32(xt, w, b))


def test_tiled_linear_refuses_what_it_does_not_compute() -> None:
    w, _ = _weights(8, 16, torch.float16)
    with pytest.raises(ValueError, match=r"must be \[N, 32\]"):
        triton_tiled.tiled_linear_triton(torch.zeros(20, 32, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bf16/fp16"):
        triton_tiled.tiled_linear_triton(torch.zeros(20, 16), w.float())
    with pytest.raises(ValueError, match=r"takes x \[M, K\]"):
        triton_tiled.tiled_linear_triton(torch.zeros(2, 20, 16, dtype=torch.float16), w)
    with pytest.raises(ValueError, match=r"bias \(7,\) must be \[8\]"):
        triton_tiled.tiled_linear_triton(torch.zeros(20, 16, dtype=torch.float16), w,
                                         torch.zeros(7, dtype=torch.float16))
    assert triton_tiled.tiled_linear_triton(torch.zeros(0, 16, dtype=torch.float16),
                                            w).shape == (0, 8)


@pytest.mark.parametrize("m", [17, 32, 33, 64, 65, 128, 200, 256])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),
                                      (24576, 4096), (4096, 12288), (151936, 1024)])
def test_tiled_config_fits_shared_memory_and_gives_every_sm_a_program_where_it_can(
        m: int, n: int, k: int) -> None:
    """One stage of both tiles within 32 KB (four stages within 128 KB of an SM's 228), BLOCK_K
    a divisor of every model's K, BLOCK_M no taller than the batch needs, and a grid of at
    least one program an SM unless even 32-wide tiles cannot make one."""
    c = triton_tiled.tiled_config(m, n, k, num_sms=132)
    assert (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 2 <= 32 * 1024
    assert k % c["BLOCK_K"] == 0
    assert c["BLOCK_M"] < 2 * m or c["BLOCK_M"] == 32
    programs = -(-m // c["BLOCK_M"]) * -(-n // c["BLOCK_N"])
    assert programs >= 132 or c["BLOCK_N"] == 32


# --- GPU ---------------------------------------------------------------------------------------

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072),  # the 0.6B's layers
          (6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288),  # the 8B's
          (151936, 1024)]  # an LM head


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [17, 48, 64, 100, 256])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_gpu_tiled_linear_matches_torch(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    w, b = _weights(n, k, dtype, "cuda")
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    _close(triton_tiled.tiled_linear_triton(x, w, b), _linear_fp32(x, w, b))
