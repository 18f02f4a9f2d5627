"""Shared test configuration: `gpu` tests skip cleanly on machines without CUDA; `interpret`
tests run under TRITON_INTERPRET=1 (in a child pytest when this one lacks it); tiny
random-weight Hugging Face models for the models and engine tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# Folders whose tests run whole engines on tiny models: one intra-op thread each (see
# `one_thread`).
_ENGINE_TEST_FOLDERS = {"engine", "server", "cli", "bench", "distributed"}


# Paths of the files holding the selected `interpret` tests, for tests/ops/test_interpreted.py.
INTERPRETED_FILES = pytest.StashKey[list[str]]()


@pytest.hookimpl(trylast=True)  # after `-k` / `-m` deselected what they do
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _ENGINE_TEST_FOLDERS & set(item.path.relative_to(config.rootpath).parts[1:2]):
            item.fixturenames.insert(0, "one_thread")
    _skip_interpret_tests(config, items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker `gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _skip_interpret_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`interpret` tests run a Triton kernel through Triton's interpreter, which a kernel
    obeys only if TRITON_INTERPRET=1 was set before it was decorated (at import). In a process
    without it they skip here, and tests/ops/test_interpreted.py runs them in a child pytest
    with it (the sm_90 compile tests need it unset, so one process can't run both)."""
    interpreted = [item for item in items if item.get_closest_marker("interpret")]
    config.stash[INTERPRETED_FILES] = sorted(
        {str(item.path.relative_to(config.rootpath)) for item in interpreted})
    if importlib.util.find_spec("triton") is None:
        reason = "needs triton (pip install -e '.[dev]')"
    elif os.environ.get("TRITON_INTERPRET") != "1":
        reason = "runs in tests/ops/test_interpreted.py's child pytest, with TRITON_INTERPRET=1"
    else:
        return
    for item in interpreted:
        item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def interpreted_files(pytestconfig: pytest.Config) -> list[str]:
    """The files holding this session's selected `interpret` tests (rootdir-relative)."""
    return pytestconfig.stash.get(INTERPRETED_FILES, [])


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    # Tiny models gain nothing from intra-op threads; on a shared 2-core machine their
    # spinning makes every op orders of magnitude slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- Tiny random-weight Hugging Face models, shared by the models and engine tests. ---

TINY_ARCHITECTURES = ("qwen3", "llama")


def _tiny_hf_config(arch: str) -> PretrainedConfig:
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=512,  # kvfit-tiny's tokenizer
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        # Five times HF's default: peaked logits, so a wrong rope or norm shows far above
        # float32 noise.
        initializer_range=0.1,
        rope_theta=10000.0,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, num_hidden_layers=2, tie_word_embeddings=True)
    if arch == "llama":
        # Llama 3 scaling with a short original context, so that it changes most frequencies;
        # a q/k/v bias so the fused projection's bias rows are loaded too.
        rope_scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return LlamaConfig(
            **common,
            num_hidden_layers=3,
            rope_scaling=rope_scaling,
            attention_bias=True,
            tie_word_embeddings=False,
        )
    raise ValueError(f"tiny model arch {arch!r} is not one of {TINY_ARCHITECTURES}")


def build_tiny_hf_model(arch: str, folder: Path) -> Path:
    """Save a seeded random-weight HF model of `arch` (safetensors) plus kvfit-tiny's tokenizer.

    Norm weights and biases are randomised too (HF initialises them to constants), so a
    mis-mapped or skipped one changes the logits.
    """
    from transformers import AutoModelForCausalLM

    from kvfit.models.loader import BUILTIN_DIR

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_tiny_hf_config(arch), dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                elif name.endswith("bias"):
                    param.copy_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUILTIN_DIR / "kvfit-tiny" / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Factory: `tiny_model("qwen3" | "llama") -> Path` of a saved tiny random-weight HF model
    (4 heads / 2 KV heads, vocab 512, float32, with a tokenizer). Built once per session."""
    built: dict[str, Path] = {}

    def get(arch: str = "qwen3") -> Path:
        if arch not in built:
            built[arch] = build_tiny_hf_model(arch, tmp_path_factory.mktemp(f"tiny-{arch}"))
        return built[arch]

    return get


@pytest.fixture
def split_tokenizer(tmp_path: Path) -> Callable[[Path], tuple[Path, Path]]:
    """Factory: `split_tokenizer(model) -> (model copy, tokenizer folder)`, the copy's
    tokenizer files moved to a folder of their own (a model that needs `--tokenizer`)."""
    def split(source: Path) -> tuple[Path, Path]:
        model, tokenizer = tmp_path / "model", tmp_path / "tokenizer"
        shutil.copytree(source, model)
        tokenizer.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (model / name).rename(tokenizer / name)
        return model, tokenizer

    return split


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`pytest ... &`, nohup, some CI runners) with SIGINT
    # ignored, and an ignored signal stays ignored in every child: the tests that Ctrl-C a
    # `kvfit` process would find it deaf. Python's own handler is reset in an exec'd child.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
