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
    the torch path one padded tile of x and its product when M is not a multiple of
    `ROW_TILE`; on CUDA none.
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
    """The torch path: `x` `[M, K]` times `weight^T` in `tile`-row GEMM calls of one shape.

    The last rows, short of a tile, are padded in a tile of their own (`[tile, K]` and its
    `[tile, N]` product), not in a padded copy of `x`: that copy, `[M, K]` at a step of any
    token count but a multiple of `tile`, was more than a step of the whole token budget
    (commonly a multiple) allocates, which is all warmup measured."""
    num_rows = x.shape[0]
    whole = num_rows - num_rows % tile
    out = x.new_empty(num_rows, weight.shape[0])
    for start in range(0, whole, tile):
        torch.mm(x[start : start + tile], weight.t(), out=out[start : start + tile])
    if whole < num_rows:
        last = x.new_zeros(tile, x.shape[1])
        last[: num_rows - whole] = x[whole:]
        out[whole:] = torch.mm(last, weight.t())[: num_rows - whole]
    return out if bias is None else out.add_(bias)

