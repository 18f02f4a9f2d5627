"""Fused Triton kernels for the small layers: RMSNorm (optionally after the residual add),
SiLU-and-mul and neox rotary embedding.

Each replaces a chain of torch elementwise kernels with one launch, which matters under CUDA
graphs where every kernel node costs a few microseconds regardless of its size. Launch shapes
depend on tensor shapes only, so all three are graph safe.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_MAX_TILE = 8192  # elements one rms_norm program holds at most when it takes several heads


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def _as_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`[T, heads * head_dim]` or `[T, heads, head_dim]` as the latter: a view when the strides
    allow it (split views do), else a copy. Sizes are explicit: `-1` is ambiguous when T == 0."""
    return x.reshape(x.shape[0], math.prod(x.shape[1:]) // head_dim, head_dim)


@triton.jit
def _rms_norm_kernel(
    x, residual, weight, out, sum_out, eps,
    stride_xt, stride_xr, stride_xd,
    ROWS: tl.constexpr,
    DIM: tl.constexpr,
    ROWS_P2: tl.constexpr,
    DIM_P2: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # token * row stride may pass 2**31
    r = tl.arange(0, ROWS_P2)[:, None]
    d = tl.arange(0, DIM_P2)[None, :]
    mask = (r < ROWS) & (d < DIM)
    dense = token * ROWS * DIM + r * DIM + d  # offsets into the contiguous outputs
    v = tl.load(x + token * stride_xt + r * stride_xr + d * stride_xd, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        # The sum is rounded to x's dtype before the norm reads it, as `x + residual` would be.
        v = (v.to(tl.float32) + tl.load(residual + dense, mask=mask, other=0.0).to(tl.float32)
             ).to(v.dtype)  # fmt: skip
        tl.store(sum_out + dense, v, mask=mask)
    v32 = v.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(v32 * v32, axis=1) / DIM + eps)
    # Same rounding order as the torch path: normalise in fp32, round to x's dtype, then scale.
    normed = (v32 * inv_rms[:, None]).to(v.dtype).to(tl.float32)
    w = tl.load(weight + d, mask=d < DIM, other=0.0).to(tl.float32)
    tl.store(out + dense, (normed * w).to(out.dtype.element_ty), mask=mask)


def _launch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim = x.shape[-1]
    if weight.shape != (dim,):
        raise ValueError(f"rms_norm weight shape {tuple(weight.shape)} != ({dim},)")
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    summed = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                f"{tuple(x.shape)} {x.dtype}"
            )
        residual = residual.contiguous()
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # A `[T, heads, head_dim]` input is normalised a token per program; anything else a row.
    heads = x.shape[-2] if x.dim() > 2 and 0 < x.shape[-2] * dim <= _MAX_TILE else 1
    rows = x.reshape(math.prod(x.shape[:-1]) // heads, heads, dim)
    if rows.numel() == 0:
        return out, summed
    rows_p2, dim_p2 = triton.next_power_of_2(rows.shape[1]), triton.next_power_of_2(dim)
    _rms_norm_kernel[(rows.shape[0],)](
        rows, residual, weight.contiguous(), out, summed, eps, *rows.stride(),
        ROWS=rows.shape[1], DIM=dim, ROWS_P2=rows_p2, DIM_P2=dim_p2,
        ADD_RESIDUAL=residual is not None, num_warps=_num_warps(rows_p2 * dim_p2),
    )  # fmt: skip
    return out, summed


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; one program per leading index (all heads of a `[T, heads, D]`
    view at once). Returns a new contiguous tensor of `x`'s shape."""
    return _launch_rms_norm(x, weight, eps, None)[0]


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)` in one launch: the residual add folded into the
    norm that reads its result. Both outputs are new contiguous tensors of `x`'s shape."""
    return _launch_rms_norm(x, weight, eps, residual)  # type: ignore[return-value]


@triton.jit
def _silu_and_mul_kernel(x, out, stride_xt, INTER: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # token * row stride may pass 2**31
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    gate = tl.load(x + token * stride_xt + i, mask=mask, other=0.0)
    up = tl.load(x + token * stride_xt + INTER + i, mask=mask, other=0.0).to(tl.float32)
    g32 = gate.to(tl.float32)
    # Round silu(gate) to the input dtype before the product, as the two torch kernels do.
    silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
    tl.store(out + token * INTER + i, (silu * up).to(out.dtype.element_ty), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `x = [gate, up]` along the last dim, in one kernel."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    rows = x.reshape(math.prod(x.shape[:-1]), 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.numel() == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
        rows, out, rows.stride(0), INTER=inter, BLOCK=block, num_warps=_num_warps(block)
    )
    return out


@triton.jit
def _cos_sin(cos_sin_cache, positions, token, HALF: tl.constexpr, HALF_P2: tl.constexpr):
    """cos and sin `[1, HALF_P2]` at this token's position, from the fp32 `[max_position,
    2 * HALF]` table (cos then sin); padding is 0."""
    pos = tl.load(positions + token).to(tl.int64)
    d = tl.arange(0, HALF_P2)[None, :]
    row = cos_sin_cache + pos * 2 * HALF + d
    return tl.load(row, mask=d < HALF, other=0.0), tl.load(row + HALF, mask=d < HALF, other=0.0)


@triton.jit
def _load_halves(src, token, stride_t, stride_h, stride_d,
                 HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr,
                 HALF_P2: tl.constexpr):  # fmt: skip
    """Both rotate-half halves `[HEADS_P2, HALF_P2]` of every head of one token; padding is 0."""
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    mask = (h < HEADS) & (d < HALF)
    base = src + token * stride_t + h * stride_h
    x1 = tl.load(base + d * stride_d, mask=mask, other=0.0)
    x2 = tl.load(base + (d + HALF) * stride_d, mask=mask, other=0.0)
    return x1, x2


@triton.jit
def _store_halves(dst, token, x1, x2, HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
                  HALF: tl.constexpr, HALF_P2: tl.constexpr):  # fmt: skip
    """Write the halves of every head of one token into a contiguous `[T, HEADS, 2 * HALF]`."""
    h = tl.arange(0, HEADS_P2)[:, None]
    d = tl.arange(0, HALF_P2)[None, :]
    mask = (h < HEADS) & (d < HALF)
    out = dst + token * HEADS * 2 * HALF + h * 2 * HALF + d
    tl.store(out, x1.to(dst.dtype.element_ty), mask=mask)
    tl.store(out + HALF, x2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_halves(x1, x2, cos, sin):
    """Neox rotary in fp32, rounded back to x's dtype."""
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    return (a * cos - b * sin).to(x1.dtype), (b * cos + a * sin).to(x2.dtype)


@triton.jit
def _rotate_heads(src, dst, token, stride_t, stride_h, stride_d, cos, sin,
                  HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HALF: tl.constexpr,
                  HALF_P2: tl.constexpr):  # fmt: skip
    x1, x2 = _load_halves(src, token, stride_t, stride_h, stride_d, HEADS, HEADS_P2, HALF,
                          HALF_P2)  # fmt: skip
    x1, x2 = _rotate_halves(x1, x2, cos, sin)
    _store_halves(dst, token, x1, x2, HEADS, HEADS_P2, HALF, HALF_P2)


@triton.jit
def _rotary_kernel(
    positions, cos_sin_cache, q, k, q_out, k_out,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    Q_HEADS_P2: tl.constexpr,
    K_HEADS_P2: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)  # token * row stride may pass 2**31
    cos, sin = _cos_sin(cos_sin_cache, positions, token, HALF, HALF_P2)
    _rotate_heads(q, q_out, token, stride_qt, stride_qh, stride_qd, cos, sin,
                  Q_HEADS, Q_HEADS_P2, HALF, HALF_P2)  # fmt: skip
    _rotate_heads(k, k_out, token, stride_kt, stride_kh, stride_kd, cos, sin,
                  K_HEADS, K_HEADS_P2, HALF, HALF_P2)  # fmt: skip


def rotary_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox (rotate-half) rotary embedding of q and k in one launch, one program per token.

    q/k are `[T, heads, head_dim]` or `[T, heads * head_dim]`, any strides; `cos_sin_cache` is
    fp32 `[max_position, head_dim]` (cos then sin). Returns new contiguous tensors of the input
    shapes and dtypes.
    """
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(
            f"head_dim {head_dim} must be even and match cos_sin_cache's last dim "
            f"{cos_sin_cache.shape[-1]}"
        )
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    q_rows, k_rows = _as_heads(q, head_dim), _as_heads(k, head_dim)
    if q_rows.shape[0] == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(q_rows.shape[0],)](
        positions, cos_sin_cache.contiguous(), q_rows, k_rows, q_out, k_out,
        *q_rows.stride(), *k_rows.stride(),
        Q_HEADS=q_rows.shape[1], K_HEADS=k_rows.shape[1],
        Q_HEADS_P2=triton.next_power_of_2(q_rows.shape[1]),
        K_HEADS_P2=triton.next_power_of_2(k_rows.shape[1]),
        HALF=half, HALF_P2=triton.next_power_of_2(half),
        num_warps=_num_warps(triton.next_power_of_2(q_rows.shape[1] * head_dim)),
    )  # fmt: skip
    return q_out, k_out
