"""Triton row log-sum-exp: one program per row, fixed tiles, lanes summed in one fixed tree."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _logsumexp_kernel(x, out, stride_r, stride_v, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = x + row.to(tl.int64) * stride_r
    cols = tl.arange(0, BLOCK)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        t = tl.load(base + (v0 + cols) * stride_v, mask=v0 + cols < V, other=float("-inf"))
        top = tl.maximum(top, t.to(tl.float32))
    m = tl.max(top)
    # An infinite max is no shift: inf - inf would be NaN where torch's log-sum-exp gives the
    # row's +-inf (a float16 logit that overflowed, a row of only -inf).
    shift = tl.where((m == float("-inf")) | (m == float("inf")), 0.0, m)
    # Each lane sums its columns in tile order; the lanes are then summed by one fixed tree.
    acc = tl.zeros([BLOCK], tl.float32)
    for v0 in range(0, V, BLOCK):
        t = tl.load(base + (v0 + cols) * stride_v, mask=v0 + cols < V, other=float("-inf"))
        acc += tl.exp(t.to(tl.float32) - shift)
    tl.store(out + row, tl.log(tl.sum(acc)) + shift)


def logsumexp_triton(x: torch.Tensor) -> torch.Tensor:
    """`[R, V]` (any float dtype and strides) -> `[R]` float32, one program per row."""
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        _logsumexp_kernel[(x.shape[0],)](x, out, *x.stride(), x.shape[1], BLOCK=BLOCK,
                                         num_warps=8)
    return out
