"""Row-wise log-sum-exp whose value for a row does not depend on the other rows.

torch's reductions choose how to split a row by the shape: on CUDA the number of rows decides
how many blocks share one row; on the CPU a lone long row is split across threads while many
rows are not. Here every row is reduced in `CHUNK`-column pieces in column order, then the
pieces in order (the torch path), or by one program per row in fixed tiles (CUDA).
"""

from __future__ import annotations

import torch

CHUNK = 1024
"""Columns per partial sum on the torch path."""


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """`x.float().logsumexp(-1)` for `x` `[R, V]`, each row reduced in a fixed order: `[R]`
    float32. A row of only -inf gives -inf.

    Extra memory: on the torch path one float32 `[R, V]` (callers pass blocks of rows); on
    CUDA none besides the output.
    """
    if x.is_cuda:
        from kvfit.batch_invariant.triton_logsumexp import logsumexp_triton  # CUDA only

        return logsumexp_triton(x)
    return logsumexp_torch(x)


def logsumexp_torch(x: torch.Tensor) -> torch.Tensor:
    """The torch path of `row_logsumexp`: max, exp, sums of `CHUNK`-column pieces, their sum."""
    x = x.float()
    top = x.amax(dim=-1)  # exact, whatever the order
    shift = torch.where(torch.isinf(top), 0.0, top)
    e = (x - shift[:, None]).exp_()
    whole = e.shape[1] // CHUNK * CHUNK
    # Each piece's sum is one reduction per output row (never split across threads), and there
    # are always several outputs or a short row: torch splits a reduction only when a single
    # output has more than 32k inputs.
    total = e[:, :whole].unflatten(1, (-1, CHUNK)).sum(-1).sum(-1) if whole else 0.0
    if whole < e.shape[1]:
        total = total + e[:, whole:].sum(-1)
    return total.log_().add_(shift)
