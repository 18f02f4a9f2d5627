"""The small-batch kernels switch (`small_batch_kernels`, on by default;
`--no-small-batch-kernels` for cuBLAS at every size) and the linear layers it routes:
`y = x W^T (+ b)` for a few rows, alone or with the op before it (residual add + RMSNorm,
SiLU-and-mul) folded into the same kernel (`triton_skinny`).

At decode batch 1 a step is paced by its kernel nodes, not its bytes: cuBLAS takes 5-8 us for a
2-8 MB weight that an H200 streams in ~2 us, sometimes as two nodes (split-K and its reduction),
and each norm and SiLU between the GEMMs is a node of its own. The skinny path is one node per
linear layer and none for those two ops.

A context variable, like the batch-invariant mode: the model runner sets it around each step it
launches and each CUDA graph it captures, so two engines in one process each run their own
kernels and a graph replays those chosen at its capture. Decode graphs are captured per batch
size, so each graph holds one path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfit.ops.attention_input import AttentionInputArgs
from kvfit.ops.layers import add_rms_norm_torch, rms_norm_torch, silu_and_mul_torch

MAX_ROWS = 16
"""The most rows (tokens) a forward may have to take the skinny kernels. Up to 16 rows cost the
kernel the same: its tensor-core product is 16 rows tall whatever M is (`tl.dot`'s smallest
M), so one compiled variant serves every M up to here. Past it a program with a 16-row weight
slice would read more bytes of x (from L2) than of its weights, and cuBLAS's tiled kernels,
which reuse each weight tile across rows, are the better tool."""

SKINNY_DTYPES = (torch.bfloat16, torch.float16)

FUSED_MAX_ROWS = 1
"""The most rows at which the model folds the norms and the SiLU into the linear layer after
them (`rms_norm_linear`, `silu_and_mul_linear`); from 2 rows up to `MAX_ROWS` it runs them as
their own kernels and the plain skinny product. Every program of a fused kernel recomputes
its prologue, ~10 (norm) to ~30 (SiLU) instructions per x element: nothing for one row, and
at 16 rows the SiLU alone costs the down projection ~2,000 instructions per 8 KB weight stage
(`triton_skinny`). `bench/skinny_linear.py` times fused against unfused at 1-16 rows; raise
this where it says the fused pairs win."""


QKV_EPILOGUE_DEFAULT = False
"""Whether an engine on the small-batch kernels runs each layer's attention input (q/k norm,
rope, K/V store) in its QKV projection's kernel (`qkv_attention_input`): one graph node fewer a
layer at decode sizes. The model runner allocates the head tickets the epilogue counts with
where it is on; `fuses_attention_input` sees them. Off: whole decode steps with it against
without (H100, 2026-12-06, `bench/throughput.py --qkv-epilogue both`, medians of 3 in one
call) were 1.5% (one sequence) and 1.1% (four) faster on the 8B shape but 5.6% and 5.3%
slower on the 0.6B's, whose QKV kernel grew 2.4 us a layer (each program's ticket, then the
head's last program reading its columns back), about the 2.65 us node it replaced, while
the device's idle time between nodes grew ~3 us a layer (docs/benchmarks.md)."""


@dataclass(frozen=True)
class SplitKScratch:
    """Device memory the skinny kernels' split-K launches share (`triton_skinny`): each
    program's fp32 partial product (`partials`) and one int32 ticket per output tile
    (`tickets`, zero between launches: a tile's last program sets its ticket back). One
    engine's launches run one after another on its stream, so one scratch serves them all;
    two engines need two. The model runner allocates it once, before warmup measures memory
    and graphs capture its addresses (`triton_skinny.allocate_split_k_scratch`, where
    `triton_skinny.SPLIT_K_DEFAULT` or `QKV_EPILOGUE_DEFAULT` is on), and puts it in effect
    with `small_batch_kernels`; without one, or with no `partials` (split K off), the kernels
    never split. `head_tickets`: one int32 counter per head of a QKV projection with the
    attention-input epilogue (`qkv_attention_input`), zero between launches like `tickets`;
    none where the epilogue is off."""

    partials: torch.Tensor
    tickets: torch.Tensor
    head_tickets: torch.Tensor


_ENABLED: ContextVar[bool] = ContextVar("kvfit_small_batch_kernels", default=False)
_SCRATCH: ContextVar[SplitKScratch | None] = ContextVar("kvfit_split_k_scratch", default=None)


def is_small_batch_enabled() -> bool:
    """Whether `small_batch_kernels` is on for the ops called now."""
    return _ENABLED.get()


def split_k_scratch() -> SplitKScratch | None:
    """The split-K scratch in effect for the ops called now (None: no split)."""
    return _SCRATCH.get()


@contextmanager
def small_batch_kernels(enabled: bool = True,
                        scratch: SplitKScratch | None = None) -> Iterator[None]:
    """Run the block with the small-batch kernels on (or off), their split-K launches and QKV
    epilogue using `scratch` (None: neither); the previous state comes back on exit."""
    token, scratch_token = _ENABLED.set(enabled), _SCRATCH.set(scratch)
    try:
        yield
    finally:
        _SCRATCH.reset(scratch_token)
        _ENABLED.reset(token)


def takes_skinny_path(x: torch.Tensor) -> bool:
    """Whether a linear layer of input `x` [T, K] runs the skinny kernels now: the switch is
    on, `x` is a CUDA bf16/fp16 tensor and 1 <= T <= `MAX_ROWS`."""
    return (_ENABLED.get() and x.is_cuda and x.dtype in SKINNY_DTYPES
            and 0 < x.shape[0] <= MAX_ROWS)


def fuses_prologue(x: torch.Tensor) -> bool:
    """Whether the norm or SiLU before a linear layer of input `x` rides in its kernel now:
    `takes_skinny_path(x)` and at most `FUSED_MAX_ROWS` rows."""
    return takes_skinny_path(x) and x.shape[0] <= FUSED_MAX_ROWS


def fuses_attention_input(x: torch.Tensor, head_dim: int) -> bool:
    """Whether a QKV projection of input `x` and heads of `head_dim` runs the attention input
    in its kernel now (`qkv_attention_input`): `takes_skinny_path(x)`, the scratch in effect
    has head tickets (`QKV_EPILOGUE_DEFAULT`), and a head is whole tiles of 16 columns (the
    kernel's narrowest)."""
    scratch = _SCRATCH.get()
    return (takes_skinny_path(x) and head_dim % 16 == 0 and scratch is not None
            and scratch.head_tickets.numel() > 0)


def qkv_attention_input(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, args: AttentionInputArgs,
    norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A QKV projection and its attention input: `F.linear(x, weight, bias)` (after `norm` =
    (residual, norm weight, eps), `rms_norm_linear`'s, where given), then `attention_input` of
    its q, k and v heads with `args`: K/V stored at the slots. Returns (q [T, num_heads,
    head_dim], normalised and rotated, x + residual where `norm` is given, else None). On CUDA
    one kernel (`triton_skinny.qkv_attention_input_triton`), whose q is a view of the
    projection's output; the head counts come from the cache's shape."""
    if x.is_cuda:
        from kvfit.ops.triton_skinny import qkv_attention_input_triton  # CUDA-only dependency

        return qkv_attention_input_triton(x, weight, bias, args, norm)
    if norm is None:
        qkv, summed = F.linear(x, weight, bias), None
    else:
        qkv, summed = rms_norm_linear_torch(x, norm[0], norm[1], norm[2], weight, bias)
    return args.apply(*args.split(qkv)), summed


def skinny_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for at most `MAX_ROWS` rows, in one kernel on CUDA."""
    if x.is_cuda:
        from kvfit.ops.triton_skinny import skinny_linear_triton  # CUDA-only dependency

        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(F.linear(rms_norm(x + residual), weight, bias), x + residual)` (without a residual,
    `x` itself is the second) in one kernel on CUDA; the norm's output never reaches memory."""
    if x.is_cuda:
        from kvfit.ops.triton_skinny import rms_norm_linear_triton  # CUDA-only dependency

        return rms_norm_linear_triton(x, residual, norm_weight, eps, weight, bias)
    return rms_norm_linear_torch(x, residual, norm_weight, eps, weight, bias)


def rms_norm_linear_torch(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused chain of `rms_norm_linear`: the CPU path and the fused kernel's oracle."""
    if residual is None:
        normed, summed = rms_norm_torch(x, norm_weight, eps), x
    else:
        normed, summed = add_rms_norm_torch(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(silu_and_mul(x), weight, bias)` for `x = [gate, up]` in one kernel on CUDA;
    the SiLU product never reaches memory."""
    if x.is_cuda:
        from kvfit.ops.triton_skinny import silu_and_mul_linear_triton  # CUDA-only dependency

        return silu_and_mul_linear_triton(x, weight, bias)
    return F.linear(silu_and_mul_torch(x), weight, bias)
