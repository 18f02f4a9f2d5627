"""Linear layers for few rows (the small-batch kernels): `y = x W^T (+ b)` in one kernel on
CUDA (`triton_skinny`), `F.linear` elsewhere.

At decode batch 1 a step is paced by its kernel nodes, not its bytes: cuBLAS takes 5-8 us for a
2-8 MB weight that an H200 streams in ~2 us, sometimes as two nodes (split-K and its reduction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MAX_ROWS = 16
"""The most rows (tokens) a forward may have to take the skinny kernels. Up to 16 rows cost the
kernel the same: its tensor-core product is 16 rows tall whatever M is (`tl.dot`'s smallest
M), so one compiled variant serves every M up to here. Past it a program with a 16-row weight
slice would read more bytes of x (from L2) than of its weights, and cuBLAS's tiled kernels,
which reuse each weight tile across rows, are the better tool."""

SKINNY_DTYPES = (torch.bfloat16, torch.float16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for at most `MAX_ROWS` rows, in one kernel on CUDA."""
    if x.is_cuda:
        from kvfit.ops.triton_skinny import skinny_linear_triton  # CUDA-only dependency

        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)
