"""`decode_attention`: a decode step's attention input fused into its attention kernel.

Its oracle is the pair it replaces, `attention_input_torch` then the reference attention, on
copies of the same caches. The fused kernel's output may differ from the pair's only in the
order it sums the new token's term, and it must store the same K/V bits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvfit.ops.attention import AttentionMetadata
from kvfit.ops.attention_input import (
    attention_input_torch,
    decode_attention,
    fused_decode_input,
    fuses_decode_input,
)
from kvfit.ops.layers import RotaryEmbedding
from kvfit.ops.reference import paged_attention_reference

from .conftest import make_paged_batch

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py
# Empty KV splits take log2(0) = -inf on purpose; numpy warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
EPS = 1e-6
SCALE = 0.3


def _decode_case(prefixes: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm: bool, *, block_size: int = 16, layout: str = "block_outermost",
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> dict:  # fmt: skip
    """Every argument of `decode_attention` for one decode row per sequence of `prefixes`
    cached tokens: the row's position is its prefix length, its slot the page slot there."""
    batch = make_paged_batch([(p, 1) for p in prefixes], block_size=block_size,
                             num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                             dtype=dtype, layout=layout, device=device)  # fmt: skip
    md = batch.metadata
    positions = torch.tensor(prefixes, dtype=torch.int64, device=device)
    rows = torch.arange(len(prefixes), device=device)
    blocks = md.block_table.long()[rows, positions // block_size]
    slots = blocks * block_size + positions % block_size
    metadata = AttentionMetadata(slot_mapping=slots, query_start_loc=md.query_start_loc,
                                 seq_lens=md.seq_lens, block_table=md.block_table,
                                 max_query_len=1, max_seq_len=md.max_seq_len)  # fmt: skip
    widths = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    qkv = torch.randn(len(prefixes), sum(widths), dtype=dtype, device=device) * 3
    q, k, v = qkv.split(widths, dim=-1)  # strided views, as the model's QKV output gives
    rope = RotaryEmbedding(head_dim, max(prefixes) + 8, base=10_000.0).to(device)

    def norm() -> torch.Tensor | None:
        return 1 + 0.3 * torch.randn(head_dim, dtype=dtype, device=device) if qk_norm else None

    return dict(positions=positions, q=q.view(-1, num_heads, head_dim),
                k=k.view(-1, num_kv_heads, head_dim), v=v.view(-1, num_kv_heads, head_dim),
                q_norm_weight=norm(), k_norm_weight=norm(), eps=EPS,
                cos_sin_cache=rope.cos_sin_cache, k_cache=batch.k_cache,
                v_cache=batch.v_cache, metadata=metadata, scale=SCALE)  # fmt: skip


def _unfused(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output, k_cache, v_cache) of the pair, on copies of the caches."""
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    md = case["metadata"]
    q = attention_input_torch(case["positions"], case["q"], case["k"], case["v"],
                              case["q_norm_weight"], case["k_norm_weight"], EPS,
                              case["cos_sin_cache"], k_cache, v_cache, md.slot_mapping)
    return paged_attention_reference(q, k_cache, v_cache, md, SCALE), k_cache, v_cache


def test_cpu_op_is_the_pair() -> None:
    torch.manual_seed(0)
    case = _decode_case([0, 5, 40], 4, 2, 16, qk_norm=True)
    expect, k_cache, v_cache = _unfused(case)
    got = decode_attention(**case)
    assert torch.equal(got, expect)
    assert torch.equal(case["k_cache"], k_cache) and torch.equal(case["v_cache"], v_cache)


def test_rejects_a_step_with_a_prefill_and_an_fp8_cache() -> None:
    case = _decode_case([3, 9], 4, 2, 16, qk_norm=False)
    md = case["metadata"]
    with pytest.raises(ValueError, match="max_query_len"):
        decode_attention(**case | dict(metadata=dataclasses.replace(md, max_query_len=2)))
    fp8 = dict(k_cache=case["k_cache"].to(torch.float8_e4m3fn),
               v_cache=case["v_cache"].to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="16-bit"):
        decode_attention(**case | fp8)


def test_the_switch_takes_decode_steps_over_16_bit_caches_only() -> None:
    case = _decode_case([3, 9], 4, 2, 16, qk_norm=False)
    md, k_cache = case["metadata"], case["k_cache"]
    assert not fuses_decode_input(k_cache, md)  # off by default
    with fused_decode_input():
        assert fuses_decode_input(k_cache, md)
        assert not fuses_decode_input(k_cache, dataclasses.replace(md, max_query_len=2))
        assert not fuses_decode_input(k_cache.to(torch.float8_e4m3fn), md)
        with fused_decode_input(False):
            assert not fuses_decode_input(k_cache, md)
    assert not fuses_decode_input(k_cache, md)  # restored on exit


# --- interpreter -------------------------------------------------------------------------------

# Prefixes whose splits of 16 tokens (tiles of 16 below) end on, just past and well before a
# tile border, a sequence with no prefix, and one whose splits outnumber its tiles.
PREFIXES = [0, 15, 16, 33, 70, 5]


@interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 16), (6, 3, 12), (2, 2, 32)])
@pytest.mark.parametrize("max_splits", [1, 3, 32])
def test_kernel_matches_the_pair(num_heads, num_kv_heads, head_dim, layout, qk_norm, dtype,
                                 max_splits):  # fmt: skip
    from kvfit.ops.triton_decode_input import decode_attention_input_triton

    torch.manual_seed(1)
    case = _decode_case(PREFIXES, num_heads, num_kv_heads, head_dim, qk_norm, block_size=8,
                        layout=layout, dtype=dtype)  # fmt: skip
    expect, k_cache, v_cache = _unfused(case)
    out = torch.full_like(case["q"], float("nan")).contiguous()
    decode_attention_input_triton(
        case["positions"], case["q"], case["k"], case["v"], case["q_norm_weight"],
        case["k_norm_weight"], EPS, case["cos_sin_cache"], case["k_cache"], case["v_cache"],
        case["metadata"].slot_mapping, case["metadata"], SCALE, out,
        max_splits=max_splits, split_tokens=16,
    )  # fmt: skip
    tol = 4e-3 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out, expect, rtol=tol, atol=tol)
    # The stored K/V: the pair's, to one rounding of a reduction order (the norm's sum).
    torch.testing.assert_close(case["k_cache"], k_cache, rtol=tol, atol=tol)
    assert torch.equal(case["v_cache"], v_cache)


@interpret
@pytest.mark.parametrize("max_splits", [3, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 3), (2, 2)])
def test_split_reduction_in_the_launch_gives_the_reduction_kernels_bits(num_heads, num_kv_heads,
                                                                         max_splits) -> None:
    """With `split_tickets` the last split program of each (sequence, KV head) combines the
    parts, in the reduction kernel's order: the same bits, and every counter back at 0."""
    from kvfit.ops.triton_decode_input import decode_attention_input_triton

    torch.manual_seed(6)
    case = _decode_case(PREFIXES, num_heads, num_kv_heads, 16, True, block_size=8)
    outs = []
    tickets = torch.zeros(len(PREFIXES) * num_kv_heads + 5, dtype=torch.int32)
    for split_tickets in (None, tickets):
        run = dict(case, k_cache=case["k_cache"].clone(), v_cache=case["v_cache"].clone(),
                   metadata=dataclasses.replace(case["metadata"], split_tickets=split_tickets))
        out = torch.full_like(case["q"], float("nan")).contiguous()
        decode_attention_input_triton(
            run["positions"], run["q"], run["k"], run["v"], run["q_norm_weight"],
            run["k_norm_weight"], EPS, run["cos_sin_cache"], run["k_cache"], run["v_cache"],
            run["metadata"].slot_mapping, run["metadata"], SCALE, out, max_splits=max_splits,
            split_tokens=16,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert not tickets.any()


@interpret
@pytest.mark.parametrize("tickets", [False, True], ids=["reduction_kernel", "tickets"])
def test_a_decode_order_changes_no_bit(tickets: bool) -> None:
    """With `metadata.decode_order` the programs start in another order (one grid axis, as the
    plain decode kernel's): every output and stored K/V bit is the batch order's."""
    from kvfit.ops.triton_decode_input import decode_attention_input_triton

    torch.manual_seed(7)
    case = _decode_case(PREFIXES, 4, 2, 16, True, block_size=8)
    results = []
    for order in (None, [5, 3, 1, 0, 4, 2], [0, 1, 2, 3, 4, 5][::-1]):
        md = dataclasses.replace(
            case["metadata"],
            decode_order=None if order is None else torch.tensor(order, dtype=torch.int32),
            split_tickets=torch.zeros(len(PREFIXES) * 2, dtype=torch.int32) if tickets else None)
        k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
        out = torch.full_like(case["q"], float("nan")).contiguous()
        decode_attention_input_triton(
            case["positions"], case["q"], case["k"], case["v"], case["q_norm_weight"],
            case["k_norm_weight"], EPS, case["cos_sin_cache"], k_cache, v_cache,
            md.slot_mapping, md, SCALE, out, max_splits=3, split_tokens=16,
        )  # fmt: skip
        results.append((out, k_cache, v_cache))
    for out, k_cache, v_cache in results[1:]:
        assert torch.equal(out, results[0][0])
        assert torch.equal(k_cache, results[0][1]) and torch.equal(v_cache, results[0][2])


@interpret
def test_each_sequence_and_kv_head_counts_at_its_own_ticket() -> None:
    """The tickets are laid out (sequence, KV head), as the runner sizes them: a counter held
    away from zero at one pair's slot keeps that pair alone from reducing (its rows stay as
    they were, its splits' arrivals stay counted) and leaves every other pair's output."""
    from kvfit.ops.triton_decode_input import decode_attention_input_triton

    torch.manual_seed(8)
    case = _decode_case(PREFIXES, 4, 2, 16, True, block_size=8)
    seq, kv_head, held = 3, 0, 1000  # 34 tokens: three splits of 16
    tickets = torch.zeros(len(PREFIXES) * 2, dtype=torch.int32)
    tickets[seq * 2 + kv_head] = held
    md = dataclasses.replace(case["metadata"], split_tickets=tickets)
    out = torch.full_like(case["q"], float("nan")).contiguous()
    decode_attention_input_triton(
        case["positions"], case["q"], case["k"], case["v"], case["q_norm_weight"],
        case["k_norm_weight"], EPS, case["cos_sin_cache"], case["k_cache"], case["v_cache"],
        md.slot_mapping, md, SCALE, out, max_splits=3, split_tokens=16,
    )  # fmt: skip
    held_rows = torch.zeros(out.shape[:2], dtype=torch.bool)
    held_rows[seq, kv_head * 2:(kv_head + 1) * 2] = True  # the KV head's two query heads
    assert out[held_rows].isnan().all() and out[~held_rows].isfinite().all()
    expect = torch.zeros_like(tickets)
    expect[seq * 2 + kv_head] = held + 3
    assert torch.equal(tickets, expect)


@interpret
def test_a_padded_row_stores_nothing_and_the_others_are_unchanged() -> None:
    """A CUDA graph's padding row (slot -1) leaves every page as it was."""
    from kvfit.ops.triton_decode_input import decode_attention_input_triton

    torch.manual_seed(2)
    case = _decode_case([7, 20, 3], 4, 2, 16, qk_norm=True, block_size=8)
    case["metadata"].slot_mapping[1] = -1
    expect, k_cache, v_cache = _unfused(case)
    out = torch.empty_like(case["q"]).contiguous()
    decode_attention_input_triton(
        case["positions"], case["q"], case["k"], case["v"], case["q_norm_weight"],
        case["k_norm_weight"], EPS, case["cos_sin_cache"], case["k_cache"], case["v_cache"],
        case["metadata"].slot_mapping, case["metadata"], SCALE, out, split_tokens=16,
    )  # fmt: skip
    torch.testing.assert_close(case["k_cache"], k_cache, rtol=1e-5, atol=1e-5)
    assert torch.equal(case["v_cache"], v_cache)
    assert out.isfinite().all()
    keep = [0, 2]  # the padded row attends to its own new token, never stored: no oracle
    torch.testing.assert_close(out[keep], expect[keep], rtol=1e-5, atol=1e-5)


# --- GPU ---------------------------------------------------------------------------------------

SHAPES = {"qwen3-0.6b": (16, 8, True), "qwen3-8b": (32, 8, True), "llama": (32, 8, False)}


@pytest.mark.gpu
@pytest.mark.parametrize("tickets", [False, True], ids=["reduction_kernel", "tickets"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_seqs,prefix", [(1, 1023), (4, 300), (64, 4000), (3, 0)])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_kernel_matches_the_unfused_kernels(shape, num_seqs, prefix, dtype,
                                                tickets) -> None:  # fmt: skip
    """Against `attention_input` then `paged_attention` on the GPU, at the engine's own split
    choice, the split reduction as its own kernel or in the launch (`split_tickets`, all back
    at 0 after): the K/V stored are those bits but for a norm's reduction order, and the
    output is within a few bf16 roundings."""
    from kvfit.ops.attention import paged_attention
    from kvfit.ops.attention_input import attention_input

    torch.manual_seed(3)
    num_heads, num_kv_heads, qk_norm = SHAPES[shape]
    prefixes = [max(0, prefix - 7 * i) for i in range(num_seqs)]
    case = _decode_case(prefixes, num_heads, num_kv_heads, 128, qk_norm, dtype=dtype,
                        device="cuda")  # fmt: skip
    split_tickets = (torch.zeros(num_seqs * num_kv_heads, dtype=torch.int32, device="cuda")
                     if tickets else None)
    case["metadata"] = dataclasses.replace(case["metadata"], split_tickets=split_tickets)
    md = case["metadata"]
    k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
    q = attention_input(case["positions"], case["q"], case["k"], case["v"],
                        case["q_norm_weight"], case["k_norm_weight"], EPS,
                        case["cos_sin_cache"], k_cache, v_cache, md.slot_mapping)
    expect = paged_attention(q, k_cache, v_cache, md, SCALE)
    with fused_decode_input():
        assert fuses_decode_input(case["k_cache"], md)
        got = decode_attention(**case)
    torch.testing.assert_close(got, expect, rtol=2e-2, atol=2e-2)
    assert (got - expect).abs().float().mean() < 2e-3
    torch.testing.assert_close(case["k_cache"], k_cache, rtol=1e-2, atol=1e-2)
    assert torch.equal(case["v_cache"], v_cache)
    assert split_tickets is None or not split_tickets.any()


@pytest.mark.gpu
def test_gpu_kernel_replays_in_a_cuda_graph() -> None:
    """Captured once (the split reduction in the launch) and replayed on new activations: a
    stale capture-time value read anywhere, or a counter left off 0, would show against the
    unfused kernels."""
    from kvfit.ops.attention import paged_attention
    from kvfit.ops.attention_input import attention_input

    torch.manual_seed(4)
    case = _decode_case([100, 37, 900, 0], 16, 8, 128, True, dtype=torch.bfloat16,
                        device="cuda")  # fmt: skip
    tickets = torch.zeros(4 * 8, dtype=torch.int32, device="cuda")
    case["metadata"] = dataclasses.replace(case["metadata"], split_tickets=tickets)
    decode_attention(**case)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(**case)
    for seed in (5, 6):
        torch.manual_seed(seed)
        for name in "qkv":
            case[name].copy_(torch.randn_like(case[name]) * 3)
        k_cache, v_cache = case["k_cache"].clone(), case["v_cache"].clone()
        md = case["metadata"]
        q = attention_input(case["positions"], case["q"], case["k"], case["v"],
                            case["q_norm_weight"], case["k_norm_weight"], EPS,
                            case["cos_sin_cache"], k_cache, v_cache, md.slot_mapping)
        expect = paged_attention(q, k_cache, v_cache, md, SCALE)
        graph.replay()
        torch.testing.assert_close(out, expect, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(case["k_cache"], k_cache, rtol=1e-2, atol=1e-2)
        assert not tickets.any()
