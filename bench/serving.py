"""Serving benchmark: `kvfit bench serve` against `kvfit serve`, then offline `LLM.generate` on
the same prompts. The server's output tokens/s at saturation should be >= 85% of offline (the
HTTP layer must not be the bottleneck).

    PYTHONPATH=/tmp/site:src python3 bench/serving.py --out $OUT/serving.json    # GPU machine
    PYTHONPATH=/tmp/site:src python3 bench/serving.py --request-rates inf \
        --engines process thread --out $OUT/serving_engines.json    # both engine placements
    PYTHONPATH=/tmp/site TESTS=none BENCH_TIMEOUT=300 bash bench/run_gpu.sh serving
    PYTHONPATH=src python3 bench/serving.py --device cpu --model kvfit-tiny --num-prompts 8 \\
        --input-len 16 --output-len 8 --request-rates inf --max-num-seqs 4 --max-model-len 64 \\
        --no-warmup --out /tmp/serving.json                            # CPU smoke (seconds)

On the GPU machine fastapi/uvicorn/pydantic come from wheels installed to /tmp/site: run with
PYTHONPATH=/tmp/site:src (run_gpu.sh puts src before what PYTHONPATH holds); the server subprocess
inherits the environment (with kvfit's source folder put first on its PYTHONPATH).
Defaults on an H200 (qwen3-0.6b-shape, 2048 prompts of 128 tokens, 128 output tokens): about 2
minutes, half of it the two engine start-ups.

The workload: `--num-prompts` prompts of `--input-len` random token ids (bench_serve's own
`make_workload` from `--seed`, so they are exactly what its load sends), `--output-len` tokens
each, ignore_eos, greedy; `--random-range-ratio R` spreads both lengths uniformly over
[len x (1 - R), len x (1 + R)], offline and served alike, so requests stop finishing in
waves. Steps:
1. Offline first, in this process before any server has run: `LLM(...)` with the same engine
   flags, one untimed pass, then `--offline-repeat` timed `generate` passes on the same prompts
   and sampling params (startup excluded); the median pass is the figure. On the H200 one
   pass run after the servers took 6.0 s where the call before took 3.8 s on the same steps.
2. Per `--engines` placement (`process`: the engine core in a process of its own, `kvfit
   serve`'s default; `thread`: `--no-engine-process`, the engine on a thread of the server's
   process), `python3 -m kvfit serve` in a subprocess (log beside --out), wait for /health,
   one untimed pass of the workload at rate inf (kernel compilation), then per
   `--max-concurrency` limit and per `--request-rates` rate bench_serve's load with at most
   that many requests in flight. The default limit is `--max-num-seqs`, the engine's batch.
   Capped there, every request of this workload (one output length) finishes in the same few
   steps as the rest of its wave, and the engine idles for a client round trip of the next
   wave that offline `generate` never waits for. A higher limit keeps a queue (on the H200,
   2026-12-04, 512 in flight ran offline's very steps). Give several limits to compare them; 0
   means no limit, as `vllm bench serve`; then keep `--num-prompts` under the server's
   `--max-concurrent-requests` (1024), or the excess is answered 503. A finite rate sends
   the first rate x `--rate-duration-s` prompts of the workload (the whole workload at 4
   req/s would take minutes); inf sends them all. Then SIGINT, wait, kill after 30 s, and
   wait for every process the server started (one left would share the GPU).
3. A table (latencies in ms; "client cpu": the load generator's CPU time over the row's
   duration, per client process (`--num-client-processes`, bench serve's default), near 100%
   meaning the load generator, not the server, was the limit; "server cpu" and "engine cpu"
   the same for the server's process, whose one GIL runs HTTP, tokenization, text and SSE,
   and for its engine core process: a server near 100% is the HTTP layer's limit, an
   engine well under it an engine left waiting; "steps", "tok/step", "decode": the engine's
   steps over the row (its `kvfit:engine_steps*` counters on /metrics), tokens per step and
   the share of decode-only steps, also given for offline, so a served load that cuts the
   batch into more, smaller or mixed steps than offline shows as such), and per placement
   serve output tok/s at saturation (the best rate-inf row, else the best row) / offline;
   the first placement's ratio is the one checked against the target.

Prefix caching is off in both by default (`--enable-prefix-caching` turns it on): every pass
sends the same prompts, so later passes would otherwise hit the cache and skip their prefills.
bench_serve times content chunks by their text, and a model without a tokenizer (the shape
models) streams empty text: the bench serves a copy of the model folder (links to its files)
with a synthetic word-level tokenizer over the whole vocabulary, one word per token, so every
token is a chunk; offline then detokenizes the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import itertools
import json
import math
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.commands import bench_serve
from kvfit.commands.common import child_env
from kvfit.models.loader import load_hf_config, resolve_model
from kvfit.ops.compiles import triton_compiles

TARGET = 0.85
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "merges.txt", "special_tokens_map.json")


def with_word_tokenizer(model: str, folder: Path) -> Path:
    """`folder` made a copy of `model` (links to its files) whose tokenizer decodes token i as
    the word `w{i}`: every token has text, whatever the model."""
    from tokenizers import Tokenizer, models

    source = resolve_model(model)
    folder.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name not in _TOKENIZER_FILES:
            (folder / path.name).symlink_to(path.resolve())
    vocab = load_hf_config(model).vocab_size
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    return folder


def load_args(args: argparse.Namespace, base_url: str, rate: float, num_prompts: int,
              max_concurrency: int | None = None) -> argparse.Namespace:
    """bench_serve's flags for one pass of the workload (or its first `num_prompts`), at most
    `max_concurrency` requests in flight (None: no limit)."""
    return argparse.Namespace(
        base_url=base_url, endpoint="/v1/completions", model=args.model, api_key=None,
        request_timeout=600.0, num_prompts=num_prompts, request_rate=rate,
        max_concurrency=max_concurrency, input_len=args.input_len,
        output_len=args.output_len, random_range_ratio=args.random_range_ratio,
        prompt_kind="token-ids", random_vocab_size=args.vocab_size,
        temperature=0.0, seed=args.seed, percentiles=[50.0, 99.0],
        num_client_processes=args.num_client_processes)


def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    """`(prompt, max_tokens)` of every request bench_serve's load sends for `args`."""
    ns = load_args(args, "", math.inf, args.num_prompts)
    return [(prompt, max_tokens)  # type: ignore[misc]
            for prompt, _, max_tokens in bench_serve.make_workload(ns)]


def engine_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the server and offline share (unset ones left at the engine's)."""
    flags = {"device": args.device, "load_format": args.load_format,
             "max_num_seqs": args.max_num_seqs, "max_model_len": args.max_model_len,
             "enable_prefix_caching": args.enable_prefix_caching,
             "cudagraph_mode": args.cudagraph_mode}
    return {k: v for k, v in flags.items() if v is not None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def start_server(args: argparse.Namespace, model_dir: Path, port: int, log: Path,
                 mode: str, api_servers: int | None) -> subprocess.Popen:
    """`python3 -m kvfit serve` with the bench's engine flags, the engine in its own process
    (`mode` "process") or on a thread of the server's ("thread"), `api_servers` API processes
    (None: the server's default); returns once /health answers."""
    cmd = [sys.executable, "-m", "kvfit", "serve", str(model_dir), "--port", str(port),
           "--served-model-name", args.model, "--uvicorn-log-level", "warning",
           "--engine-process" if mode == "process" else "--no-engine-process"]
    for name, value in engine_flags(args).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            cmd += [flag, str(value)]
    if args.stream_interval is not None:  # a server flag: offline has no streams
        cmd += ["--stream-interval", str(args.stream_interval)]
    if api_servers is not None:
        cmd += ["--api-server-count", str(api_servers)]
    env = child_env(PYTHONUNBUFFERED="1")  # the GPU machine's PYTHONPATH goes along
    print(f"server: {shlex.join(cmd)} (log {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + args.server_timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            why = (f"exited with {proc.returncode}" if proc.poll() is not None
                   else f"no /health after {args.server_timeout:.0f} s")
            stop_server(proc)
            raise RuntimeError(f"kvfit serve {why}; its log ({log}) ends:\n{log_tail(log)}")
        time.sleep(0.5)


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of each process of the server, by `api:PID` (the API server
    processes, those listening on the port: HTTP, tokenization, SSE; the engine too with
    `--no-engine-process`) and `other:PID` (its other children: the engine core process)."""
    server = psutil.Process(pid)
    times = server.cpu_times()
    result = {f"api:{pid}": times.user + times.system}
    for child in server.children(recursive=True):
        try:
            t = child.cpu_times()
            listening = any(c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp"))
        except (psutil.NoSuchProcess, psutil.AccessDenied):  # a helper that just exited
            continue
        result[f"{'api' if listening else 'other'}:{child.pid}"] = t.user + t.system
    return result


_STEP_COUNTERS = ("engine_steps", "engine_step_tokens", "engine_decode_steps")


def served_steps(base_url: str) -> dict[str, float]:
    """The engine's step counters now, from the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {family.name.removeprefix("kvfit:"): family.samples[0].value
            for family in text_string_to_metric_families(text)
            if family.name.removeprefix("kvfit:") in _STEP_COUNTERS}


def offline_steps(llm: LLM) -> dict[str, float]:
    s = llm.engine.stats()
    return dict(zip(_STEP_COUNTERS, (s.num_steps, s.num_step_tokens, s.num_decode_steps),
                    strict=True))


def step_shape(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the engine ran between two readings of its step counters: steps, tokens per step
    and the share of decode-only steps (those a decode graph runs)."""
    steps, tokens, decode = (after[k] - before[k] for k in _STEP_COUNTERS)
    return {"engine_steps": steps, "tokens_per_step": tokens / max(steps, 1),
            "decode_step_share": decode / max(steps, 1)}


def busiest(cpu: dict[str, float], kind: str) -> float | None:
    """The highest CPU share among `process_cpu`'s processes of `kind` ("api", "other")."""
    return max((v for k, v in cpu.items() if k.startswith(kind + ":")), default=None)


def stop_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGINT (uvicorn's clean shutdown, which shuts the engine down), kill after `timeout`;
    then wait for every process the server started (its engine and API processes), killing
    any left: one that outlived its server would share the GPU with the next measurement."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    for child in alive:
        print(f"server: its process {child.pid} outlived it; killed", flush=True)
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=5)


def serve_sweep(args: argparse.Namespace, model_dir: Path, log: Path, mode: str,
                api_servers: int | None = None) -> dict[str, Any]:
    """The rate sweep against a fresh server (engine `mode`, `api_servers` API processes); the
    server is stopped before this returns."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = start_server(args, model_dir, port, log, mode, api_servers)
    result: dict[str, Any] = {"engine": mode, "api_server_count": api_servers or 1,
                              "log": str(log), "startup_s": time.perf_counter() - started,
                              "rows": []}
    try:
        if args.warmup:
            warm = asyncio.run(bench_serve._main(load_args(
                args, base_url, math.inf, args.num_prompts, args.max_concurrency[0])))
            result["warmup_s"] = warm["duration_s"]
        for concurrency, rate in itertools.product(args.max_concurrency, args.request_rates):
            n = args.num_prompts if math.isinf(rate) else min(
                args.num_prompts, max(1, math.ceil(rate * args.rate_duration_s)))
            cpu_before, steps_before = process_cpu(proc.pid), served_steps(base_url)
            m = asyncio.run(bench_serve._main(load_args(args, base_url, rate, n, concurrency)))
            steps = step_shape(steps_before, served_steps(base_url))
            cpu = {k: (v - cpu_before.get(k, 0.0)) / m["duration_s"]
                   for k, v in process_cpu(proc.pid).items()}
            row = {"max_concurrency": concurrency} | {k: m[k] for k in (
                "num_prompts", "completed", "failed", "errors", "duration_s",
                "total_output_tokens", "request_throughput", "output_throughput",
                "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms", "p99_itl_ms", "p50_e2el_ms")}
            # Near 1: the load generator (its mean process) was the bottleneck, not the server.
            row["client_cpu"] = m["client_cpu_s"] / m["num_client_processes"] / m["duration_s"]
            # Near 1: an API server process (one GIL) was busy the whole row (the busiest of
            # them with --api-server-count); "engine": the engine core process.
            row["server_cpu"], row["engine_cpu"] = busiest(cpu, "api"), busiest(cpu, "other")
            row["api_servers_cpu"] = sum(v for k, v in cpu.items() if k.startswith("api:"))
            row |= steps
            result["rows"].append({"request_rate": None if math.isinf(rate) else rate, **row})
            print(f"{server_label(result)}, rate {rate:g}, at most {concurrency or 'any'} in "
                  f"flight: {row['completed']}/{n} done, "
                  f"{row['output_throughput']:,.0f} output tok/s", flush=True)
    finally:
        stop_server(proc)
    result["returncode"] = proc.returncode
    return result


def offline(args: argparse.Namespace, model_dir: Path,
            requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    """`LLM.generate` on the same prompts and sampling params (each request's max_tokens):
    one untimed pass, then `--offline-repeat` timed ones; the figures are the median pass's.
    It runs before any server starts, in a process that has run nothing else; the engine gets
    the server engine process's hygiene (startup's objects frozen out of the collector)."""
    started = time.perf_counter()
    llm = LLM(str(model_dir), **engine_flags(args))
    startup = time.perf_counter() - started
    gc.collect()
    gc.freeze()
    inputs = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for _, n in requests]
    if args.warmup:
        llm.generate(inputs, params, use_tqdm=False)
    device = llm.config.device
    passes = []
    for _ in range(args.offline_repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps_before, start = offline_steps(llm), time.perf_counter()
        with triton_compiles() as compiled:
            outputs = llm.generate(inputs, params, use_tqdm=False)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        # A kernel compiled inside a timed pass (~1 s each) is a warmup gap, not throughput.
        passes.append({"elapsed_s": elapsed, "total_output_tokens": tokens,
                       "kernels_compiled": compiled,
                       **step_shape(steps_before, offline_steps(llm))})
        print(f"offline pass {len(passes)}: {tokens / elapsed:,.0f} output tok/s "
              f"({len(compiled)} compiles)", flush=True)
    llm.shutdown()
    del llm
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    median = sorted(passes, key=lambda p: p["elapsed_s"])[len(passes) // 2]
    return {"startup_s": startup, **median, "num_prompts": len(requests),
            "output_throughput": median["total_output_tokens"] / median["elapsed_s"],
            "request_throughput": len(requests) / median["elapsed_s"],
            "passes_output_throughput": [p["total_output_tokens"] / p["elapsed_s"]
                                         for p in passes]}


def server_label(sweep: dict[str, Any]) -> str:
    """`process`, `thread`, or `process x N` for N API server processes."""
    n = sweep.get("api_server_count", 1)
    return sweep["engine"] if n == 1 else f"{sweep['engine']} x {n}"


def saturation(sweep: dict[str, Any]) -> dict[str, Any]:
    """The sweep's row at saturation: its best row at rate inf (over the concurrency limits),
    else its best row."""
    rows = [r for r in sweep["rows"] if r["request_rate"] is None] or sweep["rows"]
    return max(rows, key=lambda r: r["output_throughput"])


def print_report(result: dict[str, Any]) -> None:
    print(f"\n{result['model']} on {result['device']}: {result['args']['num_prompts']} prompts, "
          f"input {result['args']['input_len']}, output {result['args']['output_len']} "
          f"(range ratio {result['args']['random_range_ratio']}), "
          f"max concurrency {result['args']['max_concurrency']} (None: no limit)")
    print(f"{'engine':>11} {'conc':>5} {'rate':>6} {'reqs':>5} {'err':>4} {'req/s':>7} "
          f"{'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} {'p99':>8} {'E2E p50':>8} "
          f"{'client cpu':>10} {'server cpu':>10} {'engine cpu':>10} {'steps':>6} "
          f"{'tok/step':>8} {'decode':>6}")
    for sweep in result["serve_by_engine"]:
        for r in sweep["rows"]:
            rate = "inf" if r["request_rate"] is None else f"{r['request_rate']:g}"
            conc = r.get("max_concurrency") or "-"
            print(f"{server_label(sweep):>11} {conc:>5} {rate:>6} {r['completed']:>5} "
                  f"{r['failed']:>4} {r['request_throughput']:>7.2f} "
                  f"{r['output_throughput']:>10,.0f} {r['p50_ttft_ms']:>9.1f} "
                  f"{r['p99_ttft_ms']:>8.1f} {r['p50_itl_ms']:>8.2f} "
                  f"{r['p99_itl_ms']:>8.2f} {r['p50_e2el_ms']:>8.1f} {r['client_cpu']:>10.0%} "
                  f"{_share(r.get('server_cpu')):>10} {_share(r.get('engine_cpu')):>10} "
                  f"{_steps(r)}")
            for line in bench_serve.failure_lines(r["errors"]):
                print(f"       {line}")
    o = result["offline"]
    passes = ", ".join(f"{t:,.0f}" for t in o["passes_output_throughput"])
    print(f"offline LLM.generate (median of {len(o['passes_output_throughput'])} passes: "
          f"{passes}): {o['total_output_tokens']} tokens in {o['elapsed_s']:.2f} s, "
          f"{o['output_throughput']:,.0f} output tok/s; steps, tok/step, decode: {_steps(o)}")
    for sweep in result["serve_by_engine"]:
        print(f"serve ({server_label(sweep)}) at saturation (rate "
              f"{sweep['saturation_rate']}, at most {sweep['saturation_concurrency'] or 'any'} "
              f"in flight) / offline: {sweep['ratio']:.1%} (target >= "
              f"{TARGET:.0%}: {'met' if sweep['ratio'] >= TARGET else 'not met'})")


def _share(cpu: float | None) -> str:
    return "-" if cpu is None else f"{cpu:.0%}"


def _steps(r: dict[str, Any]) -> str:
    """Engine steps, tokens per step and the decode-only share (a served row or offline)."""
    return (f"{r['engine_steps']:>6,.0f} {r['tokens_per_step']:>8.1f} "
            f"{r['decode_step_share']:>6.0%}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path (the server log goes beside)")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default=None,
                   help="default: qwen3-0.6b-shape on CUDA, kvfit-tiny on the CPU")
    p.add_argument("--load-format", default="dummy", help="auto, safetensors or dummy")
    p.add_argument("--num-prompts", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rates", type=float, nargs="+", default=[4, 16, 64, math.inf],
                   help="requests per second, each a row; inf sends all at once")
    p.add_argument("--random-range-ratio", type=float, default=0.0, metavar="R",
                   help="input and output lengths uniform in [len x (1 - R), len x (1 + R)], "
                   "the same for the server's load and offline (default: 0, exact lengths, so "
                   "requests admitted together finish together)")
    p.add_argument("--rate-duration-s", type=float, default=15.0,
                   help="a finite rate sends at most rate x this many prompts")
    p.add_argument("--max-concurrency", type=int, nargs="+", default=None,
                   help="requests in flight, each value a sweep of the rates (default: "
                   "--max-num-seqs; 0: no limit); saturation is the best rate-inf row")
    p.add_argument("--num-client-processes", type=int, default=None,
                   help="load generator processes (default: bench serve's, min(4, CPUs))")
    p.add_argument("--engines", nargs="+", choices=["process", "thread"], default=["process"],
                   help="where the server runs its engine, each a sweep: its own process "
                   "(kvfit serve's default) or a thread of the server's (--no-engine-process); "
                   "the first is the one the ratio and target report")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: input + output length")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=False)
    p.add_argument("--cudagraph-mode", type=str.upper, default=None, metavar="MODE",
                   help="the engine's graph mode, server and offline alike (default: the "
                   "engine's); FULL_AND_PIECEWISE also graphs the mixed steps that admit new "
                   "requests")
    p.add_argument("--stream-interval", type=int, default=None, metavar="N",
                   help="the server's --stream-interval: tokens per streamed chunk (default: "
                   "the server's, 1)")
    p.add_argument("--api-server-count", type=int, nargs="+", default=[None], metavar="N",
                   help="the server's --api-server-count: API server processes in front of "
                   "the engine process, each value a server of its own, with `process` "
                   "engines only (default: the server's, 1)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="one untimed pass of the workload before the timed ones, in both")
    p.add_argument("--offline-repeat", type=int, default=3, metavar="N",
                   help="timed offline passes; the median one is the figure (passes on one "
                   "H200 have differed by 1.6x)")
    p.add_argument("--server-timeout", type=float, default=240.0,
                   help="seconds to wait for the server's /health")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model is None:
        args.model = "qwen3-0.6b-shape" if args.device.startswith("cuda") else "kvfit-tiny"
    if args.max_concurrency is None:
        args.max_concurrency = [args.max_num_seqs]
    args.max_concurrency = [c or None for c in args.max_concurrency]  # 0: no limit
    if args.offline_repeat < 1:
        p.error(f"--offline-repeat must be >= 1, got {args.offline_repeat}")
    args.vocab_size = load_hf_config(args.model).vocab_size
    for limit in args.max_concurrency:  # bench serve's own checks of every workload flag
        bench_serve._check_args(load_args(args, "http://127.0.0.1", math.inf,
                                          args.num_prompts, limit))
    longest = sum(math.ceil(n * (1 + args.random_range_ratio))
                  for n in (args.input_len, args.output_len))
    args.max_model_len = args.max_model_len or longest
    return args


def servers(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    """`(engine placement, API server count)` of every server the bench starts, in order: a
    thread engine lives in its one API process, so it takes no count."""
    return [(mode, n) for mode in args.engines
            for n in (args.api_server_count if mode == "process" else [None])]


def server_log(out: Path, mode: str, api_servers: int | None) -> Path:
    suffix = "" if api_servers in (None, 1) else f"_x{api_servers}"
    return out.with_name(f"{out.stem}_server_{mode}{suffix}.log")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    limits = in_run_limits(args.device)  # in a process of its own: this one keeps no context
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    requests = workload(args)
    with tempfile.TemporaryDirectory(prefix="kvfit-serving-") as tmp:
        model_dir = with_word_tokenizer(args.model, Path(tmp) / "model")
        off = offline(args, model_dir, requests)
        sweeps = [serve_sweep(args, model_dir, server_log(out, mode, n), mode, n)
                  for mode, n in servers(args)]
    for sweep in sweeps:
        row = saturation(sweep)
        sweep["saturation_rate"] = "inf" if row["request_rate"] is None else row["request_rate"]
        sweep["saturation_concurrency"] = row["max_concurrency"]
        sweep["ratio"] = row["output_throughput"] / off["output_throughput"]
    serve = sweeps[0]
    ratio = serve["ratio"]
    result = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None
        else shlex.join(["bench/serving.py", *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": args.model, "torch": torch.__version__, "cuda": torch.version.cuda,
        # Asked only now: a CUDA context in this process would have shrunk the server's cache.
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
        else "cpu",
        "args": {k: (None if isinstance(v, float) and math.isinf(v) else v)
                 for k, v in vars(args).items() if k != "request_rates"}
        | {"request_rates": [None if math.isinf(r) else r for r in args.request_rates]},
        "server_log": serve["log"], "serve": serve, "serve_by_engine": sweeps, "offline": off,
        "saturation_rate": serve["saturation_rate"],
        "saturation_concurrency": serve["saturation_concurrency"],
        "ratio": ratio, "target": TARGET, "target_met": ratio >= TARGET, **limits,
    }
    write_record(out, record_of("serving", result, result["args"]))
    print_report(result)
    return result


if __name__ == "__main__":
    main()
