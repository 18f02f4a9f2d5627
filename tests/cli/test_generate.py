"""`kvfit generate`: prompts from flags, a file (text or JSONL) and stdin; JSONL output;
startup progress and the KV cache table on stderr."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvfit
from kvfit.cli import main


def test_default_prompts_then_progress_and_kv_table_on_stderr(
    capsys: pytest.CaptureFixture[str], engine_flags: list[str],
) -> None:
    assert main(["generate", "--max-tokens", "3", *engine_flags]) == 0
    out, err = capsys.readouterr()
    assert out.count("prompt: ") == 3 and out.count("completion: ") == 3
    for stage in ("loading weights", "profiling", "warming up", "sizing the KV cache (measured)"):
        assert f"{stage}: done in" in err
    # The table comes after the stages, and stdout stays clean for piping.
    assert err.index("KV cache blocks") > err.index("warming up: done")
    assert "measured" in err and "KV cache blocks" not in out


def test_token_id_and_text_prompts_with_engine_flags(
    capsys: pytest.CaptureFixture[str], engine_flags: list[str],
) -> None:
    argv = ["generate", "--prompt-token-ids", "5,6,7", "--prompt", "hi", "--max-tokens", "2",
            "--ignore-eos", *engine_flags, "--num-gpu-blocks-override", "40",
            "--no-enable-prefix-caching", "--log-level", "warning"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    assert "prompt: [5, 6, 7]" in out and "prompt: 'hi'" in out
    assert out.count("(length)") == 2
    assert "KV cache blocks" not in err  # --log-level warning hides the info records


def test_input_file_text_and_jsonl_with_output_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], engine_flags: list[str],
) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text('first line\n\n{"prompt": "from json"}\n{"prompt_token_ids": [9, 8]}\n')
    result = tmp_path / "out.jsonl"
    argv = ["generate", "--input-file", str(prompts), "--output-file", str(result),
            "--max-tokens", "3", "--ignore-eos", *engine_flags]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt: 'first line'" in out and "prompt: 'from json'" in out
    assert "prompt: [9, 8]" in out
    records = [json.loads(line) for line in result.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["first line", "from json", None]
    assert records[2]["prompt_token_ids"] == [9, 8]
    assert all(len(r["outputs"][0]["token_ids"]) == 3 for r in records)
    assert all(r["outputs"][0]["finish_reason"] == "length" for r in records)


def test_positional_prompts_and_dash_for_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    engine_flags: list[str],
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("from stdin\n"))
    assert main(["generate", "first", "-", "--prompt", "flag", "--max-tokens", "2",
                 *engine_flags]) == 0
    out = capsys.readouterr().out
    order = [line for line in out.splitlines() if line.startswith("prompt: ")]
    assert order == ["prompt: 'first'", "prompt: 'flag'", "prompt: 'from stdin'"]


def test_input_file_dash_reads_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    engine_flags: list[str],
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("alpha\nbeta\n"))
    assert main(["generate", "--input-file", "-", "--max-tokens", "2", *engine_flags]) == 0
    out = capsys.readouterr().out
    assert "prompt: 'alpha'" in out and "prompt: 'beta'" in out and out.count("prompt: ") == 2


def test_piped_stdin_is_read_when_no_prompt_is_given(engine_flags: list[str]) -> None:
    # A real process with a real pipe (not a replaced sys.stdin), from this worktree's code.
    env = {**os.environ, "PYTHONPATH": str(Path(kvfit.__file__).parents[1])}
    result = subprocess.run(
        [sys.executable, "-m", "kvfit.cli", "generate", "--max-tokens", "2", *engine_flags],
        input="piped one\npiped two\n", capture_output=True, text=True, timeout=120, env=env,
    )
    assert result.returncode == 0, result.stderr
    assert "prompt: 'piped one'" in result.stdout and "prompt: 'piped two'" in result.stdout
    assert result.stdout.count("prompt: ") == 2
    assert "KV cache blocks" in result.stderr


@pytest.mark.parametrize(("content", "match"), [
    ('{"prompt": 5}\n', r"prompts\.txt:1: a JSONL record needs"),
    ('ok\n{"prompt": \n', r"prompts\.txt:2: not valid JSON"),
    ("\n\n", "holds no prompts"),
    # vLLM-like per-prompt settings were dropped unseen: sampling is the flags' business.
    ('{"prompt": "a", "max_tokens": 1}\n', r"prompts\.txt:1: unknown key 'max_tokens'"),
    ('ok\n{"prompt_token_ids": [1], "sampling_params": {}, "n": 2}\n',
     r"prompts\.txt:2: unknown key 'n', 'sampling_params'.*--max-tokens"),
])
def test_bad_input_file_names_the_line(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        main(["generate", "--input-file", str(path)])


def test_a_jsonl_record_with_text_and_ids_keeps_the_text(tmp_path: Path) -> None:
    from kvfit.commands.generate import parse_prompt_lines

    # The text was dropped: the output's "prompt" came out null.
    assert parse_prompt_lines(['{"prompt": "hi", "prompt_token_ids": [5, 6]}\n'], "f") == [
        {"prompt_token_ids": [5, 6], "prompt": "hi"}]


@pytest.mark.parametrize("argv", [["-"], ["--input-file", "-"]])
def test_stdin_asked_for_but_empty_is_an_error_not_the_examples(
    argv: list[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `kvfit generate - < empty` generated for the three built-in example prompts.
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n\n"))
    with pytest.raises(ValueError, match=r"(prompt .-.|--input-file -): stdin holds no prompts"):
        main(["generate", *argv])


def test_missing_input_file_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--input-file .*no such file"):
        main(["generate", "--input-file", str(tmp_path / "nope.txt")])
    with pytest.raises(ValueError, match="'-' .*and --input-file .* give one"):
        main(["generate", "-", "--input-file", str(tmp_path / "nope.txt")])



def test_an_input_file_that_is_a_folder_or_not_text_says_so(tmp_path: Path) -> None:
    # A folder was reported as 'no such file', and bytes that are not UTF-8 as a bare codec
    # error that named neither the file nor the flag.
    with pytest.raises(ValueError, match="--input-file .* is a folder"):
        main(["generate", "--input-file", str(tmp_path)])
    path = tmp_path / "prompts.bin"
    path.write_bytes(b"ok\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"--input-file .*prompts\.bin: not UTF-8 text"):
        main(["generate", "--input-file", str(path)])

def test_bad_flags_name_them(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="block_size"):
        main(["generate", "--block-size", "3", "--device", "cpu"])
    with pytest.raises(SystemExit):
        main(["generate", "--prompt-token-ids", "1,x"])
    assert "--prompt-token-ids takes comma-separated integers" in capsys.readouterr().err


def test_an_output_file_that_cannot_be_written_fails_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine_flags: list[str],
) -> None:
    # Found only after generating, it threw every completion away.
    import kvfit.commands.generate as generate

    def no_engine(args: object) -> None:
        raise AssertionError("the model loaded before --output-file was checked")

    monkeypatch.setattr(generate, "build_llm", no_engine)
    with pytest.raises(ValueError, match=r"--output-file .*missing.*No such file"):
        main(["generate", "hi", "--output-file", str(tmp_path / "missing" / "out.jsonl"),
              *engine_flags])


def test_max_tokens_left_unset_takes_the_models_max_new_tokens(
    tmp_path: Path, engine_flags: list[str],
) -> None:
    # --max-tokens' fixed default (32) used to win over generation_config.json's
    # max_new_tokens, which --generation-config says an unset field takes.
    (tmp_path / "generation_config.json").write_text('{"max_new_tokens": 3}')
    result = tmp_path / "out.jsonl"

    def tokens(*flags: str) -> int:
        assert main(["generate", "--prompt-token-ids", "5,6", "--ignore-eos",
                     "--generation-config", str(tmp_path), "--output-file", str(result),
                     *engine_flags, "--log-level", "error", *flags]) == 0
        (record,) = [json.loads(line) for line in result.read_text().splitlines()]
        return len(record["outputs"][0]["token_ids"])

    assert tokens() == 3
    assert tokens("--max-tokens", "5") == 5  # given, the flag wins
    assert tokens("--generation-config", "vllm") == 32  # no model default: the command's


def test_max_tokens_fallback_is_each_commands_own() -> None:
    from kvfit.cli import build_parser
    from kvfit.commands.common import sampling_overrides, sampling_params_from_args

    for command, fallback in (("generate", 32), ("chat", 256)):
        args = build_parser().parse_args([command])
        assert sampling_params_from_args(args).max_tokens == fallback
        assert sampling_params_from_args(args, {"max_tokens": 7}).max_tokens == 7
        args = build_parser().parse_args([command, "--max-tokens", "9"])
        assert sampling_params_from_args(args, {"max_tokens": 7}).max_tokens == 9
    # --url sends none unless given (vLLM's chat client sends none): a cap of 256 failed
    # every turn on a server whose context had less room left.
    assert "max_tokens" not in sampling_overrides(build_parser().parse_args(["chat"]))
    for given in ("16", "300"):  # 16, SamplingParams' default, is sent as well
        args = build_parser().parse_args(["chat", "--max-tokens", given])
        assert sampling_overrides(args)["max_tokens"] == int(given)
