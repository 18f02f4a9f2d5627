"""`AsyncLLM` without HTTP against offline `LLM.generate` on the same prompts: what the async
engine itself costs, with its engine in a process of its own and on a thread, apart from the
HTTP server's cost (bench/serving.py measures the two together).

    PYTHONPATH=src python3 bench/async_engine.py --out $OUT/async_engine.json    # GPU machine
    PYTHONPATH=src python3 bench/async_engine.py --device cpu --num-prompts 64 \\
        --input-len 16 --output-len 16 --max-num-seqs 16 --out /tmp/async_engine.json  # CPU smoke

Needs no server package (AsyncLLM imports none). The workload: `--num-prompts` prompts of
`--input-len` random token ids, `--output-len` tokens each, greedy, ignore_eos, prefix caching
off; at most `--max-num-seqs` requests in flight from one asyncio loop (the engine's batch),
each consumed as a stream. Each of offline, `process` and `thread` starts its own engine, runs
one untimed pass, then one timed pass (startup excluded); rows report output tokens/s and the
ratio to offline. Defaults on an H200: qwen3-0.6b-shape, dummy weights, 512 prompts of 128
tokens, 128 out (about 2 minutes, most of it the three start-ups; an estimate).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.engine.config import EngineArgs
from kvfit.models.loader import load_hf_config
from kvfit.server.async_llm import AsyncLLM


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {"model": args.model, "device": args.device, "load_format": args.load_format,
            "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": False,
            "max_model_len": args.input_len + args.output_len}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def offline(args: argparse.Namespace, prompts: list[dict[str, Any]],
            params: SamplingParams) -> float:
    """Seconds for `LLM.generate` on every prompt, after an untimed pass."""
    llm = LLM(**engine_kwargs(args))
    try:
        llm.generate(prompts, params, use_tqdm=False)
        sync(args.device)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync(args.device)
        return time.perf_counter() - start
    finally:
        llm.shutdown()


def served(args: argparse.Namespace, prompts: list[dict[str, Any]], params: SamplingParams,
           engine_process: bool) -> float:
    """Seconds for `AsyncLLM` to stream every prompt, `--max-num-seqs` at a time, after an
    untimed pass."""
    engine = AsyncLLM(EngineArgs(**engine_kwargs(args)), engine_process=engine_process)

    async def one(prompt: dict[str, Any], gate: asyncio.Semaphore) -> None:
        async with gate:
            async for _ in engine.generate(prompt, params):
                pass

    async def run_all() -> float:
        gate = asyncio.Semaphore(args.max_num_seqs)
        start = time.perf_counter()
        await asyncio.gather(*(one(p, gate) for p in prompts))
        return time.perf_counter() - start

    try:
        asyncio.run(run_all())
        return asyncio.run(run_all())
    finally:
        engine.shutdown()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default=None,
                   help="default: qwen3-0.6b-shape on CUDA, kvfit-tiny on the CPU")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--engines", nargs="+", choices=["process", "thread"],
                   default=["process", "thread"], help="AsyncLLM engine placements to run")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.model is None:
        args.model = "qwen3-0.6b-shape" if args.device.startswith("cuda") else "kvfit-tiny"
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    limits = in_run_limits(args.device)  # in a process of its own: this one keeps no context
    rng = random.Random(args.seed)
    vocab = load_hf_config(args.model).vocab_size
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.input_len)]}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    tokens = args.num_prompts * args.output_len
    rows = []
    # The servers first: a CUDA context in this process would shrink an engine process's cache.
    for mode in args.engines:
        seconds = served(args, prompts, params, engine_process=mode == "process")
        rows.append({"engine": mode, "seconds": seconds, "output_throughput": tokens / seconds})
        print(f"AsyncLLM, engine in {mode}: {tokens / seconds:,.0f} output tok/s", flush=True)
    seconds = offline(args, prompts, params)
    off = {"seconds": seconds, "output_throughput": tokens / seconds}
    for row in rows:
        row["ratio"] = row["output_throughput"] / off["output_throughput"]
    result = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None
        else shlex.join(["bench/async_engine.py", *argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "model": args.model, "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "args": vars(args), "offline": off, "rows": rows, **limits,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_record(args.out, record_of("async-engine", result, vars(args)))
    print(f"offline LLM.generate: {off['output_throughput']:,.0f} output tok/s")
    for row in rows:
        print(f"AsyncLLM (engine in {row['engine']}) / offline: {row['ratio']:.1%}")
    return result


if __name__ == "__main__":
    main()
