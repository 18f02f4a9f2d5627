"""`kv_cache_dtype="fp8"` through the engine on the CPU (host VMM driver, torch reference path):
flags and errors, the spec, measured sizing, `calculate_kv_scales`, outputs, sleep and the
shared-storage connector."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvfit.engine.worker as worker_module
import kvfit.models.llama as llama
from kvfit import LLM, SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.kv_quant import K_SCALE_CONSTANT, V_SCALE_CONSTANT

MiB = 1 << 20
FP8 = torch.float8_e4m3fn
SETTINGS = dict(device="cpu", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 60 + 9 * i))} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    """Each prompt token's logprob given the ones before it (teacher forcing: no divergence)."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    return torch.tensor([entry[token].logprob for o in llm.generate(PROMPTS, params,
                                                                     use_tqdm=False)
                         for entry, token in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:],
                                                 strict=True)])


def runner(llm: LLM):
    return llm.engine.executor.workers[0].runner


@pytest.fixture
def make_llm(qwen3: Path) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(model: Path = qwen3, **kwargs: object) -> LLM:
        llm = LLM(str(model), **{**SETTINGS, **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


@pytest.fixture(scope="module")
def float32_logprobs(qwen3: Path) -> torch.Tensor:
    """Prompt logprobs with the cache in the model's dtype (float32 on the CPU)."""
    llm = LLM(str(qwen3), **SETTINGS)
    try:
        return prompt_logprobs(llm)
    finally:
        llm.shutdown()


def test_flags_take_vllm_names_and_a_bad_value_names_the_flag(capsys) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--kv-cache-dtype", "fp8",
                                                       "--calculate-kv-scales"]))
    assert (args.kv_cache_dtype, args.calculate_kv_scales) == ("fp8", True)
    defaults = EngineArgs.from_cli_args(parser.parse_args([]))
    assert (defaults.kv_cache_dtype, defaults.calculate_kv_scales) == ("auto", False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8_e5m2"])
    assert "--kv-cache-dtype" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [
    (dict(kv_cache_dtype="fp8_e5m2"),
     r"kv_cache_dtype \(--kv-cache-dtype\) must be one of auto, bfloat16, fp8, fp8_e4m3; got "
     r"'fp8_e5m2'"),
    (dict(calculate_kv_scales=True), r"kv_cache_dtype is 'auto'; set --kv-cache-dtype fp8"),
    (dict(kv_cache_dtype="bfloat16", calculate_kv_scales=True),
     r"kv_cache_dtype is 'bfloat16'; set --kv-cache-dtype fp8"),
    (dict(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_connector="shared_storage",
          kv_connector_path="x"), r"drop --calculate-kv-scales"),
])
def test_config_errors_name_the_setting(qwen3: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(qwen3), device="cpu", **kwargs).create_engine_config()


def test_a_bfloat16_cache_halves_a_float32_model_cache(
    make_llm: Callable[..., LLM], float32_logprobs: torch.Tensor
) -> None:
    # vLLM's kv_cache_dtype="bfloat16" was refused; on the CPU, where the model runs in float32,
    # it holds twice the blocks of the default cache in the same memory.
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    llm = make_llm(kv_cache_dtype="bfloat16", num_gpu_blocks_override=64)
    cache = runner(llm)._allocated_cache
    assert cache is not None and cache.dtype == torch.bfloat16
    assert llm.kv_cache_report.dtype == "bfloat16"
    assert llm.kv_cache_report.committed_bytes == 2 * cache.numel()
    diff = (prompt_logprobs(llm) - float32_logprobs).abs()
    assert 0 < diff.mean() < 0.02 and diff.max() < 0.1  # bf16's rounding, finer than e4m3's


def test_a_bfloat16_cache_on_cuda_needs_a_bfloat16_model(qwen3: Path) -> None:
    # The CUDA kernels read a 16-bit cache in the model's dtype.
    args = EngineArgs(model=str(qwen3), kv_cache_dtype="bfloat16")
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' on CUDA needs the model "
                                         r"in bfloat16 \(got float16\): set --dtype bfloat16"):
        args._check_kv_cache_dtype(cuda, torch.float16)
    assert args._check_kv_cache_dtype(cuda, torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_spec_stores_e4m3_in_half_the_bytes_of_bf16(qwen3: Path, name: str) -> None:
    def spec(kv_cache_dtype: str):
        return EngineArgs(model=str(qwen3), device="cpu", dtype="bfloat16",
                          kv_cache_dtype=kv_cache_dtype).create_engine_config().kv_cache_spec()

    auto, fp8 = spec("auto"), spec(name)
    assert (auto.dtype, fp8.dtype) == (torch.bfloat16, FP8)
    assert auto.block_bytes == 2 * fp8.block_bytes


def test_the_help_says_what_e4m3_saves_on_the_cpu_too(qwen3: Path) -> None:
    # It said "about twice the blocks", which the CPU's float32 cache (four times) belies.
    def spec(kv_cache_dtype: str):
        return EngineArgs(model=str(qwen3), device="cpu",
                          kv_cache_dtype=kv_cache_dtype).create_engine_config().kv_cache_spec()

    assert spec("auto").dtype == torch.float32
    assert spec("auto").block_bytes == 4 * spec("fp8").block_bytes
    text = " ".join(EngineArgs.add_cli_args(argparse.ArgumentParser()).format_help().split())
    assert "twice the blocks of a 16-bit cache in the same memory, four times a float32" in text


def test_measured_sizing_gives_twice_the_blocks_of_bf16(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same measured room for both (the host's own use moves between engines): 6 MiB, below
    # what max_num_seqs sequences of max_model_len would cap the cache at.
    monkeypatch.setattr(worker_module, "available_kv_bytes", lambda profile, *args: 6 * MiB)
    limits = dict(dtype="bfloat16", max_num_seqs=64, max_model_len=512)
    bf16, fp8 = make_llm(**limits), make_llm(kv_cache_dtype="fp8", **limits)
    a, b = bf16.kv_cache_report, fp8.kv_cache_report
    assert a.method == b.method == "measured"
    assert b.max_blocks > b.num_blocks >= 1.9 * a.num_blocks
    assert (a.dtype, b.dtype) == ("bfloat16", "float8_e4m3fn")
    assert a.block_bytes == 2 * b.block_bytes
    assert "KV cache dtype  " in b.format_table() and "float8_e4m3fn" in b.format_table()
    assert b.committed_bytes <= 6 * MiB
    cache = runner(fp8).kv_cache
    assert cache.spec.dtype == FP8 and cache.committed_blocks == b.num_blocks
    assert all(k.dtype == FP8 for k, _ in cache.layer_views())
    assert fp8.engine.scheduler.block_manager.num_blocks == b.num_blocks


@pytest.mark.parametrize("calculate", [False, True])
def test_fp8_cache_stays_within_e4m3_rounding_of_the_float32_cache(
    make_llm: Callable[..., LLM], float32_logprobs: torch.Tensor, calculate: bool
) -> None:
    # Random weights put near-ties everywhere, so greedy paths may part after one flip; the
    # teacher-forced logprobs show the cache's error itself (accuracy on a trained model:
    # bench/kv_dtype.py accuracy).
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=calculate)
    if not calculate:
        assert runner(llm).kv_scales() == [(1.0, 1.0)] * 2  # the default: 1.0, as vLLM
    diff = (prompt_logprobs(llm) - float32_logprobs).abs()
    assert 0 < diff.mean() < 0.06 and diff.max() < 0.3  # quantised, and only by rounding


@pytest.mark.parametrize("sizing", [dict(enable_extensible_kv_cache=False),
                                    dict(num_gpu_blocks_override=64)], ids=str)
def test_estimate_and_override_caches_are_fp8_too(
    make_llm: Callable[..., LLM], float32_logprobs: torch.Tensor, sizing: dict
) -> None:
    llm = make_llm(kv_cache_dtype="fp8", **sizing)
    cache = runner(llm)._allocated_cache  # torch-allocated: no VMM reservation
    assert cache is not None and cache.dtype == FP8
    assert llm.kv_cache_report.committed_bytes == cache.numel()  # one byte per value
    diff = (prompt_logprobs(llm) - float32_logprobs).abs()
    assert 0 < diff.mean() < 0.06


def test_calculated_scales_come_from_the_first_real_step_then_stay(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[float, float]] = []
    calculate = llama.calculate_kv_scales_

    def spy(k_scale, v_scale, key, value) -> None:
        calls.append((key.abs().max().item(), value.abs().max().item()))
        calculate(k_scale, v_scale, key, value)

    monkeypatch.setattr(llama, "calculate_kv_scales_", spy)
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert calls  # warmup's dummy steps calculate too, so that memory is measured ...
    assert runner(llm).kv_scales() == [(1.0, 1.0)] * 2  # ... and leave the scales alone
    calls.clear()
    outputs(llm)
    first = runner(llm).kv_scales()
    assert len(calls) == 2  # one per layer, in the first step only
    for (k_amax, v_amax), (k_scale, v_scale) in zip(calls, first, strict=True):
        assert k_scale == pytest.approx(k_amax / K_SCALE_CONSTANT)
        assert v_scale == pytest.approx(v_amax / V_SCALE_CONSTANT)
        assert k_scale != 1.0
    outputs(llm)
    assert len(calls) == 2 and runner(llm).kv_scales() == first


def test_sleep_and_wake_keep_the_fp8_cache_and_its_scales(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(kv_cache_dtype="fp8", calculate_kv_scales=True, enable_sleep_mode=True)
    before = outputs(llm)
    scales = runner(llm).kv_scales()
    report = llm.sleep(level=1)
    assert report.released["kv_cache"] == llm.kv_cache_report.committed_bytes
    llm.wake_up()
    assert runner(llm).kv_scales() == scales
    assert outputs(llm) == before


def test_connector_stores_fp8_blocks_in_a_namespace_of_their_own(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    store = dict(kv_connector="shared_storage", kv_connector_path=str(tmp_path))
    first = make_llm(kv_cache_dtype="fp8", **store)
    expect = outputs(first)
    first.shutdown()
    second = make_llm(kv_cache_dtype="fp8", **store)
    assert outputs(second) == expect  # the same K/V bytes, read back from the store
    assert second.engine.scheduler.num_external_hit_tokens > 0
    second.shutdown()
    other = make_llm(**store)  # a float32 cache: the fp8 files are not its blocks
    outputs(other)
    assert other.engine.scheduler.num_external_hit_tokens == 0


def scales(llm: LLM) -> list[float]:
    """Every layer's k and v scale, in order."""
    return [s for pair in runner(llm).kv_scales() for s in pair]


def with_scales(qwen3: Path, folder: Path, scales: dict[str, torch.Tensor]) -> Path:
    """A copy of the tiny model whose checkpoint also holds `scales` (names after each layer's
    `self_attn.`, as vLLM reads them)."""
    shutil.copytree(qwen3, folder)
    weights = load_file(folder / "model.safetensors")
    for layer in range(2):
        for name, value in scales.items():
            weights[f"model.layers.{layer}.self_attn.{name}"] = value * (layer + 1)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("names", [("k_scale", "v_scale"),
                                   ("k_proj.output_scale", "v_proj.output_scale")], ids=str)
def test_checkpoint_kv_scales_are_the_fp8_cache_scales(
    make_llm: Callable[..., LLM], qwen3: Path, tmp_path: Path, float32_logprobs: torch.Tensor,
    names: tuple[str, str],
) -> None:
    # A calibrated checkpoint (llm-compressor's) carries them, beside a q scale kvfit does not
    # use: such a checkpoint did not load at all ("has no place in Qwen3ForCausalLM").
    folder = with_scales(qwen3, tmp_path / "calibrated", {
        names[0]: torch.tensor(0.01), names[1]: torch.tensor([0.02]),
        "q_scale": torch.tensor(0.5)})
    llm = make_llm(folder, kv_cache_dtype="fp8")
    assert scales(llm) == pytest.approx([0.01, 0.02, 0.02, 0.04])
    diff = (prompt_logprobs(llm) - float32_logprobs).abs()
    assert 0 < diff.mean() < 0.06 and diff.max() < 0.3  # read with the scales written with
    llm.shutdown()
    # vLLM's semantics: a 16-bit cache ignores them, calculated scales replace them.
    assert runner(make_llm(folder)).kv_scales() == [(1.0, 1.0)] * 2
    calculated = make_llm(folder, kv_cache_dtype="fp8", calculate_kv_scales=True)
    outputs(calculated)
    assert all(k != pytest.approx(0.01 * (i + 1))
               for i, (k, _) in enumerate(runner(calculated).kv_scales()))


def test_one_checkpoint_kv_scale_sets_both(make_llm: Callable[..., LLM], qwen3: Path,
                                           tmp_path: Path) -> None:
    folder = with_scales(qwen3, tmp_path / "kv", {"kv_scale": torch.tensor(0.03)})
    llm = make_llm(folder, kv_cache_dtype="fp8")
    assert scales(llm) == pytest.approx([0.03, 0.03, 0.06, 0.06])


def test_per_head_checkpoint_scales_are_refused_by_an_fp8_cache_only(
    make_llm: Callable[..., LLM], qwen3: Path, tmp_path: Path
) -> None:
    folder = with_scales(qwen3, tmp_path / "per-head", {"k_scale": torch.tensor([0.01, 0.02]),
                                                        "v_scale": torch.tensor([0.03, 0.03])})
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.k_scale' holds 2 "
                                         r"different k/v scales .* --kv-cache-dtype auto"):
        make_llm(folder, kv_cache_dtype="fp8")
    outputs(make_llm(folder))  # a 16-bit cache has no use for them


def test_load_weights_takes_new_checkpoint_kv_scales(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(kv_cache_dtype="fp8")
    assert runner(llm).kv_scales() == [(1.0, 1.0)] * 2
    llm.load_weights([("model.layers.1.self_attn.k_scale", torch.tensor(0.5)),
                      ("model.layers.1.self_attn.v_scale", torch.tensor(0.25))])
    assert runner(llm).kv_scales() == [(1.0, 1.0), (0.5, 0.25)]
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.v_scale' is 0.0, not a "
                                         r"positive k/v scale"):
        llm.load_weights([("model.layers.0.self_attn.v_scale", torch.tensor(0.0))])
