"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def qwen3(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="session")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny bf16 Qwen3 with head_dim 64 (a size the GPU kernels support), as safetensors.

    A larger init scale than HF's default makes next-token distributions peaked, so greedy
    choices are not decided by bf16 rounding.
    """
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
        initializer_range=0.15, tie_word_embeddings=False, eos_token_id=2, bos_token_id=0,
    )
    folder = tmp_path_factory.mktemp("qwen3-gpu")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    return folder
