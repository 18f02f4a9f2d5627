"""`kvfit serve --config FILE.yaml`, as vLLM's: the file's keys are the flags' long names, its
values take the place of the defaults, and the command line wins over them. It was refused
("there is no YAML config file")."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfit.cli import main
from kvfit.server import serve


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """The namespaces `kvfit serve` would have served with (it returns 0 instead)."""
    runs: list[argparse.Namespace] = []
    monkeypatch.setattr(serve, "run_serve", lambda args: runs.append(args) or 0)
    return runs


@pytest.fixture
def config(tmp_path: Path) -> Callable[[str], str]:
    def write(text: str) -> str:
        path = tmp_path / "serve.yaml"
        path.write_text(text)
        return str(path)

    return write


def test_the_files_values_are_the_flags_values(
        served: list[argparse.Namespace], config: Callable[[str], str]) -> None:
    path = config("""
model: /models/qwen
max-model-len: 32K             # vLLM's suffixes, as on the command line
max_num_seqs: 8                # underscores as dashes
port: 9000
served-model-name: [a, b]
enable-prefix-caching: false   # an on/off flag's opposite
enable-log-requests: true
max-log-len: 100
allowed-origins: ["http://localhost:3000"]
default-chat-template-kwargs: {enable_thinking: false}
shutdown-timeout: 2.5
disable-log-stats: true
""")
    assert main(["serve", "--config", path]) == 0
    (args,) = served
    assert (args.model_tag, args.model, args.max_model_len, args.max_num_seqs, args.port) == (
        None, "/models/qwen", 32768, 8, 9000)
    assert args.served_model_name == ["a", "b"]
    assert (args.enable_prefix_caching, args.enable_log_requests, args.max_log_len) == (
        False, True, 100)
    assert args.allowed_origins == ["http://localhost:3000"]
    assert args.default_chat_template_kwargs == {"enable_thinking": False}
    assert (args.shutdown_timeout, args.disable_log_stats) == (2.5, True)


@pytest.mark.parametrize(("line", "enabled"), [
    ("disable-log-requests: false", True), ("disable-log-requests: true", False),
    ("no-enable-log-requests: false", True), ("enable_log_requests: false", False),
])
def test_on_off_flags_take_either_spelling(
        line: str, enabled: bool, served: list[argparse.Namespace],
        config: Callable[[str], str]) -> None:
    """False gives the flag's opposite: vLLM's older `disable-log-requests: false` turns the
    request log on."""
    assert main(["serve", "--config", config(line + "\n")]) == 0
    assert served[0].enable_log_requests is enabled


def test_the_command_line_wins_over_the_file(
        served: list[argparse.Namespace], config: Callable[[str], str]) -> None:
    path = config("model: /models/qwen\nport: 9000\nenable-prefix-caching: false\n"
                  "enable-log-requests: true\nserved-model-name: [a, b]\n")
    # MODEL before and after the flag, as vLLM's `vllm serve SOME_MODEL --config FILE`.
    assert main(["serve", "/models/other", "--config", path, "--port", "8001",
                 "--enable-prefix-caching", "--no-enable-log-requests"]) == 0
    assert main(["serve", "--config", path, "--served-model-name", "c", "--model", "/m"]) == 0
    first, second = served
    assert (first.model_tag, first.port, first.enable_prefix_caching,
            first.enable_log_requests, first.served_model_name) == (
        "/models/other", 8001, True, False, ["a", "b"])
    assert (second.model, second.served_model_name, second.port) == ("/m", ["c"], 9000)


def test_an_unknown_key_is_a_usage_error_naming_it(
        served: list[argparse.Namespace], config: Callable[[str], str],
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", config("port: 9000\nmax-modle-len: 4096\n")])
    assert e.value.code == 2 and not served
    assert "unknown key 'max-modle-len'" in capsys.readouterr().err


@pytest.mark.parametrize(("line", "argv"), [
    ("quantization: awq", ["--quantization", "awq"]),
    ("enable-lora: true", ["--enable-lora"]),
    ("enable-chunked-prefill: false", ["--no-enable-chunked-prefill"]),
])
def test_a_key_kvfit_refuses_gets_its_flags_refusal(
        line: str, argv: list[str], served: list[argparse.Namespace],
        config: Callable[[str], str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", *argv])
    refusal = capsys.readouterr().err.strip().removeprefix("kvfit: error: ")
    path = config(line + "\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "m", "--config", path])
    assert e.value.code == 2 and not served
    assert capsys.readouterr().err.strip() == f"kvfit serve: error: --config {path}: {refusal}"


def test_a_vllm_key_kvfit_takes_anyway_is_noted(
        served: list[argparse.Namespace], config: Callable[[str], str],
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--config", config("trust-remote-code: true\nenable-lora: false\n")
                 ]) == 0
    assert served and "--trust-remote-code has no effect" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "words"), [
    ("port: lots\n", ["--port", "'lots'"]),
    ("enable-prefix-caching: 1\n", ["'enable-prefix-caching'", "true or false"]),
    ("port:\n", ["'port'", "no value"]),
    ("- port\n", ["mapping"]),
    ("port: [1\n", ["not valid YAML"]),
    ("config: other.yaml\n", ["may not name another"]),
])
def test_bad_files_are_usage_errors_saying_what_is_wrong(
        text: str, words: list[str], served: list[argparse.Namespace],
        config: Callable[[str], str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", config(text)])
    assert e.value.code == 2 and not served
    err = capsys.readouterr().err
    assert all(word in err for word in words), err


def test_two_spellings_of_one_flag_are_refused(
        served: list[argparse.Namespace], config: Callable[[str], str],
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--config", config("max-model-len: 1\nmax_model_len: 2\n")])
    assert "'max-model-len' and 'max_model_len'" in capsys.readouterr().err


def test_a_missing_file_is_named(served: list[argparse.Namespace], tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(tmp_path / "nope.yaml")])
    assert f"--config {tmp_path / 'nope.yaml'}: cannot read it" in capsys.readouterr().err


def test_other_commands_refuse_config(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["generate", "--config", "serve.yaml"])
    assert e.value.code == 2 and "only kvfit serve" in capsys.readouterr().err
