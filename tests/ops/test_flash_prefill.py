"""Fresh prefill rows on FlashAttention-2 (`kvfit.ops.flash_prefill`): which rows and steps take
it, the keys `attention_input` leaves in place for it, the paged prefill kernel leaving those
rows, and on a GPU the op's outputs against the paged kernels' and the oracle's.

    python3 -m pytest tests/ops/test_flash_prefill.py -q
    TRITON_INTERPRET=1 python3 -m pytest tests/ops/test_flash_prefill.py -q
    PYTHONPATH=src python3 -m pytest -m gpu tests/ops/test_flash_prefill.py -q
"""

from __future__ import annotations

import pytest
import torch

from kvfit.ops.attention import paged_attention
from kvfit.ops.attention_input import attention_input, stored_key
from kvfit.ops.flash_prefill import flash_prefill, fresh_query_lens, runs_flash_prefill

from .conftest import PagedBatch, make_paged_batch, naive_attention
from .test_attention_input import _case

interpret = pytest.mark.interpret  # run under TRITON_INTERPRET=1: see tests/conftest.py
gpu = pytest.mark.gpu

# (cached prefix, new tokens): fresh prompts (one of a single token, which is a decode row's
# shape), prompts continuing a prefix, decode rows.
MIXED = [(0, 37), (13, 1), (0, 1), (17, 20), (0, 64), (70, 1), (3, 40), (0, 2)]


def _new_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's new tokens' K/V as the step holds them: read back from the cache slots the
    step stored them at (the last `q_len` positions of each row's context)."""
    md, block_size = batch.metadata, batch.k_cache.shape[1]
    starts = md.query_start_loc.tolist()
    keys, values = [], []
    for i, seq_len in enumerate(md.seq_lens.tolist()):
        q_len = starts[i + 1] - starts[i]
        pos = torch.arange(seq_len - q_len, seq_len, device=md.seq_lens.device)
        blocks = md.block_table[i].long()[pos // block_size]
        keys.append(batch.k_cache[blocks, pos % block_size])
        values.append(batch.v_cache[blocks, pos % block_size])
    return torch.cat(keys), torch.cat(values)


# --- CPU ---------------------------------------------------------------------------------------


def test_fresh_query_lens_are_the_prefill_rows_without_a_prefix():
    batch = make_paged_batch(MIXED)
    assert fresh_query_lens(batch.metadata).tolist() == [37, 0, 0, 0, 64, 0, 0, 2]
    assert batch.metadata.fresh_query_lens.dtype == torch.int32
    # Kept for the step's other layers.
    assert fresh_query_lens(batch.metadata) is batch.metadata.fresh_query_lens


def test_only_a_prefill_step_over_a_cuda_cache_of_the_query_dtype_runs_it():
    batch = make_paged_batch(MIXED, dtype=torch.bfloat16)
    assert not runs_flash_prefill(torch.bfloat16, batch.k_cache, batch.metadata)  # switch off
    with flash_prefill():
        # On the CPU (and in a decode step, whatever the device) the paged kernels run it all.
        assert not runs_flash_prefill(torch.bfloat16, batch.k_cache, batch.metadata)
        decode = make_paged_batch([(5, 1), (9, 1)], dtype=torch.bfloat16)
        assert not runs_flash_prefill(torch.bfloat16, decode.k_cache, decode.metadata)
        with flash_prefill(False):
            assert not runs_flash_prefill(torch.bfloat16, batch.k_cache, batch.metadata)


def test_op_on_the_cpu_ignores_the_new_kv_and_checks_their_shape():
    batch = make_paged_batch(MIXED)
    expect = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3)
    with flash_prefill():
        got = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3,
                              new_kv=_new_kv(batch))
        assert torch.equal(got, expect)
        k, v = _new_kv(batch)
        with pytest.raises(ValueError, match="new_kv must be two"):
            paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3,
                            new_kv=(k[1:], v[1:]))


@pytest.mark.parametrize("qk_norm", [True, False])
def test_key_in_place_leaves_each_token_key_as_stored(qk_norm):
    torch.manual_seed(3)
    case = _case(11, 4, 2, 16, qk_norm)
    k_before, v_before = case["k"].clone(), case["v"].clone()
    expect_key = stored_key(case["positions"], k_before, case["k_norm_weight"], case["eps"],
                            case["cos_sin_cache"])
    plain = {**case, "k": k_before.clone(), "k_cache": case["k_cache"].clone(),
             "v_cache": case["v_cache"].clone()}
    q = attention_input(**case, key_in_place=True)
    torch.testing.assert_close(case["k"], expect_key, rtol=1e-6, atol=1e-6)  # slots -1 too
    assert (case["slot_mapping"] < 0).any()
    assert torch.equal(case["v"], v_before)
    assert torch.equal(q, attention_input(**plain))
    assert torch.equal(plain["k"], k_before)  # without it the keys are left alone
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(case[name], plain[name], rtol=0, atol=0, equal_nan=True)


# --- interpreter -------------------------------------------------------------------------------


@interpret
@pytest.mark.parametrize("qk_norm", [True, False])
def test_kernel_key_in_place_matches_the_composition(qk_norm):
    from kvfit.ops.attention_input import attention_input_torch
    from kvfit.ops.triton_attention_input import attention_input_triton

    torch.manual_seed(4)
    case = _case(9, 4, 2, 16, qk_norm, layout="block_outermost")
    expect = {**case, "k": case["k"].clone(), "k_cache": case["k_cache"].clone(),
              "v_cache": case["v_cache"].clone()}
    q = attention_input_triton(**case, key_in_place=True)
    expect_q = attention_input_torch(**expect, key_in_place=True)
    torch.testing.assert_close(q, expect_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(case["k"], expect["k"], rtol=1e-5, atol=1e-5)
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(case[name], expect[name], rtol=1e-5, atol=1e-5,
                                   equal_nan=True)


@interpret
def test_prefill_kernel_leaves_the_fresh_rows_when_asked():
    from kvfit.ops.triton_attention import paged_attention_triton

    batch = make_paged_batch(MIXED, head_dim=16)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention_triton(batch.query, batch.k_cache, batch.v_cache, batch.metadata, 0.3, out,
                           split_tokens=16, skip_fresh=True)
    fresh = fresh_query_lens(batch.metadata).repeat_interleave(
        batch.metadata.query_start_loc.diff()) > 0
    assert out[fresh].isnan().all()
    torch.testing.assert_close(out[~fresh].double(), naive_attention(batch, 0.3)[~fresh],
                               rtol=1e-4, atol=1e-4)


# --- GPU ---------------------------------------------------------------------------------------

# (num_heads, num_kv_heads, head_dim): the 0.6B and 8B shapes' heads, Llama-7B's, a tiny one.
GPU_HEADS = [(16, 8, 128), (32, 8, 128), (32, 32, 128), (8, 1, 64)]


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", GPU_HEADS)
@pytest.mark.parametrize("given_out", [False, True])
def test_gpu_op_matches_the_paged_kernels_and_the_oracle(heads, dtype, given_out):
    num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(0)
    batch = make_paged_batch(MIXED + [(0, 300)], num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype, device="cuda")
    scale = head_dim**-0.5
    paged = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale)
    with flash_prefill():
        assert runs_flash_prefill(dtype, batch.k_cache, batch.metadata)
        out = torch.full_like(batch.query, float("nan")) if given_out else None
        got = paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, scale,
                              out, new_kv=_new_kv(batch))
    assert got is out or not given_out
    assert not got.isnan().any()
    expect = naive_attention(batch, scale).to(dtype).cuda()
    torch.testing.assert_close(got, expect, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, paged, rtol=2e-2, atol=2e-2)
    fresh = fresh_query_lens(batch.metadata).repeat_interleave(
        batch.metadata.query_start_loc.diff()) > 0
    # The other rows took the same kernels either way.
    assert torch.equal(got[~fresh], paged[~fresh])


@gpu
def test_gpu_fp8_cache_keeps_the_paged_kernels():
    batch = make_paged_batch(MIXED, num_heads=16, num_kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16, device="cuda")
    cache_k, cache_v = (c.to(torch.float8_e4m3fn) for c in (batch.k_cache, batch.v_cache))
    with flash_prefill():
        assert not runs_flash_prefill(torch.bfloat16, cache_k, batch.metadata)


@gpu
def test_gpu_key_in_place_kernel_matches_the_composition():
    torch.manual_seed(6)
    case = _case(40, 16, 8, 128, True, layout="block_outermost", dtype=torch.bfloat16,
                 device="cuda")
    expect_key = stored_key(case["positions"], case["k"].clone(), case["k_norm_weight"],
                            case["eps"], case["cos_sin_cache"])
    attention_input(**case, key_in_place=True)
    torch.testing.assert_close(case["k"], expect_key, rtol=1e-2, atol=1e-2)
