"""The batch-invariant mode's kernels compute the right values: the fixed-tile attention
against the float64 oracle (always), and the Triton GEMM, log-sum-exp and single-kernel
attention through the Triton interpreter (`TRITON_INTERPRET=1`, as test_triton_interpret.py).
That they are batch invariant is `kvfit.batch_invariant.registry`'s job."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvfit.batch_invariant.logsumexp import logsumexp_torch
from kvfit.kv_quant import dequantize_fp8, quantize_fp8
from kvfit.ops.attention import paged_attention

MIXED = [(0, 5), (13, 1), (0, 1), (17, 20), (70, 1), (3, 40), (31, 33)]
interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py


@pytest.mark.parametrize("layout", ["block_outermost", "head_major"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_fixed_tile_attention_matches_naive(paged_batch, naive, layout, num_heads,
                                            num_kv_heads):  # fmt: skip
    batch = paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=32,
                        layout=layout)  # fmt: skip
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.2,
                          batch_invariant=True)  # fmt: skip
    torch.testing.assert_close(out.double(), naive(batch, 0.2), rtol=1e-5, atol=1e-5)


def test_fixed_tile_attention_ignores_garbage_past_the_context(paged_batch, naive):
    batch = paged_batch([(40, 1), (0, 7)], num_heads=4, num_kv_heads=2, head_dim=32)
    expect = naive(batch, 0.2)
    written = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool)
    for seq, n in enumerate([41, 7]):
        for pos in range(n):
            block = batch.metadata.block_table[seq, pos // batch.k_cache.shape[1]]
            written[block, pos % batch.k_cache.shape[1]] = True
    batch.k_cache[~written] = float("nan")
    batch.v_cache[~written] = float("nan")
    out = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.2,
                          batch_invariant=True)  # fmt: skip
    torch.testing.assert_close(out.double(), expect, rtol=1e-5, atol=1e-5)


def test_fixed_tile_attention_reads_an_fp8_cache_with_its_scales(paged_batch, naive):
    batch = paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=32)
    k_scale, v_scale = torch.tensor([0.02]), torch.tensor([0.05])
    k8, v8 = quantize_fp8(batch.k_cache, k_scale), quantize_fp8(batch.v_cache, v_scale)
    out = paged_attention(batch.query, k8, v8, batch.metadata, 0.2, batch_invariant=True,
                          k_scale=k_scale, v_scale=v_scale)
    batch.k_cache.copy_(dequantize_fp8(k8, k_scale, torch.float32))
    batch.v_cache.copy_(dequantize_fp8(v8, v_scale, torch.float32))
    torch.testing.assert_close(out.double(), naive(batch, 0.2), rtol=1e-5, atol=1e-5)


def test_logsumexp_torch_matches_torch() -> None:
    x = torch.randn(5, 3000) * 4
    x[1] = float("-inf")
    x[2, :100] = float("-inf")
    torch.testing.assert_close(logsumexp_torch(x), x.logsumexp(-1))


@interpret
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2)])
def test_triton_attention_in_the_mode_matches_naive(paged_batch, naive, num_heads,
                                                    num_kv_heads):  # fmt: skip
    from kvfit.ops.triton_attention import paged_attention_triton

    batch = paged_batch(MIXED, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3, out,
                           prefill_config=dict(BLOCK_M=16, BLOCK_N=16), batch_invariant=True)
    torch.testing.assert_close(out.double(), naive(batch, 0.3), rtol=1e-4, atol=1e-4)


@interpret
@pytest.mark.parametrize("rows", [1, 5, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matmul_matches_linear(rows: int, bias: bool, monkeypatch) -> None:
    from kvfit.batch_invariant import triton_matmul

    # Small tiles keep the interpreter quick; the kernel is the same.
    monkeypatch.setattr(triton_matmul, "matmul_config",
                        lambda m, n, k, dtype: dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2))
    x, w, b = torch.randn(rows, 40), torch.randn(36, 40), torch.randn(36)
    torch.testing.assert_close(triton_matmul.matmul_triton(x, w, b if bias else None),
                               F.linear(x, w, b if bias else None), rtol=1e-4, atol=1e-4)


@interpret
@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # the row of -inf
def test_triton_logsumexp_matches_torch(monkeypatch) -> None:
    from kvfit.batch_invariant import triton_logsumexp

    monkeypatch.setattr(triton_logsumexp, "BLOCK", 256)
    x = torch.randn(4, 1000) * 4
    x[1] = float("-inf")
    x[3, 700] = float("inf")  # an overflowed logit: the row's log-sum-exp is inf, not NaN
    torch.testing.assert_close(triton_logsumexp.logsumexp_triton(x), x.logsumexp(-1))
    torch.testing.assert_close(logsumexp_torch(x), x.logsumexp(-1))


@pytest.mark.parametrize("seqs", [[(13, 1), (70, 1)], MIXED, [(0, 300)]])
def test_the_mode_launches_one_attention_config_for_every_step(paged_batch, monkeypatch,
                                                               seqs) -> None:
    """Decode-only, mixed and long-prefill steps all run the one prefill-kernel config of the
    mode (a row's bits must not follow the step's shape), and no split-KV decode kernel."""
    triton_attention = pytest.importorskip("kvfit.ops.triton_attention")
    launches: list[dict] = []

    class Recorder:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            return lambda *args, **kwargs: launches.append(kwargs)

    monkeypatch.setattr(triton_attention, "_prefill_kernel", Recorder())
    monkeypatch.setattr(triton_attention, "_decode_kernel", None)  # a launch would raise
    batch = paged_batch(seqs, num_heads=16, num_kv_heads=8, head_dim=128)
    triton_attention.paged_attention_triton(batch.query, batch.k_cache, batch.v_cache,
                                            batch.metadata, 0.1, torch.empty_like(batch.query),
                                            batch_invariant=True)
    (kwargs,) = launches
    config = {k: kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")}
    assert config == triton_attention._batch_invariant_config(128)
    assert config["BLOCK_M"] == 16 and kwargs["BATCH_INVARIANT"]
