"""rms_norm, silu_and_mul and RotaryEmbedding against plain formulas and transformers' Llama."""

from __future__ import annotations

import pytest
import torch

from kvfit.ops.layers import RotaryEmbedding, add_rms_norm, rms_norm, silu_and_mul

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
# DeepSeek-style mscales.
YARN_MSCALE = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64,
               "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    x = torch.randn(5, 64, dtype=dtype) * 3
    weight = torch.randn(64, dtype=dtype)
    x64 = x.double()
    expect = weight.double() * x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    got = rms_norm(x, weight, 1e-6)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), expect, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_residual_add_then_the_norm(dtype):
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype) * 4
    weight = torch.randn(64, dtype=dtype)
    normed, summed = add_rms_norm(x, residual, weight, 1e-6)
    # The sum is the residual stream's next value, rounded like the unfused `x + residual`.
    assert torch.equal(summed, x + residual)
    assert torch.equal(normed, rms_norm(x + residual, weight, 1e-6))


def test_silu_and_mul():
    x = torch.randn(7, 2 * 48)
    gate, up = x[:, :48], x[:, 48:]
    torch.testing.assert_close(silu_and_mul(x), gate * torch.sigmoid(gate) * up)


def test_rotary_rotates_each_half_pair_by_position_angle():
    dim, base = 16, 10000.0
    rope = RotaryEmbedding(dim, max_position=100, base=base)
    positions = torch.tensor([0, 1, 7, 99])
    q, k = torch.randn(2, 4, 3, dim)
    got_q, got_k = rope(positions, q, k)
    inv_freq = base ** (-torch.arange(0, dim, 2).double() / dim)
    angle = positions[:, None, None].double() * inv_freq  # [T, 1, dim/2]
    for x, got in ((q, got_q), (k, got_k)):
        pairs = torch.complex(x[..., : dim // 2].double(), x[..., dim // 2 :].double())
        rotated = pairs * torch.polar(torch.ones_like(angle), angle)
        expect = torch.cat([rotated.real, rotated.imag], -1)
        torch.testing.assert_close(got.double(), expect, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_q[0], q[0])  # position 0 is the identity


def test_rotary_keeps_flat_shape_and_dtype():
    rope = RotaryEmbedding(8, max_position=10, base=100.0)
    positions = torch.arange(3)
    q = torch.randn(3, 4 * 8, dtype=torch.bfloat16)
    k = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    got_q, got_k = rope(positions, q, k)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    assert got_q.dtype == torch.bfloat16
    ref_q, _ = rope(positions, q.view(3, 4, 8), k)
    assert torch.equal(got_q.view(3, 4, 8), ref_q)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3, LINEAR, YARN, YARN_MSCALE],
                         ids=["default", "llama3", "linear", "yarn", "yarn-mscale"])
def test_rotary_matches_transformers_llama(rope_scaling):
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    head_dim, heads, theta, max_pos = 32, 2, 50000.0, 512
    rope_parameters = {"rope_type": "default", "rope_theta": theta, **(rope_scaling or {})}
    config = LlamaConfig(
        hidden_size=head_dim * heads, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_pos, rope_parameters=rope_parameters,
    )  # fmt: skip
    positions = torch.tensor([0, 3, 63, 64, 200, 511])
    q, k = torch.randn(2, len(positions), heads, head_dim)
    cos, sin = llama.LlamaRotaryEmbedding(config)(q, positions[None])
    expect_q, expect_k = llama.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    rope = RotaryEmbedding(head_dim, max_pos, theta, rope_scaling)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, expect_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, expect_k[0].transpose(0, 1))


def test_llama3_scaling_changes_long_wavelengths_only():
    plain = RotaryEmbedding(64, 4096, 500000.0)
    scaled = RotaryEmbedding(64, 4096, 500000.0, LLAMA3)
    positions = torch.tensor([4095])
    q = torch.randn(1, 1, 64)
    (plain_q, _), (scaled_q, _) = plain(positions, q, q), scaled(positions, q, q)
    assert torch.equal(plain_q[..., :1], scaled_q[..., :1])  # the highest frequency is untouched
    assert not torch.allclose(plain_q, scaled_q)


def test_rotary_rejects_unknown_rope_type():
    with pytest.raises(ValueError, match="rope_scaling"):
        RotaryEmbedding(8, 10, 100.0, {"rope_type": "dynamic", "factor": 2.0})


def test_layers_accept_an_empty_batch():
    rope = RotaryEmbedding(8, max_position=10, base=100.0)
    q, k = rope(torch.zeros(0, dtype=torch.long), torch.zeros(0, 4 * 8), torch.zeros(0, 2, 8))
    assert q.shape == (0, 32) and k.shape == (0, 2, 8)
    assert rms_norm(torch.zeros(0, 16), torch.ones(16), 1e-6).shape == (0, 16)
    assert silu_and_mul(torch.zeros(0, 16)).shape == (0, 8)
