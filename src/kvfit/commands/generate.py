"""`kvfit generate`: offline completions of prompts from flags, a file or stdin."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from kvfit.commands.common import (
    Subparsers,
    add_logging_args,
    add_sampling_args,
    build_llm,
    sampling_params_from_args,
    token_ids,
)
from kvfit.models.builtins import DEFAULT_MODEL

DEFAULT_PROMPTS = ("Hello, my name is", "The capital of France is", "The future of AI is")


def add_parser(sub: Subparsers) -> None:
    """Register `kvfit generate`."""
    from kvfit.engine.config import EngineArgs

    p = sub.add_parser(
        "generate", help=f"generate completions offline (default model: {DEFAULT_MODEL})",
        description="Generate completions offline. Prompts come from the arguments, --prompt, "
        "--prompt-token-ids and --input-file, else from stdin when it is piped, else three "
        "built-in examples.",
    )
    g = p.add_argument_group("input")
    g.add_argument("prompts", nargs="*", metavar="PROMPT",
                   help="text prompts; '-' reads prompts from stdin like --input-file -")
    g.add_argument("--prompt", action="append", help="a text prompt (repeatable)")
    g.add_argument("--prompt-token-ids", action="append", type=token_ids, metavar="IDS",
                   help="a prompt as comma-separated token ids (repeatable)")
    g.add_argument("--input-file", metavar="PATH",
                   help="prompts, one per line, or JSONL of {\"prompt\": ...} or "
                        "{\"prompt_token_ids\": [...]}; '-' reads stdin")
    o = p.add_argument_group("output")
    o.add_argument("--output-file", metavar="PATH",
                   help="also write one JSON object per prompt (prompt, token ids, outputs)")
    add_sampling_args(p)
    EngineArgs.add_cli_args(p)
    add_logging_args(p)
    p.set_defaults(func=run, model=DEFAULT_MODEL)


def parse_prompt_lines(lines: Iterable[str], source: str) -> list[str | dict[str, Any]]:
    """Prompts from text lines: a line that is a JSON object is a JSONL record (`prompt` or
    `prompt_token_ids`), any other line is a text prompt; blank lines are skipped."""
    prompts: list[str | dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        text = line.rstrip("\r\n")
        if not text.strip():
            continue
        if text.lstrip().startswith("{"):
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}:{number}: not valid JSON ({e.msg}); a JSONL line "
                                 f"is {{\"prompt\": \"...\"}}") from None
            # A record's other keys (max_tokens, ...) would be dropped unseen: sampling comes
            # from the flags, for every prompt.
            if unknown := sorted(set(record) - {"prompt", "prompt_token_ids"}):
                raise ValueError(f"{source}:{number}: unknown key {', '.join(map(repr, unknown))}"
                                 f"; a JSONL record holds \"prompt\" and/or "
                                 f"\"prompt_token_ids\", and sampling is set by the flags "
                                 f"(--max-tokens, --temperature, ...) for every prompt")
            if "prompt_token_ids" in record:
                # Both keys: the ids are generated from, the text is kept for the output.
                prompts.append({key: record[key] for key in ("prompt_token_ids", "prompt")
                                if key in record})
            elif isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            else:
                raise ValueError(f"{source}:{number}: a JSONL record needs a string \"prompt\" "
                                 f"or a \"prompt_token_ids\" list")
        else:
            prompts.append(text)
    return prompts


def _stdin_is_piped(stdin: IO[str] | None) -> bool:
    # A terminal is for `chat`, not `generate`; an unreadable stdin (closed, or a test
    # harness's placeholder) holds no prompts.
    return stdin is not None and not stdin.isatty() and stdin.readable()


def collect_prompts(args: argparse.Namespace) -> list[str | dict[str, Any]]:
    """The prompts of a `generate` invocation: token ids, then text (arguments, then
    --prompt), then the file (or stdin for `-`); stdin when none is given and it is piped."""
    prompts: list[str | dict[str, Any]] = [
        {"prompt_token_ids": ids} for ids in args.prompt_token_ids or []
    ]
    positional = [text for text in args.prompts if text != "-"]
    prompts += positional + (args.prompt or [])
    if "-" in args.prompts:
        if args.input_file not in (None, "-"):
            raise ValueError(f"the prompt '-' (stdin) and --input-file {args.input_file} both "
                             f"name a prompt source; give one")
        args.input_file = "-"
    if args.input_file == "-":
        prompts += parse_prompt_lines(sys.stdin, "<stdin>")
        if not prompts:  # asked for stdin's prompts: not the built-in examples instead
            source = "the prompt '-'" if "-" in args.prompts else "--input-file -"
            raise ValueError(f"{source}: stdin holds no prompts")
    elif args.input_file:
        path = Path(args.input_file)
        if path.is_dir():
            raise ValueError(f"--input-file {args.input_file} is a folder; pass a file of "
                             f"prompts (one per line, or JSONL)")
        if not path.is_file():
            raise ValueError(f"--input-file {args.input_file}: no such file")
        try:
            with path.open(encoding="utf-8") as f:
                prompts += parse_prompt_lines(f, str(path))
        except UnicodeDecodeError:
            raise ValueError(f"--input-file {args.input_file}: not UTF-8 text; save the "
                             f"prompts as UTF-8") from None
        except OSError as e:
            raise ValueError(f"--input-file {args.input_file}: cannot read it "
                             f"({e.strerror})") from None
        if not prompts:
            raise ValueError(f"--input-file {args.input_file}: holds no prompts")
    elif not prompts and _stdin_is_piped(sys.stdin):
        prompts = parse_prompt_lines(sys.stdin, "<stdin>")
    return prompts


def run(args: argparse.Namespace) -> int:
    """Generate for every prompt; print each, and write JSONL to --output-file if given."""
    prompts = collect_prompts(args)
    # Opened before the model loads: a path that cannot be written fails now, not after
    # every completion has been generated.
    with _open_output(args.output_file) as output_file:
        llm = build_llm(args)
        params = sampling_params_from_args(args, llm.config.model_config.sampling_defaults)
        tokenizer = llm.get_tokenizer()
        if not prompts:
            prompts = list(DEFAULT_PROMPTS) if tokenizer else [{"prompt_token_ids": [1]}]
        outputs = llm.generate(prompts, params)
        for out in outputs:
            prompt = out.prompt if out.prompt is not None else out.prompt_token_ids
            print(f"prompt: {prompt!r}")
            for completion in out.outputs:
                text = completion.text if tokenizer else completion.token_ids
                print(f"completion: {text!r} ({completion.finish_reason})")
            print()
        if output_file is not None:
            for out in outputs:
                record = {
                    "prompt": out.prompt, "prompt_token_ids": out.prompt_token_ids,
                    "outputs": [{"text": c.text, "token_ids": c.token_ids,
                                 "finish_reason": c.finish_reason} for c in out.outputs],
                }
                output_file.write(json.dumps(record) + "\n")
    return 0


def _open_output(path: str | None) -> IO[str] | contextlib.nullcontext[None]:
    """--output-file opened for writing (nothing for None); an error names the flag."""
    if path is None:
        return contextlib.nullcontext()
    try:
        return open(path, "w", encoding="utf-8")  # noqa: SIM115 - the caller's `with` closes it
    except OSError as e:
        raise ValueError(f"--output-file {path}: cannot write it ({e.strerror})") from None
