"""`kvfit generate`: runs the built-in tiny model with no arguments and prints the results."""

from __future__ import annotations

import pytest

from kvfit.cli import main


def test_generate_prints_completions_and_the_kv_cache_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["generate", "--max-tokens", "3", "--max-num-batched-tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert out.count("prompt: ") == 3 and out.count("completion: ") == 3
    assert "KV cache blocks" in out and "measured" in out


def test_generate_token_id_prompts_and_engine_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt-token-ids", "5,6,7", "--prompt", "hi", "--max-tokens", "2",
            "--ignore-eos", "--num-gpu-blocks-override", "300", "--no-enable-prefix-caching"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt: [5, 6, 7]" in out and "prompt: 'hi'" in out
    assert "override" in out and "(length)" in out


def test_generate_bad_flag_names_it() -> None:
    with pytest.raises(ValueError, match="block_size"):
        main(["generate", "--block-size", "3"])
