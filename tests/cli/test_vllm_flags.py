"""A vLLM user's `serve` / `generate` command lines: the flag spellings and values vLLM takes
parse the same here, and the vLLM flags kvfit does not do are refused by name."""

from __future__ import annotations

import pytest

from kvfit.cli import build_parser, main


@pytest.mark.parametrize(("text", "value"), [
    ("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 1_000_000),
    ("1M", 1 << 20), ("2G", 2 << 30),
])
@pytest.mark.parametrize("flag", ["--max-model-len", "--max-num-batched-tokens",
                                  "--kv-cache-memory-bytes"])
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
