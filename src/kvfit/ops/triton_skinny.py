"""Linear layers for few rows: `y = x W^T (+ b)` for x [M, K] with M <= `MAX_ROWS`, W [N, K]
row-major (as `nn.Linear` stores it), bf16 or fp16, accumulated in fp32; optionally after the
op before it (a prologue computed on the x tile each program reads): RMSNorm with or without
the residual add (`rms_norm_linear_triton`), or SiLU-and-mul (`silu_and_mul_linear_triton`),
each rounded as the unfused kernels round, so that the chain's node is gone.

At decode batch sizes the product is a stream of W: every weight byte is read once and used M
times. The kernel is shaped for that stream rather than for reuse:

- One program per BLOCK_N rows of W, each running the whole K loop, but where that leaves
  SMs without a program (`split_k`: N 1024 at 16-row tiles is 64 programs): there each tile's
  K is cut into SPLIT_K parts, each part a program, and the tile's last program to finish
  sums the parts in split order in the same launch (`_reduce_split_k`): no reduction node, no
  memset, no atomics on the output, and the bits do not depend on which program came last.
  Memory: the output, and for a split launch the engine's `SplitKScratch`, allocated once
  (`allocate_split_k_scratch`); no allocation per launch.
- An epilogue for a QKV projection (`qkv_attention_input_triton`): once a program has stored
  its tile it takes its head's ticket (a head is 2 x HALF / BLOCK_N whole tiles), and the
  head's last program reads the head's columns back and runs the attention input on them
  (`triton_attention_input.attention_input_epilogue`: q normalised and rotated in place, K/V
  to the cache): the attention input's node is gone. Memory: one int32 ticket a head in the
  engine's scratch; no q copy.
- The MMA is `tl.dot` on a 16-row tile of x (its smallest M), rows past M masked off: loading
  them costs no bytes, and one compiled variant serves every M up to 16 (`M` is not
  specialised, so no batch size compiles anything new). At M = 1 a kernel takes FMAs instead
  (a runtime branch, `_product`) where `ROW_GEMV` says: `skinny_config` sets it where the
  weight tile is at most 32 rows (timed per shape there: the 0.6B down_proj 8.9 us as a
  16-row MMA, 5.7 with FMAs) and for every kernel with a prologue, whose 16-row tile costs ALU
  work per row, but a wider tile than 32 rows of W with a norm prologue computes the norm on
  its one row and broadcasts it to the MMA's 16 (`ROW_MMA_PROLOGUE`: the 8B's gate_up 1.6%
  faster so, its one-row step 1.5%).
- A prologue is recomputed by every program (from L2: the x rows are a few KB): the RMSNorm's
  rms by a pre-pass over the row, the SiLU per tile. That is ~10 (norm) and ~30 (SiLU)
  instructions per x element per program, cheap for one row and not for 16 (see `_product`).
- Bytes in flight: an H200 streams ~4.8 TB/s against ~0.6-0.8 us of DRAM latency, so each of
  its 132 SMs needs ~25-30 KB of loads outstanding. `skinny_config` sizes one weight stage at
  8-16 KB, of which the pipeline buffers num_stages - 1 = 3 (2-3 in flight per program:
  16-48 KB), with BLOCK_N as wide as still gives every SM a program (numbers per shape there).

- Programmatic dependent launch (`pdl=True`, sm_90+): the weights do not depend on the kernel
  before, only x does. Launched with PDL, the kernel starts while its predecessor finishes,
  asks L2 for the first `PREFETCH_BYTES` of its weight slice, and only then waits for the
  predecessor (`gdc_wait`) before it reads x or writes anything; it lets its own successor
  start as soon as every program has passed that wait, or with `ops/pdl.py`'s `PDL_EARLY`
  off, once every program has its product, before the stores. At one row each node's ~3 us
  beyond its bytes (launch, the first DRAM round trips, the tail) is what paces a decode
  step, and this overlaps part of it with the node before. On for one-row steps
  (`ops/pdl.py`'s `PDL_DEFAULT`, which the decode step's other kernels follow too; its
  docstring has the whole steps' times with each trigger and the rule that picks one).

The launch shape follows the tensor shapes only (graph safe). K is a constexpr (a layer's K
never changes, and a static trip count lets the loop drop its mask when BLOCK_K divides K).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvfit.kv_quant import is_fp8
from kvfit.ops import sm_count
from kvfit.ops.attention_input import AttentionInputArgs
from kvfit.ops.pdl import pdl_keywords, release_late, use_pdl, wait_then_release
from kvfit.ops.small_batch import MAX_ROWS, SKINNY_DTYPES, SplitKScratch, split_k_scratch
from kvfit.ops.triton_attention_input import attention_input_epilogue
from kvfit.ops.triton_tickets import last_to_arrive

BLOCK_M = 16
"""Rows of the MMA tile: `tl.dot`'s smallest M; x rows past M are masked (no bytes read)."""


NONE, RMS_NORM, ADD_RMS_NORM, SILU_AND_MUL = 0, 1, 2, 3
"""The kernel's `PROLOGUE`: what it computes from x before the product."""


def skinny_config(n: int, k: int, num_sms: int = sm_count.DEFAULT_SMS,
                  prologue: int = NONE, head_dim: int | None = None) -> dict[str, int]:
    """Tiles and launch options for a `[n, k]` weight whose kernel computes `prologue` (NONE,
    RMS_NORM, ADD_RMS_NORM or SILU_AND_MUL) from x first (timed: `bench/skinny_linear.py`);
    with `head_dim`, BLOCK_N narrowed until a head's columns are whole tiles (the QKV
    epilogue counts a head's tiles), and the rest chosen for that tile.

    BLOCK_N is the widest of 64/32/16 that still gives one program per SM (16 is the narrowest
    tile `tl.dot` takes). With 132 SMs: the 0.6B model's o_proj and down_proj (N = 1024) get
    16-row tiles and 64 programs, its qkv (N = 4096) 16 and 256, gate_up (6144) 32 and 192; the
    8B's qkv (6144) 32 and 192, o_proj/down (4096) 16 and 256, gate_up (24576) 64 and 384; an
    LM head (151936) 64 and 2374.

    BLOCK_K makes one stage's weight tile 8 KB (BLOCK_N 16: 16 x 256 x 2 B) or 16 KB (32 x 256,
    64 x 128); num_stages = 4 buffers three stages, so 2-3 are in flight per program: 16-48 KB
    against the ~25-30 KB an SM needs outstanding to stream at copy bandwidth. Shared memory
    per program (ptxas, `tools/triton_sass.py --linear N K`): 48-72 KB for the plain product,
    up to 108 KB with a prologue's buffers (the 0.6B gate_up's add + norm); two programs fit an
    SM's 228 KB. Every K here (1024, 2048, 3072, 4096, 12288) is a multiple of BLOCK_K.

    num_warps: 4, but 2 for BLOCK_N 16, whose 16 x 16 output tile holds two 16 x 8 MMA tiles:
    more warps would each load the whole weight stage from shared memory for a duplicate.

    With a `prologue`, whose buffers (up to 108 KB at four stages) may leave room for only two
    programs an SM, a grid beyond two programs a SM could run in two waves, the second
    part-empty; there it takes three stages (the 8B's gate_up: 384 programs, 78 -> 53 KB, four
    a SM: one wave).
    The H200 measured the two-wave case 1.33x slower than its unfused pair (69 against 52 us),
    where every one-wave fused kernel won.

    ROW_GEMV: the plain kernel's one-row path (`_product`), FMAs where the tile is at most 32
    rows of W. H100, 2026-12-05, FMAs against the 16-row MMA at one row: 0.6B qkv 4.9/5.5 us,
    o_proj 4.5/5.5, gate_up 6.5/7.1, down 5.7/8.9, 8B qkv 19.3/20.1, o_proj 13.4/14.6, down
    36.2/38.6; at BLOCK_N 64 the MMA's: 8B gate_up 68.7/73.1, LM heads 102.4/109.0 (0.6B) and
    406.3/408.9 (8B). A kernel with a prologue takes FMAs where its tile is at most 32 rows;
    above, a norm prologue takes the MMA where `ROW_MMA_PROLOGUE` says and SiLU-and-mul the
    FMAs (no model's down_proj is that wide, and its MMA spills 16 bytes at N 24576: sm_90,
    `tests/tools/test_triton_compile.py`). A norm's one row feeds the MMA broadcast to the
    tile's 16 rows, which for the 8B's gate_up (BLOCK_N 64), after the residual add, is a
    133-instruction stage at 70 registers against the FMAs' 260 at 128 (sm_90,
    `tools/triton_sass.py --linear 24576 4096 --batch 1`). H100, 2026-12-07
    (`bench/skinny_linear.py --m 1`): that layer fused 71.8 us with the MMA against 72.9 with
    FMAs (the plain product 66.6, unfused 70.6).
    """
    block_n = next((b for b in (64, 32) if triton.cdiv(n, b) >= num_sms), 16)
    while head_dim is not None and head_dim % block_n and block_n > 16:
        block_n //= 2
    block_k = 256 if block_n <= 32 else 128
    block_k = max(16, min(block_k, triton.next_power_of_2(k)))
    one_wave = prologue == NONE or triton.cdiv(n, block_n) <= 2 * num_sms
    mma_prologue = prologue in (RMS_NORM, ADD_RMS_NORM) and ROW_MMA_PROLOGUE
    return dict(BLOCK_N=block_n, BLOCK_K=block_k, num_warps=2 if block_n == 16 else 4,
                num_stages=4 if one_wave else 3,
                ROW_GEMV=block_n <= 32 or (prologue != NONE and not mma_prologue),
                SPLIT_K=split_k(triton.cdiv(n, block_n), k, block_k, num_sms))


ROW_MMA_PROLOGUE = True
"""Whether a one-row kernel with a norm prologue and a tile wider than 32 rows of W (the 8B's
gate_up, the LM heads under a fused norm) broadcasts its prologue's row to the 16-row MMA
instead of taking FMAs (`skinny_config`'s ROW_GEMV). On since whole one-row steps of the 8B
shape timed it (H100, 2026-12-07, `bench/throughput.py --one-row-mma both`, medians of 3 in one
call): 5.876 ms against 5.966 with FMAs, 1.5% faster. Read at launch: graphs keep what they
captured."""


MAX_SPLIT_K = 4
"""The most parts a split-K launch cuts K into (`split_k`)."""

SPLIT_K_DEFAULT = True
"""Whether an engine allocates the split-K scratch (`allocate_split_k_scratch`), and so runs
the launches `split_k` cuts in parts. On: whole decode steps of the 0.6B shape, a tree with it
on beside one with it off (H100, 2026-12-06, `bench/throughput.py --decode-batches 1 4 16`,
three runs each way in two calls, sixteen in the second only), were 1.4-2.3% faster at one
sequence, 3.8-5.0% at four and 3.0% at sixteen; the engine's greedy tokens stayed the cuBLAS
path's (docs/benchmarks.md).
Shapes with a program for every SM (the 8B's layers) never split."""


def split_k(tiles: int, k: int, block_k: int, num_sms: int) -> int:
    """Parts of K for a launch of `tiles` output tiles: doubled from 1 while the launch has
    fewer programs than SMs and each part stays a whole number of BLOCK_K tiles, up to
    `MAX_SPLIT_K`.

    Why: a weight with few rows (N 1024: the 0.6B's o_proj and down_proj) makes 64 tiles of
    16 rows, so half the SMs stream nothing and the other half hold 24 KB of loads in flight
    each, against the ~25-30 KB every SM needs outstanding; at one row on an H100 those
    layers ran at 31-37% of copy bandwidth (4.5 and 5.7 us) where qkv and gate_up, with a
    program for every SM, ran at 58-66%. The parts' sum costs a store, a ticket and a read of
    SPLIT_K partials from L2 by the tile's last program (`_reduce_split_k`), in the same
    launch. Timed alone (`bench/skinny_linear.py`, H100): at one row o_proj 4.74 us in four
    parts against 4.55 whole (3.59 against 3.93 with PDL), down_proj 5.49 against 5.78; at
    four rows 5.07 against 5.80 and 5.78 against 7.45."""
    parts = 1
    while (parts < MAX_SPLIT_K and tiles * parts < num_sms
           and k % (2 * parts * block_k) == 0):
        parts *= 2
    return parts


def allocate_split_k_scratch(device: torch.device, heads: int = 0) -> SplitKScratch:
    """The scratch for every launch `skinny_config` splits on `device`, and for QKV
    projections of up to `heads` heads with the attention-input epilogue: a split launch has
    fewer tiles than SMs, each at most 16 rows of W (the narrowest BLOCK_N), so N < 16 x SMs.
    Memory: `MAX_SPLIT_K` x `MAX_ROWS` x 16 x SMs fp32 partials (540 KB at 132 SMs) where
    `SPLIT_K_DEFAULT` is on (else none: no launch splits), one int32 ticket a SM and one a
    head."""
    sms = sm_count.num_sms(device)
    partials = MAX_SPLIT_K * MAX_ROWS * 16 * sms if SPLIT_K_DEFAULT else 0
    return SplitKScratch(
        partials=torch.empty(partials, dtype=torch.float32, device=device),
        tickets=torch.zeros(sms, dtype=torch.int32, device=device),
        head_tickets=torch.zeros(heads, dtype=torch.int32, device=device))


def _split_launch(parts: int, explicit: bool, n: int, k: int, block_n: int, block_k: int,
                  scratch: SplitKScratch | None) -> int:
    """`parts` if `scratch` holds that launch's partials and tickets and each part is a whole
    number of BLOCK_K tiles, else 1; a config that asked for the split (`explicit`) raises
    instead."""
    if parts == 1:
        return 1
    tiles = triton.cdiv(n, block_n)
    reason = None
    if parts & (parts - 1) or k % (parts * block_k):
        reason = f"SPLIT_K {parts} must be a power of two dividing K {k} into BLOCK_K tiles"
    elif scratch is None:
        reason = "no split-K scratch is in effect (small_batch_kernels(scratch=...))"
    elif (scratch.tickets.numel() < tiles
          or scratch.partials.numel() < parts * BLOCK_M * n):
        reason = f"the split-K scratch is too small for N {n} in {parts} parts"
    if reason is None:
        return parts
    if explicit:
        raise ValueError(reason)
    return 1


PREFETCH_BYTES = 32 * 1024
"""Weight bytes each program asks L2 for before it waits on its predecessor: a few pipeline
stages' worth, so that all programs' prefetches (8-12 MB at the two models' shapes) fit L2."""

NORM_BLOCK_K = 2048
"""Columns of one row per iteration of a one-row norm prologue's rms pass, at most half the
row (K 4096: two iterations, 16-32 values a thread; K 1024: two of 512)."""


@triton.jit
def _prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines at `ptrs`; nothing waits on the answer."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _residual_sum(x_rows, r_rows, k, mask, ADD_RESIDUAL: tl.constexpr):
    """x (+ residual) at columns `k`, the sum rounded to x's dtype as `x + residual` is."""
    v = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(r_rows + k[None, :], mask=mask, other=0.0)
        v = (v.to(tl.float32) + r.to(tl.float32)).to(v.dtype)
    return v


@triton.jit
def _sum_of_squares(x_rows, r_rows, sum_out, rm, row_mask, pid, K: tl.constexpr,
                    BLOCK: tl.constexpr, STAGES: tl.constexpr,
                    ADD_RESIDUAL: tl.constexpr):  # fmt: skip
    """Each row's sum of squares of x (+ residual) in fp32 over `BLOCK` columns at a time;
    program 0 writes the residual sum to `sum_out`."""
    rk = tl.arange(0, BLOCK)
    sum_sq = tl.zeros([rm.shape[0]], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK, num_stages=STAGES):
        k = k0 + rk
        mask = row_mask if K % BLOCK == 0 else row_mask & (k[None, :] < K)
        v = _residual_sum(x_rows, r_rows, k, mask, ADD_RESIDUAL)
        if ADD_RESIDUAL:
            tl.store(sum_out + rm.to(tl.int64)[:, None] * K + k[None, :], v,
                     mask=mask & (pid == 0))
        v32 = v.to(tl.float32)
        sum_sq += tl.sum(v32 * v32, axis=1)
    return sum_sq


@triton.jit
def _operand(x_rows, r_rows, norm_weight, inv_rms, k, mask, k_mask,
             K: tl.constexpr, PROLOGUE: tl.constexpr):  # fmt: skip
    """The x tile `[ROWS, BLOCK_K]` the product reads, after the prologue, in x's dtype."""
    if PROLOGUE == 3:  # SILU_AND_MUL over x = [gate, up], rounded as `_silu_and_mul_kernel`
        gate = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
        up = tl.load(x_rows + K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        g32 = gate.to(tl.float32)
        silu = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype).to(tl.float32)
        a = (silu * up).to(gate.dtype)
    elif PROLOGUE == 0:
        a = tl.load(x_rows + k[None, :], mask=mask, other=0.0)
    else:  # (ADD_)RMS_NORM, rounded as `_rms_norm_kernel`: normalise in fp32, round, scale
        v = _residual_sum(x_rows, r_rows, k, mask, PROLOGUE == 2)
        normed = (v.to(tl.float32) * inv_rms[:, None]).to(v.dtype).to(tl.float32)
        g = tl.load(norm_weight + k, mask=k_mask, other=0.0).to(tl.float32)
        a = (normed * g[None, :]).to(v.dtype)
    return a


@triton.jit
def _product(x, residual, norm_weight, w, sum_out, M, N, eps, pid, tile, k_lo,
             K: tl.constexpr, K_PART: tl.constexpr, PROLOGUE: tl.constexpr, ROWS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             NORM_BLOCK_K: tl.constexpr, NORM_STAGES: tl.constexpr,
             GEMV_STAGES: tl.constexpr, FMA: tl.constexpr = True):  # fmt: skip
    """acc `[BLOCK_M, BLOCK_N]` fp32 of output tile `tile`'s columns over the K_PART columns of
    x from `k_lo` (all K without a split), after the prologue on ROWS rows of x (M <= ROWS).
    ROWS == BLOCK_M: the tensor-core product; ROWS == 1 with `FMA`: FMAs on a `[BLOCK_N,
    BLOCK_K]` weight tile, reduced over K once after the loop (row 0 of acc); ROWS == 1
    without: the prologue on the one row, broadcast to the MMA's BLOCK_M rows (every row of
    acc is row 0's).

    Why a second path at M = 1: the prologue's tile feeds the MMA, and a tile of fewer rows
    than the MMA's 16, repeated to 16, is computed in the MMA operand's layout, where each
    element sits in 8 lanes of both warps; the 16-row SiLU tile alone is ~2,000 instructions
    per 8 KB weight stage (tools/triton_sass.py --linear). Without an MMA the row is computed
    once per lane that multiplies it."""
    rm = tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    x_stride = 2 * K if PROLOGUE == 3 else K  # SILU_AND_MUL reads [gate, up] rows
    x_rows = x + rm.to(tl.int64)[:, None] * x_stride
    r_rows = residual + rm.to(tl.int64)[:, None] * K
    row_mask = rm[:, None] < M
    inv_rms = tl.zeros([ROWS], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:
        # Every program takes the rows' rms from x (+ residual) itself: a few KB from L2, where
        # sharing it would take a second node. Program 0 alone writes the residual sum. This
        # pass precedes the weight stream, so its loads' latency is paid in full, once per
        # iteration: one row takes it in NORM_BLOCK_K columns at a time (two passes up to K
        # 4096), where BLOCK_K columns took 32 dependent rounds to L2 at K 4096 (the 8B's
        # gate_up, H100: 102 us fused against 74 us unfused).
        RMS_BLOCK: tl.constexpr = NORM_BLOCK_K if ROWS == 1 else BLOCK_K
        sum_sq = _sum_of_squares(x_rows, r_rows, sum_out, rm, row_mask, pid, K, RMS_BLOCK,
                                 NORM_STAGES, PROLOGUE == 2)
        inv_rms = tl.rsqrt(sum_sq / K + eps)
    # Rows of W past N read row N - 1 instead (their outputs are not stored): the weight loads,
    # the bytes that matter, need no mask.
    if ROWS == 1 and FMA:
        rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w_tile = w + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K  # [BLOCK_N, 1] rows
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        # Without a dot the pipeliner stages these loads only when asked (as the main loop's).
        for k0 in tl.range(k_lo, k_lo + K_PART, BLOCK_K, num_stages=GEMV_STAGES):
            k = k0 + rk
            if K % BLOCK_K == 0:
                a = _operand(x_rows, r_rows, norm_weight, inv_rms, k, row_mask, k < K, K,
                             PROLOGUE)
                wt = tl.load(w_tile + k[None, :])
            else:
                k_mask = k < K
                a = _operand(x_rows, r_rows, norm_weight, inv_rms, k,
                             row_mask & k_mask[None, :], k_mask, K, PROLOGUE)
                wt = tl.load(w_tile + k[None, :], mask=k_mask[None, :], other=0.0)
            part += wt.to(tl.float32) * a.to(tl.float32)
        acc = tl.broadcast_to(tl.sum(part, axis=1)[None, :], (BLOCK_M, BLOCK_N))
    else:
        w_rows = w + tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), N - 1
                                ).to(tl.int64)[None, :] * K  # [1, BLOCK_N] rows
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_lo + K_PART, BLOCK_K):
            k = k0 + rk
            if K % BLOCK_K == 0:
                a = _operand(x_rows, r_rows, norm_weight, inv_rms, k, row_mask, k < K, K,
                             PROLOGUE)
                wt = tl.load(w_rows + k[:, None])
            else:
                k_mask = k < K
                a = _operand(x_rows, r_rows, norm_weight, inv_rms, k,
                             row_mask & k_mask[None, :], k_mask, K, PROLOGUE)
                wt = tl.load(w_rows + k[:, None], mask=k_mask[:, None], other=0.0)
            if ROWS < BLOCK_M:
                a = tl.broadcast_to(a, (BLOCK_M, BLOCK_K))
            acc = tl.dot(a, wt, acc)
    return acc


@triton.jit
def _store_rows(out, bias, acc, tile, M, N, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """Rows < M of the output tile `tile`: acc (+ bias) in out's dtype."""
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_BIAS:
        acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    rm = tl.arange(0, BLOCK_M)
    out_ptrs = out + rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(out_ptrs, acc.to(out.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _reduce_split_k(out, bias, partials, tickets, acc, tile, split, M, N,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    SPLIT_K: tl.constexpr):  # fmt: skip
    """Store this program's partial product; the tile's last program to arrive sums the
    SPLIT_K partials, in split order whichever came last, and stores the rows. Returns whether
    this program stored them.

    Partials lie at `[split, row, column]`, fp32. The ticket's acq_rel atomic makes every
    other program's partial visible to the last one, which reads them past L1 (".cg")."""
    rm = tl.arange(0, BLOCK_M)
    rn = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    row_ptrs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(partials + split * BLOCK_M * N + row_ptrs, acc, mask=mask)
    last = last_to_arrive(tickets, tile, SPLIT_K)
    if last:
        # One part at a time: a [SPLIT_K, 16, 16] tile at once spilled beside the SiLU
        # prologue's registers (tools/triton_sass.py --linear 1024 2048).
        total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(partials + s * BLOCK_M * N + row_ptrs, mask=mask, other=0.0,
                             cache_modifier=".cg")
        _store_rows(out, bias, total, tile, M, N, HAS_BIAS, BLOCK_M, BLOCK_N)
    return last


# M changes with the batch: not specialised, so a new batch size never compiles a variant.
@triton.jit(do_not_specialize=["M"])
def _skinny_kernel(
    x, residual, norm_weight, w, bias, out, sum_out, partials, tickets, M, N, eps,
    positions, cos_sin_cache, q_norm_weight, k_norm_weight, qk_eps, k_cache, v_cache,
    slot_mapping, k_scale, v_scale, head_tickets,
    stride_cb, stride_cs, stride_ch, stride_cd, block_size,
    K: tl.constexpr,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK_K: tl.constexpr,
    NORM_STAGES: tl.constexpr,
    GEMV_STAGES: tl.constexpr,
    PDL: tl.constexpr = False,
    PDL_EARLY: tl.constexpr = True,
    PREFETCH_K: tl.constexpr = 64,
    ROW_GEMV: tl.constexpr = True,
    SPLIT_K: tl.constexpr = 1,
    ATTENTION_INPUT: tl.constexpr = False,
    NUM_HEADS: tl.constexpr = 0,
    NUM_KV_HEADS: tl.constexpr = 0,
    HALF: tl.constexpr = 8,
    HALF_P2: tl.constexpr = 8,
    QK_NORM: tl.constexpr = False,
    FP8: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    # A tile's SPLIT_K programs are neighbours, each over K / SPLIT_K columns.
    tile = pid // SPLIT_K
    split = pid % SPLIT_K
    K_PART: tl.constexpr = K // SPLIT_K
    k_lo = split * K_PART
    if PDL:
        # Only the weights may be touched before the wait, while the kernel before still
        # runs: x and the residual may be its outputs, and out and sum_out may reuse the
        # memory of its inputs (the caching allocator), so all four come after, as do the
        # split partials and tickets, which the kernel before may be using.
        rows = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        lines = k_lo + tl.minimum(tl.arange(0, PREFETCH_K // 64) * 64, K_PART - 1)
        _prefetch_l2(w + rows[:, None] * K + lines[None, :])
        wait_then_release(PDL, PDL_EARLY)
    if PROLOGUE == 0 and not ROW_GEMV:  # the 16-row tile at every M (the bench's baseline)
        acc = _product(x, residual, norm_weight, w, sum_out, M, N, eps, pid, tile, k_lo, K,
                       K_PART, PROLOGUE, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, NORM_BLOCK_K,
                       NORM_STAGES, GEMV_STAGES)
    elif M == 1:  # a branch on M, not a variant: one compiled kernel serves every M
        acc = _product(x, residual, norm_weight, w, sum_out, M, N, eps, pid, tile, k_lo, K,
                       K_PART, PROLOGUE, 1, BLOCK_M, BLOCK_N, BLOCK_K, NORM_BLOCK_K,
                       NORM_STAGES, GEMV_STAGES, ROW_GEMV)
    else:
        acc = _product(x, residual, norm_weight, w, sum_out, M, N, eps, pid, tile, k_lo, K,
                       K_PART, PROLOGUE, BLOCK_M, BLOCK_M, BLOCK_N, BLOCK_K, NORM_BLOCK_K,
                       NORM_STAGES, GEMV_STAGES)
    release_late(PDL, PDL_EARLY)
    if SPLIT_K == 1:
        _store_rows(out, bias, acc, tile, M, N, HAS_BIAS, BLOCK_M, BLOCK_N)
        stored = True
    else:
        stored = _reduce_split_k(out, bias, partials, tickets, acc, tile, split, M, N,
                                 HAS_BIAS, BLOCK_M, BLOCK_N, SPLIT_K)
    if ATTENTION_INPUT:
        # A head's columns are 2 * HALF / BLOCK_N whole tiles; the last of them to be stored
        # runs the head's attention input (the projection is q heads, then k, then v).
        TILES_PER_HEAD: tl.constexpr = 2 * HALF // BLOCK_N
        head = tile // TILES_PER_HEAD
        # Nested, not `and`: only a program that stored its tile may take the ticket.
        if stored:  # noqa: SIM102
            if last_to_arrive(head_tickets, head, TILES_PER_HEAD):
                attention_input_epilogue(
                    out, head, M, N, positions, cos_sin_cache, q_norm_weight, k_norm_weight,
                    qk_eps, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                    stride_cb, stride_cs, stride_ch, stride_cd, block_size,
                    NUM_HEADS, NUM_KV_HEADS, HALF, HALF_P2, QK_NORM, FP8, BLOCK_M)


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


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int, prologue: int,
    config: dict[str, int] | None, residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0, sum_out: torch.Tensor | None = None,
    pdl: bool | None = None, attention_input: AttentionInputArgs | None = None,
) -> torch.Tensor:
    _check(x, weight, bias, k)
    n = weight.shape[0]
    out = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    head_dim = None if attention_input is None else attention_input.k_cache.shape[3]
    launch = dict(config or skinny_config(n, k, sm_count.num_sms(x.device), prologue, head_dim))
    block_n = launch.pop("BLOCK_N")
    scratch = split_k_scratch()
    epilogue = _epilogue_operands(attention_input, x, out, block_n, scratch)
    parts = _split_launch(launch.pop("SPLIT_K", 1), config is not None and "SPLIT_K" in config,
                          n, k, block_n, launch["BLOCK_K"], scratch)
    # At least two iterations: a one-block pass over the whole row let the compiler keep the
    # row live into the product's loop, where it spilled (K 1024: 255 registers and 292 bytes
    # spilled, 3.4x slower at one row on the H200; tools/triton_sass.py --linear 6144 1024).
    launch.setdefault("NORM_BLOCK_K", max(16, min(NORM_BLOCK_K, triton.next_power_of_2(k) // 2)))
    launch.setdefault("NORM_STAGES", 2)
    launch.setdefault("GEMV_STAGES", launch.get("num_stages", 3))
    if use_pdl(pdl, x.device, x.shape[0]):
        # 64 elements a line: 128 bytes of bf16/fp16.
        cols = max(64, min(PREFETCH_BYTES // (2 * block_n), triton.next_power_of_2(k // parts)))
        launch.update(pdl_keywords(weight.numel() * weight.element_size()), PREFETCH_K=cols)
    x = x.contiguous()
    partials, tickets = (scratch.partials, scratch.tickets) if parts > 1 else (out, out)
    # Absent operands' pointers are x's (out's for an unsplit launch's scratch): the kernel's
    # PROLOGUE and SPLIT_K never read them.
    _skinny_kernel[(triton.cdiv(n, block_n) * parts,)](
        x, x if residual is None else residual, x if norm_weight is None else norm_weight,
        weight.contiguous(), bias, out, sum_out, partials, tickets, x.shape[0], n, eps,
        *epilogue.pop("operands"), K=k, PROLOGUE=prologue, HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, SPLIT_K=parts, **launch, **epilogue,
    )  # fmt: skip
    return out


def _epilogue_operands(args: AttentionInputArgs | None, x: torch.Tensor, out: torch.Tensor,
                       block_n: int, scratch: SplitKScratch | None) -> dict:
    """The kernel's attention-input operands (`operands`, positional, after `eps`) and
    constexprs for `args`; without them, placeholders the kernel never reads."""
    if args is None:
        return dict(operands=[x] * 4 + [0.0] + [x] * 6 + [0] * 5)
    k_cache = args.k_cache
    q, k, v = args.split(out)
    args.check(q, k, v)
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if head_dim % block_n:
        raise ValueError(f"the attention-input epilogue needs head_dim {head_dim} a multiple of "
                         f"BLOCK_N {block_n}")
    heads = num_heads + 2 * num_kv_heads
    if scratch is None or scratch.head_tickets.numel() < heads:
        raise ValueError(f"the attention-input epilogue needs {heads} head tickets in the "
                         "small-batch scratch in effect (small_batch_kernels(scratch=...))")
    fp8 = is_fp8(k_cache.dtype)
    qk_norm = args.q_norm_weight is not None
    return dict(
        operands=[args.positions, args.cos_sin_cache.contiguous(),
                  args.q_norm_weight.contiguous() if qk_norm else x,
                  args.k_norm_weight.contiguous() if qk_norm else x, args.eps,
                  k_cache, args.v_cache, args.slot_mapping,
                  args.k_scale if fp8 else x, args.v_scale if fp8 else x, scratch.head_tickets,
                  *k_cache.stride(), k_cache.shape[1]],
        ATTENTION_INPUT=True, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HALF=head_dim // 2, HALF_P2=triton.next_power_of_2(head_dim // 2), QK_NORM=qk_norm,
        FP8=fp8)


def skinny_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [M, K], M <= `MAX_ROWS`, in one kernel. `config`
    overrides `skinny_config` (the bench's sweep); `pdl` overrides `ops.pdl.use_pdl`'s choice.
    Memory: the output [M, N]; a split-K launch's partials are the `SplitKScratch` in effect
    (`small_batch_kernels`), allocated before."""
    return _launch(x, weight, bias, x.shape[-1], NONE, config, pdl=pdl)


def rms_norm_linear_triton(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
    weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None, pdl: bool | None = None,
    attention_input: AttentionInputArgs | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(F.linear(rms_norm(x + residual), weight, bias), x + residual)` in one kernel, rounded
    as `add_rms_norm` then `F.linear` are; without `residual`, `(F.linear(rms_norm(x), ...),
    x)`. `config` and `pdl` as `skinny_linear_triton`'s; `attention_input`: the epilogue of
    `qkv_attention_input_triton`. Memory: the output [M, N] and, with a residual, the sum
    [M, K]; split partials as `skinny_linear_triton`'s."""
    k = x.shape[-1]
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"the norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} must "
                         f"be [{k}] in x's dtype {x.dtype}")
    summed = x
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}")
        residual = residual.contiguous()
        summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch(x, weight, bias, k, RMS_NORM if residual is None else ADD_RMS_NORM, config,
                  residual, norm_weight.contiguous(), eps, summed if residual is not None
                  else None, pdl, attention_input)
    return out, summed


def qkv_attention_input_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    args: AttentionInputArgs, norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None,
    config: dict[str, int] | None = None, pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The kernel of `kvfit.ops.small_batch.qkv_attention_input`: the projection (after the
    RMSNorm `norm` = (residual, weight, eps) where given), then each head's attention input
    run by the last program to store one of its tiles (`attention_input_epilogue`), counted
    in by the scratch's `head_tickets`. `config` and `pdl` as `skinny_linear_triton`'s.
    Memory: the projection's output [M, N] (q is normalised and rotated in it), the norm's
    sum as `rms_norm_linear_triton`'s; no q copy."""
    if norm is None:
        qkv = _launch(x, weight, bias, x.shape[-1], NONE, config, pdl=pdl, attention_input=args)
        summed = None
    else:
        qkv, summed = rms_norm_linear_triton(x, norm[0], norm[1], norm[2], weight, bias, config,
                                             pdl, args)
    return args.split(qkv)[0], summed


def silu_and_mul_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None, pdl: bool | None = None,
) -> torch.Tensor:
    """`F.linear(silu_and_mul(x), weight, bias)` for `x = [gate, up]` [M, 2K] in one kernel,
    rounded as `silu_and_mul` then `F.linear` are; `config` and `pdl` as
    `skinny_linear_triton`'s. Memory: the output [M, N], and as `skinny_linear_triton`'s."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    return _launch(x, weight, bias, x.shape[-1] // 2, SILU_AND_MUL, config, pdl=pdl)
