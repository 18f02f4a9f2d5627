"""`y = x W^T + b` whose row i does not depend on how many rows `x` has or where row i sits.

A GEMM library picks its blocking, kernel and split of the K reduction from the shape: on this
project's CPU (MKL, float32) row 0 of a 2-row product already differs from the same row alone.
The torch path therefore calls the library on fixed `ROW_TILE`-row tiles only (the last one
zero-padded), so every call has one shape; on CUDA a Triton kernel with one K order and no
split-K for every M (`triton_matmul`) does the same job near cuBLAS's speed.
"""

from __future__ import annotations

import torch

ROW_TILE = 16
"""Rows of every GEMM call on the torch path. Small, so a decode step pads little."""


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with each output row a function of its input row alone.

    `x` is `[..., K]`, `weight` `[N, K]`; returns `[..., N]` in x's dtype. Extra memory: on
    the torch path one padded copy of x when M is not a multiple of `ROW_TILE`; on CUDA none.
    """
    rows = x.reshape(-1, x.shape[-1])
    if x.is_cuda:
        from kvfit.batch_invariant.triton_matmul import matmul_triton  # CUDA-only dependency

        out = matmul_triton(rows, weight, bias)
    else:
        out = row_tiled_linear(rows, weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def row_tiled_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    tile: int = ROW_TILE,
) -> torch.Tensor:  # fmt: skip
    """The torch path: `x` `[M, K]` times `weight^T` in `tile`-row GEMM calls of one shape."""
    num_rows = x.shape[0]
    pad = -num_rows % tile
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = x.new_empty(x.shape[0], weight.shape[0])
    for start in range(0, x.shape[0], tile):
        torch.mm(x[start : start + tile], weight.t(), out=out[start : start + tile])
    out = out[:num_rows]
    return out if bias is None else out.add_(bias)

