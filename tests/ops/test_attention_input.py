"""`attention_input` (q/k norm -> rotary -> K/V store in one op) against its oracles.

CPU: the torch composition against a naive float64 per-token reference, and input checks.
Interpreter (tiny shapes, fp32/fp16): the fused kernel against the torch composition.
GPU (model shapes, bf16/fp16, and a CUDA graph replay): the fused kernel against the unfused
Triton kernels it replaces.

    python3 -m pytest tests/ops/test_attention_input.py -q
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_attention_input.py -q
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_attention_input.py -q
"""

from __future__ import annotations

import pytest
import torch

from kvfit.ops import attention_input
from kvfit.ops.attention_input import attention_input_torch
from kvfit.ops.layers import RotaryEmbedding

try:  # Triton is optional (the `cuda` and `dev` extras): the torch path's tests run without it.
    from kvfit.ops import triton_attention_input
    from kvfit.ops.triton_kv_write import write_kv_triton
    from kvfit.ops.triton_layers import rms_norm_triton, rotary_triton
except ImportError:
    triton_attention_input = None

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py

EPS = 1e-6
NAN = float("nan")



def _qkv_split(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, **kw):
    """q, k, v as the model produces them: `[T, heads, head_dim]` views of one fused qkv row."""
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = (torch.randn(num_tokens, sum(widths), **kw) * 3).split(widths, dim=-1)
    return (q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim),
            v.view(-1, num_kv_heads, head_dim))  # fmt: skip


def _poisoned_caches(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                     layout: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """NaN-filled K/V views `[num_blocks, block_size, kv_heads, head_dim]` sharing strides:
    head-major (`[blocks, kv_heads, block_size, dim]` stored) or the engine's block-outermost
    layout (layer 1 of 2, so the block stride spans the other layer)."""
    if layout == "head_major":
        full = torch.full((2, num_blocks, num_kv_heads, block_size, head_dim), NAN, **kw)
        return full[0].transpose(1, 2), full[1].transpose(1, 2)
    full = torch.full((num_blocks, 2, 2, block_size, num_kv_heads, head_dim), NAN, **kw)
    return full[:, 1, 0], full[:, 1, 1]


def _slots(num_tokens: int, num_blocks: int, block_size: int, device: str = "cpu"):
    """Distinct random slots out of order, every fifth from the fourth on -1 (skipped)."""
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[3::5] = -1
    return slots


def _case(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, qk_norm: bool,
          block_size: int = 4, layout: str = "head_major", dtype: torch.dtype = torch.float32,
          device: str = "cpu") -> dict:  # fmt: skip
    """All arguments of `attention_input` for a random batch with unsorted positions."""
    max_position = 3 * num_tokens + 5
    kw = dict(dtype=dtype, device=device)
    q, k, v = _qkv_split(num_tokens, num_heads, num_kv_heads, head_dim, **kw)
    num_blocks = -(-num_tokens // block_size) + 2
    k_cache, v_cache = _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, layout,
                                        **kw)  # fmt: skip
    rope = RotaryEmbedding(head_dim, max_position, base=10_000.0).to(device)
    return dict(
        positions=torch.randperm(max_position, device=device)[:num_tokens],
        q=q, k=k, v=v,
        q_norm_weight=1 + 0.3 * torch.randn(head_dim, **kw) if qk_norm else None,
        k_norm_weight=1 + 0.3 * torch.randn(head_dim, **kw) if qk_norm else None,
        eps=EPS,
        cos_sin_cache=rope.cos_sin_cache,
        k_cache=k_cache, v_cache=v_cache,
        slot_mapping=_slots(num_tokens, num_blocks, block_size, device),
    )  # fmt: skip


def _with_cache_copies(case: dict) -> dict:
    return {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}


def _naive(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64, token by token: norm -> rope -> store. Returns (q, k_cache, v_cache)."""
    q, k, v = (case[name].double() for name in "qkv")
    k_cache, v_cache = case["k_cache"].double(), case["v_cache"].double()
    block_size, half = k_cache.shape[1], q.shape[-1] // 2
    q_out = torch.empty_like(q)

    def prepare(x: torch.Tensor, weight: torch.Tensor | None, cos, sin) -> torch.Tensor:
        if weight is not None:
            x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight.double()
        x1, x2 = x[:, :half], x[:, half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    for t, (pos, slot) in enumerate(zip(case["positions"].tolist(),
                                        case["slot_mapping"].tolist(), strict=True)):  # fmt: skip
        cos, sin = case["cos_sin_cache"][pos].double().chunk(2)
        q_out[t] = prepare(q[t], case["q_norm_weight"], cos, sin)
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            k_cache[block, offset] = prepare(k[t], case["k_norm_weight"], cos, sin)
            v_cache[block, offset] = v[t]
    return q_out, k_cache, v_cache


# --- CPU ---------------------------------------------------------------------------------------

GQA = [(4, 2), (6, 3), (2, 2)]


@pytest.mark.parametrize("layout", ["head_major", "block_outermost"])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads", GQA)
def test_composition_matches_naive(num_heads, num_kv_heads, qk_norm, layout):
    torch.manual_seed(0)
    head_dim = 16
    case = _case(11, num_heads, num_kv_heads, head_dim, qk_norm, layout=layout)
    expect_q, expect_k, expect_v = _naive(case)
    q = attention_input(**case)
    assert q.shape == case["q"].shape and q.dtype == case["q"].dtype and q.is_contiguous()
    torch.testing.assert_close(q.double(), expect_q, rtol=1e-5, atol=1e-5)
    # Poisoned slots the batch skips or never addresses must still be NaN on both sides.
    for got, expect in ((case["k_cache"], expect_k), (case["v_cache"], expect_v)):
        torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-5, equal_nan=True)
    written = (case["slot_mapping"] >= 0).sum().item()
    assert 0 < written < len(case["slot_mapping"])
    assert (~case["k_cache"].isnan()).sum() == written * num_kv_heads * head_dim


def test_op_is_the_composition_on_cpu():
    torch.manual_seed(1)
    case = _case(6, 4, 2, 8, qk_norm=True)
    expect = _with_cache_copies(case)
    assert torch.equal(attention_input(**case), attention_input_torch(**expect))
    assert torch.equal(case["k_cache"].nan_to_num(), expect["k_cache"].nan_to_num())
    assert torch.equal(case["v_cache"].nan_to_num(), expect["v_cache"].nan_to_num())


def test_no_tokens():
    case = _case(0, 4, 2, 8, qk_norm=True)
    assert attention_input(**case).shape == (0, 4, 8)
    assert case["k_cache"].isnan().all()


BAD_INPUTS = [
    ("q_norm_weight", lambda c: {**c, "k_norm_weight": None}),
    ("q_norm_weight", lambda c: {**c, "q_norm_weight": c["q_norm_weight"][:4]}),
    ("k_norm_weight", lambda c: {**c, "k_norm_weight": c["k_norm_weight"].double()}),
    ("cos_sin_cache", lambda c: {**c, "cos_sin_cache": c["cos_sin_cache"][:, :4]}),
    ("slot_mapping", lambda c: {**c, "slot_mapping": c["slot_mapping"][:2]}),
    ("positions", lambda c: {**c, "positions": c["positions"].float()}),
    ("v_cache strides", lambda c: {**c, "v_cache": c["v_cache"].contiguous()}),
    ("num_kv_heads", lambda c: {**c, "k_cache": c["k_cache"][:, :, :1],
                                "v_cache": c["v_cache"][:, :, :1]}),
    ("share one dtype", lambda c: {**c, "v": c["v"].half()}),
    ("head_dim", lambda c: {**c, "k": c["k"][..., :4], "v": c["v"][..., :4]}),
]  # fmt: skip


@pytest.mark.parametrize("match,corrupt", BAD_INPUTS, ids=[m for m, _ in BAD_INPUTS])
def test_rejects_bad_input(match, corrupt):
    case = _case(6, 4, 2, 8, qk_norm=True)
    with pytest.raises(ValueError, match=match):
        attention_input(**corrupt(case))


# --- interpreter -------------------------------------------------------------------------------


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim",
                         [(4, 2, 16), (6, 3, 12), (4, 4, 4), (3, 1, 2)])
def test_kernel_matches_composition(num_heads, num_kv_heads, head_dim, qk_norm, dtype):
    torch.manual_seed(2)
    case = _case(9, num_heads, num_kv_heads, head_dim, qk_norm, layout="block_outermost",
                 dtype=dtype)  # fmt: skip
    expect = _with_cache_copies(case)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    q = triton_attention_input.attention_input_triton(**case)
    expect_q = attention_input_torch(**expect)
    torch.testing.assert_close(q, expect_q, rtol=tol, atol=tol)
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(case[name], expect[name], rtol=tol, atol=tol, equal_nan=True)
    if dtype == torch.float16:
        # Same rounding points: only an element whose fp32 value sits on an fp16 rounding
        # boundary may differ (numpy and torch sum and rsqrt differently). A skipped or extra
        # rounding moves about one element in seven.
        written = ~expect["k_cache"].isnan()
        assert (q != expect_q).float().mean() < 0.01
        assert (case["k_cache"][written] != expect["k_cache"][written]).float().mean() < 0.01


@interpret
def test_kernel_stores_fp8_with_the_scales():
    """At position 0 rope is the identity and without q/k norm k is stored as given; K/V that
    e4m3 holds exactly at a power-of-two scale need no rounding, which the interpreter gets
    wrong at binade boundaries (see test_triton_interpret.py), so the bytes must match."""
    torch.manual_seed(5)
    case = _case(9, 4, 2, 16, qk_norm=False, layout="block_outermost")
    codes = torch.randint(0, 126, (2, 9, 2, 16), dtype=torch.uint8)  # finite, non-negative
    k, v = codes.view(torch.float8_e4m3fn).float() * torch.tensor([0.5, 8.0])[:, None, None, None]
    k[0, 0, :2] = torch.tensor([1e4, -1e4])  # saturates to +-448 x 0.5
    fp8 = dict(dtype=torch.float8_e4m3fn)
    case |= dict(positions=torch.zeros(9, dtype=torch.int64), k=k, v=v,
                 k_cache=torch.zeros(case["k_cache"].shape, **fp8),
                 v_cache=torch.zeros(case["v_cache"].shape, **fp8),
                 k_scale=torch.tensor([0.5]), v_scale=torch.tensor([8.0]))
    expect = _with_cache_copies(case)
    triton_attention_input.attention_input_triton(**case)
    attention_input_torch(**expect)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(case[name].view(torch.uint8), expect[name].view(torch.uint8))
    assert case["k_cache"].float().abs().max() == 448


# --- GPU ---------------------------------------------------------------------------------------

SHAPES = {"qwen3-0.6b": (16, 8, True), "qwen3-8b": (32, 8, True), "llama": (32, 8, False)}


def _unfused(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four launches the fused kernel replaces. Returns the rotated q and the q and k the
    rotary took in, whose magnitudes bound a reduction-order difference."""
    q, k, head_dim = case["q"], case["k"], case["q"].shape[-1]
    if case["q_norm_weight"] is not None:
        q = rms_norm_triton(q, case["q_norm_weight"], EPS)
        k = rms_norm_triton(k, case["k_norm_weight"], EPS)
    q_rot, k_rot = rotary_triton(case["positions"], q, k, case["cos_sin_cache"], head_dim)
    write_kv_triton(k_rot, case["v"], case["k_cache"], case["v_cache"], case["slot_mapping"])
    return q_rot, q, k


def _assert_rounding_close(got: torch.Tensor, expect: torch.Tensor, rotated: torch.Tensor,
                           exact: bool) -> None:  # fmt: skip
    """Equal, except that with q/k norm the fused kernel sums a head's squares in another order:
    an inverse RMS one fp32 ulp away moves a rare normalised element across a rounding boundary,
    i.e. one ulp of the rotary's input (two after the weight multiply), plus one ulp from the
    rotary's own rounding. So each element is within eps * (3 * max|input pair| + |expect|), and
    at most 1 in 1000 differ at all (4 elements, two crossings, in a tensor too small for that).
    Without the norm there is no reduction: bitwise equal."""
    assert got.shape == expect.shape and got.dtype == expect.dtype
    if exact:
        assert torch.equal(got, expect)
        return
    half = rotated.shape[-1] // 2
    pair = torch.maximum(rotated[..., :half].abs(), rotated[..., half:].abs()).float()
    bound = torch.finfo(got.dtype).eps * (3 * torch.cat([pair, pair], -1) + expect.float().abs())
    assert ((got.float() - expect.float()).abs() <= bound).all()
    assert (got != expect).sum().item() <= max(4, 1e-3 * got.numel())


def _check_against_unfused(case: dict, expect: dict, got_q: torch.Tensor, qk_norm: bool) -> None:
    """Run the unfused kernels on `expect` (`case` with copies of its caches, taken before the
    fused op ran) and compare q, every written K/V slot, and the poison of every other slot."""
    expect_q, rotated_q, rotated_k = _unfused(expect)
    _assert_rounding_close(got_q, expect_q, rotated_q, exact=not qk_norm)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(case[name].isnan(), expect[name].isnan())
    keep = case["slot_mapping"] >= 0
    slots = case["slot_mapping"][keep]
    block_size = case["k_cache"].shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    assert not case["k_cache"][blocks, offsets].isnan().any()
    _assert_rounding_close(case["k_cache"][blocks, offsets], expect["k_cache"][blocks, offsets],
                           rotated_k[keep], exact=not qk_norm)  # fmt: skip
    assert torch.equal(case["v_cache"][blocks, offsets], expect["v_cache"][blocks, offsets])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 8192])
@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_kernel_matches_unfused(shape, head_dim, num_tokens, block_size, dtype):
    torch.manual_seed(3)
    num_heads, num_kv_heads, qk_norm = SHAPES[shape]
    case = _case(num_tokens, num_heads, num_kv_heads, head_dim, qk_norm, block_size,
                 layout="block_outermost", dtype=dtype, device="cuda")  # fmt: skip
    expect = _with_cache_copies(case)
    _check_against_unfused(case, expect, attention_input(**case), qk_norm)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_kernel_replays_in_cuda_graph(shape):
    """Captured once, replayed on new positions, activations and slots (incl. -1)."""
    torch.manual_seed(4)
    num_heads, num_kv_heads, qk_norm = SHAPES[shape]
    case = _case(8, num_heads, num_kv_heads, 128, qk_norm, 16, layout="block_outermost",
                 dtype=torch.bfloat16, device="cuda")  # fmt: skip
    attention_input(**case)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = attention_input(**case)
    for _ in range(2):
        fresh = _case(8, num_heads, num_kv_heads, 128, qk_norm, device="cuda")
        case["positions"].copy_(fresh["positions"])
        case["slot_mapping"].copy_(_slots(8, *case["k_cache"].shape[:2], device="cuda"))
        for name in "qkv":
            case[name].copy_(fresh[name])
        expect = _with_cache_copies(case)
        graph.replay()
        _check_against_unfused(case, expect, q_out, qk_norm)
