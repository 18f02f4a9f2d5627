"""A vLLM user's `serve` / `generate` command lines: the flag spellings and values vLLM takes
parse the same here, and the vLLM flags kvfit does not do are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfit.cli import build_parser, main
from kvfit.engine.config import EngineArgs


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 1_000_000),
    ("1M", 1 << 20), ("2G", 2 << 30),
])
@pytest.mark.parametrize("flag", ["--max-model-len", "--max-num-batched-tokens",
                                  "--kv-cache-memory-bytes", "--cpu-kv-cache-space-bytes"])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_token_and_byte_counts_take_vllm_suffixes(command: str, flag: str, text: str,
                                                   value: int) -> None:
    # vLLM: k, m, g, t are powers of 1000, K, M, G, T powers of 1024.
    args = build_parser().parse_args([command, flag, text])
    assert getattr(args, flag[2:].replace("-", "_")) == value


@pytest.mark.parametrize("text", ["1.5K", "0.0001k", "32kb", "k", "1e3", "lots"])
def test_bad_counts_are_usage_errors_naming_the_flag(
    text: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--max-model-len", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-model-len" in err and repr(text) in err


@pytest.mark.parametrize(("argv", "flag", "reason"), [
    (["serve", "m", "--quantization", "awq"], "--quantization", "unquantized"),
    (["serve", "m", "-q", "awq"], "-q", "unquantized"),
    (["serve", "m", "--quantization=fp8"], "--quantization", "unquantized"),
    (["serve", "m", "-pp", "2"], "-pp", "--tensor-parallel-size"),
    (["serve", "m", "--enable-lora"], "--enable-lora", "LoRA"),
    (["serve", "m", "--override-generation-config", "{}"], "--override-generation-config",
     "--generation-config FOLDER"),
    (["generate", "--config", "serve.yaml"], "--config", "only kvfit serve"),
    # kvfit serve's request log flags, which the other commands refuse.
    (["generate", "--enable-log-requests"], "--enable-log-requests", "only kvfit serve"),
    (["generate", "--no-disable-log-requests"], "--no-disable-log-requests", "kvfit serve"),
    (["generate", "--revision", "main"], "--revision", "local folder"),
    # Found by the hunt: these were argparse's bare 'unrecognized arguments'.
    (["serve", "m", "--hf-overrides", '{"a": 1}'], "--hf-overrides", "config.json"),
    (["serve", "m", "--structured-outputs-config", "{}"], "--structured-outputs-config",
     "structured output"),
    (["serve", "m", "--guided-decoding-backend", "xgrammar"], "--guided-decoding-backend",
     "structured output"),
    (["serve", "m", "--uds", "/tmp/s"], "--uds", "--host and --port"),
    (["serve", "m", "--middleware", "a.b"], "--middleware", "proxy"),
    (["serve", "m", "--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs", "TLS"),
    (["serve", "m", "--headless"], "--headless", "load balancer"),
    (["serve", "m", "-dpa", "10.0.0.1"], "-dpa", "load balancer"),
    (["serve", "m", "--enable-expert-parallel"], "--enable-expert-parallel", "expert"),
    (["serve", "m", "--max-cpu-loras", "2"], "--max-cpu-loras", "LoRA"),

    (["generate", "--enable-log-outputs"], "--enable-log-outputs", "only kvfit serve"),
    (["serve", "m", "--trust-request-chat-template"], "--trust-request-chat-template",
     "--chat-template"),
    (["serve", "m", "--tool-parser-plugin", "p.py"], "--tool-parser-plugin", "tool calling"),
    (["serve", "m", "--mm-processor-kwargs", "{}"], "--mm-processor-kwargs", "text-only"),
    (["serve", "m", "--otlp-traces-endpoint", "x:4317"], "--otlp-traces-endpoint", "/metrics"),
    (["generate", "--rope-scaling", "{}"], "--rope-scaling", "config.json"),
    (["serve", "m", "--disable-sliding-window"], "--disable-sliding-window", "--max-model-len"),
    (["serve", "m", "--max-num-partial-prefills", "2"], "--max-num-partial-prefills",
     "--max-num-batched-tokens"),
    # vLLM's JSON fields and optimization levels: they were unrecognized, not refused.
    (["serve", "m", "--hf-overrides.rope_theta", "1"], "--hf-overrides", "config.json"),
    (["serve", "m", "--speculative-config.method", "ngram"], "--speculative-config",
     "speculative"),
    (["serve", "m", "--compilation-config.cudagraph_capture_sizes+", "8"],
     "--compilation-config", "torch.compile"),
    (["serve", "m", "-O3"], "-O", "torch.compile"),
    (["serve", "m", "-O.level=3"], "-O", "torch.compile"),
    (["serve", "m", "-dcp", "2"], "-dcp", "context parallelism"),
    (["serve", "m", "--attention-backend", "FLASH_ATTN"], "--attention-backend", "kernels"),
    (["serve", "m", "--mamba-ssm-cache-dtype", "float32"], "--mamba-ssm-cache-dtype", "Mamba"),
    (["serve", "m", "--fingerprint-mode", "none"], "--fingerprint-mode", "system_fingerprint"),
    # Older vLLM command lines, still in many guides.
    (["serve", "m", "--speculative-model", "d"], "--speculative-model", "speculative"),
    (["serve", "m", "--num-scheduler-steps", "8"], "--num-scheduler-steps", "multi-step"),
    (["serve", "m", "--enable-reasoning"], "--enable-reasoning", "reasoning"),
])
def test_vllm_flags_kvfit_does_not_do_are_refused_by_name(
    argv: list[str], flag: str, reason: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if flag in line)
    assert "not supported" in line and reason in line


@pytest.mark.parametrize(("flag", "why"), [
    ("--trust-remote-code", "own code"), ("--enable-chunked-prefill", "chunks"),
    ("--no-trust-remote-code", "never runs"), ("--async-scheduling", "outputs are the same"),
    ("--aggregate-engine-logging", "one engine"),
    ("--disable-custom-all-reduce", "torch.distributed"), ("--disable-cascade-attn", "cascade"),
    ("--disable-hybrid-kv-cache-manager", "one kind"), ("--use-tqdm-on-load", "loading"),
    ("--no-enable-log-deltas", "whole as it ends"), ("--use-v2-block-manager", "one block"),
])
def test_vllm_flags_that_ask_for_what_kvfit_does_run_with_a_note(
    flag: str, why: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfit.server import serve

    ran = []
    monkeypatch.setattr(serve, "run_serve", lambda args: ran.append(args.model_tag) or 0)
    assert main(["serve", "m", *flag.split(), "--port", "0"]) == 0
    # Before MODEL too: a flag's value is not taken for the model.
    assert main(["serve", *flag.split(), "m"]) == 0
    assert ran == ["m", "m"]
    err = capsys.readouterr().err
    assert flag.split()[0] in err and why in err


def test_vllm_spellings_of_kvfit_flags(no_serving: None) -> None:
    """`--disable-frontend-multiprocessing` (the engine in the server's process),
    `--cudagraph-capture-sizes` (vLLM's newer name for --cuda-graph-sizes) and
    `--chat-template-content-format string` (what kvfit does) were unrecognized."""
    args = build_parser().parse_args(["serve", "m", "--disable-frontend-multiprocessing",
                                      "--cudagraph-capture-sizes", "1", "2",
                                      "--chat-template-content-format", "string"])
    assert (args.engine_process, args.cuda_graph_sizes) == (False, [1, 2])
    assert build_parser().parse_args(["serve", "m"]).engine_process is True


def test_disable_frontend_multiprocessing_with_api_servers_names_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfit.server import serve

    monkeypatch.setattr(serve, "missing_server_modules", lambda: [])
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "-asc", "2", "--disable-frontend-multiprocessing"])
    assert exit_info.value.code == 2
    assert "--disable-frontend-multiprocessing" in capsys.readouterr().err


def test_chat_template_content_format_openai_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--chat-template-content-format", "openai"])
    assert "--chat-template-content-format" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "policy"), [
    ([], "fcfs"), (["--scheduling-policy", "priority"], "priority"),
    (["--scheduling-policy=fcfs"], "fcfs")])
def test_scheduling_policy_is_an_engine_flag(argv: list[str], policy: str) -> None:
    """vLLM's `--scheduling-policy`: the flag was an unrecognized argument."""
    args = build_parser().parse_args(["serve", "m", *argv])
    assert EngineArgs.from_cli_args(args).scheduling_policy == policy


def test_an_unknown_scheduling_policy_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "m", "--scheduling-policy", "lifo"])
    assert e.value.code == 2 and "fcfs" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["vllm", "auto", "/some/folder"])
def test_generation_config_is_an_engine_flag(value: str) -> None:
    """`--generation-config` (vLLM's): where a request's unset sampling fields come from."""
    args = build_parser().parse_args(["serve", "m", "--generation-config", value])
    assert args.generation_config == value
    assert build_parser().parse_args(["serve", "m"]).generation_config == "auto"


def test_bench_serve_takes_vllm_bench_serve_flags() -> None:
    # `vllm bench serve --host H --port P --random-input-len ... --metric-percentiles ...`
    # stopped at 'the following arguments are required: --base-url'.
    from kvfit.commands.bench_serve import resolve_base_url

    args = build_parser().parse_args([
        "bench", "serve", "--host", "10.0.0.2", "--port", "9000", "--random-input-len", "64",
        "--random-output-len", "16", "--metric-percentiles", "50,90"])
    assert (args.input_len, args.output_len, args.percentiles) == (64, 16, [50.0, 90.0])
    assert resolve_base_url(args) == "http://10.0.0.2:9000"
    # vLLM's defaults: a server on this machine's port 8000.
    assert resolve_base_url(build_parser().parse_args(["bench", "serve"])) == \
        "http://127.0.0.1:8000"
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://h:1"])
    assert resolve_base_url(args) == "http://h:1"


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvfit serve` parses and checks its flags, then returns 0 instead of serving."""
    from kvfit.server import serve

    monkeypatch.setattr(serve, "run_serve", lambda args: 0)


def test_serve_refuses_a_model_swallowed_by_served_model_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_serving: None,
) -> None:
    # `--served-model-name` takes every word after it: the model folder became a second name
    # and the built-in default model was served under both, without a word.
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--served-model-name", "mine", str(tmp_path)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--served-model-name" in err and str(tmp_path) in err and "MODEL" in err


@pytest.mark.parametrize("model", ["kvfit-tiny", "qwen3-0.6b-shape", "org/cached"])
def test_serve_refuses_a_builtin_or_cached_model_swallowed_by_served_model_name(
    model: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], no_serving: None,
) -> None:
    # Only folders were caught: `--served-model-name mine kvfit-tiny` served kvfit-sotu.
    snapshot = tmp_path / "models--org--cached" / "snapshots" / "0" / "config.json"
    snapshot.parent.mkdir(parents=True)
    snapshot.write_text("{}")
    (tmp_path / "models--org--cached" / "refs").mkdir()
    (tmp_path / "models--org--cached" / "refs" / "main").write_text("0")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--served-model-name", "mine", model])
    assert exit_info.value.code == 2
    assert f"took the model {model!r}" in capsys.readouterr().err
    # The default model under its own name, or an uncached repo id, is a name.
    assert main(["serve", "--served-model-name", "kvfit-sotu", "org/elsewhere"]) == 0


@pytest.mark.parametrize("argv", [["--served-model-name", ""],
                                  ["m", "--served-model-name", "a", " "]])
def test_serve_refuses_an_empty_served_model_name(
    argv: list[str], capsys: pytest.CaptureFixture[str], no_serving: None,
) -> None:
    """An empty name (a variable that was not set, `--served-model-name "$NAME"`) is refused
    as such: not taken for a folder, nor served as a model no client can name."""
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--served-model-name: names may not be empty" in err and "folder" not in err


def test_serve_refuses_two_different_models(capsys: pytest.CaptureFixture[str],
                                            no_serving: None) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/models/a", "--model", "/models/b"])
    assert exit_info.value.code == 2
    assert "/models/a" in capsys.readouterr().err
    # One model named both ways, or names that are not folders, are fine.
    assert main(["serve", "/models/a", "--model", "/models/a"]) == 0
    assert main(["serve", "/models/a", "--served-model-name", "x", "y"]) == 0


@pytest.mark.parametrize("mode", ["serve", "throughput"])
def test_bench_takes_vllms_random_dataset_name(mode: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    # `vllm bench ... --dataset-name random`: the workload kvfit's benchmarks generate.
    args = build_parser().parse_args(["bench", mode, "--dataset-name", "random",
                                      "--random-input-len", "7", "--random-output-len", "3"])
    assert (args.dataset_name, args.input_len, args.output_len) == ("random", 7, 3)
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", mode, "--dataset-name", "sharegpt"])
    assert exit_info.value.code == 2
    assert "--dataset-name" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--enforce-eager", "--enable-sleep-mode", "--elastic-kv-cache",
                                  "--deterministic", "--batch-invariant",
                                  "--calculate-kv-scales"])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_switch_takes_vllms_no_form(command: str, flag: str) -> None:
    # vLLM makes every bool field --x / --no-x; these were store_true here, so a vLLM command
    # line with --no-enforce-eager stopped at "unrecognized arguments".
    dest = "deterministic" if flag == "--batch-invariant" else flag[2:].replace("-", "_")
    parser = build_parser()
    assert getattr(parser.parse_args([command, flag]), dest) is True
    assert getattr(parser.parse_args([command, flag, f"--no-{flag[2:]}"]), dest) is False
    assert getattr(parser.parse_args([command]), dest) is False


@pytest.mark.parametrize("value", ["pt", "gguf", "bitsandbytes"])
def test_a_vllm_load_format_kvfit_cannot_load_is_a_usage_error(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # It failed only after the port was bound and the engine began to load, without a word
    # of what to do.
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["serve", "m", "--load-format", value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--load-format" in err and repr(value) in err and "safetensors" in err
    assert build_parser().parse_args(["serve", "m", "--load-format", "dummy"]).load_format == \
        "dummy"


def test_llm_takes_and_refuses_the_new_vllm_arguments_as_the_command_line() -> None:
    """`LLM(...)` shares the tables: vLLM scripts' disable_custom_all_reduce=True (what kvfit
    does) is taken, hf_overrides refused with the reason, and either at a value that asks for
    nothing (None, False, "auto") is taken."""
    from kvfit.engine.llm import _without_vllm_noops

    assert _without_vllm_noops({"disable_custom_all_reduce": True, "async_scheduling": False,
                                "hf_overrides": None, "model_impl": "auto",
                                "enable_prompt_embeds": False}) == {}
    with pytest.raises(ValueError, match=r"hf_overrides=.*config\.json"):
        _without_vllm_noops({"hf_overrides": {"rope_theta": 1}})
    with pytest.raises(ValueError, match=r"structured_outputs_config=.*structured output"):
        _without_vllm_noops({"structured_outputs_config": {"backend": "xgrammar"}})


@pytest.mark.parametrize("flag", ["--allow-credentials", "--enable-prompt-tokens-details",
                                  "--disable-uvicorn-access-log", "--disable-fastapi-docs",
                                  "--enable-request-id-headers", "--return-tokens-as-token-ids",
                                  "--enable-force-include-usage"])
def test_every_server_switch_takes_vllms_no_form(flag: str) -> None:
    # vLLM makes its frontend's bool fields --x / --no-x too; --no-allow-credentials and
    # --no-enable-prompt-tokens-details stopped at "unrecognized arguments".
    dest = flag[2:].replace("-", "_")
    parser = build_parser()
    assert getattr(parser.parse_args(["serve", flag]), dest) is True
    assert getattr(parser.parse_args(["serve", flag, f"--no-{flag[2:]}"]), dest) is False
    assert getattr(parser.parse_args(["serve"]), dest) is False


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize(("flag", "value"), [
    ("--tokenizer-mode", "auto"), ("--task", "generate"), ("--runner", "generate"),
    ("--model-impl", "auto"), ("--preemption-mode", "recompute")])
def test_vllm_flags_at_values_that_ask_for_what_kvfit_does_are_taken(
        command: str, flag: str, value: str) -> None:
    """`--tokenizer-mode auto`, `--task generate`, ... (vLLM's defaults, spelt out in many
    guides) were refused as though they asked for something; before MODEL, their value was
    taken for the model."""
    build_parser().parse_args([command, flag, value])
    if command == "serve":
        assert build_parser().parse_args([command, flag, value, "m"]).model_tag == "m"


@pytest.mark.parametrize(("flag", "value", "reason"), [
    ("--tokenizer-mode", "mistral", "fast tokenizer"), ("--task", "embed", "generative"),
    ("--runner", "pooling", "generative"), ("--preemption-mode", "swap", "recomputing")])
def test_vllm_flags_at_other_values_are_refused_with_the_reason(
        flag: str, value: str, reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and repr(value) in err and "not supported" in err and reason in err


def test_llm_takes_vllm_arguments_at_values_that_ask_for_nothing() -> None:
    from kvfit.engine.llm import _without_vllm_noops

    assert _without_vllm_noops({"task": "generate", "tokenizer_mode": "hf",
                                "preemption_mode": "recompute"}) == {}
    with pytest.raises(ValueError, match="task='embed'.*generative"):
        _without_vllm_noops({"task": "embed"})


def test_flags_take_vllms_underscore_spelling(no_serving: None) -> None:
    """vLLM's parser takes `--max_model_len 4096` and `--max_num_seqs=8`; kvfit refused them
    as unrecognized arguments. Values keep their underscores."""
    from kvfit.cli import dashed_flags

    argv = dashed_flags(["serve", "--max_model_len", "4k", "--max_num_seqs=8",
                         "--served_model_name", "a_b", "--enable_prefix_caching"])
    args = build_parser().parse_args(argv)
    assert (args.max_model_len, args.max_num_seqs) == (4000, 8)
    assert (args.served_model_name, args.enable_prefix_caching) == (["a_b"], True)
    assert dashed_flags(["generate", "--", "--not_a_flag"])[-1] == "--not_a_flag"
    assert main(["serve", "m", "--max_model_len", "64"]) == 0


def test_refused_vllm_flags_are_refused_in_the_underscore_spelling(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--enable_lora"])
    assert exit_info.value.code == 2 and "--enable-lora" in capsys.readouterr().err
