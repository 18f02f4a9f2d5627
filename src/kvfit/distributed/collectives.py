"""Collectives over the tensor-parallel group; each is the identity in a world of one, so
models call them unconditionally and a single device pays nothing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kvfit.distributed.parallel_state import cpu_group, device_group, tp_size

# torch 2.13 renamed all_gather_into_tensor (deprecated there); older releases have only it.
_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`x` reduced over the ranks (`op`: "sum" or "max"), in place; returns `x`."""
    if tp_size() > 1:
        dist.all_reduce(x, op=_REDUCE_OPS[op], group=device_group())
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order (a new tensor)."""
    size = tp_size()
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_into(out, x, group=device_group())
    dim = dim % x.dim()
    if dim == 0:
        return out
    # [size, ..., d, ...] -> [..., size * d, ...]
    out = out.view(size, *x.shape).movedim(0, dim)
    return out.reshape(*x.shape[:dim], size * x.shape[dim], *x.shape[dim + 1:])


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Rank `src`'s `x` on every rank, in place; returns `x`."""
    if tp_size() > 1:
        dist.broadcast(x, src, group=device_group())
    return x


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order, over the CPU group (never the device)."""
    size = tp_size()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=cpu_group())
    return out
