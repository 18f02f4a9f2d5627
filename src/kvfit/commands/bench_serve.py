"""`kvfit bench serve`: a load generator against a running OpenAI-compatible server.

Requests go to `/v1/completions` with `stream=true`, arrive as a Poisson process at
`--request-rate` (all at once when infinite) and are capped at `--max-concurrency` in flight.
Per request it records the time to the first content chunk (TTFT), the inter-token latency
(ITL), the end-to-end time (E2E) and the output tokens. Tokens are counted from the streamed
`usage` (`stream_options.continuous_usage_stats` asks for it on every chunk; without it, one
token per content chunk): a server may send several tokens in one chunk. ITL is per token: a
chunk carrying k tokens after a gap g adds k gaps of g/k (tokens in the first chunk beyond
its first are part of the TTFT and add none). A failed request (an HTTP error status, an
error event, a dropped connection, a stream without `[DONE]`) is counted with its reason; it
never stops the run. The load is spread over `--num-client-processes` processes (requests
dealt round-robin, each with its arrival time and a share of `--max-concurrency`) whose
results are merged, so the load generator's own CPU is not the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import os
import pickle
import random
import select
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.record import write_record
from kvfit.commands.common import (
    SSE_DONE,
    Subparsers,
    add_dataset_name_arg,
    add_remote_args,
    auth_headers,
    check_server_url,
    check_writable,
    child_env,
    format_table,
    key_refused,
    parse_percentiles,
    parse_sse_line,
    percentiles,
    sse_error,
)

# Common English words: text prompts with `--prompt-kind words` need no tokenizer or download.
_WORDS_TEXT = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
)
_WORDS = _WORDS_TEXT.split()
_DEFAULT_HOST, _DEFAULT_PORT = "127.0.0.1", 8000
# vLLM's bench serve backends that send streamed OpenAI completions, the requests sent here.
_BACKENDS = ("vllm", "openai")


def add_parser(sub: Subparsers) -> None:
    """Register `bench serve` under the `bench` subparsers."""
    p = sub.add_parser(
        "serve", help="load-test a running OpenAI-compatible server (TTFT, ITL, throughput)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default=None, metavar="URL",
                   help="the server's root, e.g. http://localhost:8000 (default: "
                   "http://HOST:PORT of --host and --port)")
    s.add_argument("--host", default=_DEFAULT_HOST,
                   help="the server's host when --base-url is not given (default: %(default)s)")
    s.add_argument("--port", type=int, default=_DEFAULT_PORT,
                   help="the server's port when --base-url is not given (default: %(default)s)")
    s.add_argument("--endpoint", default="/v1/completions",
                   help="the completions path (default: %(default)s)")
    s.add_argument("--model", default=None,
                   help="the served model's name (default: the first of /v1/models)")
    s.add_argument("--backend", default="openai",
                   help="the protocol spoken: vLLM's vllm and openai backends (streamed OpenAI "
                   "completions) are the only one kvfit's bench sends; others are refused "
                   "(default: %(default)s)")
    add_remote_args(s)
    w = p.add_argument_group("workload")
    add_dataset_name_arg(w)
    w.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send (default: %(default)s)")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second of a Poisson process; inf sends all at once "
                        "(default: %(default)s)")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    w.add_argument("--input-len", "--random-input-len", type=int, default=128,
                   help="prompt length in tokens (words with --prompt-kind words; default: "
                        "%(default)s)")
    w.add_argument("--output-len", "--random-output-len", type=int, default=128,
                   help="max_tokens per request; ignore_eos is sent so outputs have this length "
                        "(default: %(default)s)")
    w.add_argument("--ignore-eos", action="store_true",
                   help="taken for vLLM's command lines: ignore_eos is always sent")
    w.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="draw each request's input and output length uniformly from "
                        "[len x (1 - R), len x (1 + R)], so requests end at different steps "
                        "as real traffic does (default: %(default)s, every length exact)")
    w.add_argument("--prompt-kind", choices=("token-ids", "words"), default="token-ids",
                   help="random token ids (exact lengths) or random words (for servers that "
                        "take only text; default: %(default)s)")
    w.add_argument("--random-vocab-size", type=int, default=512, metavar="N",
                   help="token ids are drawn from [0, N); keep N within the served model's "
                        "vocabulary (default: %(default)s)")
    w.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature sent (default: %(default)s)")
    w.add_argument("--seed", type=int, default=0,
                   help="seeds the prompts and arrival times (default: %(default)s)")
    w.add_argument("--continuous-usage", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for stream_options.continuous_usage_stats (usage on every chunk, "
                        "to count the tokens of each); --no-continuous-usage for servers that "
                        "refuse the field (default: on)")
    w.add_argument("--num-client-processes", type=int, default=None, metavar="N",
                   help="processes sending the load, at most --max-concurrency (default: "
                        "min(4, CPUs, --num-prompts, --max-concurrency))")
    o = p.add_argument_group("output")
    o.add_argument("--percentiles", "--metric-percentiles", type=parse_percentiles,
                   default=[50.0, 99.0], metavar="P,P",
                   help="percentiles of TTFT, TPOT, ITL and E2E to report (default: 50,99)")
    o.add_argument("--result-file", metavar="PATH",
                   help="write the metrics as a JSON record (kvfit.benchmarks)")
    o.add_argument("--save-result", action="store_true",
                   help="write the record to --result-dir/--result-filename, as vLLM's bench "
                        "does (or name the file with --result-file)")
    o.add_argument("--result-dir", metavar="DIR",
                   help="with --save-result, the folder of the record, made if missing "
                        "(default: the current folder)")
    o.add_argument("--result-filename", metavar="NAME",
                   help="with --save-result, the record's file name (default: as vLLM's, "
                        "kvfit-{RATE}qps[-concurrency{N}]-{MODEL}-{YYYYmmdd-HHMMSS}.json)")
    o.add_argument("--save-detailed", action="store_true",
                   help="with --result-file or --save-result, also each request's figures "
                        "(TTFT, inter-token latencies, tokens, error): ~3 KB a request")
    o.add_argument("--limits-device", default="none", metavar="DEVICE",
                   help="for --result-file's record, measure the copy bandwidth and GEMM "
                        "throughput of this machine's DEVICE (cuda, or auto: CUDA where there "
                        "is one) before the load: only where the server's GPU is here and can "
                        "spare ~2.4 GiB for a moment, since a server sized from measured memory "
                        "keeps little free (bench/serving.py measures before its server "
                        "starts; default: %(default)s)")
    p.set_defaults(func=run)


Work = tuple[str | list[int], float, int]
"""`(prompt, arrival in seconds from the start, max_tokens)` of one request."""


@dataclass
class RequestResult:
    """One request's outcome; times in seconds from its send."""

    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2e: float = 0.0
    error: str | None = None


def lengths(length: int, ratio: float, n: int, rng: random.Random) -> list[int]:
    """`n` lengths drawn one after another, uniformly from [length x (1 - ratio), length x
    (1 + ratio)] (at least 1); all `length`, drawing nothing, when `ratio` is 0."""
    if not ratio:
        return [length] * n
    low, high = max(1, round(length * (1 - ratio))), max(1, round(length * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[str | list[int]]:
    """`--num-prompts` random prompts of `--input-len` token ids or words (lengths spread by
    `--random-range-ratio`), each drawn whole before the next: the first k prompts of a run
    are those of any longer run with the same seed."""
    prompts: list[str | list[int]] = []
    for _ in range(args.num_prompts):
        size = lengths(args.input_len, args.random_range_ratio, 1, rng)[0]
        if args.prompt_kind == "words":
            prompts.append(" ".join(rng.choice(_WORDS) for _ in range(size)))
        else:
            prompts.append([rng.randrange(args.random_vocab_size) for _ in range(size)])
    return prompts


def make_workload(args: argparse.Namespace) -> list[Work]:
    """`(prompt, arrival, max_tokens)` of every request from `--seed`: prompts, then arrival
    times, from one generator (a ratio of 0 sends what a run without the flag sends), output
    lengths from a second, so the first k prompts and output lengths of any run with that
    seed are the same (arrival times at a finite rate are not: they follow the prompts)."""
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng)
    arrivals = arrival_times(args, rng)
    outputs = lengths(args.output_len, args.random_range_ratio, args.num_prompts,
                      random.Random(f"{args.seed}:output-lengths"))
    return list(zip(prompts, arrivals, outputs, strict=True))


async def send_request(session: Any, url: str, body: dict[str, Any],
                       prompt_tokens: int) -> RequestResult:
    """POST one streamed completion and time its content chunks; every failure is returned
    as an error result, never raised."""
    result = RequestResult(prompt_tokens=prompt_tokens)
    start = time.perf_counter()
    chunks: list[tuple[float, int]] = []  # (arrival, tokens it carried) of content chunks
    usage_tokens = None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status}: {text[:200]}"
                return result
            done = False
            async for raw in response.content:  # one line per iteration
                payload = parse_sse_line(raw.decode())
                if payload == SSE_DONE:
                    done = True
                    break
                if not isinstance(payload, dict):
                    continue
                error = sse_error(payload)
                if error is not None:
                    result.error = f"error event: {error[:200]}"
                    return result
                counted, tokens = usage_tokens or 0, 1
                usage = payload.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                    if usage_tokens is not None:  # continuous usage: this chunk's tokens
                        tokens = max(1, usage_tokens - counted)
                choices = payload.get("choices") or []
                # A chunk of tokens whose text is held back (parts of one character) has
                # no text, but its continuous usage grew: it is content all the same.
                grew = bool(choices) and usage_tokens is not None and usage_tokens > counted
                if grew or any(choice.get("text") for choice in choices):
                    chunks.append((time.perf_counter(), tokens))
            if not done:
                result.error = "stream ended before [DONE]"
                return result
    except Exception as e:  # a dropped connection, a timeout, a malformed event: counted
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    if not chunks:
        result.error = "no content in the stream"
        return result
    result.ok = True
    result.ttft = chunks[0][0] - start
    result.itl = per_token_itl(chunks)
    result.output_tokens = usage_tokens if usage_tokens is not None else len(chunks)
    return result


def per_token_itl(chunks: list[tuple[float, int]]) -> list[float]:
    """Inter-token latencies of content chunks `(arrival, tokens)`: each chunk after the first
    spreads the gap since the one before evenly over its tokens."""
    itl: list[float] = []
    for (before, _), (at, tokens) in zip(chunks, chunks[1:], strict=False):
        itl += [(at - before) / tokens] * tokens
    return itl


def arrival_times(args: argparse.Namespace, rng: random.Random) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process at
    `--request-rate`, all at 0 when infinite."""
    times, t = [0.0], 0.0
    for _ in range(args.num_prompts - 1):
        if math.isfinite(args.request_rate):
            t += rng.expovariate(args.request_rate)
        times.append(t)
    return times


def request_body(args: argparse.Namespace, model: str, prompt: str | list[int],
                 max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": args.temperature, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True} | (
                {"continuous_usage_stats": True}
                if getattr(args, "continuous_usage", True) else {})}


async def run_load(args: argparse.Namespace, session: Any, model: str,
                   work: list[Work], max_concurrency: int | None,
                   start: float) -> tuple[list[RequestResult], float]:
    """Send each `(prompt, arrival, max_tokens)` of `work` at `start` (a `time.monotonic()`
    reading) + its arrival under the concurrency cap; the results in order and the monotonic
    time the last one ended."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    url = args.base_url.rstrip("/") + args.endpoint

    async def one(prompt: str | list[int], max_tokens: int) -> RequestResult:
        n = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        body = request_body(args, model, prompt, max_tokens)
        if limit is None:
            return await send_request(session, url, body, n)
        async with limit:
            return await send_request(session, url, body, n)

    tasks = []
    for prompt, arrival, max_tokens in work:
        if (wait := start + arrival - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
    results = await asyncio.gather(*tasks)
    return list(results), time.monotonic()


def summarize(results: list[RequestResult], duration: float,
              ps: list[float]) -> dict[str, Any]:
    """Throughput and latency statistics (milliseconds) over the successful requests, and the
    failures by reason."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    # Time per output token after the first, per request: the decode speed a user sees.
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    metrics: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration
        if duration > 0 else 0.0,
        "errors": dict(Counter(r.error for r in results if not r.ok)),
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots),
                         ("itl", [gap for r in ok for gap in r.itl]),
                         ("e2el", [r.e2e for r in ok])):
        for stat, value in percentiles(values, ps).items():
            metrics[f"{stat}_{name}_ms"] = value * 1000
    return metrics


def format_metrics(metrics: dict[str, Any], ps: list[float]) -> str:
    """The metrics as vLLM-style result table."""
    rows = [
        ("Successful requests:", f"{metrics['completed']}"),
        ("Failed requests:", f"{metrics['failed']}"),
        ("Benchmark duration (s):", f"{metrics['duration_s']:.2f}"),
        ("Total input tokens:", f"{metrics['total_input_tokens']}"),
        ("Total generated tokens:", f"{metrics['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{metrics['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{metrics['total_token_throughput']:.2f}"),
    ]
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E")):
        for stat in ("mean", *(f"p{p:g}" for p in ps)):
            rows.append((f"{stat.capitalize()} {label} (ms):",
                         f"{metrics[f'{stat}_{name}_ms']:.2f}"))
    table = format_table("Serving Benchmark Result", rows)
    return table + "".join(f"\n{line}" for line in failure_lines(metrics["errors"]))


def failure_lines(errors: dict[str, int], most: int = 10) -> list[str]:
    """`failed xN: reason` for the `most` commonest reasons, then one line for the rest (a
    reason that names its value, such as a bad token id, can differ for every request)."""
    ranked = sorted(errors.items(), key=lambda item: -item[1])
    lines = [f"failed x{count}: {reason}" for reason, count in ranked[:most]]
    if rest := ranked[most:]:
        lines.append(f"failed x{sum(c for _, c in rest)}: {len(rest)} other reasons "
                     f"(all of them in --result-file)")
    return lines


def resolve_base_url(args: argparse.Namespace) -> str:
    """`--base-url`, else `http://HOST:PORT` from `--host` and `--port` (as vLLM's bench
    builds it)."""
    if args.base_url:  # callers that build their own Namespace (bench/serving.py) set only it
        return args.base_url
    host = f"[{args.host}]" if ":" in args.host else args.host  # an IPv6 address
    return f"http://{host}:{args.port}"


def _check_args(args: argparse.Namespace) -> None:
    # Callers that build their own Namespace (bench/serving.py) set base_url, not host/port.
    host, port = getattr(args, "host", _DEFAULT_HOST), getattr(args, "port", _DEFAULT_PORT)
    if args.base_url and (host, port) != (_DEFAULT_HOST, _DEFAULT_PORT):
        raise ValueError(f"--base-url {args.base_url} names the server, so --host and --port "
                         f"would be ignored; give one or the other")
    if not args.base_url and not 1 <= port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {port}")
    args.base_url = resolve_base_url(args)
    check_server_url("--base-url", args.base_url)
    if not args.endpoint.startswith("/"):
        # Joined to the server's root as written: http://host:8000v1/completions.
        raise ValueError(f"--endpoint must be a path starting with '/', like /v1/completions; "
                         f"got {args.endpoint!r}")
    backend = getattr(args, "backend", "openai")
    if backend not in _BACKENDS:
        # vLLM's others speak chat, TGI's, TensorRT-LLM's or DeepSpeed-MII's protocols; a
        # server that also speaks OpenAI completions is measured with --backend openai.
        raise ValueError(f"--backend {backend}: kvfit's bench serve sends streamed OpenAI "
                         f"completions requests only ({' or '.join(_BACKENDS)}, as vLLM's "
                         f"backends of that protocol); for a server that takes them, pass "
                         f"--backend openai")
    if args.endpoint.rstrip("/").endswith("chat/completions"):
        # vLLM's bench takes it with --backend openai-chat; these requests hold a `prompt`,
        # which a chat route refuses: every request would fail with a 400.
        raise ValueError(f"--endpoint {args.endpoint}: bench serve sends completions requests "
                         f"(a prompt, not chat messages), which a chat route refuses; use a "
                         f"completions path such as /v1/completions")
    result_file = getattr(args, "result_file", None)
    save = getattr(args, "save_result", False)
    if save and result_file is not None:
        raise ValueError("--save-result and --result-file both name where the record goes; "
                         "give one")
    for flag, value in (("--result-dir", getattr(args, "result_dir", None)),
                        ("--result-filename", getattr(args, "result_filename", None))):
        if value is not None and not save:
            # vLLM ignores them without --save-result: a run whose record went nowhere.
            raise ValueError(f"{flag} names where --save-result writes the record, and "
                             f"--save-result is not given; add it (or pass --result-file PATH)")
    for flag, given in (("--save-detailed", getattr(args, "save_detailed", False)),
                        ("--limits-device", getattr(args, "limits_device", "none") != "none")):
        if given and result_file is None and not save:
            raise ValueError(f"{flag} adds to --result-file's record, and no --result-file "
                             f"(or --save-result) is given; add one or drop {flag}")
    for name in ("num_prompts", "input_len", "output_len", "random_vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), "
                         f"got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.num_client_processes is not None and args.num_client_processes < 1:
        raise ValueError(f"--num-client-processes must be >= 1, got {args.num_client_processes}")
    if (args.num_client_processes or 0) > (args.max_concurrency or math.inf):
        # Each process takes a share of --max-concurrency: one with none would send its
        # requests with no limit at all.
        raise ValueError(f"--num-client-processes {args.num_client_processes} is more than "
                         f"--max-concurrency {args.max_concurrency}, which each process takes "
                         f"a share of; lower --num-client-processes to at most "
                         f"{args.max_concurrency}")
    check_writable("--result-file", result_file)
    if save:
        _check_result_dir(args)


def _check_result_dir(args: argparse.Namespace) -> None:
    """`--save-result`'s folder made (as vLLM's bench makes it) and writable, and a named
    `--result-filename` writable there, before the load rather than after it."""
    folder = Path(args.result_dir or ".").expanduser()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--result-dir {args.result_dir}: cannot make it ({e.strerror})") from None
    if args.result_filename is not None:
        if Path(args.result_filename).name != args.result_filename:
            raise ValueError(f"--result-filename must be a file name, got "
                             f"{args.result_filename!r}; put the folder in --result-dir")
        check_writable("--result-filename", str(folder / args.result_filename))
    elif not os.access(folder, os.W_OK):
        raise ValueError(f"--result-dir {folder}: cannot write it (permission denied)")


def result_path(args: argparse.Namespace, model: str) -> str | None:
    """Where the record goes: `--result-file`, else with `--save-result` `--result-dir` /
    `--result-filename`, by default named as vLLM's bench names it (its backend label is
    kvfit here); None for no record."""
    if args.result_file or not getattr(args, "save_result", False):
        return args.result_file
    name = args.result_filename
    if name is None:
        concurrency = (f"-concurrency{args.max_concurrency}"
                       if args.max_concurrency is not None else "")
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = (f"kvfit-{args.request_rate:g}qps{concurrency}-{model.split('/')[-1]}-"
                f"{stamp}.json")
    return str(Path(args.result_dir or ".").expanduser() / name)


def _session(args: argparse.Namespace, connections: int) -> Any:
    """An aiohttp session with `connections` connections to the server. aiohttp, as `vllm
    bench serve` uses: its C parsers spend ~11 us of CPU per streamed chunk where httpx spent
    ~64 us (dev machine), which at tens of thousands of tokens/s made the load generator the
    limit of the server it measured."""
    import aiohttp

    return aiohttp.ClientSession(
        headers=auth_headers(args), connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=args.request_timeout),
        read_bufsize=1 << 20)  # an event line may outgrow aiohttp's 64 KiB (logprobs)


def num_client_processes(args: argparse.Namespace) -> int:
    """`--num-client-processes`, else as many as help: at most 4, the CPUs, the requests and
    `--max-concurrency` (each process takes a share of it, at least one slot)."""
    n = getattr(args, "num_client_processes", None)
    return n if n is not None else min(4, os.cpu_count() or 1, args.num_prompts,
                                       args.max_concurrency or args.num_prompts)


def _shares(total: int | None, n: int) -> list[int | None]:
    """`--max-concurrency` split over `n` processes (None: no limit in any)."""
    if total is None:
        return [None] * n
    return [total // n + (k < total % n) for k in range(n)]


_WORKER = "from kvfit.commands.bench_serve import worker_main; worker_main()"
_READY, _GO = b"R", b"G"
_START_TIMEOUT_S = 120.0


def worker_main() -> None:
    """A client process's main (`_run_processes`): read `(args, model, work,
    max_concurrency)` pickled on stdin, open the client, write `_READY`, wait for `_GO`, run the
    load and write `(results, start, end, cpu, error)` pickled to stdout. Anything else the
    process prints goes to stderr, so nothing can corrupt the reply."""
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    args, model, work, max_concurrency = pickle.load(sys.stdin.buffer)

    async def go() -> tuple[list[RequestResult], float, float, float]:
        async with _session(args, max_concurrency or len(work)) as session:
            reply.write(_READY)
            reply.flush()
            if sys.stdin.buffer.read(1) != _GO:
                raise RuntimeError("the load was called off before it started")
            start, cpu = time.monotonic(), time.process_time()
            out, end = await run_load(args, session, model, work, max_concurrency, start)
            return out, start, end, time.process_time() - cpu

    try:
        out, start, end, cpu = asyncio.run(go())
        message = ([asdict(r) for r in out], start, end, cpu, None)
    except BaseException as e:  # reported, so the parent counts its requests as failed
        message = (None, 0.0, 0.0, 0.0, f"{type(e).__name__}: {e}"[:200])
    pickle.dump(message, reply)
    reply.close()


def _run_processes(args: argparse.Namespace, model: str,
                   work: list[Work], n: int
                   ) -> tuple[list[RequestResult], float, float]:
    """The load over `n` client processes, request `i` in process `i % n`, all started
    together once each is ready; the merged results in request order, the wall time from the
    first start to the last end and the CPU seconds the processes spent on the load.

    Each client is `python -c` importing this module alone, never multiprocessing's child:
    that imports the caller's main module first (for bench/serving.py torch, the engine and
    transformers), which took ~18 s of CPU per child on the H200 host, one after another."""
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=child_env()) for _ in range(n)]
    try:
        for k, (proc, share) in enumerate(zip(procs, _shares(args.max_concurrency, n),
                                              strict=True)):
            with contextlib.suppress(OSError):  # one that died is reported below
                pickle.dump((args, model, work[k::n], share), proc.stdin)
                proc.stdin.flush()
        first = _wait_ready(procs, time.monotonic() + _START_TIMEOUT_S)
        ready = all(byte == _READY for byte in first)
        for proc, byte in zip(procs, first, strict=True):
            with contextlib.suppress(OSError):
                if ready:
                    proc.stdin.write(_GO)
                proc.stdin.close()  # a ready client not told to go stops with an error
            if byte is None:  # silent past the deadline: stop it
                proc.kill()
        parts = [_reply(proc, byte, len(work[k::n]))
                 for k, (proc, byte) in enumerate(zip(procs, first, strict=True))]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    results: list[RequestResult] = [RequestResult()] * len(work)
    for k, (rows, _, _, _) in enumerate(parts):
        results[k::n] = rows
    starts = [p[1] for p in parts if math.isfinite(p[1])]
    ends = [p[2] for p in parts if math.isfinite(p[2])]
    cpu = sum(p[3] for p in parts)
    return results, (max(ends) - min(starts)) if starts else 0.0, cpu


def _wait_ready(procs: list[subprocess.Popen], deadline: float) -> list[bytes | None]:
    """The first byte each client wrote before `deadline`: `_READY`, else the start of its
    reply (it failed; b"": it exited without one); None if it said nothing."""
    first: list[bytes | None] = [None] * len(procs)
    waiting = {proc.stdout: k for k, proc in enumerate(procs)}
    while waiting:
        readable, _, _ = select.select(list(waiting), [], [],
                                       max(0.0, deadline - time.monotonic()))
        if not readable:
            break
        for stdout in readable:
            first[waiting.pop(stdout)] = stdout.read(1)
    return first


def _reply(proc: subprocess.Popen, first: bytes | None, num_requests: int
           ) -> tuple[list[RequestResult], float, float, float]:
    """A client's `(results, start, end, cpu)` (`first`: the byte `_wait_ready` read); each
    request failed with the reason when the client failed or said nothing."""
    head = first if first not in (None, _READY) else b""
    try:
        rows, start, end, cpu, error = pickle.loads(head + proc.stdout.read())
    except (EOFError, pickle.UnpicklingError, ValueError):
        rows, error = None, f"client process exited with {proc.wait()}"
    if rows is None:
        failed = RequestResult(error=f"client process failed: {error}")
        return [failed] * num_requests, math.inf, -math.inf, 0.0
    return [RequestResult(**r) for r in rows], start, end, cpu


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    base = args.base_url.rstrip("/")
    model = args.model
    if model is None:
        async with _session(args, 1) as session:
            try:
                async with session.get(f"{base}/v1/models") as response:
                    if refused := key_refused(f"{base}/v1/models", response.status, args):
                        raise SystemExit(refused)  # --model would not help: every request 401s
                    response.raise_for_status()
                    model = (await response.json())["data"][0]["id"]
            except SystemExit:
                raise
            except Exception as e:
                raise SystemExit(f"cannot read the served model from {base}/v1/models "
                                 f"({type(e).__name__}: {e}); check --base-url (or --host and "
                                 f"--port), or pass --model") from None
    work = make_workload(args)
    n = num_client_processes(args)
    if n == 1:
        async with _session(args, args.max_concurrency or args.num_prompts) as session:
            start, cpu = time.monotonic(), time.process_time()
            results, end = await run_load(args, session, model, work, args.max_concurrency,
                                          start)
        duration, cpu = end - start, time.process_time() - cpu
    else:
        results, duration, cpu = await asyncio.to_thread(_run_processes, args, model, work, n)
    metrics = summarize(results, duration, args.percentiles)
    return {"base_url": base, "endpoint": args.endpoint, "model": model,
            "num_prompts": args.num_prompts, "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "input_len": args.input_len,
            "output_len": args.output_len,
            "random_range_ratio": args.random_range_ratio,
            "num_client_processes": n,
            # The load's own CPU time (all client processes, their start-up excluded).
            "client_cpu_s": cpu, **metrics,
            "requests": [asdict(r) for r in results]}


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """`--limits-device`'s limits for `--result-file`'s record; {} without CUDA, without a
    record, or where the measurement fails (a server that holds all the memory leaves none):
    the load's figures matter more than the machine's."""
    if not (args.result_file or args.save_result) or args.limits_device == "none":
        return {}
    from kvfit.benchmarks.limits import in_run_limits

    try:
        return in_run_limits(args.limits_device)
    except Exception as e:
        print(f"warning: no in-run limits ({type(e).__name__}: {e})", file=sys.stderr)
        return {}


def run(args: argparse.Namespace) -> int:
    """Run the load, print the table, write `--result-file`; exit 1 if nothing succeeded."""
    _check_args(args)
    if args.ignore_eos:
        print("kvfit bench serve: note: --ignore-eos has no effect: ignore_eos is always sent, "
              "so outputs have --output-len tokens", file=sys.stderr)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise SystemExit("kvfit bench serve needs aiohttp: pip install 'kvfit[server]'") from None
    limits = _limits(args)  # before the load: the server is idle
    result = asyncio.run(_main(args))
    print(format_metrics(result, args.percentiles))
    if path := result_path(args, result["model"]):
        # JSON has no infinity: an unlimited rate is written as null.
        rate = result["request_rate"]
        payload = {**result, "request_rate": rate if math.isfinite(rate) else None, **limits}
        if not args.save_detailed:
            del payload["requests"]
        # Records get published (docs/results): whether a key was given, never the key.
        config = {**vars(args), "api_key": "<set>" if args.api_key else None}
        write_record(path, record_of("bench-serve", payload, config))
        if path != args.result_file:
            print(f"record written to {path}")
    return 0 if result["completed"] else 1
