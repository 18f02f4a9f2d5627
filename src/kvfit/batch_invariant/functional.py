"""The ops the model and the sampler call, each switching to its batch-invariant kernel while
the mode is on (`batch_invariant_mode`); outside it they are the default kernels unchanged."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfit.batch_invariant.logsumexp import row_logsumexp
from kvfit.batch_invariant.matmul import batch_invariant_linear
from kvfit.batch_invariant.mode import is_batch_invariant
from kvfit.ops import layers
from kvfit.ops.attention import AttentionMetadata
from kvfit.ops.attention import paged_attention as _paged_attention


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """`F.linear`; in the mode `batch_invariant_linear` (one K order, no split-K)."""
    if is_batch_invariant():
        return batch_invariant_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`ops.layers.silu_and_mul`; in the mode on the CPU, `silu_and_mul_exp`."""
    if is_batch_invariant() and not x.is_cuda:
        return silu_and_mul_exp(x)
    return layers.silu_and_mul(x)


def silu_and_mul_exp(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` as `gate / (1 + exp(-gate))` in float32, rounded like the Triton
    kernel. torch's fused CPU silu computes vector lanes and leftover elements by different
    formulas, so an element's result follows where the batch puts it; `exp` and the IEEE
    operations here agree in both (`registry` checks it)."""
    gate, up = x.chunk(2, dim=-1)
    g = gate.float()
    silu = (g / (1.0 + torch.exp(-g))).to(x.dtype)
    return silu * up


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    metadata: AttentionMetadata, scale: float,
                    out: torch.Tensor | None = None, *, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`ops.paged_attention`, with `batch_invariant` set in the mode."""
    return _paged_attention(query, k_cache, v_cache, metadata, scale, out,
                            batch_invariant=is_batch_invariant(), k_scale=k_scale,
                            v_scale=v_scale)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Row-wise float32 log-sum-exp of `[R, V]`; in the mode `row_logsumexp`."""
    if is_batch_invariant():
        return row_logsumexp(x)
    return x.float().logsumexp(dim=-1)


def topk_indices(x: torch.Tensor, n: int) -> torch.Tensor:
    """Column ids of the `n` largest entries of each row of `[R, V]`. In the mode ties go to
    the lower column (a stable sort), where `topk`'s choice among equal values follows its
    algorithm for the shape. Extra memory in the mode: the sorted values and their int64 ids,
    `[R, V]` each."""
    if is_batch_invariant():
        return x.sort(dim=-1, descending=True, stable=True).indices[:, :n]
    return x.topk(n, dim=-1).indices
