"""The small-batch linear kernels (`ops/triton_skinny.py`) against torch.

Interpreter tests (tiny odd shapes, fp16; the interpreter's bf16 is unreliable):
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_triton_skinny.py -q
GPU tests (the 0.6B and 8B layer shapes, bf16/fp16):
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_triton_skinny.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kvfit.ops.attention_input import AttentionInputArgs, attention_input_torch
from kvfit.ops.layers import (
    RotaryEmbedding,
    add_rms_norm_torch,
    rms_norm_torch,
    silu_and_mul_torch,
)
from kvfit.ops.small_batch import small_batch_kernels

triton_skinny = pytest.importorskip("kvfit.ops.triton_skinny")

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py

ROWS = [1, 3, 16]  # the M = 1 path (FMAs), and the tensor-core path partly and fully used


def _weights(n: int, k: int, dtype: torch.dtype, device: str = "cpu", bias: bool = True):
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype=dtype, device=device)
    b = torch.randn(n, generator=g).to(dtype=dtype, device=device) if bias else None
    return w, b


def _linear_fp32(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The product accumulated in fp32 and rounded once, as the kernel (and cuBLAS) do."""
    return F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)


def _close(got: torch.Tensor, expect: torch.Tensor) -> None:
    """Equal to one rounding of the output dtype: only the fp32 summation order differs."""
    assert got.shape == expect.shape and got.dtype == expect.dtype
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), expect.float(), rtol=2 * eps, atol=2 * eps)


# --- interpreter -------------------------------------------------------------------------------


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(37, 100), (300, 1000), (16, 256)])
@pytest.mark.parametrize("bias", [True, False])
def test_skinny_linear_matches_torch(rows: int, n: int, k: int, bias: bool) -> None:
    """N and K off the tiles (37 of 16-row tiles, K 100 and 1000 of 128/256) and on them."""
    w, b = _weights(n, k, torch.float16, bias=bias)
    x = torch.randn(rows, k, dtype=torch.float16)
    _close(triton_skinny.skinny_linear_triton(x, w, b), _linear_fp32(x, w, b))


@interpret
@pytest.mark.parametrize("row_gemv", [True, False])
def test_one_row_takes_either_path(row_gemv: bool) -> None:
    """At one row the plain kernel takes FMAs or the 16-row MMA tile (`ROW_GEMV`), off-tile N
    and K included; both give the product."""
    w, b = _weights(70, 200, torch.float16)
    x = torch.randn(1, 200, dtype=torch.float16)
    got = triton_skinny.skinny_linear_triton(
        x, w, b, config=dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=2,
                             ROW_GEMV=row_gemv))
    _close(got, _linear_fp32(x, w, b))


@interpret
def test_skinny_linear_takes_a_config_and_a_strided_input() -> None:
    """The bench's configs are launch overrides, and a row-strided x (a slice) is read right."""
    w, b = _weights(70, 96, torch.float16)
    x = torch.randn(5, 200, dtype=torch.float16)[:, 8:104]
    got = triton_skinny.skinny_linear_triton(
        x, w, b, config=dict(BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=2))
    _close(got, _linear_fp32(x, w, b))


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(37, 100), (48, 256)])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("norm_block_k", [None, 64])
def test_rms_norm_linear_matches_the_unfused_chain(rows: int, n: int, k: int,
                                                  with_residual: bool,
                                                  norm_block_k: int | None) -> None:
    """The norm's output, rounded as `add_rms_norm` rounds it, feeds the product: the result
    is the chain's to one rounding; the residual sum is the chain's bit for bit. The rms pass
    in one wide block (the default here) or in several, the last one partial."""
    w, b = _weights(n, k, torch.float16)
    x = torch.randn(rows, k, dtype=torch.float16)
    residual = torch.randn(rows, k, dtype=torch.float16) * 3 if with_residual else None
    norm = torch.randn(k, dtype=torch.float16)
    config = (None if norm_block_k is None
              else dict(triton_skinny.skinny_config(n, k), NORM_BLOCK_K=norm_block_k))
    got, summed = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, w, b,
                                                       config=config)
    if with_residual:
        normed, expect_sum = add_rms_norm_torch(x, residual, norm, 1e-6)
        assert torch.equal(summed, expect_sum)
    else:
        normed = rms_norm_torch(x, norm, 1e-6)
        assert summed is x
    _close(got, _linear_fp32(normed, w, b))


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("n", "k"), [(37, 100), (48, 256)])
def test_silu_and_mul_linear_matches_the_unfused_chain(rows: int, n: int, k: int) -> None:
    w, b = _weights(n, k, torch.float16)
    gate_up = torch.randn(rows, 2 * k, dtype=torch.float16) * 2
    got = triton_skinny.silu_and_mul_linear_triton(gate_up, w, b)
    _close(got, _linear_fp32(silu_and_mul_torch(gate_up), w, b))


@interpret
@pytest.mark.parametrize("rows", [1, 3])  # the FMA path (the model's) and the MMA path
@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm", "silu_and_mul"])
def test_fused_prologues_round_where_the_unfused_kernels_round(prologue: str, rows: int
                                                              ) -> None:
    """An identity weight makes the product exact (one non-zero term per output), so the
    output is the prologue's own result: rounded to fp16 before the norm's scale (and after
    the SiLU, before the product with up), as `_rms_norm_kernel` and `_silu_and_mul_kernel`
    round. The tolerance tests above cannot see a rounding dropped; here about one element in
    ten would differ. One may differ where fp32 rsqrt/exp round otherwise than torch's."""
    k = 256
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(rows, k, generator=g) * 3).half()
    eye = torch.eye(k, dtype=torch.float16)
    if prologue == "silu_and_mul":
        gate_up = torch.cat([x, (torch.randn(rows, k, generator=g) * 3).half()], dim=-1)
        got = triton_skinny.silu_and_mul_linear_triton(gate_up, eye)
        expect = silu_and_mul_torch(gate_up)
    else:
        residual = (torch.randn(rows, k, generator=g) * 3).half() if prologue != "rms_norm" \
            else None
        norm = (torch.rand(k, generator=g) + 0.5).half()
        got, _ = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, eye)
        expect = (rms_norm_torch(x, norm, 1e-6) if residual is None
                  else add_rms_norm_torch(x, residual, norm, 1e-6)[0])
    assert (got != expect).sum() <= 1, (got != expect).sum()


@interpret
@pytest.mark.parametrize("prologue", ["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("row_gemv", [True, False])
def test_one_row_norm_feeds_either_product(prologue: str, row_gemv: bool) -> None:
    """At one row a norm prologue feeds FMAs (`ROW_GEMV`: `skinny_config`'s choice for every
    kernel with a prologue) or, with `ROW_GEMV` off, the MMA tile, its one row broadcast to the
    tile's 16: both round where the unfused kernels round (an identity weight makes the product
    exact) and give the chain's product to one rounding, off the tile's edge in N too."""
    g = torch.Generator().manual_seed(5)
    k, n = 256, 40
    x = (torch.randn(1, k, generator=g) * 3).half()
    residual = (torch.randn(1, k, generator=g) * 3).half() if prologue == "add_rms_norm" \
        else None
    norm = (torch.rand(k, generator=g) + 0.5).half()
    expect = (rms_norm_torch(x, norm, 1e-6) if residual is None
              else add_rms_norm_torch(x, residual, norm, 1e-6)[0])
    config = dict(BLOCK_N=16, BLOCK_K=64, num_warps=2, num_stages=2, ROW_GEMV=row_gemv)
    got, _ = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6,
                                                  torch.eye(k, dtype=torch.float16),
                                                  config=config)
    assert (got != expect).sum() <= 1, (got != expect).sum()
    w, b = _weights(n, k, torch.float16)
    got, _ = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, w, b, config=config)
    _close(got, _linear_fp32(expect, w, b))


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("row_gemv", [True, False])
def test_split_k_matches_torch_and_leaves_the_tickets_at_zero(rows: int, parts: int,
                                                              row_gemv: bool) -> None:
    """K cut into 2 or 4 parts (each a program, the last of a tile summing them) gives the
    product, N off the tiles and with a bias, and every ticket is back at zero for the next
    launch; the plain, norm and SiLU prologues alike."""
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cpu"))
    cfg = dict(BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=2, ROW_GEMV=row_gemv,
               SPLIT_K=parts)
    w, b = _weights(37, 256, torch.float16)
    x = torch.randn(rows, 256, dtype=torch.float16)
    with small_batch_kernels(scratch=scratch):
        got = triton_skinny.skinny_linear_triton(x, w, b, config=cfg)
        gate_up = torch.randn(rows, 512, dtype=torch.float16) * 2
        silu = triton_skinny.silu_and_mul_linear_triton(gate_up, w, config=cfg)
        residual = torch.randn(rows, 256, dtype=torch.float16)
        norm = torch.randn(256, dtype=torch.float16)
        normed_out, summed = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, w,
                                                                  config=cfg)
    _close(got, _linear_fp32(x, w, b))
    _close(silu, _linear_fp32(silu_and_mul_torch(gate_up), w, None))
    normed, expect_sum = add_rms_norm_torch(x, residual, norm, 1e-6)
    assert torch.equal(summed, expect_sum)
    _close(normed_out, _linear_fp32(normed, w, None))
    assert not scratch.tickets.any()


def _attention_layer(rows: int, qk_norm: bool, dtype: torch.dtype, device: str = "cpu",
                     heads: tuple[int, int, int] = (4, 2, 32), hidden: int = 64,
                     cache_dtype: torch.dtype | None = None):
    """A QKV weight of `heads` (q heads, KV heads, head_dim), its attention-input arguments
    (caches of 3 blocks of 8 slots, rows at distinct slots, the second at -1 where there are
    several) and an input x."""
    num_heads, num_kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(rows * 10 + qk_norm)
    w, b = _weights((num_heads + 2 * num_kv_heads) * head_dim, hidden, dtype, device)
    slots = torch.randperm(24, generator=g)[:rows]
    if rows > 1:
        slots[1] = -1  # a CUDA graph's padded row: computed, not stored
    norm = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype=dtype, device=device)
            for _ in range(2)] if qk_norm else [None, None]
    cache = torch.zeros(3, 8, num_kv_heads, head_dim, dtype=cache_dtype or dtype, device=device)
    rope = RotaryEmbedding(head_dim, 64, base=10_000.0).to(device)
    args = AttentionInputArgs(
        torch.randint(0, 64, (rows,), generator=g).to(device), norm[0], norm[1], 1e-6,
        rope.cos_sin_cache, cache, cache.clone(), slots.to(device),
        *(torch.ones(1, device=device) for _ in range(2)))
    x = (torch.randn(rows, hidden, generator=g) * 2).to(dtype=dtype, device=device)
    return w, b, args, x


def _unfused(w, b, args: AttentionInputArgs, x, norm, config):
    """The oracle of `qkv_attention_input_triton`: the same projection launch without the
    epilogue (the same product bits), then `attention_input_torch` on caches of its own."""
    if norm is None:
        qkv = triton_skinny.skinny_linear_triton(x, w, b, config=config)
    else:
        qkv = triton_skinny.rms_norm_linear_triton(x, norm[0], norm[1], norm[2], w, b,
                                                   config=config)[0]
    caches = args.k_cache.clone(), args.v_cache.clone()
    q = attention_input_torch(args.positions, *args.split(qkv), args.q_norm_weight,
                              args.k_norm_weight, args.eps, args.cos_sin_cache, *caches,
                              args.slot_mapping, args.k_scale, args.v_scale)
    return q, caches


@interpret
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("prologue", ["none", "rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("parts", [None, 1, 2])
def test_qkv_epilogue_runs_the_attention_input(rows: int, prologue: str, qk_norm: bool,
                                               parts: int | None) -> None:
    """Each head's last program to store one of its tiles normalises and rotates a q head in
    place, a k head into the cache, copies a v head: q and the stored K are the unfused
    chain's to one rounding (the rms sums in another order), V bit for bit; slot -1 stores
    nothing; every head ticket is back at zero. Whole K and K in parts (the tile's last
    program then also takes the head's ticket), `skinny_config`'s tiles (None) and 16-column
    tiles, two to a head."""
    w, b, args, x = _attention_layer(rows, qk_norm, torch.float16)
    residual = torch.randn_like(x) if prologue == "add_rms_norm" else None
    norm = None if prologue == "none" else (residual, torch.rand(x.shape[1]).half() + 0.5, 1e-6)
    config = None if parts is None else dict(BLOCK_N=16, BLOCK_K=32, num_warps=2,
                                             num_stages=2, SPLIT_K=parts)
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cpu"), heads=8)
    with small_batch_kernels(scratch=scratch):
        q, summed = triton_skinny.qkv_attention_input_triton(x, w, b, args, norm, config)
        expect_q, (expect_k, expect_v) = _unfused(w, b, args, x, norm, config)
    _close(q, expect_q)
    _close(args.k_cache, expect_k)
    assert torch.equal(args.v_cache, expect_v)
    assert args.v_cache.flatten(0, 1).flatten(1).any(1).sum() == (args.slot_mapping >= 0).sum()
    assert summed is None if norm is None else summed.shape == x.shape
    assert not scratch.head_tickets.any() and not scratch.tickets.any()


def test_qkv_epilogue_narrows_tiles_to_whole_heads() -> None:
    """Where the widest tile does not divide a head (64 columns against 80-wide heads), the
    epilogue's config narrows it to one that does, the rest chosen for that tile; where it
    divides, the config is the plain one."""
    config = triton_skinny.skinny_config
    assert config(9600, 1024, num_sms=132)["BLOCK_N"] == 64
    assert config(9600, 1024, num_sms=132, head_dim=80) == dict(
        BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=4, ROW_GEMV=True, SPLIT_K=1)
    # 80-wide heads at N 1200: 75 tiles of 16 for 132 SMs, so K in two parts.
    assert config(1200, 1024, num_sms=132, head_dim=80)["SPLIT_K"] == 2
    assert config(9600, 1024, num_sms=132, head_dim=128) == config(9600, 1024, num_sms=132)


def test_qkv_epilogue_needs_its_tickets_and_whole_heads() -> None:
    """Without head tickets in effect, or with a head not a whole number of tiles, the launch
    says what to change rather than run."""
    w, b, args, x = _attention_layer(1, True, torch.float16, heads=(2, 1, 16))
    with pytest.raises(ValueError, match="head tickets"):
        triton_skinny.qkv_attention_input_triton(x, w, b, args)
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cpu"), heads=4)
    with small_batch_kernels(scratch=scratch), pytest.raises(ValueError, match="BLOCK_N 32"):
        triton_skinny.qkv_attention_input_triton(
            x, w, b, args, config=dict(BLOCK_N=32, BLOCK_K=32, num_warps=2, num_stages=2))


def test_split_k_parts_only_where_sms_would_idle() -> None:
    """The 0.6B's N-1024 layers (64 tiles of 16 rows) split in 4 on 132 SMs, and in 2 on 108
    (128 programs); every layer with a program for every SM, and a K not cut into whole
    BLOCK_K tiles, stays whole."""
    cfg = triton_skinny.skinny_config
    assert cfg(1024, 2048, num_sms=132)["SPLIT_K"] == 4  # 0.6B o_proj
    assert cfg(1024, 3072, num_sms=132, prologue=triton_skinny.SILU_AND_MUL)["SPLIT_K"] == 4
    assert cfg(1024, 3072, num_sms=108)["SPLIT_K"] == 2
    for n, k in [(4096, 1024), (6144, 1024), (6144, 4096), (4096, 4096), (4096, 12288),
                 (24576, 4096), (151936, 1024)]:
        assert cfg(n, k, num_sms=132)["SPLIT_K"] == 1, (n, k)
    assert cfg(1024, 768, num_sms=132)["SPLIT_K"] == 1  # 768 = 3 BLOCK_K tiles: no halves
    assert cfg(1024, 1536, num_sms=132)["SPLIT_K"] == 2  # 6 tiles: halves, not quarters


def test_split_k_without_its_scratch_runs_whole_or_refuses() -> None:
    """The default rule's split needs the scratch in effect: without one (a direct call) the
    launch runs unsplit; a config that asks for a split it cannot have says why."""
    w, _ = _weights(16, 64, torch.float16)
    x = torch.randn(1, 64, dtype=torch.float16)
    ask = dict(BLOCK_N=16, BLOCK_K=32, num_warps=2, num_stages=2, SPLIT_K=2)
    with pytest.raises(ValueError, match="no split-K scratch"):
        triton_skinny.skinny_linear_triton(x, w, config=ask)
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cpu"))
    with small_batch_kernels(scratch=scratch), pytest.raises(ValueError, match="power of two"):
        triton_skinny.skinny_linear_triton(x, w, config=dict(ask, SPLIT_K=3))
    with small_batch_kernels(scratch=scratch), pytest.raises(ValueError, match="BLOCK_K"):
        triton_skinny.skinny_linear_triton(x, w, config=dict(ask, SPLIT_K=4))
    small = dataclasses.replace(scratch, partials=scratch.partials[:16])
    with small_batch_kernels(scratch=small), pytest.raises(ValueError, match="too small"):
        triton_skinny.skinny_linear_triton(x, w, config=ask)
    assert triton_skinny._split_launch(4, False, 1024, 2048, 16, 256, None) == 1


def test_skinny_linear_refuses_what_it_does_not_compute() -> None:
    w, _ = _weights(16, 32, torch.float16)
    with pytest.raises(ValueError, match="M <= 16"):
        triton_skinny.skinny_linear_triton(torch.randn(17, 32, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bf16/fp16"):
        triton_skinny.skinny_linear_triton(torch.randn(2, 32), w.float())
    with pytest.raises(ValueError, match=r"\[N, 32\]"):
        triton_skinny.skinny_linear_triton(torch.randn(2, 32, dtype=torch.float16), w[:, :16])
    assert triton_skinny.skinny_linear_triton(torch.empty(0, 32, dtype=torch.float16),
                                              w).shape == (0, 16)
    x = torch.randn(2, 32, dtype=torch.float16)
    with pytest.raises(ValueError, match="norm weight"):
        triton_skinny.rms_norm_linear_triton(x, None, torch.ones(32), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        triton_skinny.rms_norm_linear_triton(x, x[:1], torch.ones(32, dtype=x.dtype), 1e-6, w)
    with pytest.raises(ValueError, match="even last dim"):
        triton_skinny.silu_and_mul_linear_triton(torch.randn(2, 33, dtype=torch.float16), w)


def test_skinny_config_gives_every_sm_a_program_and_keeps_block_k_a_divisor() -> None:
    """At the model shapes: BLOCK_N as wide as leaves one program per SM, and BLOCK_K divides
    every K, so the loop runs without a mask."""
    for n in (1024, 4096, 6144, 24576, 151936):
        for k in (1024, 2048, 3072, 4096, 12288):
            cfg = triton_skinny.skinny_config(n, k, num_sms=132)
            assert k % cfg["BLOCK_K"] == 0
            assert -(-n // cfg["BLOCK_N"]) >= 132 or cfg["BLOCK_N"] == 16
    assert triton_skinny.skinny_config(24576, 4096)["BLOCK_N"] == 64
    # One row: FMAs up to 32-row tiles, the MMA for the 64-row ones (timed per shape).
    assert [triton_skinny.skinny_config(n, 4096)["ROW_GEMV"] for n in (4096, 6144, 24576)
            ] == [True, True, False]
    assert triton_skinny.skinny_config(1024, 3072)["BLOCK_N"] == 16
    # A prologue's buffers fit two programs a SM at four stages: a grid beyond that takes three.
    norm = triton_skinny.ADD_RMS_NORM
    assert triton_skinny.skinny_config(24576, 4096, prologue=norm)["num_stages"] == 3
    assert triton_skinny.skinny_config(24576, 4096)["num_stages"] == 4
    assert triton_skinny.skinny_config(6144, 4096, prologue=norm)["num_stages"] == 4


@pytest.mark.parametrize("mma_prologue", [True, False])
def test_one_row_mma_takes_norm_prologues_of_wide_tiles_only(monkeypatch: pytest.MonkeyPatch,
                                                             mma_prologue: bool) -> None:
    """`ROW_MMA_PROLOGUE` moves a one-row norm prologue of a 64-row tile (the 8B's gate_up) to
    the MMA; 32-row tiles and the SiLU prologue keep the FMAs either way."""
    monkeypatch.setattr(triton_skinny, "ROW_MMA_PROLOGUE", mma_prologue)
    gemv = {(n, p): triton_skinny.skinny_config(n, 4096, num_sms=132, prologue=p)["ROW_GEMV"]
            for n in (6144, 24576) for p in (triton_skinny.RMS_NORM, triton_skinny.ADD_RMS_NORM,
                                               triton_skinny.SILU_AND_MUL)}
    wide_norms = {(24576, triton_skinny.RMS_NORM), (24576, triton_skinny.ADD_RMS_NORM)}
    assert gemv == {key: not (mma_prologue and key in wide_norms) for key in gemv}


# --- GPU ---------------------------------------------------------------------------------------

SHAPES_0_6B = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]  # qkv, o, gate_up, down
SHAPES_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("n", "k"), [*SHAPES_0_6B, *SHAPES_8B, (151936, 1024)])
def test_gpu_skinny_linear_matches_torch(dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    w, b = _weights(n, k, dtype, "cuda")
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    _close(triton_skinny.skinny_linear_triton(x, w, b), _linear_fp32(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("n", "k"), [(4096, 1024), (6144, 1024), (24576, 4096)])
def test_gpu_rms_norm_linear_matches_the_unfused_chain(dtype: torch.dtype, rows: int, n: int,
                                                      k: int) -> None:
    w, b = _weights(n, k, dtype, "cuda", bias=False)
    x = torch.randn(rows, k, dtype=dtype, device="cuda")
    residual = torch.randn(rows, k, dtype=dtype, device="cuda") * 3
    norm = torch.randn(k, dtype=dtype, device="cuda")
    got, summed = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, w, b)
    normed, expect_sum = add_rms_norm_torch(x, residual, norm, 1e-6)
    assert torch.equal(summed, expect_sum)
    _close(got, _linear_fp32(normed, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(6144, 1024), (24576, 4096)])
def test_gpu_one_row_norm_through_the_mma_matches_the_unfused_chain(dtype: torch.dtype, n: int,
                                                                  k: int) -> None:
    """With `ROW_GEMV` off a one-row fused norm feeds the MMA tile (`bench/skinny_linear.py`'s
    `fused_mma`): the chain's product to one rounding, the residual sum bit for bit."""
    w, _ = _weights(n, k, dtype, "cuda", bias=False)
    x = torch.randn(1, k, dtype=dtype, device="cuda")
    residual = torch.randn(1, k, dtype=dtype, device="cuda") * 3
    norm = torch.randn(k, dtype=dtype, device="cuda")
    config = {**triton_skinny.skinny_config(n, k, prologue=triton_skinny.ADD_RMS_NORM),
              "ROW_GEMV": False}
    got, summed = triton_skinny.rms_norm_linear_triton(x, residual, norm, 1e-6, w,
                                                       config=config)
    normed, expect_sum = add_rms_norm_torch(x, residual, norm, 1e-6)
    assert torch.equal(summed, expect_sum)
    _close(got, _linear_fp32(normed, w, None))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("n", "k"), [(1024, 3072), (4096, 12288)])
def test_gpu_silu_and_mul_linear_matches_the_unfused_chain(dtype: torch.dtype, rows: int,
                                                          n: int, k: int) -> None:
    w, b = _weights(n, k, dtype, "cuda", bias=False)
    gate_up = torch.randn(rows, 2 * k, dtype=dtype, device="cuda") * 2
    got = triton_skinny.silu_and_mul_linear_triton(gate_up, w, b)
    _close(got, _linear_fp32(silu_and_mul_torch(gate_up), w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("n", "k", "prologue"), [(1024, 2048, "none"), (1024, 3072, "silu"),
                                                  (1024, 1024, "norm"), (2000, 4096, "none")])
def test_gpu_split_k_matches_torch_and_repeats_its_bits(dtype: torch.dtype, rows: int, n: int,
                                                        k: int, prologue: str) -> None:
    """With the scratch in effect the N-1024 layers (and an N off the tiles) split K across
    programs: the product to one rounding, the same bits on every launch whichever program of
    a tile finishes last, and the tickets back at zero."""
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert triton_skinny.skinny_config(n, k, sms)["SPLIT_K"] > 1
    w, b = _weights(n, k, dtype, "cuda", bias=prologue == "none")
    x = torch.randn(rows, 2 * k if prologue == "silu" else k, dtype=dtype, device="cuda")
    norm = torch.randn(k, dtype=dtype, device="cuda")

    def run() -> torch.Tensor:
        if prologue == "silu":
            return triton_skinny.silu_and_mul_linear_triton(x, w)
        if prologue == "norm":
            return triton_skinny.rms_norm_linear_triton(x, None, norm, 1e-6, w)[0]
        return triton_skinny.skinny_linear_triton(x, w, b)

    with small_batch_kernels(scratch=scratch):
        got = [run() for _ in range(20)]
    operand = {"silu": lambda: silu_and_mul_torch(x), "norm": lambda: rms_norm_torch(x, norm, 1e-6),
               "none": lambda: x}[prologue]()
    _close(got[0], _linear_fp32(operand, w, b))
    assert all(torch.equal(g, got[0]) for g in got)
    assert not scratch.tickets.any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize(("heads", "hidden"), [
    ((16, 8, 128), 1024),  # the 0.6B shape: 16-column tiles, 8 a head
    ((32, 8, 128), 4096),  # the 8B shape: 32-column tiles
    ((32, 8, 64), 2048),   # 64-wide heads
])  # fmt: skip
@pytest.mark.parametrize("cache", ["16-bit", "fp8"])
def test_gpu_qkv_epilogue_matches_the_unfused_chain_and_repeats_its_bits(
        dtype: torch.dtype, rows: int, heads: tuple[int, int, int], hidden: int,
        cache: str) -> None:
    """The QKV projection with the attention input in its kernel, as the model runs it (the
    input norm and residual in the kernel at one row, a plain product above): q and the
    stored K within a rounding of the same launch without the epilogue followed by the
    unfused attention input, V bit for bit (an e4m3 cache: at most 1% of the K codes a step
    apart); 20 launches give the same bits whichever program of a head comes last; the head
    tickets are back at zero."""
    cache_dtype = torch.float8_e4m3fn if cache == "fp8" else None
    w, b, args, x = _attention_layer(rows, True, dtype, "cuda", heads, hidden, cache_dtype)
    b = None
    norm = (torch.randn_like(x), torch.rand(hidden, device="cuda").to(dtype) + 0.5, 1e-6) \
        if rows == 1 else None
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cuda"),
                                                     heads[0] + 2 * heads[1])
    with small_batch_kernels(scratch=scratch):
        runs = []
        for _ in range(20):
            args.k_cache.zero_(), args.v_cache.zero_()
            q, _ = triton_skinny.qkv_attention_input_triton(x, w, b, args, norm)
            runs.append((q.clone(), args.k_cache.clone(), args.v_cache.clone()))
        expect_q, (expect_k, expect_v) = _unfused(w, b, args, x, norm, None)
    q, k_cache, v_cache = runs[0]
    _close(q.contiguous(), expect_q)
    if cache_dtype is None:
        _close(k_cache, expect_k)
    else:
        assert (k_cache.float() != expect_k.float()).float().mean() < 0.01
    assert torch.equal(v_cache.float(), expect_v.float())
    assert all(all(torch.equal(a.float(), b.float()) for a, b in zip(run, runs[0], strict=True))
               for run in runs)
    assert not scratch.head_tickets.any() and not scratch.tickets.any()


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("rows", [1, 3])
def test_gpu_pdl_chain_in_a_graph_gives_the_bits_without_pdl(
        rows: int, early: bool, split: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer's chain of skinny kernels, each reading its predecessor's output, launched with
    programmatic dependent launch and replayed from a CUDA graph: the same bits as without, on
    every replay (a read before `gdc_wait` would see the predecessor's output half written),
    with the successor released early or late (`PDL_EARLY`), and with o_proj and down_proj
    split across programs sharing one scratch (a scratch touched before the wait would race
    the split launch before)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    from kvfit.ops import pdl as ops_pdl

    monkeypatch.setattr(ops_pdl, "PDL_EARLY", early)
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cuda")) if split else None
    dtype, hidden, inter = torch.bfloat16, 1024, 3072
    qkv, _ = _weights(4096, hidden, dtype, "cuda", bias=False)
    o, _ = _weights(hidden, 4096, dtype, "cuda", bias=False)
    gate_up, _ = _weights(2 * inter, hidden, dtype, "cuda", bias=False)
    down, _ = _weights(hidden, inter, dtype, "cuda", bias=False)
    norm = torch.randn(hidden, dtype=dtype, device="cuda")
    x = torch.randn(rows, hidden, dtype=dtype, device="cuda")

    def layer(pdl: bool) -> torch.Tensor:
        h, residual = x, x
        for _ in range(4):
            q, residual = triton_skinny.rms_norm_linear_triton(h, residual, norm, 1e-6, qkv,
                                                               pdl=pdl)
            h = triton_skinny.skinny_linear_triton(q, o, pdl=pdl)
            g, residual = triton_skinny.rms_norm_linear_triton(h, residual, norm, 1e-6,
                                                               gate_up, pdl=pdl)
            h = triton_skinny.silu_and_mul_linear_triton(g, down, pdl=pdl)
        return h

    with small_batch_kernels(scratch=scratch):
        expect = layer(False)
        layer(True)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = layer(True)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, expect)
    assert scratch is None or not scratch.tickets.any()
