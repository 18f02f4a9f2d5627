"""Linear layers for few rows: `y = x W^T (+ b)` for x [M, K] with M <= `MAX_ROWS`, W [N, K]
row-major (as `nn.Linear` stores it), bf16 or fp16, accumulated in fp32.

At decode batch sizes the product is a stream of W: every weight byte is read once and used M
times. The kernel is shaped for that stream rather than for reuse:

- One program per BLOCK_N rows of W, each running the whole K loop. No split-K across
  programs: partial sums would need a second node (a reduction) or atomics into a zeroed
  output (a memset node, and a summation order that follows scheduling), the two things this
  kernel exists to remove. The memory bound is the output alone; no workspace.
- The MMA is `tl.dot` on a 16-row tile of x (its smallest M), rows past M masked off: loading
  them costs no bytes, and one compiled variant serves every M up to 16 (`M` is not
  specialised, so no batch size compiles anything new).
- Bytes in flight: an H200 streams ~4.8 TB/s against ~0.6-0.8 us of DRAM latency, so each of
  its 132 SMs needs ~25-30 KB of loads outstanding. `skinny_config` sizes one weight stage at
  8-16 KB and keeps num_stages - 1 = 3 of them in flight per program (24-48 KB), with BLOCK_N
  as wide as still gives every SM a program (`skinny_config` has the numbers per shape).

The launch shape follows the tensor shapes only (graph safe). K is a constexpr (a layer's K
never changes, and a static trip count lets the loop drop its mask when BLOCK_K divides K).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvfit.ops.small_batch import MAX_ROWS, SKINNY_DTYPES

BLOCK_M = 16
"""Rows of the MMA tile: `tl.dot`'s smallest M; x rows past M are masked (no bytes read)."""
_DEFAULT_SMS = 132  # an H100/H200, for launches captured without a GPU (tools, interpreter)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def skinny_config(n: int, k: int, num_sms: int = _DEFAULT_SMS) -> dict[str, int]:
    """Tiles and launch options for a `[n, k]` weight (to be timed: `bench/skinny_linear.py`).

    BLOCK_N is the widest of 64/32/16 that still gives one program per SM (16 is the narrowest
    tile `tl.dot` takes). With 132 SMs: the 0.6B model's o_proj and down_proj (N = 1024) get
    16-row tiles and 64 programs, its qkv (N = 4096) 16 and 256, gate_up (6144) 32 and 192; the
    8B's qkv (6144) 32 and 192, o_proj/down (4096) 16 and 256, gate_up (24576) 64 and 384; an
    LM head (151936) 64 and 2374.

    BLOCK_K makes one stage's weight tile 8 KB (BLOCK_N 16: 16 x 256 x 2 B) or 16 KB (32 x 256,
    64 x 128); with num_stages = 4, three stages are in flight per program: 24-48 KB, the
    ~25-30 KB an SM needs outstanding to stream at copy bandwidth. Shared memory per program
    is num_stages x (BLOCK_N + 16) x BLOCK_K x 2 B, at most 96 KB: two programs fit an SM.
    Every K here (1024, 2048, 3072, 4096, 12288) is a multiple of BLOCK_K.

    num_warps: 4, but 2 for BLOCK_N 16, whose 16 x 16 output tile holds two 16 x 8 MMA tiles:
    more warps would each load the whole weight stage from shared memory for a duplicate.
    """
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= num_sms), 16)
    block_k = 256 if block_n <= 32 else 128
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=2 if block_n == 16 else 4,
                num_stages=4)


# M changes with the batch: not specialised, so a new batch size never compiles a variant.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x, w, bias, out, M, N,
    K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows of W past N read row N - 1 instead (their outputs are not stored): the weight loads,
    # the bytes that matter, need no mask.
    w_rows = w + tl.minimum(rn, N - 1).to(tl.int64)[None, :] * K
    x_rows = x + rm.to(tl.int64)[:, None] * K
    row_mask = rm[:, None] < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        if K % BLOCK_K == 0:
            a = tl.load(x_rows + k[None, :], mask=row_mask, other=0.0)
            wt = tl.load(w_rows + k[:, None])
        else:
            a = tl.load(x_rows + k[None, :], mask=row_mask & (k[None, :] < K), other=0.0)
            wt = tl.load(w_rows + k[:, None], mask=k[:, None] < K, other=0.0)
        acc = tl.dot(a, wt, acc)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=row_mask & (rn[None, :] < N))


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int) -> None:
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"the skinny kernels take x [M, K] with M <= {MAX_ROWS}, got "
                         f"{tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(f"weight {tuple(weight.shape)} must be [N, {k}]")
    if x.dtype not in SKINNY_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"the skinny kernels take bf16/fp16 x and weight of one dtype, got "
                         f"{x.dtype} and {weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}]")


def skinny_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, K], M <= `MAX_ROWS`, in one kernel. `config`
    overrides `skinny_config` (the bench's sweep). Memory: the output [M, N] only."""
    k = x.shape[-1]
    _check(x, weight, bias, k)
    n = weight.shape[0]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    cfg = config or skinny_config(n, k, _num_sms(x.device))
    launch = dict(cfg)
    block_n = launch.pop("BLOCK_N")
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x.contiguous(), weight.contiguous(), bias, out, x.shape[0], n, K=k,
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=block_n, **launch,
    )  # fmt: skip
    return out
