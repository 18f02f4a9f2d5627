"""`--help` of every command works, is grouped, and documents every flag; `serve` without
the server package says what to install."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator

import pytest

from kvfit.cli import build_parser, main

GROUPS = {
    (): ["COMMAND", "serve", "generate", "chat", "bench", "probe"],
    ("serve",): [],
    ("generate",): ["input:", "output:", "sampling:", "engine:", "logging:"],
    ("chat",): ["remote server:", "conversation:", "sampling:", "engine:", "logging:"],
    ("bench",): ["throughput", "latency", "serve"],
    ("bench", "throughput"): ["benchmark:", "engine:", "--num-prompts"],
    ("bench", "latency"): ["benchmark:", "engine:", "--num-iters"],
    ("bench", "serve"): ["server:", "workload:", "output:", "--max-concurrency", "--base-url"],
    ("probe",): ["--device"],
}


@pytest.mark.parametrize("command", list(GROUPS), ids=lambda c: " ".join(c) or "kvfit")
def test_help_shows_groups(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: kvfit {' '.join(command)}".rstrip())
    for text in GROUPS[command]:
        assert text in out


def _parsers(parser: argparse.ArgumentParser,
             path: str = "kvfit") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def test_every_flag_and_command_has_help() -> None:
    missing = []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{path} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
    assert not missing, f"flags without help: {missing}"


def test_serve_without_the_server_package_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "kvfit.server.serve", None)  # import raises ImportError
    assert main(["serve", "--model", "kvfit-tiny", "--port", "8000"]) == 1
    assert "pip install 'kvfit[server]'" in capsys.readouterr().err


def test_unknown_flags_are_still_errors(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["probe", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err


def _help_text(action: argparse.Action) -> str:
    return (action.help or "") % {**vars(action), "prog": "kvfit"}


def test_every_flag_with_a_default_names_it() -> None:
    # A flag that takes a value, or can be turned off, says what it is when not given; a
    # number it states is the one argparse uses.
    silent, wrong = [], []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.default in (None, argparse.SUPPRESS):
                continue
            takes_value = action.nargs != 0
            if not (takes_value or isinstance(action, argparse.BooleanOptionalAction)):
                continue  # store_true: off unless given
            text = _help_text(action)
            name = f"{path} {action.option_strings[0]}"
            if "default" not in text:
                silent.append(name)
            stated = re.search(r"default: (-?[\d.]+)\)", text)
            if stated and isinstance(action.default, (int, float)) and \
                    float(stated.group(1)) != float(action.default):
                wrong.append(f"{name}: says {stated.group(1)}, is {action.default}")
    assert not silent, f"flags whose help does not name the default: {silent}"
    assert not wrong, wrong


def test_seed_help_says_what_the_engine_seed_seeds() -> None:
    # Dummy weights are the same at every seed (`init_dummy`'s fixed seed, as vLLM's); the
    # help once listed them among what --seed seeds, so a user asking for other random weights
    # got the same model.
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if "--seed" in action.option_strings and path != "kvfit bench serve":
                text = _help_text(action)
                assert "requests without a seed" in text, (path, text)
                assert "dummy weights are the same at every seed" in text, (path, text)
