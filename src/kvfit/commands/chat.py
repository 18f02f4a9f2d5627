"""`kvfit chat`: an interactive terminal chat, against a running OpenAI-compatible server
(`--url`, streamed) or a model loaded in this process."""

from __future__ import annotations

import argparse
import functools
import sys
import urllib.parse
from collections.abc import Callable, Iterator
from typing import IO, Any

from kvfit.commands.common import (
    SSE_DONE,
    Subparsers,
    add_logging_args,
    add_remote_args,
    add_sampling_args,
    auth_headers,
    build_llm,
    check_sampling_args,
    check_server_url,
    key_refused,
    parse_sse_line,
    sampling_overrides,
    sampling_params_from_args,
    sse_error,
)
from kvfit.models.builtins import DEFAULT_MODEL

Message = dict[str, str]
Reply = Callable[[list[Message], IO[str]], str]
"""Writes the assistant's reply to a conversation to the stream as it comes; returns it."""

HELP = "commands: /reset (forget the conversation), /exit or /quit (leave), /help"


def add_parser(sub: Subparsers) -> None:
    """Register `kvfit chat`."""
    from kvfit.engine.config import EngineArgs

    p = sub.add_parser(
        "chat", help="chat in the terminal with a running server or a local model",
        description="Chat in the terminal. With --url, talk to a running OpenAI-compatible "
        "server (streamed); without it, load --model in this process (the engine flags apply "
        "then). Reads one user turn per line; " + HELP + ". Works with piped stdin too. A "
        "failed turn is printed and the session goes on, but kvfit chat exits 1 if any turn "
        "failed (0 otherwise), so a script that pipes turns in can tell.",
    )
    r = p.add_argument_group("remote server")
    r.add_argument("--url", metavar="URL",
                   help="the server's API base, e.g. http://localhost:8000/v1 (a URL with no "
                   "path, http://localhost:8000, means its /v1)")
    add_remote_args(r)
    c = p.add_argument_group("conversation")
    c.add_argument("--system-prompt", default=None, help="a system message to start with")
    add_sampling_args(p, max_tokens=256, with_n=False)
    before = list(p._actions)
    EngineArgs.add_cli_args(p)
    # The engine's flags but --model load a model here: with --url the server's own apply.
    local_only = [a for a in p._actions if a not in before and a.dest != "model"]
    remote_only = [a for a in p._actions if a.dest in ("api_key", "request_timeout")]
    # --model also names the served model with --url; unset there, the server's first model.
    p.set_defaults(model=None, func=run,
                   check_args=functools.partial(check_chat_args, p, local_only, remote_only))
    for action in p._actions:
        if action.dest == "model":
            action.help = (f"the model to load (default: {DEFAULT_MODEL}), or with --url the "
                           "served model's name (default: the first of {url}/models)")
        if action.dest == "max_tokens":  # a server's model's file is not read from here
            action.help = ("most tokens to generate per reply (default: the model's "
                           "generation_config.json max_new_tokens, else 256; with --url the "
                           "server's default, what its context has left)")
    add_logging_args(p)


def check_chat_args(parser: argparse.ArgumentParser, local_only: list[argparse.Action],
                    remote_only: list[argparse.Action], args: argparse.Namespace) -> None:
    """The sampling flags (`check_sampling_args`), and no flag the chosen backend would
    ignore: an engine flag with --url (the server was started with its own), or --api-key or
    --request-timeout without it (no server to send them to). A usage error naming it."""
    check_sampling_args(parser, args)
    unused, why = ((local_only, "engine settings of a model loaded here, and --url loads "
                    "none (the server runs with its own); drop them")
                   if args.url else
                   (remote_only, "settings of a server given by --url, and none is given (the "
                    "model is loaded here); drop them or add --url"))
    # A flag without a default (argparse.SUPPRESS) is in the namespace only where given.
    given = [a for a in unused if getattr(args, a.dest, a.default) != a.default]
    if given:
        parser.error(f"{', '.join(a.option_strings[0] for a in given)}: {why}")


def iter_sse_data(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    """The JSON payloads of a server-sent-event stream's `data:` lines, up to `[DONE]`.
    An `{"error": ...}` payload raises RuntimeError with the server's message."""
    for line in lines:
        payload = parse_sse_line(line)
        if payload == SSE_DONE:
            return
        if isinstance(payload, dict):
            error = sse_error(payload)
            if error is not None:
                raise RuntimeError(error)
            yield payload


def remote_reply(args: argparse.Namespace) -> tuple[Reply, Callable[[], None]]:
    """A `Reply` over `POST {url}/chat/completions` with stream=true, and its closer."""
    try:
        import httpx
    except ImportError:
        raise SystemExit("kvfit chat --url needs httpx: pip install 'kvfit[server]'") from None
    check_server_url("--url", args.url)
    base = args.url.rstrip("/")
    if urllib.parse.urlsplit(base).path == "":
        base += "/v1"  # the server's root: OpenAI-compatible APIs live under /v1
    client = httpx.Client(base_url=base, headers=auth_headers(args), timeout=args.request_timeout)
    try:
        model = args.model or _first_model(client, base, args)
    except SystemExit:
        client.close()
        raise
    body_extra = sampling_overrides(args)

    def reply(messages: list[Message], out: IO[str]) -> str:
        body = {"model": model, "messages": messages, "stream": True, **body_extra}
        parts: list[str] = []
        try:
            with client.stream("POST", "/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise RuntimeError(f"HTTP {response.status_code} from {base}/chat/"
                                       f"completions: {response.text[:500]}")
                for payload in iter_sse_data(response.iter_lines()):
                    for choice in payload.get("choices") or []:
                        text = (choice.get("delta") or {}).get("content") or ""
                        parts.append(text)
                        out.write(text)
                        out.flush()
        except httpx.TransportError as e:  # unreachable, dropped, timed out: name the URL
            raise RuntimeError(f"the request to {base}/chat/completions failed "
                               f"({type(e).__name__}: {e}); check --url or --request-timeout"
                               ) from None
        return "".join(parts)

    return reply, client.close


def _first_model(client: Any, base: str, args: argparse.Namespace) -> str:
    try:
        response = client.get("/models")
        if refused := key_refused(f"{base}/models", response.status_code, args):
            raise SystemExit(refused)  # not a --url or --model matter: a 401 is the key
        response.raise_for_status()
        models = response.json().get("data") or []
    except SystemExit:
        raise
    except Exception as e:  # unreachable, not an OpenAI server, ...: say which URL failed
        raise SystemExit(f"cannot list the served models at {base}/models ({type(e).__name__}: "
                         f"{e}); check --url, or pass --model") from None
    if not models:
        raise SystemExit(f"{base}/models lists no models; pass --model")
    return models[0]["id"]


def local_reply(args: argparse.Namespace) -> tuple[Reply, Callable[[], None]]:
    """A `Reply` from a model loaded here with the engine flags (`LLM.chat`)."""
    if args.model is None:
        args.model = DEFAULT_MODEL
    llm = build_llm(args)
    params = sampling_params_from_args(args, llm.config.model_config.sampling_defaults)

    def reply(messages: list[Message], out: IO[str]) -> str:
        text = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        out.write(text)
        return text

    return reply, llm.shutdown


def read_turns(stdin: IO[str], prompt: str) -> Iterator[str]:
    """User turns: `input()` with a prompt on a terminal (line editing), plain lines else."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            try:
                line = input(prompt)
            except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C at the prompt: leave
                print()
                return
        else:
            line = stdin.readline()
            if not line:
                return
        yield line.rstrip("\r\n")


def chat_loop(reply: Reply, stdin: IO[str], out: IO[str],
              system_prompt: str | None = None) -> int:
    """Read turns until /exit or end of input; keep the history; a failed turn is reported
    and dropped from the history, and the loop goes on. The exit status: 1 if any turn
    failed, else 0 (with piped turns, printed errors alone would leave a script none the
    wiser)."""
    start: list[Message] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    history = list(start)
    failed = False
    for line in read_turns(stdin, "> "):
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            history = list(start)
            out.write("(conversation reset)\n")
            continue
        if text == "/help":
            out.write(HELP + "\n")
            continue
        history.append({"role": "user", "content": line})
        try:
            answer = reply(history, out)
        except Exception as e:  # a server error or a bad turn must not end the session
            history.pop()
            out.write(f"\nerror: {e}\n")
            failed = True
            continue
        out.write("\n")
        out.flush()
        history.append({"role": "assistant", "content": answer})
    return 1 if failed else 0


def run(args: argparse.Namespace) -> int:
    """Start the remote or local backend and chat on stdin/stdout."""
    reply, close = remote_reply(args) if args.url else local_reply(args)
    try:
        return chat_loop(reply, sys.stdin, sys.stdout, args.system_prompt)
    except KeyboardInterrupt:  # Ctrl-C during a reply ends the session without a traceback
        print("\n(interrupted)")
        return 130
    finally:
        close()
