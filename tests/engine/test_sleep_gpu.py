"""Sleep mode on a CUDA device: the CPU tests' assertions against `torch.cuda.mem_get_info`,
plus no graph recaptured on wake."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfit import LLM, SamplingParams
from kvfit.engine.worker import Worker

pytestmark = pytest.mark.gpu

SETTINGS = dict(device="cuda", enable_sleep_mode=True, gpu_memory_utilization=0.05,
                max_num_seqs=16, max_model_len=512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prompts() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
            for n in (1, 7, 16, 33, 64, 100)]


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def worker(llm: LLM) -> Worker:
    return llm.engine.executor.workers[0]


def device_free() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def held(llm: LLM) -> int:
    runner = worker(llm).runner
    return runner.kv_cache.physical_bytes + runner.weight_arena.physical_bytes


@pytest.fixture(scope="module")
def llm(gpu_model: Path) -> Iterator[LLM]:
    llm = LLM(str(gpu_model), **SETTINGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return outputs(llm)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_frees_device_memory_and_wake_needs_no_recapture(llm, reference, level) -> None:
    graphs = worker(llm).runner.graphs
    passes = graphs.num_capture_passes
    ptrs = [p.data_ptr() for p in worker(llm).runner.model.parameters()]
    awake, nbytes = device_free(), held(llm)
    report = llm.sleep(level=level)
    assert device_free() - awake >= 0.95 * nbytes
    assert report.released_bytes >= 0.95 * nbytes
    assert report.kept["torch"] >= 0  # graph pools and inputs stay, reported
    llm.wake_up()
    assert abs(device_free() - awake) <= worker(llm).runner.kv_cache.granularity
    assert [p.data_ptr() for p in worker(llm).runner.model.parameters()] == ptrs
    assert outputs(llm) == reference
    assert worker(llm).runner.graphs is graphs and graphs.num_capture_passes == passes


def test_ten_cycles_leave_free_memory_where_it_was(llm, reference) -> None:
    outputs(llm)
    awake = device_free()
    granule = worker(llm).runner.kv_cache.granularity
    for cycle in range(10):
        llm.sleep(level=1 + cycle % 2)
        llm.wake_up()
        assert abs(device_free() - awake) <= granule, cycle
    assert outputs(llm) == reference


@pytest.fixture(scope="module")
def other_model(gpu_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-gpu-swapped")
    for file in gpu_model.iterdir():
        shutil.copy(file, folder / file.name)
    g = torch.Generator().manual_seed(1)
    weights = {name: (t.float() + 0.05 * torch.randn(t.shape, generator=g)).to(t.dtype)
               for name, t in load_file(gpu_model / "model.safetensors").items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_weights_swapped_at_level_2_are_the_ones_used(llm, reference, gpu_model,
                                                      other_model) -> None:
    other = LLM(str(other_model), **SETTINGS)
    try:
        expected = outputs(other)
    finally:
        other.shutdown()
    assert expected != reference
    llm.sleep(level=2)
    llm.load_weights(load_file(other_model / "model.safetensors", device="cuda"))
    llm.wake_up()
    try:
        assert outputs(llm) == expected
    finally:
        llm.load_weights(load_file(gpu_model / "model.safetensors", device="cuda"))
    assert outputs(llm) == reference
