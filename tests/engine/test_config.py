"""EngineArgs -> EngineConfig: defaults resolved against model and device, errors name the flag."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvfit.engine.config import EngineArgs, _resolve_dtype
from kvfit.models.loader import load_hf_config


def config(**kwargs: object):  # -> EngineConfig
    return EngineArgs(model="kvfit-tiny", device="cpu", **kwargs).create_engine_config()


def test_cpu_defaults() -> None:
    c = config()
    hf = load_hf_config("kvfit-tiny")
    assert c.device == torch.device("cpu")
    assert c.model_config.dtype == torch.float32
    assert c.model_config.max_model_len == min(hf.max_position_embeddings, 4096)
    assert c.scheduler_config.max_num_batched_tokens == 2048
    assert c.enforce_eager  # no CUDA graphs on the CPU
    cc = c.cache_config
    assert cc.enable_extensible_kv_cache is True
    assert cc.memory_utilization == 1.0
    assert 0 < cc.cpu_kv_cache_space_bytes <= 8 << 30


def test_auto_dtype_on_gpu_is_the_checkpoint_half_precision() -> None:
    hf = load_hf_config("qwen3-0.6b-shape")
    assert _resolve_dtype("auto", hf, torch.device("cuda", 0)) == torch.bfloat16
    assert _resolve_dtype("auto", hf, torch.device("cpu")) == torch.float32
    assert _resolve_dtype("half", hf, torch.device("cpu")) == torch.float16


def test_max_model_len_default_is_capped_and_larger_is_an_error() -> None:
    hf = load_hf_config("qwen3-0.6b-shape")
    c = EngineArgs(model="qwen3-0.6b-shape", device="cpu").create_engine_config()
    assert c.model_config.max_model_len < hf.max_position_embeddings
    assert config(max_model_len=100).scheduler_config.max_model_len == 100
    with pytest.raises(ValueError, match="max_model_len .* max_position_embeddings"):
        config(max_model_len=hf.max_position_embeddings * 8)


def test_max_model_len_auto_is_the_models_whole_context() -> None:
    hf = load_hf_config("qwen3-0.6b-shape")
    for auto in ("auto", "AUTO", -1):
        c = EngineArgs(model="qwen3-0.6b-shape", device="cpu",
                       max_model_len=auto).create_engine_config()
        assert c.model_config.max_model_len == hf.max_position_embeddings  # not capped
        assert c.model_config.max_model_len_auto
    assert not config(max_model_len=100).model_config.max_model_len_auto
    with pytest.raises(ValueError, match="max_model_len must be an integer >= 1, or -1"):
        config(max_model_len=0)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert parser.parse_args(["--max-model-len", "auto"]).max_model_len == -1
    assert parser.parse_args(["--max-model-len", "32K"]).max_model_len == 32768


@pytest.mark.parametrize("name", ["kv_cache_memory_bytes", "num_gpu_blocks_override"])
def test_manual_cache_size_turns_the_extensible_default_off(name: str) -> None:
    cc = config(**{name: 1 << 20}).cache_config
    assert cc.enable_extensible_kv_cache is False
    assert cc.memory_utilization == 0.92
    with pytest.raises(ValueError, match=f"enable_extensible_kv_cache=True conflicts with {name}"):
        config(enable_extensible_kv_cache=True, **{name: 1 << 20})


def test_utilization_given_is_kept_and_fallback_restores_the_estimate_default() -> None:
    assert config(gpu_memory_utilization=0.5).cache_config.memory_utilization == 0.5
    cc = config().cache_config
    cc.enable_extensible_kv_cache = False  # what the engine does when the VMM probe fails
    assert cc.memory_utilization == 0.92


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": 24}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 8}, "max_num_batched_tokens"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"kv_cache_margin_fraction": -0.1}, "kv_cache_margin_fraction"),
        ({"kv_cache_margin_fraction": float("nan")}, "kv_cache_margin_fraction"),
        ({"kv_cache_margin_fraction": float("inf")}, "kv_cache_margin_fraction"),
        ({"kv_cache_margin_floor_bytes": -1}, "kv_cache_margin_floor_bytes"),
        ({"cpu_kv_cache_space_bytes": 0}, "cpu_kv_cache_space_bytes"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"dtype": "int3"}, "dtype"),
        ({"load_format": "pickle"}, "load_format"),
        ({"max_logprobs": -2}, "max_logprobs"),  # -1 is the whole vocabulary
        ({"cuda_graph_sizes": [0]}, "cuda_graph_sizes"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold"),
    ],
)
def test_bad_values_name_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        config(**kwargs)


@pytest.mark.parametrize(("max_num_seqs", "max_model_len", "block_size", "expect"), [
    (1, 64, 16, 64),      # the CPU default 2048 was kept: warmup profiled 32x any real step
    (3, 100, 16, 300),
    (1, 8, 16, 16),       # never below one block
    (1, 2048, 16, 2048),  # a step that can fill the default keeps it
    (64, 4096, 16, 2048),
])
def test_the_default_token_budget_is_capped_at_what_a_step_can_fill(
    max_num_seqs: int, max_model_len: int, block_size: int, expect: int,
) -> None:
    """As a user-given budget is: a step holds at most max_num_seqs x max_model_len tokens."""
    c = config(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size)
    assert c.scheduler_config.max_num_batched_tokens == expect


def test_block_size_has_an_upper_bound_naming_the_flag() -> None:
    # `--block-size 1048576` was accepted: warmup profiled a step of a million tokens (the
    # default token budget is at least one block) for minutes before serving anything.
    with pytest.raises(ValueError, match=r"block_size \(--block-size\) must be at most 1024, "
                                         r"got 1048576"):
        config(block_size=1 << 20)
    with pytest.raises(ValueError, match="--block-size"):
        config(block_size=2048)
    c = config(block_size=1024, max_model_len=2048)  # the largest block is kept
    assert c.cache_config.block_size == 1024


def test_device_errors() -> None:
    with pytest.raises(ValueError, match="device"):
        EngineArgs(device="tpu").create_engine_config()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineArgs(device="cuda").create_engine_config()


def test_cpu_device_index_is_refused_naming_the_setting() -> None:
    # Found by the hunt: 'cpu:1' was accepted and failed in the weight loader, which called
    # the checkpoint damaged. 'cpu:0' is the CPU.
    with pytest.raises(ValueError, match=r"device='cpu:1': the CPU has no device index"):
        config_on("cpu:1")
    assert config_on("cpu:0").device == torch.device("cpu")


def config_on(device: str):  # -> EngineConfig
    return EngineArgs(model="kvfit-tiny", device=device).create_engine_config()


@pytest.mark.parametrize(("kwargs", "match"), [
    # Found by the hunt: these failed in the worker with torch's words, naming no setting...
    ({"seed": 1.5}, r"seed must be an integer in \[-2\*\*63, 2\*\*64\), got 1.5"),
    ({"seed": 2**70}, r"seed must be an integer"),
    ({"max_num_batched_tokens": 200.5}, r"max_num_batched_tokens must be an integer >= 1"),
    # ... and 0 was taken as "the default".
    ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens must be an integer >= 1, got 0"),
])
def test_engine_seed_and_token_budget_are_checked_at_config_time(
    kwargs: dict, match: str,
) -> None:
    with pytest.raises(ValueError, match=match):
        config(**kwargs)


def test_no_engine_seed_is_seed_0_as_in_vllm() -> None:
    # Found by the hunt: vLLM's seed is `int | None` (None its V1 default, made 0 there: every
    # worker must sample alike), so LLM(model, seed=None) from a vLLM script was refused here
    # as "seed must be an integer".
    assert config(seed=None).model_config.seed == 0


@pytest.mark.gpu
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_cuda_device_resolves_to_an_index(device: str) -> None:
    # torch.cuda.set_device and tensor-device comparisons need the index.
    c = EngineArgs(model="kvfit-tiny", device=device).create_engine_config()
    assert c.device == torch.device("cuda", torch.cuda.current_device())


def test_unknown_model_names_the_setting() -> None:
    with pytest.raises(FileNotFoundError, match="model"):
        EngineArgs(model="/no/such/folder").create_engine_config()


def test_cuda_graph_sizes_are_capped_by_the_batch_limits() -> None:
    c = config(max_num_seqs=20, cuda_graph_sizes=[1, 8, 16, 32, 64])
    assert c.cuda_graph_sizes == [1, 8, 16]
    assert max(config(max_num_seqs=48).cuda_graph_sizes) == 48


def test_cli_round_trip() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args([
        "--model", "qwen3-0.6b-shape", "--max-model-len", "1024", "--no-enable-prefix-caching",
        "--enforce-eager", "--num-gpu-blocks-override", "64", "--cuda-graph-sizes", "1", "2",
        "--no-enable-extensible-kv-cache", "--kv-cache-margin-fraction", "0.25",
    ])
    args = EngineArgs.from_cli_args(ns)
    assert args == EngineArgs(
        model="qwen3-0.6b-shape", max_model_len=1024, enable_prefix_caching=False,
        enforce_eager=True, num_gpu_blocks_override=64, cuda_graph_sizes=[1, 2],
        enable_extensible_kv_cache=False, kv_cache_margin_fraction=0.25,
    )
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()


def test_long_prefill_token_threshold_flag_reaches_the_scheduler_config() -> None:
    # vLLM's engine argument: LLM(long_prefill_token_threshold=...) was a TypeError and the
    # flag unknown, though the scheduler cuts prompts at it.
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--long-prefill-token-threshold", "64"]))
    assert args.long_prefill_token_threshold == 64
    scheduler = config(long_prefill_token_threshold=64).scheduler_config
    assert scheduler.long_prefill_token_threshold == 64
    assert config().scheduler_config.long_prefill_token_threshold == 0


def test_logprobs_mode_takes_vllms_four_modes() -> None:
    # vLLM's engine argument: LLM(logprobs_mode="raw_logprobs") was a TypeError (unknown
    # engine argument) and --logprobs-mode an unrecognized flag; then only the default ran.
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert config().model_config.logprobs_mode == "raw_logprobs"
    for mode in ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"):
        args = EngineArgs.from_cli_args(parser.parse_args(["--logprobs-mode", mode]))
        assert config(logprobs_mode=args.logprobs_mode).model_config.logprobs_mode == mode
    with pytest.raises(ValueError, match="logprobs_mode .*must be one of raw_logprobs"):
        config(logprobs_mode="raw")


def test_small_batch_kernels_flag_reaches_the_engine_config() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flags, expected in (([], True), (["--small-batch-kernels"], True),
                            (["--no-small-batch-kernels"], False)):
        args = EngineArgs.from_cli_args(parser.parse_args(flags))
        assert args.small_batch_kernels is expected
        assert config(small_batch_kernels=expected).small_batch_kernels is expected


def test_fused_decode_input_flag_reaches_the_engine_config() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flags, expected in (([], False), (["--fused-decode-input"], True),
                            (["--no-fused-decode-input"], False)):
        args = EngineArgs.from_cli_args(parser.parse_args(flags))
        assert args.fused_decode_input is expected
        assert args.create_engine_config().fused_decode_input is expected


def test_explicit_extensible_cache_where_vmm_is_unusable_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert config(enable_extensible_kv_cache=True).cache_config.enable_extensible_kv_cache
    import kvfit.vmm

    monkeypatch.setattr(kvfit.vmm, "vmm_unavailable_reason", lambda device: "no VMM here")
    with pytest.raises(ValueError, match="enable_extensible_kv_cache=True .* no VMM here"):
        config(enable_extensible_kv_cache=True)
    # Unset, it stays on: the engine probes again at startup and falls back with a warning.
    assert config().cache_config.enable_extensible_kv_cache


def _saved_config(tmp_path, arch: str = "qwen3", **fields: object) -> str:
    from transformers import LlamaConfig, Qwen3Config

    cls = Qwen3Config if arch == "qwen3" else LlamaConfig
    cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
        architectures=[cls.__name__.replace("Config", "ForCausalLM")],
        **fields).save_pretrained(tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(("arch", "fields", "match"), [
    ("qwen3", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
     "sliding_window=64.*lower max_model_len to 64"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_model_features_kvfit_does_not_run_are_refused_naming_the_field(
        tmp_path, arch: str, fields: dict, match: str) -> None:
    model = _saved_config(tmp_path, arch, **fields)
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=model, device="cpu", max_model_len=128).create_engine_config()


@pytest.mark.parametrize(("fields", "match"), [
    ({"head_dim": 9, "hidden_size": 32}, "config.json head_dim 9 is odd"),
    ({"hidden_size": 18}, "head_dim 9 \\(hidden_size 18 / num_attention_heads 2\\) is odd"),
])
def test_an_odd_head_dim_is_refused_naming_the_field(fields: dict, match: str) -> None:
    """Neox rope rotates a head's two halves: an odd head_dim has none, and the rotary
    kernels failed (or the CPU path raised a shape error) at the first step. transformers 5
    refuses such a config itself; 4.x, which kvfit supports, loads it: a bare
    PretrainedConfig stands for it here."""
    from transformers import PretrainedConfig

    from kvfit.models.llama import check_config

    config = PretrainedConfig(hidden_act="silu", num_attention_heads=2, **fields)
    with pytest.raises(ValueError, match=match):
        check_config(config, 128)
    config.head_dim = 4  # even and tiny: runs (the attention kernels pad it to 16)
    check_config(config, 128)


def test_a_sliding_window_as_long_as_the_context_runs(tmp_path) -> None:
    model = _saved_config(tmp_path, use_sliding_window=True, sliding_window=64,
                          max_window_layers=0)
    args = EngineArgs(model=model, device="cpu", max_model_len=64)
    assert args.create_engine_config().model_config.max_model_len == 64


def test_yarn_runs_to_its_extended_context_past_max_position_embeddings(tmp_path) -> None:
    """Qwen3's model card extends 32k to 128k by adding rope_scaling yarn (factor 4 over
    original_max_position_embeddings 32768) and leaves max_position_embeddings at 40960: the
    context is original x factor, as vLLM reads it; max_model_len past 40960 was refused."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    model = _saved_config(tmp_path, rope_scaling=yarn)  # max_position_embeddings 256
    args = EngineArgs(model=model, device="cpu", max_model_len=512)
    assert args.create_engine_config().model_config.max_model_len == 512
    with pytest.raises(ValueError, match=r"max_model_len \(513\) .* rope_scaling extends it "
                       r"\(512, max_position_embeddings 256\)"):
        EngineArgs(model=model, device="cpu", max_model_len=513).create_engine_config()


def test_linear_rope_scaling_runs_to_max_position_embeddings_times_its_factor(tmp_path) -> None:
    # vLLM's reading: positions are divided by the factor, so the context is the factor times
    # longer; llama3's config gives its long context itself and stays.
    model = _saved_config(tmp_path, rope_scaling={"rope_type": "linear", "factor": 2.0})
    args = EngineArgs(model=model, device="cpu", max_model_len=512)
    assert args.create_engine_config().model_config.max_model_len == 512
    with pytest.raises(ValueError, match=r"extends it \(512, max_position_embeddings 256\)"):
        EngineArgs(model=model, device="cpu", max_model_len=513).create_engine_config()


def test_a_token_budget_no_step_can_fill_is_capped_at_what_one_can(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # `--max-num-batched-tokens 1000000000` profiled (and warmed up) a step of a billion
    # tokens: minutes and tens of GiB on the CPU before any error, though a step holds at
    # most max_num_seqs sequences of max_model_len tokens.
    with caplog.at_level("INFO", logger="kvfit"):
        c = config(max_num_batched_tokens=10**9, max_num_seqs=4, max_model_len=128)
    assert c.scheduler_config.max_num_batched_tokens == 4 * 128
    assert "max_num_batched_tokens" in caplog.text
    # A budget a step can fill is kept.
    assert config(max_num_batched_tokens=384, max_num_seqs=4,
                  max_model_len=128).scheduler_config.max_num_batched_tokens == 384


@pytest.mark.parametrize(("kwargs", "match"), [
    # Found by the hunt: a str where a number is meant raised a bare TypeError from a
    # comparison, naming no setting ...
    ({"gpu_memory_utilization": "0.5"}, r"gpu_memory_utilization must be a number, got '0.5'"),
    ({"kv_cache_margin_fraction": None}, r"kv_cache_margin_fraction must be a number, got None"),
    ({"kv_offloading_size": "2"}, r"kv_offloading_size must be a number of GiB, got '2'"),
    ({"tensor_parallel_size": None}, r"tensor_parallel_size must be an integer >= 1, got None"),
    ({"tensor_parallel_size": "2"}, r"tensor_parallel_size must be an integer >= 1, got '2'"),
    ({"cuda_graph_sizes": 8}, r"cuda_graph_sizes must be a list of integers >= 1, got 8"),
    ({"cuda_graph_sizes": "16"}, r"cuda_graph_sizes must be a list of integers >= 1, got '16'"),
    ({"tokenizer": 5}, r"tokenizer must be a path or name \(a str\), got 5"),
    ({"kv_connector": "shared_storage", "kv_connector_path": 5}, r"kv_connector_path must be"),
    # ... a bool passed as the number 1 (one sequence, a 1-token block, the whole device) ...
    ({"max_num_seqs": True}, r"max_num_seqs must be an integer >= 1, got True"),
    ({"block_size": True}, r"block_size must be an integer >= 1, got True"),
    ({"gpu_memory_utilization": True}, r"gpu_memory_utilization must be a number, got True"),
    ({"max_logprobs": False}, r"max_logprobs must be an integer >= -1, got False"),
    # ... a string for a switch was read by truthiness: "False" turned it on ...
    ({"enforce_eager": "False"}, r"enforce_eager must be True or False, got 'False'"),
    ({"enable_prefix_caching": "no"}, r"enable_prefix_caching must be True or False"),
    ({"enable_extensible_kv_cache": "false"}, r"enable_extensible_kv_cache must be True or"),
    ({"calculate_kv_scales": 2}, r"calculate_kv_scales must be True or False, got 2"),
    # ... and a hook not of the form module:function failed in the worker.
    ({"worker_init_fn": "tp_hooks"}, r"worker_init_fn must be 'module:function'"),
    ({"worker_init_fn": 5}, r"worker_init_fn must be 'module:function', got 5"),
    # Still refused: fractions, NaN, the seed's range.
    ({"max_model_len": 64.5}, r"max_model_len must be an integer >= 1, or -1 \('auto'"),
    ({"max_model_len": -2}, r"max_model_len must be an integer >= 1, or -1 \('auto'"),
    ({"num_gpu_blocks_override": float("nan")}, r"num_gpu_blocks_override must be an integer"),
    ({"seed": -(2**63) - 1}, r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
])
def test_a_setting_of_the_wrong_type_is_refused_naming_it(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config(**kwargs)


def test_numpy_scalars_and_whole_floats_are_taken_as_vllm_takes_them() -> None:
    """vLLM's configs (pydantic) take np.int64(64) or 64.0 for an int, any real for a float
    and 0/1 for a switch; kvfit refused the first two with "must be an integer", and they are
    what a script computing its settings passes."""
    import pathlib

    import numpy as np

    args = EngineArgs(model=pathlib.Path("kvfit-tiny"), device="cpu",
                      max_model_len=np.int64(64), max_num_seqs=4.0, seed=np.uint32(7),
                      block_size=np.int32(16), gpu_memory_utilization=np.float32(0.5),
                      cuda_graph_sizes=(np.int64(1), 2.0), enforce_eager=np.bool_(True),
                      enable_prefix_caching=0)
    c = args.create_engine_config()
    assert c.model_config.model == "kvfit-tiny"
    assert c.model_config.max_model_len == 64 and type(c.model_config.max_model_len) is int
    assert c.scheduler_config.max_num_seqs == 4 and type(c.scheduler_config.max_num_seqs) is int
    assert c.model_config.seed == 7 and type(c.model_config.seed) is int
    assert type(c.cache_config.block_size) is int
    assert c.cache_config.gpu_memory_utilization == 0.5
    assert type(c.cache_config.gpu_memory_utilization) is float
    assert c.cuda_graph_sizes == [1, 2]
    assert c.enforce_eager is True and c.cache_config.enable_prefix_caching is False
    # The arguments read back as the engine runs them.
    assert type(args.max_model_len) is int and args.enable_prefix_caching is False


def test_every_integer_setting_has_its_range_in_the_table() -> None:
    from dataclasses import fields

    from kvfit.engine.config import _INTEGER_RANGES

    ints = {f.name for f in fields(EngineArgs) if f.type.removesuffix(" | None") == "int"}
    assert ints == set(_INTEGER_RANGES)


@pytest.mark.parametrize(("kwargs", "match"), [
    # Found by the hunt: these raised AttributeError ('NoneType' object has no attribute
    # 'upper'), TypeError (unhashable type: 'list') or torch's own words ...
    ({"cudagraph_mode": None}, r"cudagraph_mode must be one of NONE, PIECEWISE, .*got None"),
    ({"cudagraph_mode": 1}, r"cudagraph_mode must be one of .*got 1"),
    ({"dtype": ["bfloat16"]}, r"dtype must be 'auto' or one of .*got \['bfloat16'\]"),
    ({"device": None}, r"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got None"),
    # ... and a falsy backend was taken as unset.
    ({"distributed_executor_backend": False},
     r"distributed_executor_backend must be one of uni, mp, external_launcher; got False"),
    ({"distributed_executor_backend": ""}, r"distributed_executor_backend must be one of"),
])
def test_a_choice_of_the_wrong_type_is_refused_naming_its_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{"model": "kvfit-tiny", "device": "cpu", **kwargs}).create_engine_config()
    # The choices' other spellings stay: lower case modes and torch's own types.
    c = config(cudagraph_mode="piecewise", dtype=torch.float16)
    assert (c.cudagraph_mode, c.model_config.dtype) == ("PIECEWISE", torch.float16)
    assert EngineArgs(device=torch.device("cpu")).create_engine_config().device.type == "cpu"
