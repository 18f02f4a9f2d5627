"""Triton kernels against the torch reference on the GPU, eagerly and replayed in CUDA graphs.

PYTHONPATH=src python3 -m pytest -m gpu tests/ops -q
"""

from __future__ import annotations

import pytest
import torch

from kvfit.ops.attention import AttentionMetadata, paged_attention, write_kv
from kvfit.ops.reference import paged_attention_reference, write_kv_reference

pytestmark = pytest.mark.gpu

# (batch, context, block_size, head_dim, num_heads, num_kv_heads, dtype): a few minutes in all.
DECODE_GRID = [
    (1, 1, 16, 128, 32, 8, torch.bfloat16),
    (1, 32768, 16, 128, 32, 8, torch.bfloat16),
    (1, 32768, 32, 64, 16, 2, torch.float16),
    (4, 8191, 32, 128, 32, 8, torch.float16),
    (64, 4096, 16, 128, 32, 8, torch.bfloat16),
    (64, 1000, 32, 64, 32, 32, torch.bfloat16),
    (256, 1500, 16, 64, 16, 4, torch.float16),
    (256, 2048, 32, 128, 32, 8, torch.bfloat16),
    (8, 3000, 16, 256, 16, 4, torch.bfloat16),
]


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def _reference(batch, scale: float) -> torch.Tensor:
    """Reference in float32 so the oracle does not carry bf16 rounding of its own."""
    return paged_attention_reference(
        batch.query.float(), batch.k_cache.float(), batch.v_cache.float(), batch.metadata, scale
    )


def _check(batch, scale: float) -> None:
    out = torch.full_like(batch.query, float("nan"))  # unwritten rows fail the check
    paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale, out=out)
    assert _rel_error(out, _reference(batch, scale)) < 1e-2


@pytest.mark.parametrize("case", DECODE_GRID, ids=str)
def test_decode_matches_reference(paged_batch, case):
    batch_size, context, block_size, head_dim, heads, kv_heads, dtype = case
    lens = torch.randint(max(1, context // 2), context + 1, (batch_size,)).tolist()
    lens[0] = context  # the longest context is always exercised
    batch = paged_batch(
        [(n - 1, 1) for n in lens], block_size=block_size, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device="cuda",
    )  # fmt: skip
    _check(batch, head_dim**-0.5)


@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
@pytest.mark.parametrize("block_size,head_dim",
                         [(16, 128), (32, 64), (16, 256), (16, 80), (16, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_matches_reference(paged_batch, layout, block_size, head_dim, dtype):
    seqs = [(0, 1000), (512, 300), (31, 1), (4000, 1), (0, 17), (30000, 2048), (7, 1), (100, 2)]
    batch = paged_batch(
        seqs, block_size=block_size, num_heads=16, num_kv_heads=4, head_dim=head_dim,
        dtype=dtype, layout=layout, device="cuda",
    )  # fmt: skip
    _check(batch, head_dim**-0.5)


@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
def test_write_kv_matches_reference(paged_batch, layout):
    batch = paged_batch([(0, 4096)], num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                        layout=layout, device="cuda")  # fmt: skip
    num_slots = batch.k_cache.shape[0] * batch.k_cache.shape[1]
    slots = torch.randperm(num_slots, device="cuda")[:3000]
    slots[::7] = -1
    key, value = torch.randn(2, 3000, 8, 128, dtype=torch.bfloat16, device="cuda")
    expect_k, expect_v = batch.k_cache.clone(), batch.v_cache.clone()
    write_kv_reference(key, value, expect_k, expect_v, slots)
    write_kv(key, value, batch.k_cache, batch.v_cache, slots)
    assert torch.equal(batch.k_cache, expect_k) and torch.equal(batch.v_cache, expect_v)


def _new_tokens_slots(md: AttentionMetadata, block_size: int) -> torch.Tensor:
    """Slots of each sequence's last query_len positions: where this step's K/V belong."""
    starts, lens = md.query_start_loc.tolist(), md.seq_lens.tolist()
    slots = []
    for i, seq_len in enumerate(lens):
        pos = torch.arange(seq_len - (starts[i + 1] - starts[i]), seq_len, device="cuda")
        slots.append(md.block_table[i, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots)


@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [64, 1, 16, 1]], ids=["decode", "mixed"])
def test_cuda_graph_replay_with_new_inputs(paged_batch, query_lens):
    """Capture write_kv + attention once; replay with new values, lengths and block tables."""
    max_model_len, block_size = 8192, 16
    batch = paged_batch(
        [(max_model_len - q, q) for q in query_lens], block_size=block_size, num_heads=32,
        num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
        spare_blocks=len(query_lens),
    )  # fmt: skip
    md, k_cache, v_cache = batch.metadata, batch.k_cache, batch.v_cache
    num_blocks, width = k_cache.shape[0], md.block_table.shape[1]
    key, value = torch.randn(2, *batch.query.shape[:1], 8, 128, dtype=torch.bfloat16, device="cuda")
    slots = _new_tokens_slots(md, block_size)
    out = torch.empty_like(batch.query)

    def step() -> None:
        write_kv(key, value, k_cache, v_cache, slots)
        paged_attention(batch.query, k_cache, v_cache, md, 0.1, out=out)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for _ in range(3):
        lens = [int(torch.randint(q, max_model_len + 1, ())) for q in query_lens]
        md.seq_lens.copy_(torch.tensor(lens))
        md.block_table.copy_(torch.randperm(num_blocks)[: len(lens) * width].view(-1, width))
        for t in (batch.query, k_cache, v_cache, key, value):
            t.normal_()
        slots.copy_(_new_tokens_slots(md, block_size))
        slots[-1] = -1  # a padded slot: nothing written
        expect_k, expect_v = k_cache.clone(), v_cache.clone()
        write_kv_reference(key, value, expect_k, expect_v, slots)
        out.fill_(float("nan"))
        graph.replay()

        assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)
        assert _rel_error(out, _reference(batch, 0.1)) < 1e-2


def test_decode_split_layout_follows_the_sequence_and_the_padded_batch(paged_batch):
    """A decode row's output is bit-identical at its launch's own max_seq_len and at
    max_model_len (a CUDA graph's bound), and in a batch padded to its graph's size (rows of
    one token past the real ones): eager and graph replay then give the same greedy tokens.
    The split follows the row's length and the launch's row count rounded up to a power of
    two (`decode_split_tokens`), which such padding keeps."""
    lens = [5000, 700, 1, 12000, 513]
    padded = lens + [1] * 3  # a graph of 8 rows
    batch = paged_batch([(n - 1, 1) for n in padded], num_heads=32, num_kv_heads=8,
                        head_dim=128, dtype=torch.bfloat16, device="cuda")  # fmt: skip
    md, scale, real = batch.metadata, 128**-0.5, len(lens)

    def run(rows: int, max_seq_len: int) -> torch.Tensor:
        sliced = AttentionMetadata(md.slot_mapping[:rows], md.query_start_loc[: rows + 1],
                                   md.seq_lens[:rows], md.block_table[:rows], max_query_len=1,
                                   max_seq_len=max_seq_len)  # fmt: skip
        return paged_attention(batch.query[:rows], batch.k_cache, batch.v_cache, sliced, scale)

    eager = run(real, max(lens))
    assert torch.equal(run(real, 32768), eager)
    assert torch.equal(run(len(padded), 32768)[:real], eager)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_decode_order_changes_no_bit_eager_or_replayed(paged_batch, kv_dtype):
    """256 decode rows of mixed lengths and a prefill row: started longest first
    (`decode_order`, the engine's), shortest first or in batch order, the output is the same
    bits (bf16 pages and e4m3 pages through the pairs kernel), and a CUDA graph captured with
    an order buffer gives them too after the buffer is refilled with another order."""
    import numpy as np

    from kvfit.ops.decode_order import decode_order
    from kvfit.ops.sm_count import num_sms

    g = torch.Generator().manual_seed(3)
    lens = torch.randint(100, 2300, (256,), generator=g).tolist()
    seqs = [(n - 1, 1) for n in lens[:200]] + [(0, 37)] + [(n - 1, 1) for n in lens[200:]]
    batch = paged_batch(seqs, num_heads=16, num_kv_heads=8, head_dim=128,
                        dtype=torch.bfloat16, device="cuda")  # fmt: skip
    md, query = batch.metadata, batch.query
    k_cache, v_cache, scales = batch.k_cache, batch.v_cache, {}
    if kv_dtype != torch.bfloat16:
        k_cache, v_cache = (c.clamp(-4, 4).to(kv_dtype) for c in (k_cache, v_cache))
        one = torch.ones(1, device="cuda")
        scales = dict(k_scale=one, v_scale=one)
    lpt = decode_order(md.seq_lens.cpu().numpy(),
                       np.diff(md.query_start_loc.cpu().numpy()), 8, 128, kv_dtype,
                       num_sms(query.device))  # fmt: skip
    assert lpt[-1] == 200  # the prefill row, which the decode kernel skips, last

    def attend(order: np.ndarray | None) -> torch.Tensor:
        md.decode_order = None if order is None else torch.from_numpy(order).cuda()
        return paged_attention(query, k_cache, v_cache, md, 0.1, **scales)

    expect = attend(None)
    assert torch.equal(attend(lpt), expect)
    assert torch.equal(attend(lpt[::-1].copy()), expect)

    md.decode_order = order_buf = torch.from_numpy(lpt[::-1].copy()).cuda()
    out = torch.empty_like(query)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention(query, k_cache, v_cache, md, 0.1, out=out, **scales)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(query, k_cache, v_cache, md, 0.1, out=out, **scales)
    order_buf.copy_(torch.from_numpy(lpt))
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, expect)
