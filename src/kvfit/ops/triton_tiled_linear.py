"""Linear layers at decode batch sizes past the skinny kernels: `y = x W^T (+ b)` for x [M, K]
with `small_batch.MAX_ROWS` < M <= `small_batch.TILED_MAX_ROWS`, W [N, K] row-major, bf16 or
fp16, accumulated in fp32.

A decode step of 17-256 sequences runs ~113 GEMMs (the 0.6B shape) whose weights an H100
streams in 1.5-4 us each; cuBLAS took 6-8 us for them in the offline run's profile (H100,
2026-12-06), ~0.6 s of the 6.9 s run. At these sizes a GEMM is one wave or less of output
tiles, so what sets its time is how many SMs stream weights at once, not the MMA rate.

The kernel is a plain tiled product, shaped for that:

- Programs are numbered M tile fastest: the programs that read one weight tile run together,
  and all but the first find it in L2. Each weight byte leaves DRAM once.
- `tiled_config` picks BLOCK_N as wide as still gives every SM a program, BLOCK_M as tall as
  the batch needs (32, 64 or 128: three compiled variants at most; `M` is not specialised),
  to be timed by `bench/skinny_linear.py --m 64 128 256 --sweep`.
- Rows of x past M, and rows of W past N, are read clamped to the last row rather than
  masked (their products are not stored): the inner loop has no masks when BLOCK_K divides K.

No workspace and no split-K: the memory bound is the output alone. The launch shape follows
the tensor shapes only (graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfit.ops import sm_count
from kvfit.ops.small_batch import SKINNY_DTYPES


def tiled_config(m: int, n: int, k: int, num_sms: int = sm_count.DEFAULT_SMS) -> dict[str, int]:
    """Tiles and launch options for x [m, k] against a [n, k] weight.

    BLOCK_M: 32 up to 32 rows, 64 up to 64, else 128 (one or two M tiles at 256 rows). BLOCK_N:
    the widest of 128/64/32 whose grid still gives every SM a program (the 0.6B's o_proj and
    down_proj, N 1024, at 256 rows: 32-wide tiles, 64 programs; its qkv, N 4096: 32 and 256;
    the LM head 128 and 2,374). BLOCK_K makes one stage of both tiles at most 32 KB (x's
    128 x 64 and W's 32 x 64 at 256 rows), four stages at most 128 KB of shared memory."""
    block_m = 32 if m <= 32 else 64 if m <= 64 else 128
    m_tiles = triton.cdiv(m, block_m)
    block_n = next((b for b in (128, 64) if triton.cdiv(n, b) * m_tiles >= num_sms), 32)
    fit = 16384 // (block_m + block_n)  # elements of K per stage within 32 KB of bf16
    block_k = max(16, min(triton.next_power_of_2(fit + 1) // 2, triton.next_power_of_2(k)))
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
                num_stages=4)


# M changes with the batch: not specialised, so a new batch size compiles nothing new.
@triton.jit(do_not_specialize=["M"])
def _tiled_kernel(
    x, w, bias, out, M, N, stride_xm,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    m_tiles = tl.cdiv(M, BLOCK_M)
    rm = (pid % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm
    w_rows = w + tl.minimum(rn, N - 1).to(tl.int64)[None, :] * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        if K % BLOCK_K == 0:
            a = tl.load(x_rows + k[None, :])
            b = tl.load(w_rows + k[:, None])
        else:
            a = tl.load(x_rows + k[None, :], mask=k[None, :] < K, other=0.0)
            b = tl.load(w_rows + k[:, None], mask=k[:, None] < K, other=0.0)
        acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def tiled_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        config: dict[str, int] | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, K] (any M; shaped for 17-256)
    in one kernel. `config` overrides `tiled_config` (the bench's sweep). Memory: the output
    [M, N] only."""
    if x.dim() != 2:
        raise ValueError(f"the tiled kernel takes x [M, K], got {tuple(x.shape)}")
    if x.stride(1) != 1:  # rows may be strided (a slice), columns not
        x = x.contiguous()
    m, k = x.shape
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, {k}]")
    if x.dtype not in SKINNY_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"the tiled kernel takes bf16/fp16 x and weight of one dtype, got "
                         f"{x.dtype} and {weight.dtype}")
    n = weight.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{n}]")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    launch = dict(config or tiled_config(m, n, k, sm_count.num_sms(x.device)))
    block_m, block_n = launch.pop("BLOCK_M"), launch.pop("BLOCK_N")
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _tiled_kernel[grid](x, weight.contiguous(), bias, out, m, n, x.stride(0), K=k,
                        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, **launch)
    return out
