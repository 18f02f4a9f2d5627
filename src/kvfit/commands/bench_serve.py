"""`kvfit bench serve`: a load generator against a running OpenAI-compatible server.

Requests go to `/v1/completions` with `stream=true`, arrive as a Poisson process at
`--request-rate` (all at once when infinite) and are capped at `--max-concurrency` in flight.
Per request it records the time to the first content chunk (TTFT), the gaps between content
chunks (ITL), the end-to-end time (E2E) and the output tokens (from the streamed `usage`
when the server sends it, else one per content chunk). A failed request (an HTTP error
status, an error event, a dropped connection, a stream without `[DONE]`) is counted with its
reason; it never stops the run.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfit.commands.common import (
    SSE_DONE,
    Subparsers,
    format_table,
    parse_percentiles,
    parse_sse_line,
    percentiles,
    sse_error,
    write_json,
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


def add_parser(sub: Subparsers) -> None:
    """Register `bench serve` under the `bench` subparsers."""
    p = sub.add_parser(
        "serve", help="load-test a running OpenAI-compatible server (TTFT, ITL, throughput)",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s = p.add_argument_group("server")
    s.add_argument("--base-url", required=True, metavar="URL",
                   help="the server's root, e.g. http://localhost:8000")
    s.add_argument("--endpoint", default="/v1/completions",
                   help="the completions path (default: %(default)s)")
    s.add_argument("--model", default=None,
                   help="the served model's name (default: the first of /v1/models)")
    s.add_argument("--api-key", default=None,
                   help="sent as a bearer token (default: $OPENAI_API_KEY if set)")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="per-request timeout (default: %(default)s)")
    w = p.add_argument_group("workload")
    w.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send (default: %(default)s)")
    w.add_argument("--request-rate", type=float, default=math.inf,
                   help="mean arrivals per second of a Poisson process; inf sends all at once "
                        "(default: %(default)s)")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="most requests in flight (default: no limit)")
    w.add_argument("--input-len", type=int, default=128,
                   help="prompt length in tokens (words with --prompt-kind words; default: "
                        "%(default)s)")
    w.add_argument("--output-len", type=int, default=128,
                   help="max_tokens per request; ignore_eos is sent so outputs have this length "
                        "(default: %(default)s)")
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
    o = p.add_argument_group("output")
    o.add_argument("--percentiles", type=parse_percentiles, default=[50.0, 99.0], metavar="P,P",
                   help="percentiles of TTFT, TPOT, ITL and E2E to report (default: 50,99)")
    o.add_argument("--result-file", metavar="PATH",
                   help="write the metrics and per-request figures as JSON")
    p.set_defaults(func=run)


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


def make_prompts(args: argparse.Namespace, rng: random.Random) -> list[str | list[int]]:
    """`--num-prompts` random prompts of `--input-len` token ids or words."""
    if args.prompt_kind == "words":
        return [" ".join(rng.choice(_WORDS) for _ in range(args.input_len))
                for _ in range(args.num_prompts)]
    return [[rng.randrange(args.random_vocab_size) for _ in range(args.input_len)]
            for _ in range(args.num_prompts)]


async def send_request(client: Any, endpoint: str, body: dict[str, Any],
                       prompt_tokens: int) -> RequestResult:
    """POST one streamed completion and time its content chunks; every failure is returned
    as an error result, never raised."""
    result = RequestResult(prompt_tokens=prompt_tokens)
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage_tokens = None
    try:
        async with client.stream("POST", endpoint, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode("utf-8", "replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
                return result
            done = False
            async for line in response.aiter_lines():
                payload = parse_sse_line(line)
                if payload == SSE_DONE:
                    done = True
                    break
                if not isinstance(payload, dict):
                    continue
                error = sse_error(payload)
                if error is not None:
                    result.error = f"error event: {error[:200]}"
                    return result
                usage = payload.get("usage")
                if usage:
                    usage_tokens = usage.get("completion_tokens", usage_tokens)
                    result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
                if any(choice.get("text") for choice in payload.get("choices") or []):
                    chunk_times.append(time.perf_counter())
            if not done:
                result.error = "stream ended before [DONE]"
                return result
    except Exception as e:  # a dropped connection, a timeout, a malformed event: counted
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.e2e = time.perf_counter() - start
    if not chunk_times:
        result.error = "no content in the stream"
        return result
    result.ok = True
    result.ttft = chunk_times[0] - start
    result.itl = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    result.output_tokens = usage_tokens if usage_tokens is not None else len(chunk_times)
    return result


async def run_load(args: argparse.Namespace, client: Any, model: str) -> tuple[
        list[RequestResult], float]:
    """Send every request at its arrival time under the concurrency cap; the results in
    request order and the wall time from the first send to the last completion."""
    rng = random.Random(args.seed)
    prompts = make_prompts(args, rng)
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def one(prompt: str | list[int]) -> RequestResult:
        body = {"model": model, "prompt": prompt, "max_tokens": args.output_len,
                "temperature": args.temperature, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}
        n = len(prompt) if isinstance(prompt, list) else args.input_len
        if limit is None:
            return await send_request(client, args.endpoint, body, n)
        async with limit:
            return await send_request(client, args.endpoint, body, n)

    start = time.perf_counter()
    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(one(prompt)))
        if math.isfinite(args.request_rate) and i + 1 < len(prompts):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


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
    for reason, count in metrics["errors"].items():
        table += f"\nfailed x{count}: {reason}"
    return table


def _check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "input_len", "output_len", "random_vocab_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")
    if not args.request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), "
                         f"got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    import os

    import httpx

    headers = {}
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    connections = args.max_concurrency or args.num_prompts
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits,
                                 timeout=args.request_timeout) as client:
        model = args.model
        if model is None:
            try:
                response = await client.get("/v1/models")
                response.raise_for_status()
                model = response.json()["data"][0]["id"]
            except Exception as e:
                raise SystemExit(f"cannot read the served model from {base}/v1/models "
                                 f"({type(e).__name__}: {e}); pass --model") from None
        results, duration = await run_load(args, client, model)
    metrics = summarize(results, duration, args.percentiles)
    return {"base_url": base, "endpoint": args.endpoint, "model": model,
            "num_prompts": args.num_prompts, "request_rate": args.request_rate,
            "max_concurrency": args.max_concurrency, "input_len": args.input_len,
            "output_len": args.output_len, **metrics,
            "requests": [asdict(r) for r in results]}


def run(args: argparse.Namespace) -> int:
    """Run the load, print the table, write `--result-file`; exit 1 if nothing succeeded."""
    _check_args(args)
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise SystemExit("kvfit bench serve needs httpx: pip install 'kvfit[server]'") from None
    result = asyncio.run(_main(args))
    print(format_metrics(result, args.percentiles))
    if args.result_file:
        # JSON has no infinity: an unlimited rate is written as null.
        rate = result["request_rate"]
        write_json(args.result_file, {**result, "request_rate": rate if math.isfinite(rate)
                                      else None})
    return 0 if result["completed"] else 1
