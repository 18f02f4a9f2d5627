"""Fixtures shared by the engine tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import kvfit.engine.model_runner as model_runner
from kvfit import LLM
from kvfit.engine.sequence import ScheduledBatch
from kvfit.ops.memwatch import watch_memory


@pytest.fixture(scope="module")
def qwen3(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def llm(request: pytest.FixtureRequest, qwen3: Path) -> Iterator[LLM]:
    """One `LLM` on the tiny Qwen3 with the test module's `SETTINGS`, shared by its tests (a
    module that needs another engine defines its own `llm`)."""
    llm = LLM(str(qwen3), **request.module.SETTINGS)
    yield llm
    llm.shutdown()


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


def one_layer_qwen3(folder: Path, vocab_size: int, initializer_range: float = 0.02) -> Path:
    """A one-layer float32 Qwen3 (EOS 2) whose peak step memory is set by `vocab_size`'s
    logits or by attention: the warmup-coverage tests' model. A larger `initializer_range`
    than HF's default makes attention, not the input token's own embedding, decide greedy
    tokens (a test of what the KV cache holds)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
                         eos_token_id=2, bos_token_id=0, initializer_range=initializer_range)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


class StepPeaks:
    """Peak bytes of every step launched, warmup's (the engine's startup) and real ones."""

    def __init__(self) -> None:
        self.warmup: list[int] = []
        self.real: list[tuple[int, list[int]]] = []  # (peak, tokens per sequence)
        self.started = False

    def record(self, batch: ScheduledBatch, peak: int) -> None:
        if self.started:
            self.real.append((peak, list(batch.num_new_tokens)))
        else:
            self.warmup.append(peak)


@pytest.fixture
def peaks(monkeypatch: pytest.MonkeyPatch) -> Iterator[StepPeaks]:
    peaks = StepPeaks()
    launch = model_runner.ModelRunner.launch

    def watched(self: model_runner.ModelRunner, batch: ScheduledBatch) -> object:
        with watch_memory("cpu") as watch:
            output = launch(self, batch)
            output.result()
        peaks.record(batch, watch.peak_bytes)
        return output

    monkeypatch.setattr(model_runner.ModelRunner, "launch", watched)
    yield peaks
