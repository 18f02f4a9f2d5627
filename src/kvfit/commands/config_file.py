"""`kvfit serve --config FILE.yaml`, as vLLM's: a YAML mapping of the command's flags, by long
name (`max-model-len` or `max_model_len`, the positional MODEL as `model`), to values. The
file's values take the place of the defaults, so a flag on the command line wins over the file
(vLLM's order: command line, file, defaults)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvfit.commands.common import check_vllm_flags
from kvfit.engine.vllm_compat import VLLM_NOOP_FLAGS, VLLM_UNSUPPORTED_FLAGS


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> None:
    """Make the values of the YAML file `path` `parser`'s defaults. A key that is no flag of
    `parser` is a usage error naming it; a vLLM flag kvfit refuses is refused in the words its
    flag gets, and one kvfit takes as a no-op noted, as on the command line."""
    where = f"--config {path}"
    tokens, dests = [], {}
    for key, value in _read(parser, path).items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        action = parser._option_string_actions.get(flag)
        if flag == "--config" or action is None or isinstance(action, argparse._HelpAction):
            _vllm_key(parser, where, key, flag, value)
            continue
        if action.dest in dests:
            parser.error(f"{where}: the keys {dests[action.dest]!r} and {key!r} set the same "
                         f"setting; keep one")
        dests[action.dest] = key
        tokens += _tokens(parser, where, key, flag, action, value)
    # Parsed as the command line is (types, choices), each error naming its flag.
    parser.exit_on_error = False
    try:
        namespace, rest = parser.parse_known_args(tokens)
    except argparse.ArgumentError as e:
        parser.error(f"{where}: {e}")
    finally:
        parser.exit_on_error = True
    if rest:  # an item of a list that reads as a flag
        parser.error(f"{where}: cannot take {' '.join(rest)!r}; check the values' types")
    # argparse runs a default that is a string through the flag's type again: the types of
    # kvfit's flags of text (--load-format, --root-path, ...) take their own output.
    parser.set_defaults(**{dest: getattr(namespace, dest) for dest in dests})


def _read(parser: argparse.ArgumentParser, path: str) -> dict[Any, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
    except OSError as e:
        parser.error(f"--config {path}: cannot read it: {e.strerror or e}")
    except yaml.YAMLError as e:
        parser.error(f"--config {path}: not valid YAML: {e}")
    if config is None:  # an empty file
        return {}
    if not isinstance(config, dict):
        parser.error(f"--config {path}: must be a mapping of flag names to values (e.g. "
                     f"'max-model-len: 4096'), got a YAML {type(config).__name__}")
    return config


def _tokens(parser: argparse.ArgumentParser, where: str, key: Any, flag: str,
            action: argparse.Action, value: Any) -> list[str]:
    """The command-line words for `key: value`, `flag` being the key's option of `action`."""
    if value is None:
        parser.error(f"{where}: {key!r} has no value")
    if action.nargs == 0:  # an on/off flag: true gives it, false its opposite, if any
        if not isinstance(value, bool):
            parser.error(f"{where}: {key!r} takes true or false, got {value!r}")
        if value:
            return [flag]
        opposite = ("--" + flag[5:]) if flag.startswith("--no-") else "--no-" + flag[2:]
        # A flag without an opposite (--disable-log-stats) left at its default.
        return [opposite] if opposite in parser._option_string_actions else []
    if action.nargs in (None, "?"):
        # One word, never read as a flag (a value may start with '-').
        return [f"{flag}={_word(value)}"]
    values = value if isinstance(value, list) else [value]
    return [flag, *map(_word, values)]


def _word(value: Any) -> str:
    """A YAML value as the command line spells it: a list or mapping as JSON, which the flags
    of one value that take one read (--allowed-origins, --default-chat-template-kwargs)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def _vllm_key(parser: argparse.ArgumentParser, where: str, key: Any, flag: str,
              value: Any) -> None:
    """A key naming no flag of `parser`: a vLLM flag kvfit refuses or takes as a no-op (the
    same refusal or note as its flag), else a usage error naming the key."""
    if flag == "--config":
        parser.error(f"{where}: a config file may not name another (key {key!r})")
    if isinstance(value, bool):
        # On/off vLLM flags: false asks for vLLM's default unless its opposite is known.
        word = flag if value else "--no-" + flag[2:]
        known = flag in VLLM_NOOP_FLAGS or flag in VLLM_UNSUPPORTED_FLAGS
        if word in VLLM_NOOP_FLAGS or word in VLLM_UNSUPPORTED_FLAGS:
            check_vllm_flags(parser, [word], where)
            return
        if known:
            return
    elif flag in VLLM_UNSUPPORTED_FLAGS:
        check_vllm_flags(parser, [flag], where)
    elif flag in VLLM_NOOP_FLAGS:
        parser.error(f"{where}: {key!r} takes true or false, got {value!r}")
    parser.error(f"{where}: unknown key {key!r}: {parser.prog} has no flag {flag} (its flags "
                 f"are listed by {parser.prog} --help)")
