"""Triton GEMM with one K order for every M and no split-K: the CUDA path of
`batch_invariant_linear`.

Each output tile accumulates its K loop in BLOCK_K steps from k = 0 upward, in float32, inside
one program. Row i of the output is then the same sequence of tensor-core products and adds
whether the launch has 1 row or 8192, and wherever row i sits in its tile. cuBLAS promises none
of this: it picks kernels, tiles and split-K factors by M.

The tile shape may follow M for 16-bit inputs only, and BLOCK_K never does: a 16-bit tensor-core
instruction adds its k = 16 products into the float32 accumulator in one fixed order whatever
the tile's rows and columns, so each output element sees the same additions in any tile
(`bench/batch_invariant_gemm.py` checks the bits of every config against the default one, and
the registry's linear check crosses each M threshold). float32 multiplies on FMA units, whose
order follows the layout: it keeps one tile for every M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SMALL_M = 128
"""Up to this many rows (decode steps) the tiles are narrow: without split-K, a program per
64-row by BLOCK_N tile is all the parallelism a small M has."""
LARGE_M = 1024
"""From this many rows (prefill chunks) every weight takes 128 x 128 tiles, which reuse each
loaded operand twice as often (1.3-2.2x faster than the narrow tiles at 2048 and 8192 rows on
an H200)."""


def matmul_config(m: int, n: int, k: int, dtype: torch.dtype) -> dict[str, int]:
    """The tile config for `m` rows times a `[n, k]` weight of `dtype`, as measured best on an
    H200 (`bench/batch_invariant_gemm.py`, 2026-12-04). Every config it returns keeps
    BLOCK_K = 64, so a row's bits never depend on which one ran (see the module docstring);
    float32 takes the narrow config at every M.

    Narrow tiles for narrow weights at small M: the 0.6B model's o_proj and down_proj (N = 1024)
    need 32-column tiles to give an H200's 132 SMs a wave at 256 rows. Wide weights (N >= 6K:
    gate_up, the LM head) take the big tiles from SMALL_M rows on, where their narrow tiles
    run 1.2-1.7x slower."""
    if dtype != torch.float32 and (m >= LARGE_M or (m > SMALL_M and n >= 6 * k)):
        return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    block_n = 32 if n <= 1024 else 64 if n <= 8192 else 128
    return dict(BLOCK_M=64, BLOCK_N=block_n, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)


# M changes every step: not specialised, so a new row count never compiles a new variant (and
# the divisibility hints Triton derives from M cannot change the code that runs).
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a, b, bias, c, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    # Grouped launch order (GROUP_M row tiles share each column tile) for L2 reuse of W; the
    # order programs run in never changes what any one of them computes.
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_size
    pid_n = (pid % (GROUP_M * tiles_n)) // group_size

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a + rm.to(tl.int64)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b + rn.to(tl.int64)[None, :] * stride_bn + rk[:, None] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + rk) < K
        x = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_mask[None, :], other=0.0)
        w = tl.load(b_ptrs, mask=k_mask[:, None] & (rn[None, :] < N), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """`x` `[M, K]` times `weight^T` (`weight` `[N, K]`, any strides) plus `bias` `[N]`, into a
    new `[M, N]` of x's dtype. float32 inputs multiply in IEEE float32 (no TF32).

    `config` (tile sizes, `num_warps`, `num_stages`; default `matmul_config(M, N, K, dtype)`)
    is for `bench/batch_invariant_gemm.py`, which times other configs and compares their bits:
    a caller that passes one must pass the same for every M, or rows may lose their invariance.

    Memory: the output only (no split-K workspace).
    """
    num_rows, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.dtype != weight.dtype:
        raise ValueError(f"x {list(x.shape)} {x.dtype} and weight {list(weight.shape)} "
                         f"{weight.dtype} do not multiply: weight must be [N, {k}] {x.dtype}")
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    cfg = matmul_config(num_rows, n, k, x.dtype) if config is None else config
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _matmul_kernel[grid](
        x, weight, weight if bias is None else bias, out, num_rows, n, k,
        *x.stride(), *weight.stride(), *out.stride(),
        HAS_BIAS=bias is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **cfg,
    )  # fmt: skip
    return out
