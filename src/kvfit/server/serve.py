"""`kvfit serve MODEL`: the OpenAI-compatible server on uvicorn.

Importing this module costs nothing beyond argparse: FastAPI, uvicorn and the engine load in
`run_serve`, so the CLI builds its parser (and runs other commands) without the `server` extra.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.util
import json
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvfit.engine.config import at_least_one
from kvfit.models.builtins import DEFAULT_MODEL

if TYPE_CHECKING:
    from kvfit.engine.config import EngineArgs
    from kvfit.server.async_llm import AsyncLLM
    from kvfit.server.openai_api import ServeConfig

SERVER_MODULES = ("fastapi", "uvicorn", "pydantic", "prometheus_client")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `serve` (every engine flag, plus the server's) on a CLI's subparsers."""
    from kvfit.engine.config import EngineArgs

    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve MODEL (a Hugging Face folder or a built-in name) over HTTP: "
        "/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, "
        "/health, /ping, /invocations, /metrics, /version; with "
        "KVFIT_SERVER_DEV_MODE=1 also /kv_cache, /kv_cache/resize, /reset_prefix_cache, "
        "/pause, /resume and /is_paused, and /sleep, /wake_up, /is_sleeping where "
        "--enable-sleep-mode is given too.")
    parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                        help=f"model folder or built-in name (the same as --model; default: "
                        f"{DEFAULT_MODEL})")
    parser.add_argument("--config", dest="config_file", metavar="FILE.yaml",
                        help="read flags from a YAML file mapping their long names to values "
                        "(e.g. 'max-model-len: 4096', 'enable-prefix-caching: true', the model "
                        "as 'model: FOLDER'), as vLLM's; flags on the command line win over it")
    EngineArgs.add_cli_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind (0.0.0.0 for every interface; default: "
                        "%(default)s)")
    server.add_argument("--port", type=port_number, default=8000,
                        help="port to listen on (0: any free one; default: %(default)s)")
    server.add_argument("--served-model-name", nargs="+", default=None,
                        help="names clients use for the model (default: MODEL); the first "
                        "is the one reported")
    env_key = os.environ.get("KVFIT_API_KEY")
    server.add_argument("--api-key", nargs="+", metavar="KEY",
                        default=None if env_key is None else [env_key],
                        help="require 'Authorization: Bearer KEY' (any of the keys given, as "
                        "vLLM takes several) on every route but /health and /ping (default: "
                        "$KVFIT_API_KEY; vLLM's $VLLM_API_KEY is not read)")
    for flag, what in (("--allowed-origins", "origins (e.g. '[\"http://localhost:3000\"]')"),
                       ("--allowed-methods", "HTTP methods"),
                       ("--allowed-headers", "request headers")):
        server.add_argument(flag, type=json_strings, default=["*"], metavar="JSON_LIST",
                            help=f"CORS: the {what} browsers may send cross-origin requests "
                            f"with, as a JSON list, as vLLM takes it (default: '[\"*\"]', any)")
    server.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="CORS: let browsers send cookies and credentials cross-origin "
                        "(default: off)")
    server.add_argument("--max-concurrent-requests", type=int, default=1024,
                        help="generation requests in progress at once; more get HTTP 503 "
                        "(0: unbounded; default: %(default)s)")
    server.add_argument("--max-request-body-bytes", type=int, default=64 << 20,
                        help="request bodies over this many bytes get HTTP 413 (0: unbounded; "
                        "default: %(default)s)")
    server.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="run the engine core in a process of its own, fed over a pipe, so "
                        "its steps never wait on HTTP work for the GIL (--no-engine-process: "
                        "on a thread of the server's process; default: --engine-process)")
    # vLLM's name for it: the engine in the API server's process.
    server.add_argument("--disable-frontend-multiprocessing", dest="engine_process",
                        action="store_false",
                        help="vLLM's spelling of --no-engine-process")
    server.add_argument("--api-server-count", "-asc", type=at_least_one("API server processes"),
                        default=1, metavar="N",
                        help="HTTP API server processes sharing the port in front of the one "
                        "engine process, so HTTP, SSE and text decoding use N GILs (needs "
                        "--engine-process; default: %(default)s)")
    server.add_argument("--stream-interval", type=at_least_one("tokens per streamed chunk"),
                        default=1, metavar="N",
                        help="new tokens a streamed request gathers before its next chunk is "
                        "sent (its first token and its end go at once); above 1, less server "
                        "work per token at many concurrent streams (default: %(default)s)")
    server.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="a Jinja chat template, as a file or inline, used for chat "
                        "requests instead of the tokenizer's own (default: the tokenizer's)")
    server.add_argument("--shutdown-timeout", type=seconds, default=0.0, metavar="SECONDS",
                        help="on SIGINT or SIGTERM, how long the generation requests in "
                        "progress may take to finish before they are aborted (new ones get "
                        "HTTP 503 meanwhile; 0: aborted at once; default: %(default)s)")
    server.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="report the prompt tokens served from the prefix cache or the KV "
                        "connector in the usage, as prompt_tokens_details.cached_tokens "
                        "(default: off)")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="do not print the engine's figures (queues, KV cache use, prefix "
                        "cache hits) every 10 s while it works")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's own log level (access and server logs; default: "
                        "%(default)s)")
    server.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction,
                        default=False, help="no uvicorn log line per request (default: off)")
    server.add_argument("--disable-access-log-for-endpoints", type=paths, default=[],
                        metavar="PATHS",
                        help="no uvicorn log line for requests to these paths, "
                        "comma-separated, e.g. /health,/metrics,/ping (default: none)")
    server.add_argument("--root-path", type=root_path, default="", metavar="PATH",
                        help="the path prefix a proxy serves this server under, e.g. /llm "
                        "(FastAPI's root_path: the docs' URLs carry it, and requests are "
                        "answered with the prefix or without it; default: none)")
    server.add_argument("--response-role", default="assistant", metavar="ROLE",
                        help="the role of a chat answer to a request with "
                        "add_generation_prompt (default: %(default)s)")
    server.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="do not serve /docs, /redoc and /openapi.json (default: off)")
    server.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="send an X-Request-Id header with every answer: the id its body "
                        "is named by (the client's X-Request-Id where it sends one; "
                        "default: off)")
    server.add_argument("--chat-template-content-format", choices=("auto", "string"),
                        default="auto",
                        help="how a message's content reaches the chat template: kvfit gives "
                        "it as one string (vLLM's 'string'; 'openai', a list of parts, is not "
                        "built; default: %(default)s, which is 'string' here)")
    server.add_argument("--return-tokens-as-token-ids", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="logprobs give each token as 'token_id:N' unless a request's "
                        "return_tokens_as_token_ids says otherwise (default: off)")
    server.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="every streamed answer ends with its usage, whatever its "
                        "stream_options ask (default: off)")
    server.add_argument("--default-chat-template-kwargs", type=json_object, default={},
                        metavar="JSON",
                        help="chat template variables for every chat request, under its own "
                        "chat_template_kwargs, e.g. '{\"enable_thinking\": false}' "
                        "(default: none)")
    server.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="log each generation request at INFO as it is queued (its id, "
                        "prompt tokens, sampling settings, prompt) and as it ends (finish "
                        "reason, output tokens) (default: off)")
    # vLLM's older spellings, its default then being on.
    server.add_argument("--disable-log-requests", dest="enable_log_requests",
                        action="store_false", help="vLLM's older spelling of "
                        "--no-enable-log-requests (kvfit's default)")
    server.add_argument("--no-disable-log-requests", dest="enable_log_requests",
                        action="store_true", help="vLLM's older spelling of "
                        "--enable-log-requests")
    server.add_argument("--enable-log-outputs", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="with --enable-log-requests, also log each completion's generated "
                        "text and token ids as its request ends (a stream's whole, at its "
                        "end) (default: off)")
    server.add_argument("--max-log-len", type=non_negative_int, default=None, metavar="N",
                        help="the most characters of a prompt or output (or token ids) "
                        "--enable-log-requests logs (0: none; default: all)")
    parser.set_defaults(func=run_serve, serve_parser=parser, model=DEFAULT_MODEL,
                        check_args=functools.partial(check_serve_args, parser))
    return parser


def check_serve_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Which model to serve, unambiguous before anything loads: MODEL and --model naming two,
    or a model folder taken in by --served-model-name (it takes every word after it, so
    `--served-model-name NAME FOLDER` would serve the default model), is a usage error."""
    default = parser.get_default("model")
    if args.enable_log_outputs and not args.enable_log_requests:
        # As vLLM: the outputs are logged by the request log, which would be off.
        parser.error("--enable-log-outputs needs --enable-log-requests (the outputs are "
                     "logged with the requests)")
    if args.default_chat_template_kwargs:
        from transformers import PreTrainedTokenizerBase

        from kvfit.engine.prompts import template_call_args

        # The template call's own arguments (tokenize, documents, ...) are no variables of it:
        # refused here, as a request's are, not in every chat request's answer.
        call_args = template_call_args(PreTrainedTokenizerBase.apply_chat_template)
        if clash := sorted(call_args & set(args.default_chat_template_kwargs)):
            parser.error(f"--default-chat-template-kwargs may not set {', '.join(clash)}: an "
                         f"argument of the template call, not a variable of the template")
    if any(not name.strip() for name in args.served_model_name or ()):
        # An empty name reads as a folder ('' is the working directory) below, and served, it
        # is a model no client can name.
        parser.error(f"--served-model-name: names may not be empty, got "
                     f"{args.served_model_name!r}")
    if args.model_tag and args.model not in (default, args.model_tag):
        parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} name two models; "
                     f"give one")
    if args.model_tag is None and args.model == default:
        # Both take every word after them; a key only past the first (a key may be anything).
        api_keys = args.api_key[1:] if isinstance(args.api_key, list) else []
        for flag, what, words in (("--served-model-name", "name", args.served_model_name),
                                  ("--api-key", "key", api_keys)):
            models = [n for n in words or () if _names_a_model(n, default)]
            if models:
                kind = "folder" if Path(models[0]).expanduser().is_dir() else "model"
                parser.error(f"{flag} took the {kind} {models[0]!r} as a {what} (it takes "
                             f"every word after it), and no MODEL is given: put MODEL before "
                             f"{flag}")


def _names_a_model(name: str, default: str) -> bool:
    """Whether `name` is a model kvfit would load (a folder, another built-in than the
    default, a repo id in the Hugging Face cache) rather than a name for one."""
    if Path(name).expanduser().is_dir():
        return True
    from kvfit.models.builtins import BUILTIN_MODELS

    if name in BUILTIN_MODELS:
        return name != default  # the default served under its own name is no mistake
    if name.count("/") == 1 and all(name.split("/")):
        from kvfit.models.loader import cached_snapshot

        return cached_snapshot(name) is not None
    return False


def non_negative_int(value: str) -> int:
    """An argparse type: a whole number >= 0."""
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {value!r}")
    return number


def seconds(value: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value!r}")
    return number


def root_path(value: str) -> str:
    """An argparse type: a URL path prefix, '' or '/...' without a trailing '/' (FastAPI
    would otherwise match no request under it)."""
    if value and not value.startswith("/"):
        raise argparse.ArgumentTypeError(f"must be a path starting with '/', e.g. '/llm', got "
                                         f"{value!r}")
    return value.rstrip("/")


def paths(value: str) -> list[str]:
    """An argparse type: comma-separated URL paths, each starting with '/'."""
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not all(item.startswith("/") for item in items):
        raise argparse.ArgumentTypeError(f"must be paths starting with '/', comma-separated, "
                                         f"e.g. '/health,/metrics', got {value!r}")
    return items


def json_strings(value: str) -> list[str]:
    """An argparse type: a JSON list of strings (vLLM's CORS flags take them so)."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings, e.g. '[\"http://localhost:3000\"]', got "
            f"{value!r}")
    return parsed


def json_object(value: str) -> dict[str, object]:
    """An argparse type: a JSON object."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(
            f"must be a JSON object, e.g. '{{\"enable_thinking\": false}}', got {value!r}")
    return parsed


def port_number(value: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (the socket layer would take 70000 as 4464)."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number in [0, 65535], got {value!r}")
    return port


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`'s text: the file it names, else the value itself when it reads as a
    Jinja template (braces or a line break), as vLLM takes it. Checked before the engine loads."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        raise ValueError(f"--chat-template {value!r} is a folder; pass the template file in it")
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not an inline Jinja "
                     f"template either; pass a template file or the template text")


def _event_loop_kinds() -> str:
    """Which event loop and HTTP parser uvicorn's "auto" picks here."""
    def have(name: str) -> bool:
        return importlib.util.find_spec(name) is not None

    return (f"{'uvloop' if have('uvloop') else 'asyncio'} loop, "
            f"{'httptools' if have('httptools') else 'h11'} HTTP")


def missing_server_modules() -> list[str]:
    """The `server` extra's modules that are not installed."""
    return [name for name in SERVER_MODULES if importlib.util.find_spec(name) is None]


DEV_MODE_ENV = "KVFIT_SERVER_DEV_MODE"
"""Set to 1 to serve the development routes (`/sleep`, `/wake_up`, `/is_sleeping` with sleep
mode; `/kv_cache`, `/kv_cache/resize`, `/reset_prefix_cache`, `/pause`, `/resume`,
`/is_paused`): any client of them can take the model or its memory away from every other, so
a flag alone does not turn them on."""


def sleep_endpoints(engine_args: EngineArgs) -> bool:
    """Whether to serve the sleep routes: sleep mode on and `KVFIT_SERVER_DEV_MODE=1`."""
    if not engine_args.enable_sleep_mode:
        return False
    if not dev_mode():
        print(f"kvfit serve: --enable-sleep-mode without {DEV_MODE_ENV}=1: the /sleep, "
              "/wake_up and /is_sleeping routes are off", file=sys.stderr, flush=True)
        return False
    return True


def dev_mode() -> bool:
    """Whether `KVFIT_SERVER_DEV_MODE=1`: the development routes (`/kv_cache`, `/pause`, and
    `/sleep` with sleep mode) are served."""
    return os.environ.get(DEV_MODE_ENV) == "1"


def server_api_key(args: argparse.Namespace) -> list[str] | None:
    """The keys clients may send (one of): `--api-key`, else $KVFIT_API_KEY. vLLM's
    $VLLM_API_KEY is not read, but set alone it means a server its owner expects locked:
    refused. So is an empty key (`--api-key "$KEY"` of an unset variable), which would serve
    without one."""
    keys = [args.api_key] if isinstance(args.api_key, str) else args.api_key
    if keys is not None and not all(key.strip() for key in keys):
        raise ValueError("--api-key (else $KVFIT_API_KEY) is empty, which would serve without "
                         "a key: pass the key, or leave both unset to serve without one")
    if keys:
        return keys
    if os.environ.get("VLLM_API_KEY"):
        raise ValueError("VLLM_API_KEY is set, but kvfit does not read it and would serve "
                         "without a key: pass --api-key or set KVFIT_API_KEY (or unset "
                         "VLLM_API_KEY to serve without one)")
    return None


def run_serve(args: argparse.Namespace) -> int:
    """Start the engine, print its KV cache sizing, and serve until interrupted."""
    missing = missing_server_modules()
    if missing:
        print(f"kvfit serve needs the server extra ({', '.join(missing)} missing): "
              f"pip install 'kvfit[server]'", file=sys.stderr)
        return 1
    server_api_key(args)  # before the engine loads
    if args.max_request_body_bytes < 0:
        print("--max-request-body-bytes must be >= 0 (0: unbounded)", file=sys.stderr)
        return 2
    if args.max_concurrent_requests < 0:
        print("--max-concurrent-requests must be >= 0 (0: unbounded)", file=sys.stderr)
        return 2
    num_api_servers = getattr(args, "api_server_count", 1)
    if num_api_servers > 1 and not args.engine_process:
        message = ("--api-server-count above 1 needs the engine in a process of its own: drop "
                   "--no-engine-process (vLLM's --disable-frontend-multiprocessing)")
        if getattr(args, "serve_parser", None) is not None:
            args.serve_parser.error(message)  # exits with status 2, as argparse does
        print(message, file=sys.stderr)
        return 2
    if num_api_servers > 1:
        return _run_api_servers(args, num_api_servers)
    from kvfit.engine.config import EngineArgs
    from kvfit.server.api_servers import bind_sockets, uvicorn_server
    from kvfit.server.async_llm import AsyncLLM
    from kvfit.server.openai_api import build_app

    if args.model_tag:
        args.model = args.model_tag
    engine_args = EngineArgs.from_cli_args(args)
    chat_template = load_chat_template(args.chat_template)  # a typo fails before the load
    try:
        # Before the engine loads (minutes for a large model): a port in use or a host that is
        # no address here fails at once, not after it. It listens once the engine is up.
        (sock,) = bind_sockets(args.host, args.port, 1, reuse_port=False)
    except OSError as e:
        print(f"kvfit serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    print(f"kvfit serve: loading {engine_args.model} and sizing the KV cache ...", flush=True)
    try:
        engine = AsyncLLM(engine_args, engine_process=args.engine_process,
                          stream_interval=args.stream_interval)
    except BaseException:
        sock.close()
        raise
    try:
        print(f"KV cache:\n{engine.kv_cache_report.format_table()}", flush=True)
        if not _listen(args, [sock]):
            return 1
        config = _serve_config(args, engine_args, chat_template)
        app = build_app(engine, config)
        server = uvicorn_server(app, args.uvicorn_log_level)
        died: list[BaseException] = []

        def engine_died(error: BaseException) -> None:
            died.append(error)
            server.should_exit = True  # polled by uvicorn's main loop: a clean exit

        engine.add_dead_callback(engine_died)
        where = "its own process" if args.engine_process else "a thread"
        print(f"kvfit serve: {', '.join(config.served_model_names)} on "
              f"http://{args.host}:{sock.getsockname()[1]}/v1 (engine in {where}; "
              f"{_event_loop_kinds()}; stream interval {args.stream_interval})",
              flush=True)
        _serve_logging_stats(args, engine,
                             lambda: _until_interrupted(lambda: server.run(sockets=[sock])))
    finally:
        engine.shutdown()
        sock.close()
    return _exit_status(died)


def _run_api_servers(args: argparse.Namespace, num_api_servers: int) -> int:
    """`run_serve` with `num_api_servers` API server processes (`api_servers`): this process
    is the first; it binds the port, starts the engine and the others, serves, and at the end
    stops the others, then the engine."""
    import shutil
    import tempfile

    from kvfit.server.api_servers import PROMETHEUS_MULTIPROC_ENV

    made_dir = None
    if not os.environ.get(PROMETHEUS_MULTIPROC_ENV):  # a folder of the user's own is kept
        if "prometheus_client" in sys.modules:
            print("kvfit serve: --api-server-count needs prometheus_client imported after "
                  f"{PROMETHEUS_MULTIPROC_ENV} is set", file=sys.stderr)
            return 1
        made_dir = tempfile.mkdtemp(prefix="kvfit-metrics-")
        os.environ[PROMETHEUS_MULTIPROC_ENV] = made_dir  # inherited by the spawned processes
    try:
        return _serve_api_servers(args, num_api_servers)
    finally:
        if made_dir is not None:
            shutil.rmtree(made_dir, ignore_errors=True)
            os.environ.pop(PROMETHEUS_MULTIPROC_ENV, None)


def _serve_api_servers(args: argparse.Namespace, num_api_servers: int) -> int:
    import functools
    import multiprocessing
    import signal

    from kvfit.engine.config import EngineArgs
    from kvfit.server.api_servers import (
        SHUTDOWN_CLOSE_S,
        ApiServerProcesses,
        ApiServerSpec,
        bind_sockets,
        uvicorn_server,
    )
    from kvfit.server.async_llm import AsyncLLM
    from kvfit.server.engine_client import EngineProcess
    from kvfit.server.openai_api import build_app

    if args.model_tag:
        args.model = args.model_tag
    engine_args = EngineArgs.from_cli_args(args)
    chat_template = load_chat_template(args.chat_template)  # a typo fails before the load
    try:
        # Before the engine loads: a port in use fails at once.
        sock, *other_sockets = bind_sockets(args.host, args.port, num_api_servers)
    except OSError as e:
        print(f"kvfit serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    print(f"kvfit serve: loading {engine_args.model} and sizing the KV cache ...", flush=True)
    try:
        engine = AsyncLLM(engine_args, stream_interval=args.stream_interval,
                          client=functools.partial(EngineProcess,
                                                   num_api_servers=num_api_servers))
    except BaseException:
        for s in (sock, *other_sockets):
            s.close()
        raise
    others = None
    died: list[BaseException] = []
    # From here on a Ctrl-C (or SIGTERM, which uvicorn re-raises once it has stopped; made a
    # KeyboardInterrupt here) stops the other API processes and the engine, not orphans them.
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        print(f"KV cache:\n{engine.kv_cache_report.format_table()}", flush=True)
        if not _listen(args, [sock, *other_sockets]):
            return 1
        config = _serve_config(args, engine_args, chat_template, multiprocess_metrics=True)
        if config.max_concurrent_requests is not None:
            # The bound is the server's: every API process counts its requests in progress
            # in this shared array (each its own entry), and checks their sum.
            config.admission_counts = multiprocessing.get_context("spawn").RawArray(
                "q", num_api_servers)
        spec = ApiServerSpec(engine_args, config, engine.engine_pid, args.stream_interval,
                             args.uvicorn_log_level)
        conns = engine.engine_client.api_server_conns
        engine.engine_client.api_server_conns = []  # theirs now
        # They drain as this one does (`uvicorn_server`), then are killed.
        others = ApiServerProcesses(conns, other_sockets, spec, stop_timeout_s=30.0 + (
            config.shutdown_timeout + 2 * SHUTDOWN_CLOSE_S))
        others.wait_ready()
        app = build_app(engine, config)
        # The others stop taking requests and drain as this one begins to, not after it.
        server = uvicorn_server(app, args.uvicorn_log_level, on_shutdown=others.begin_stop)

        def engine_died(error: BaseException) -> None:
            died.append(error)
            server.should_exit = True

        engine.add_dead_callback(engine_died)
        print(f"kvfit serve: {', '.join(config.served_model_names)} on "
              f"http://{args.host}:{sock.getsockname()[1]}/v1 ({num_api_servers} API server "
              f"processes, engine in its own process; {_event_loop_kinds()}; stream interval "
              f"{args.stream_interval})", flush=True)
        _serve_logging_stats(args, engine, lambda: server.run(sockets=[sock]))
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        if others is not None:
            others.stop()
        engine.shutdown()
        for s in (sock, *other_sockets):  # closed already where handed over
            s.close()
    return _exit_status(died)


def _listen(args: argparse.Namespace, sockets: list[socket.socket]) -> bool:
    """Listen on the port bound before the engine loaded; False (with the reason) when
    another process took it meanwhile."""
    from kvfit.server.api_servers import listen

    try:
        listen(sockets)
    except OSError as e:
        print(f"kvfit serve: cannot listen on {args.host}:{args.port}: {e} (another process "
              f"took the port while the engine loaded)", file=sys.stderr, flush=True)
        return False
    return True


def _serve_config(args: argparse.Namespace, engine_args: EngineArgs,
                  chat_template: str | None = None,
                  multiprocess_metrics: bool = False) -> ServeConfig:
    """The app's `ServeConfig` from `kvfit serve`'s flags (one API process or several)."""
    from kvfit.server.openai_api import ServeConfig

    return ServeConfig(
        served_model_names=args.served_model_name or [engine_args.model],
        api_key=server_api_key(args),
        max_concurrent_requests=args.max_concurrent_requests or None,
        max_request_body_bytes=args.max_request_body_bytes or None,
        root=engine_args.model,
        enable_sleep_endpoints=sleep_endpoints(engine_args),
        enable_kv_cache_endpoints=dev_mode(),
        enable_pause_endpoints=dev_mode(),
        multiprocess_metrics=multiprocess_metrics,
        chat_template=chat_template,
        shutdown_timeout=args.shutdown_timeout,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        root_path=args.root_path,
        response_role=args.response_role,
        disable_fastapi_docs=args.disable_fastapi_docs,
        enable_request_id_headers=args.enable_request_id_headers,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        disable_access_log_for_endpoints=args.disable_access_log_for_endpoints,
        enable_force_include_usage=args.enable_force_include_usage,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        enable_log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
        enable_log_outputs=args.enable_log_outputs,
    )


def _serve_logging_stats(args: argparse.Namespace, engine: AsyncLLM,
                         run: Callable[[], object]) -> None:
    """`run()` (uvicorn's serving) with the stats logger on unless `--disable-log-stats`."""
    # Startup's objects (modules, the tokenizer) live as long as the server: keep the
    # collector's full passes off them while requests stream.
    gc.collect()
    gc.freeze()
    from kvfit.server.stats_logger import StatsLogger

    stats = None if args.disable_log_stats else StatsLogger(engine).start()
    try:
        run()
    finally:
        if stats is not None:
            stats.stop()


def _until_interrupted(run: Callable[[], object]) -> None:
    """`run()` until it returns or a SIGINT or SIGTERM ends it. uvicorn re-raises the signal
    it stopped on once it has; a SIGTERM with its default action would then kill this process
    before it shuts the engine down: made a KeyboardInterrupt meanwhile, as SIGINT is."""
    import signal

    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            run()
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_status(died: list[BaseException]) -> int:
    """1 (with the reason) when the engine stopped under the server, else 0."""
    if died:
        print(f"kvfit serve: exiting, the engine stopped: {died[0]}", file=sys.stderr,
              flush=True)
        return 1
    return 0
