"""Tensor-parallel layers: each rank holds a slice of a weight and the collectives that make
the slices one layer (Megatron's split). A column-parallel projection keeps its output split; the
row-parallel one after it sums partial products with one all-reduce, so an attention or MLP
block costs one all-reduce. With one rank every layer is the plain one (no collective).

Every parameter says which slice of its checkpoint tensor it holds (`Shard`), so the loader
reads only that slice from safetensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvfit.batch_invariant import is_batch_invariant
from kvfit.batch_invariant.functional import linear
from kvfit.distributed import all_gather, all_reduce, tp_rank, tp_size
from kvfit.ops.attention_input import AttentionInputArgs
from kvfit.ops.small_batch import (
    fuses_attention_input,
    fuses_prologue,
    qkv_attention_input,
    rms_norm_linear,
    silu_and_mul_linear,
    skinny_linear,
    takes_skinny_path,
)


def small_batch_fused(x: torch.Tensor) -> bool:
    """Whether the norm or SiLU before a linear layer of input `x` rides in its kernel now
    (`kvfit.ops.small_batch`); never in the batch-invariant mode, whose GEMMs keep one K
    order for every M."""
    return fuses_prologue(x) and not is_batch_invariant()


def small_batch_attention_input(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a QKV projection of input `x` runs the attention input in its kernel now
    (`kvfit.ops.small_batch.fuses_attention_input`); never in the batch-invariant mode."""
    return fuses_attention_input(x, head_dim) and not is_batch_invariant()


def _local_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's product: the small-batch kernel for a few rows while it is on, else
    `linear` (cuBLAS, or the batch-invariant GEMM in that mode)."""
    if takes_skinny_path(x) and not is_batch_invariant():
        return skinny_linear(x, weight, bias)
    return linear(x, weight, bias)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank keeps: `size` entries of dimension `dim`
    (which has `full` entries in the checkpoint) from `start`."""

    dim: int
    start: int
    size: int
    full: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole checkpoint tensor `tensor`."""
        return tensor.narrow(self.dim, self.start, self.size)

    def index(self) -> tuple[slice, ...]:
        """The part as an index into the whole tensor (for safetensors' `get_slice`)."""
        return (slice(None),) * self.dim + (slice(self.start, self.start + self.size),)

    def full_shape(self, shape: torch.Size) -> tuple[int, ...]:
        """The checkpoint tensor's shape, given the shape of this rank's part."""
        return (*shape[: self.dim], self.full, *shape[self.dim + 1 :])


def even_shard(full: int, dim: int = 0) -> Shard:
    """This rank's equal part of `full` entries (the caller has checked divisibility)."""
    size = full // tp_size()
    return Shard(dim, tp_rank() * size, size, full)


def kv_head_shard(num_kv_heads: int, head_dim: int) -> Shard:
    """This rank's K (or V) projection rows: its share of the KV heads, or, with more ranks
    than KV heads, a copy of the one head its query heads read (rank r: head r * kv / tp)."""
    full = num_kv_heads * head_dim
    size = tp_size()
    if num_kv_heads >= size:
        return even_shard(full)
    return Shard(0, tp_rank() * num_kv_heads // size * head_dim, head_dim, full)


class MergedColumnParallelLinear(nn.Module):
    """Projections of one input (q/k/v, gate/up) stacked along the output dim, so they run as
    one GEMM; this rank holds each projection's `Shard` of rows and its output stays split.

    `shards` maps each checkpoint projection (`q_proj`, ...) to the rows this rank keeps, in
    order; the loader finds a checkpoint tensor's place through `shard`.
    """

    def __init__(self, in_features: int, shards: dict[str, Shard], bias: bool) -> None:
        super().__init__()
        self.shards = shards
        self.output_sizes = [s.size for s in shards.values()]
        self.weight = nn.Parameter(torch.empty(sum(self.output_sizes), in_features))
        self.bias = nn.Parameter(torch.empty(sum(self.output_sizes))) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _local_linear(x, self.weight, self.bias)

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """`(self(rms_norm(x + residual)), x + residual)` (without a residual, `x` second) in
        one kernel (`kvfit.ops.small_batch.rms_norm_linear`): the small-batch path only."""
        return rms_norm_linear(x, residual, norm_weight, eps, self.weight, self.bias)

    def forward_attention_input(
        self, x: torch.Tensor, args: AttentionInputArgs,
        norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(q, x + residual or None): this QKV projection and the attention input of this
        rank's heads in one kernel, the input norm `norm` in it too where given
        (`kvfit.ops.small_batch.qkv_attention_input`): the small-batch path only."""
        return qkv_attention_input(x, self.weight, self.bias, args, norm)

    def shard(self, param: torch.Tensor, name: str) -> torch.Tensor:
        """The rows of `param` (this module's weight or bias) that checkpoint `name` fills."""
        offset = 0
        for shard_name, size in zip(self.shards, self.output_sizes, strict=True):
            if shard_name == name:
                return param.narrow(0, offset, size)
            offset += size
        raise KeyError(name)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with the input dim split: each rank multiplies its slice of `x` (the
    column-parallel output before it) by its columns of W, one all-reduce sums the parts, then
    the (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.tp_shards = {"weight": even_shard(in_features, dim=1)}
        # This rank's sizes, as `nn.Linear` names them.
        self.in_features, self.out_features = in_features // tp_size(), out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return _local_linear(x, self.weight, self.bias)
        y = _sum_over_ranks(_local_linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)

    def forward_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """`self(silu_and_mul(x))` with the SiLU in the local product's kernel
        (`kvfit.ops.small_batch.silu_and_mul_linear`): the small-batch path only. Each rank's
        `x` holds its gate and up columns, so the SiLU of its slice is its share."""
        if tp_size() == 1:
            return silu_and_mul_linear(x, self.weight, self.bias)
        y = _sum_over_ranks(silu_and_mul_linear(x, self.weight))
        return y if self.bias is None else y.add_(self.bias)


def _sum_over_ranks(y: torch.Tensor) -> torch.Tensor:
    """The all-reduce of the ranks' partial products; in the batch-invariant mode gathered and
    added in rank order, since the collective's algorithm (and so its summation order) follows
    the message size, which follows the number of rows. Memory in the mode: tp_size copies."""
    if not is_batch_invariant():
        return all_reduce(y)
    parts = all_gather(y[None], dim=0)
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total


def _vocab_shard(vocab_size: int) -> tuple[Shard, int]:
    """(this rank's checkpoint rows, the rows it holds): the vocabulary padded to a multiple
    of the ranks, so every rank holds as many rows; rows past the vocabulary stay zero."""
    per_rank = -(-vocab_size // tp_size())
    start = tp_rank() * per_rank
    return Shard(0, start, max(0, min(per_rank, vocab_size - start)), vocab_size), per_rank


class VocabParallelEmbedding(nn.Module):
    """Token embeddings with the vocabulary split over ranks: each rank looks up the ids in its
    range (others give zero rows), one all-reduce sums them."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        shard, self.rows = _vocab_shard(vocab_size)
        self.start = shard.start
        self.tp_shards = {"weight": shard}
        self.weight = nn.Parameter(torch.zeros(self.rows, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """The output projection with the vocabulary split like `VocabParallelEmbedding` (so a tied
    head shares its weight): each rank computes its logit columns, one all-gather joins them.

    Memory: the gathered logits [N, padded vocab] plus, when the model has more than one rank,
    the gather's buffer of the same size (both at the largest N warmup samples)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        shard, rows = _vocab_shard(vocab_size)
        self.vocab_size = vocab_size
        self.tp_shards = {"weight": shard}
        self.weight = nn.Parameter(torch.zeros(rows, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather(_local_linear(hidden, self.weight), dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[:, : self.vocab_size]
