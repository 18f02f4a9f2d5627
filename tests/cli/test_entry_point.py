"""The `kvfit` entry point as a new user runs it (`python -m kvfit`, in a subprocess): wrong
sampling flags are one-line usage errors before any model loads, `--version`, `probe`'s exit
status, vLLM's temperature default, and no progress-bar lines in a log."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvfit
from kvfit.cli import build_parser
from kvfit.engine.sampling_params import SamplingParams

SRC = Path(kvfit.__file__).parents[1]


def kvfit_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`python -m kvfit ARGS` from this worktree's sources, one torch thread."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "kvfit", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_bad_sampling_flag_is_one_line_exit_2_before_loading() -> None:
    # A model that does not exist: reaching the engine would fail differently.
    result = kvfit_cli("generate", "--model", "/no/such/model", "--max-tokens", "0")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "kvfit generate: error: argument --max-tokens: must be >= 1, got 0"]
    assert result.stdout == ""


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--temperature", "-1"], "argument --temperature: must be >= 0, got -1.0"),
    (["generate", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0.0"),
    (["generate", "--temperature", "nan"],
     "argument --temperature: must be a finite number, got nan"),
    (["generate", "--presence-penalty", "inf"],
     "argument --presence-penalty: must be a finite number, got inf"),
    (["chat", "--top-k", "-5"], "argument --top-k: must be -1 (off), 0 (off) or >= 1, got -5"),
])
def test_every_sampling_flag_is_checked_by_the_parser(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--model", "/no/such/model"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == f"kvfit {argv[0]}: error: {message}\n"


@pytest.mark.parametrize(("argv", "prog"), [
    (["generate", "--bogus"], "kvfit generate"),
    (["bench", "throughput", "--bogus"], "kvfit bench throughput"),
    (["probe", "--bogus"], "kvfit probe"),
])
def test_an_unknown_flag_shows_its_commands_usage(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str],
) -> None:
    from kvfit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: {prog} ")
    assert err.endswith(f"{prog}: error: unrecognized arguments: --bogus\n")


def test_version() -> None:
    result = kvfit_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"kvfit {kvfit.__version__}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="VMM may work on this machine's GPU")
def test_probe_exits_non_zero_with_the_reason_where_vmm_is_unusable() -> None:
    result = kvfit_cli("probe", "--device", "cuda")
    assert result.returncode == 1
    assert "vmm:     unavailable (" in result.stdout


# cpu:1 was probed as the CPU and reported usable, where the engine refuses it.
@pytest.mark.parametrize("device", ["nonsense", "cuda:x", "cpu:0:1", "cpu:1"])
def test_probe_with_a_device_that_is_no_device_is_a_usage_error(device: str) -> None:
    # It reported "vmm: unavailable" with torch's parse error and status 1.
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["probe", "--device", device])
    assert exit_info.value.code == 2


def test_probe_exits_zero_where_vmm_works() -> None:
    result = kvfit_cli("probe", "--device", "cpu")
    assert result.returncode == 0 and "vmm:     usable" in result.stdout


def test_temperature_default_is_vllms_and_the_help_says_so() -> None:
    from kvfit.commands.common import sampling_params_from_args

    for command in ("generate", "chat"):
        args = build_parser().parse_args([command])
        assert args.temperature is None  # the model's generation_config.json, else 1.0
        assert sampling_params_from_args(args).temperature == SamplingParams().temperature == 1.0
        assert sampling_params_from_args(args, {"temperature": 0.6}).temperature == 0.6
        args = build_parser().parse_args([command, "--temperature", "1.0"])
        assert sampling_params_from_args(args, {"temperature": 0.6}).temperature == 1.0
    help_text = " ".join(kvfit_cli("generate", "--help").stdout.split())
    assert ("0 is greedy (default: the model's generation_config.json, else 1.0, as vLLM"
            in help_text)


def test_no_progress_bar_lines_when_not_on_a_terminal() -> None:
    result = kvfit_cli("generate", "--device", "cpu", "--max-num-batched-tokens", "64",
                       "--max-num-seqs", "2", "--max-model-len", "64", "--max-tokens", "2",
                       "--prompt-token-ids", "5,6", "--log-level", "warning")
    assert result.returncode == 0, result.stderr
    assert "Generating" not in result.stderr and "it/s" not in result.stderr
    assert "prompt: [5, 6]" in result.stdout


def test_a_setting_error_is_one_line_not_a_traceback() -> None:
    result = kvfit_cli("generate", "--model", "Qwen/Qwen3-0.6B")
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith("kvfit: error: model 'Qwen/Qwen3-0.6B' is not a local folder")
    assert "hf download Qwen/Qwen3-0.6B" in line


def test_the_traceback_is_there_when_asked_for() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "KVFIT_TRACEBACK": "1"}
    result = subprocess.run([sys.executable, "-m", "kvfit", "generate", "--block-size", "3",
                             "--device", "cpu"], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "block_size must be a power of two" in result.stderr


ENGINE = ("--device", "cpu", "--max-num-batched-tokens", "128", "--max-num-seqs", "4",
          "--max-model-len", "128", "--log-level", "warning")


def test_output_to_a_closed_pipe_is_no_traceback() -> None:
    # `kvfit generate ... | head -1`: the reader leaves after the first line.
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfit", "generate", *ENGINE,
                             "--max-tokens", "1", *map(str, range(2000))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().startswith("prompt: ")
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141  # as a shell reports a process SIGPIPE ended
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_ctrl_c_exits_130_without_a_traceback() -> None:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvfit", "generate", *ENGINE[:-1], "info",
                             "--max-tokens", "100", "--ignore-eos", *map(str, range(500))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=env)
    lines = []
    for line in proc.stderr:  # generating once the KV cache table is out
        lines.append(line)
        if "blocks" in line:
            break
    proc.send_signal(signal.SIGINT)
    stderr = "".join(lines) + proc.stderr.read()
    assert proc.wait(timeout=60) == 130
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
