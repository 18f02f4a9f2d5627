"""The one-launch greedy argmax against `torch.argmax`: through the interpreter (tiny rows, many
splits) and on the GPU (Qwen3's vocabulary, the sizes the sampler meets).

    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_triton_argmax.py -q
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_triton_argmax.py -q
"""

from __future__ import annotations

import pytest
import torch

from kvfit.ops import argmax_scratch, greedy_argmax

try:  # Triton is optional (the `cuda` and `dev` extras)
    from kvfit.ops import triton_argmax
except ImportError:
    triton_argmax = None

INF, NAN = float("inf"), float("nan")
QWEN3_VOCAB = 151936
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py


def _hard_rows(vocab: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """Rows where an argmax can go wrong: ties (rounded values, the largest value repeated
    across splits), all -inf, NaN (which torch takes as the largest), signed zeros, all-negative
    values, and the largest value in the last column."""
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(9, vocab, generator=gen)
    rows[1] = rows[1].round()
    rows[2] = -INF
    rows[3, vocab // 3] = NAN
    rows[3, -1] = NAN
    rows[4] = 0.0
    rows[4, : vocab // 2] = -0.0
    rows[5] = -rows[5].abs() - 1.0
    rows[6, -1] = 100.0
    rows[7, :: max(1, vocab // 5)] = 50.0  # one value, first in split 0, again in later splits
    rows[8] = rows[8].clamp(max=0.5)  # many columns at the row's maximum
    return rows.to(dtype).to(device)


@interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 100, 333])
def test_matches_torch_argmax_whatever_the_split(dtype, vocab):
    logits = _hard_rows(vocab, dtype)
    scratch = triton_argmax.ArgmaxScratch.allocate(16, logits.device)
    expected = logits.argmax(dim=-1)
    for splits in (None, 1, 3, 50):
        for block in (8, 64):
            got = triton_argmax.argmax_triton(logits, scratch, splits=splits, block=block)
            assert torch.equal(got, expected), (splits, block)
    # Each launch left every row's ticket at zero for the next.
    assert not scratch.arrived.any()


@interpret
def test_reads_strided_rows_and_columns():
    base = _hard_rows(64, torch.float32)
    for logits in (base[::2], base.t().contiguous().t(), base[:, ::3]):
        scratch = triton_argmax.ArgmaxScratch.allocate(logits.shape[0], logits.device)
        got = triton_argmax.argmax_triton(logits, scratch, block=8)
        assert torch.equal(got, logits.argmax(dim=-1))


def test_dispatch_takes_torchs_argmax_off_cuda():
    """No scratch off CUDA (nothing to allocate), and torch's reduction gives the ids."""
    assert argmax_scratch(256, torch.device("cpu")) is None
    logits = _hard_rows(50, torch.bfloat16)
    assert torch.equal(greedy_argmax(logits, None), logits.argmax(dim=-1))


@pytest.mark.skipif(triton_argmax is None, reason="needs triton")
def test_more_rows_than_the_scratch_is_refused_naming_the_cause():
    scratch = triton_argmax.ArgmaxScratch.allocate(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="allocate the scratch for the most rows"):
        triton_argmax.argmax_triton(torch.zeros(3, 10), scratch)


@pytest.mark.skipif(triton_argmax is None, reason="needs triton")
@pytest.mark.parametrize("max_rows", [1, 7, 256, 4096])
def test_scratch_bounds_every_launch_up_to_its_rows(max_rows):
    """The scratch allocated once holds the parts of a launch of any row count up to its own
    (so warmup's allocation is the largest), and the split count stays under the kernel's
    compiled bound."""
    device = torch.device("cpu")
    scratch = triton_argmax.ArgmaxScratch.allocate(max_rows, device)
    num_tiles = -(-QWEN3_VOCAB // triton_argmax.BLOCK)
    bound = triton_argmax.splits_bound(num_tiles, device)
    for rows in range(1, max_rows + 1):
        splits = triton_argmax.num_splits(rows, num_tiles, device)
        assert rows * splits <= scratch.parts.numel()
        assert splits <= bound


@interpret
def test_requested_splits_beyond_the_scratch_are_capped_not_refused():
    """A caller's `splits` past what the scratch holds (9 rows x 50 splits, 20 parts) runs at
    fewer splits (2 a row), to the same ids."""
    logits = _hard_rows(4000, torch.float32)
    scratch = triton_argmax.ArgmaxScratch(torch.zeros(9, dtype=torch.int32),
                                          torch.empty(20, dtype=torch.int64))
    got = triton_argmax.argmax_triton(logits, scratch, splits=50, block=16)
    assert torch.equal(got, logits.argmax(dim=-1))
    assert not scratch.arrived.any()


# --- GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 64, 256])
def test_gpu_matches_torch_argmax(dtype, num_rows):
    gen = torch.Generator("cuda").manual_seed(num_rows)
    logits = (torch.randn(num_rows, QWEN3_VOCAB, generator=gen, device="cuda") * 4).to(dtype)
    hard = _hard_rows(QWEN3_VOCAB, dtype, "cuda")[: num_rows]
    logits[: hard.shape[0]] = hard
    scratch = argmax_scratch(256, logits.device)
    expected = logits.argmax(dim=-1)
    assert torch.equal(greedy_argmax(logits, scratch), expected)
    for splits in (1, 7, 1000):
        got = triton_argmax.argmax_triton(logits, scratch, splits=splits)
        assert torch.equal(got, expected), splits
    assert not scratch.arrived.any()


@pytest.mark.gpu
def test_gpu_graph_replay_takes_each_replays_logits():
    """Captured once, replayed over new logits: the tickets reset inside the launch, so every
    replay reduces its own row (the sampler runs eagerly; a graph is the strictest reuse)."""
    logits = torch.zeros(4, QWEN3_VOCAB, dtype=torch.bfloat16, device="cuda")
    scratch = triton_argmax.ArgmaxScratch.allocate(4, logits.device)
    triton_argmax.argmax_triton(logits, scratch)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_argmax.argmax_triton(logits, scratch)
    for step in range(5):
        logits.normal_(generator=torch.Generator("cuda").manual_seed(step))
        graph.replay()
        assert torch.equal(out, logits.argmax(dim=-1)), step
