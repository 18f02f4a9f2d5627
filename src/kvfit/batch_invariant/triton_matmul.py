"""Triton GEMM with one tile config for every M and no split-K: the CUDA path of
`batch_invariant_linear`.

Each output tile accumulates its K loop in BLOCK_K steps from k = 0 upward, in float32, inside
one program; the tile sizes depend on the weight's shape only, never on M. Row i of the output
is then the same sequence of tensor-core products and adds whether the launch has 1 row or
8192, and wherever row i sits in its tile. cuBLAS promises none of this: it picks kernels,
tiles and split-K factors by M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def matmul_config(n: int) -> dict[str, int]:
    """The tile config for a weight of `n` output features: a function of the weight's shape
    alone, never of M, so one layer runs one config for every batch (the invariance rests on
    it). Narrow tiles for narrow weights: without split-K, a program per 64-row by BLOCK_N
    tile is all the parallelism a decode step has, and the 0.6B model's o_proj and down_proj
    (N = 1024) need 32-column tiles to give an H200's 132 SMs a wave at 256 rows."""
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

    `config` (tile sizes, `num_warps`, `num_stages`; default `matmul_config(N)`) is for
    `bench/batch_invariant_gemm.py`, which times other configs and compares their bits: a
    caller that passes one must pass the same for every M, or rows lose their invariance.

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
    cfg = matmul_config(n) if config is None else config
    grid = (triton.cdiv(num_rows, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _matmul_kernel[grid](
        x, weight, weight if bias is None else bias, out, num_rows, n, k,
        *x.stride(), *weight.stride(), *out.stride(),
        HAS_BIAS=bias is not None,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        **cfg,
    )  # fmt: skip
    return out
