"""Pieces shared by the subcommands: sampling flags, logging, engine startup, statistics."""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import re
import sys
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvfit.engine.vllm_compat import VLLM_NOOP_FLAGS, VLLM_UNSUPPORTED_FLAGS

if TYPE_CHECKING:
    from kvfit.engine.llm import LLM
    from kvfit.engine.sampling_params import SamplingParams

Subparsers = argparse._SubParsersAction

LOG_LEVELS = ("debug", "info", "warning", "error")

# `--flag` -> SamplingParams field, for the flags `add_sampling_args` adds.
_SAMPLING_FIELDS = {
    "n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "min_p": "min_p", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "sampling_seed": "seed", "stop": "stop", "max_tokens": "max_tokens",
    "ignore_eos": "ignore_eos",
}

# The fields generation_config.json may set (`load_sampling_defaults`): their flags are unset
# unless given, so that the model's defaults apply.
_MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                         "max_tokens")


def add_sampling_args(parser: argparse.ArgumentParser, *, max_tokens: int = 32,
                      with_n: bool = True) -> None:
    """The `sampling` group: SamplingParams fields under vLLM's flag names and defaults.
    The flags are checked together, before any model loads (`check_args`)."""
    g = parser.add_argument_group("sampling")
    # Unset, a flag takes the model's generation_config.json default (--generation-config),
    # else SamplingParams' (--max-tokens: else the command's own, `default_max_tokens`).
    model = "the model's generation_config.json, else"
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens to generate per completion (default: the model's "
                   f"generation_config.json max_new_tokens, else {max_tokens})")
    g.add_argument("--temperature", type=float, default=None,
                   help=f"sampling temperature; 0 is greedy (default: {model} 1.0, as vLLM)")
    g.add_argument("--top-p", type=float, default=None,
                   help=f"nucleus filter; 1 is off (default: {model} 1)")
    g.add_argument("--top-k", type=int, default=None,
                   help=f"keep the k likeliest; -1 is off (default: {model} -1)")
    g.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens below min-p x the likeliest's probability; 0 is off "
                   f"(default: {model} 0)")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2]; 0, the default, is off")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2]; 0, the default, is off")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"> 1 discourages repeats; 1 is off (default: {model} 1)")
    if with_n:
        g.add_argument("--n", type=int, default=1,
                       help="completions per prompt (default: %(default)s)")
    g.add_argument("--stop", action="append", metavar="STRING",
                   help="a stop string (repeatable)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="per-request sampling seed; -1 is none, as in vLLM (default: none, the "
                   "engine's generator)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")
    parser.set_defaults(check_args=functools.partial(check_sampling_args, parser),
                        default_max_tokens=max_tokens)


def check_sampling_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Build the SamplingParams the flags describe; an invalid value is a usage error naming
    its flag (one line without the long usage, exit status 2 as argparse's), before any model
    loads."""
    try:
        sampling_params_from_args(args)
    except ValueError as e:
        message = str(e)
        for flag, field in _SAMPLING_FIELDS.items():
            prefix = f"SamplingParams.{field} "
            if message.startswith(prefix):
                message = f"argument --{flag.replace('_', '-')}: {message.removeprefix(prefix)}"
                break
        parser.exit(2, f"{parser.prog}: error: {message}\n")


def sampling_params_from_args(args: argparse.Namespace,
                              defaults: dict[str, Any] | None = None) -> SamplingParams:
    """A `SamplingParams` from the flags of `add_sampling_args`; a flag left unset takes
    `defaults` (the model's, `ModelConfig.sampling_defaults`), else SamplingParams' own."""
    from kvfit.engine.sampling_params import SamplingParams

    given = {field: getattr(args, flag) for flag, field in _SAMPLING_FIELDS.items()
             if hasattr(args, flag) and getattr(args, flag) is not None}
    # The command's own cap, under the model's max_new_tokens: vLLM's None (up to
    # max_model_len) is no default for a terminal.
    fallback = ({"max_tokens": args.default_max_tokens}
                if getattr(args, "default_max_tokens", None) is not None else {})
    return SamplingParams(**{**fallback, **(defaults or {}), **given})


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags given, as request-body fields (vLLM's names; the OpenAI ones plus
    vLLM's extras), for a remote server; those left unset take its model's defaults there.
    A flag with a fixed default is sent where it differs from SamplingParams'. `max_tokens`
    unset is not sent, as `vllm chat` sends none: the server's default is the room its
    context has left, where a cap of the client's own would fail every turn that has less."""
    from kvfit.engine.sampling_params import SamplingParams

    default = SamplingParams()
    body: dict[str, Any] = {}
    for flag, field in _SAMPLING_FIELDS.items():
        value = getattr(args, flag, None)
        if value is not None and (
                field in _MODEL_DEFAULT_FIELDS or value != getattr(default, field)):
            body[field] = value
    return body


def vllm_flag_name(arg: str) -> str:
    """The vLLM flag `arg` gives, in any of vLLM's spellings: `--flag=value`, a JSON flag's
    field (`--hf-overrides.rope_theta 1`, `--compilation-config.cudagraph_capture_sizes+ 8`)
    and the optimization level run together with `-O` (`-O3`, `-O.level=3`)."""
    name = arg.partition("=")[0]
    if name.startswith("--") or name.startswith("-O"):
        name = name.partition(".")[0]
    return "-O" if re.fullmatch(r"-O\d*", name) else name


def check_vllm_flags(parser: argparse.ArgumentParser, unknown: list[str],
                     source: str | None = None) -> list[str]:
    """`unknown` (what `parse_known_args` left) less the vLLM flags kvfit takes as no-ops
    (each noted on stderr); a vLLM flag kvfit does not do is a usage error (exit status 2)
    naming it and what to do instead. `source` says where the flags came from (a --config
    file), before the words."""
    rest = []
    where = "" if source is None else f"{source}: "
    for arg in unknown:
        name = vllm_flag_name(arg)
        if name in VLLM_UNSUPPORTED_FLAGS:
            parser.exit(2, f"{parser.prog}: error: {where}{name} (a vLLM flag) is not "
                        f"supported: {VLLM_UNSUPPORTED_FLAGS[name]}\n")
        if arg in VLLM_NOOP_FLAGS:
            print(f"{parser.prog}: note: {where}{arg} has no effect: {VLLM_NOOP_FLAGS[arg]}",
                  file=sys.stderr)
        else:
            rest.append(arg)
    return rest


def add_dataset_name_arg(group: argparse._ArgumentGroup) -> None:
    """`--dataset-name random`, as vLLM's benchmarks take it: the only workload here."""
    group.add_argument("--dataset-name", choices=("random",), default="random",
                       help="the prompts: random ones of --input-len, the only kind kvfit's "
                       "benchmarks generate (default: %(default)s)")

def add_logging_args(parser: argparse.ArgumentParser) -> None:
    """`--log-level`, in a group of its own."""
    g = parser.add_argument_group("logging")
    g.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                   help="kvfit's log level on stderr; startup progress and the KV cache table "
                        "are logged at info (default: %(default)s)")


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (it may be replaced after setup, as
    pytest's capture does), not the stream of the first call."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def setup_logging(level: str = "info") -> None:
    """Log kvfit's records (startup stages, the KV cache table, warnings) to stderr."""
    logger = logging.getLogger("kvfit")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s",
                                               datefmt="%H:%M:%S"))
        logger.addHandler(handler)
    logger.setLevel(level.upper())


def build_llm(args: argparse.Namespace) -> LLM:
    """Start an engine from the `engine` flags, logging its startup stages as it goes."""
    from kvfit.engine.config import EngineArgs
    from kvfit.engine.llm import LLM

    setup_logging(getattr(args, "log_level", "info"))
    return LLM(**vars(EngineArgs.from_cli_args(args)))


def percentiles(values: list[float], ps: list[float]) -> dict[str, float]:
    """`mean` and `p{p}` for each p of `values` (all 0.0 for no values, so a run in which
    every request failed still reports)."""
    import numpy as np

    if not values:
        return {"mean": 0.0, **{f"p{p:g}": 0.0 for p in ps}}
    arr = np.asarray(values, dtype=np.float64)
    return {"mean": float(arr.mean()), **{f"p{p:g}": float(np.percentile(arr, p)) for p in ps}}


def parse_percentiles(text: str) -> list[float]:
    """`--percentiles 50,90,99` -> [50.0, 90.0, 99.0], each in [0, 100]."""
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--percentiles takes numbers like 50,99; got {text!r}") from None
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"--percentiles must be in [0, 100]; got {text!r}")
    return ps


def token_ids(text: str) -> list[int]:
    """`--prompt-token-ids 5,6,7` -> [5, 6, 7]."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids takes comma-separated integers like 5,6,7; got {text!r}") from None


def format_table(title: str, rows: list[tuple[str, str]]) -> str:
    """A titled two-column table, labels left and values right (like vLLM's bench output)."""
    width = max(len(label) for label, _ in rows) + 2 + max(len(value) for _, value in rows)
    width = max(width, len(title) + 4)
    lines = [f" {title} ".center(width, "="),
             *(f"{label}{value:>{width - len(label)}}" for label, value in rows), "=" * width]
    return "\n".join(lines)


def check_writable(flag: str, path: str | None) -> None:
    """ValueError naming `flag` when the file `path` could not be written, so that a run
    whose results go there stops before it starts, not after (None: no file)."""
    if path is None:
        return
    target = Path(path).expanduser()
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder; pass a file path")
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: the folder {str(folder)!r} does not exist")
    if not os.access(target if target.exists() else folder, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot write it (permission denied)")


def write_json(path: str, result: dict[str, Any]) -> None:
    """Write a benchmark's result to `--result-file`."""
    import json

    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


SSE_DONE = "[DONE]"


def add_remote_args(group: argparse._ArgumentGroup) -> None:
    """`--api-key` and `--request-timeout`: how a command reaches a running server."""
    group.add_argument("--api-key", default=None,
                       help="sent as a bearer token (default: $OPENAI_API_KEY if set)")
    group.add_argument("--request-timeout", type=positive_seconds, default=600.0,
                       metavar="SECONDS",
                       help="per-request timeout (default: %(default)s)")


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0 (httpx takes 0 as "time out at once",
    aiohttp as "never")."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    """The `Authorization` header for `--api-key` (else $OPENAI_API_KEY), or none."""
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def check_server_url(flag: str, url: str) -> None:
    """ValueError naming `flag` unless `url` is an http(s)://host[:port] URL: `localhost:8000`
    reads as a URL of scheme "localhost", which an HTTP client refuses in words that do not say
    which flag to fix."""
    parts = urllib.parse.urlsplit(url)
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (
            parts.port or True)
    except ValueError:  # a port that is not a number
        valid = False
    if not valid:
        raise ValueError(f"{flag} must be an http(s)://host[:port] URL, got {url!r}")


def key_refused(url: str, status: int, args: argparse.Namespace) -> str | None:
    """What to say when `url` answered `status`: for 401 or 403 (the server wants a key, or
    another one), which setting sends the key; None for other statuses."""
    if status not in (401, 403):
        return None
    sent = args.api_key or os.environ.get("OPENAI_API_KEY")
    what = ("refused the API key sent (--api-key, else $OPENAI_API_KEY)" if sent else
            "wants an API key: pass --api-key (or set $OPENAI_API_KEY)")
    return f"HTTP {status} from {url}: the server {what}"


def parse_sse_line(line: str) -> dict[str, Any] | str | None:
    """One line of an OpenAI-style server-sent-event stream: the JSON payload of a `data:`
    line, `SSE_DONE` for `data: [DONE]`, None for anything else (blank separators, comments,
    `event:` lines). Raises ValueError for a payload that is not JSON."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == SSE_DONE:
        return SSE_DONE
    import json

    return json.loads(data)


def sse_error(payload: dict[str, Any]) -> str | None:
    """The message of an `{"error": ...}` payload (how servers report a failure mid-stream)."""
    error = payload.get("error")
    if error is None:
        return None
    return str(error.get("message", error)) if isinstance(error, dict) else str(error)


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment (plus `extra`) with this kvfit's source folder first on
    PYTHONPATH: a child Python process imports this kvfit, wherever it runs and whatever is
    installed."""
    src = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return env
