"""The physical-limit model: bytes and FLOPs of a tiny shape counted by hand, the per-step max
and the sum over steps, the count against a real kvfit model's weights, and the measurements."""

from __future__ import annotations

import pytest
import torch

from kvfit.benchmarks.limits import (
    DeviceLimits,
    ModelShape,
    StepShape,
    Work,
    measure_device_limits,
    run_limit,
    step_work,
)

# 2 layers, hidden 8, 2 query heads and 1 KV head of 4, MLP 16, vocabulary 32, 2-byte weights.
SHAPE = ModelShape(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4,
                   intermediate_size=16, vocab_size=32)
# Sequence A prefills its first 3 tokens, B decodes its 6th (5 cached); both are sampled.
MIXED = StepShape(starts=[0, 5], num_new=[3, 1], num_logits=2)
# A's next chunk: 3 more tokens after its 3, not sampled (a prefill chunk that does not end).
CHUNK = StepShape(starts=[3], num_new=[3], num_logits=0)


def test_shape_counts_by_hand() -> None:
    # qkv 8 x (8 + 4 + 4) + o 8 x 8 + gate/up/down 3 x 8 x 16
    assert SHAPE.layer_params == 128 + 64 + 384 == 576
    assert SHAPE.body_params == 1152 and SHAPE.head_params == 256
    assert SHAPE.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2 == 32  # K and V, 2 layers, 2 bytes
    assert SHAPE.attention_flops_per_pair == 4 * 2 * 2 * 4 == 64


def test_step_work_by_hand() -> None:
    # Pairs: A attends causally over 1 + 2 + 3 = 6, B's one query over 5 + 1 = 6.
    assert step_work(SHAPE, MIXED) == Work(
        weight_bytes=(1152 + 256) * 2,       # body and the LM head (rows are sampled)
        kv_read_bytes=5 * 32,                # B's cached prefix; A has none
        kv_write_bytes=4 * 32,               # every new token
        gemm_flops=2 * 1152 * 4 + 2 * 256 * 2,
        attention_flops=12 * 64)
    # 3 queries after 3 cached tokens: 3 x 3 + (1 + 2 + 3) pairs; no LM head at all.
    assert step_work(SHAPE, CHUNK) == Work(weight_bytes=1152 * 2, kv_read_bytes=3 * 32,
                                           kv_write_bytes=3 * 32, gemm_flops=2 * 1152 * 3,
                                           attention_flops=15 * 64)


def test_run_limit_sums_each_steps_max_of_bytes_and_flops() -> None:
    limits = DeviceLimits(copy_bytes_per_s=1000.0, gemm_flops_per_s=3200.0)
    # MIXED: 3104 bytes (3.104 s) vs 11008 FLOPs (3.44 s): compute sets it.
    # CHUNK: 2496 bytes (2.496 s) vs 7872 FLOPs (2.46 s): memory sets it.
    limit = run_limit(SHAPE, [MIXED, CHUNK], limits)
    assert limit.seconds == pytest.approx(11008 / 3200 + 2496 / 1000)
    assert limit.num_steps == 2 and limit.memory_bound_steps == 1
    assert limit.work == step_work(SHAPE, MIXED) + step_work(SHAPE, CHUNK)
    assert limit.as_dict()["limit_s"] == limit.seconds
    assert run_limit(SHAPE, [], limits).seconds == 0.0


def test_from_hf_config_counts_the_gemm_weights_of_the_real_model() -> None:
    """The count equals the GEMM parameters a loaded kvfit model holds (tied head: the
    embedding table is the LM head, read once per sampling step)."""
    from kvfit.models.loader import load_hf_config, load_model

    config = load_hf_config("kvfit-tiny")
    shape = ModelShape.from_hf_config(config, dtype_bytes=4)
    model = load_model(config, "kvfit-tiny", torch.float32, torch.device("cpu"), "dummy")
    gemm = sum(p.numel() for name, p in model.named_parameters()
               if name.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight",
                                 "down_proj.weight")))
    assert shape.body_params == gemm
    assert shape.head_params == model.lm_head.weight.numel()
    spec_bytes = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert shape.kv_bytes_per_token == spec_bytes and shape.dtype_bytes == 4


def test_measured_limits_are_positive_and_sized_by_the_arguments() -> None:
    limits = measure_device_limits(torch.device("cpu"), torch.float32, copy_bytes=1 << 20,
                                   gemm_size=64)
    assert limits.copy_bytes_per_s > 0 and limits.gemm_flops_per_s > 0
    work = Work(weight_bytes=int(limits.copy_bytes_per_s))  # one second of copying
    assert limits.seconds(work) == pytest.approx(1.0)
