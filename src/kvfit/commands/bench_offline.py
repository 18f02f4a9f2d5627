"""`kvfit bench throughput` and `kvfit bench latency`: the engine in this process on
synthetic prompts of random token ids (nothing is downloaded, any model works)."""

from __future__ import annotations

import argparse
import random
import time
from typing import TYPE_CHECKING, Any

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.commands.common import (
    Subparsers,
    add_dataset_name_arg,
    add_logging_args,
    build_llm,
    check_writable,
    format_table,
    parse_percentiles,
    percentiles,
)

if TYPE_CHECKING:
    from kvfit.engine.llm import LLM
    from kvfit.engine.sampling_params import SamplingParams


def _add_common(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    from kvfit.engine.config import EngineArgs

    g = p.add_argument_group("benchmark")
    g.add_argument("--input-len", "--random-input-len", type=int, default=32,
                   help="prompt tokens per request (default: %(default)s)")
    g.add_argument("--output-len", "--random-output-len", type=int, default=32,
                   help="generated tokens per request, EOS ignored (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature (default: %(default)s)")
    g.add_argument("--result-file", "--output-json", metavar="PATH",
                   help="write the results as a JSON record (--output-json: vLLM's name)")
    add_dataset_name_arg(g)
    EngineArgs.add_cli_args(p)
    add_logging_args(p)
    return g


def add_parsers(sub: Subparsers) -> None:
    """Register `bench throughput` and `bench latency` under the `bench` subparsers."""
    t = sub.add_parser(
        "throughput", help="offline throughput: requests/s and tokens/s of one batch",
        description="Generate for --num-prompts random token-id prompts in one LLM.generate "
        "call and report requests/s and tokens/s. The engine seed (--seed) seeds the prompts.",
    )
    g = _add_common(t)
    g.add_argument("--num-prompts", type=int, default=64,
                   help="requests in the batch (default: %(default)s)")
    t.set_defaults(func=run_throughput)

    lat = sub.add_parser(
        "latency", help="offline latency: end-to-end time of one batch, over iterations",
        description="Time LLM.generate of one batch of --batch-size random token-id prompts, "
        "--num-iters times after --num-iters-warmup untimed runs; report mean and percentiles.",
    )
    g = _add_common(lat)
    g.add_argument("--batch-size", type=int, default=8,
                   help="requests per batch (default: %(default)s)")
    g.add_argument("--num-iters-warmup", type=int, default=1,
                   help="untimed runs first (default: %(default)s)")
    g.add_argument("--num-iters", type=int, default=5,
                   help="timed runs (default: %(default)s)")
    g.add_argument("--percentiles", type=parse_percentiles, default=[50.0, 90.0, 99.0],
                   metavar="P,P", help="latency percentiles to report (default: 50,90,99)")
    lat.set_defaults(func=run_latency)


def _check_positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                             f"got {getattr(args, name)}")


def random_prompts(num: int, input_len: int, vocab_size: int,
                   seed: int) -> list[dict[str, list[int]]]:
    """`num` prompts of `input_len` token ids drawn uniformly from the vocabulary."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(vocab_size) for _ in range(input_len)]}
            for _ in range(num)]


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    """The device's limits for `--result-file`'s record, measured before the engine starts
    (it sizes its KV cache from free memory); none on the CPU or without a record."""
    return in_run_limits(args.device) if args.result_file else {}


def _params(args: argparse.Namespace) -> SamplingParams:
    """The requests' SamplingParams; a bad --temperature is named now, before the engine
    loads (it was found after, as `SamplingParams.temperature`)."""
    from kvfit.engine.sampling_params import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, max_tokens=args.output_len,
                              ignore_eos=True)
    except ValueError as e:
        raise ValueError(str(e).replace("SamplingParams.temperature", "--temperature")) from None


def _setup(args: argparse.Namespace, num: int) -> tuple[LLM, list[dict]]:
    llm = build_llm(args)
    max_model_len = llm.config.model_config.max_model_len
    if args.input_len + args.output_len > max_model_len:
        # Every output would stop at the context's end, short of --output-len: rates of a
        # workload other than the one asked for.
        llm.shutdown()
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} is "
                         f"more than max_model_len ({max_model_len}); lower them or raise "
                         f"--max-model-len")
    vocab = llm.config.model_config.hf_config.vocab_size
    return llm, random_prompts(num, args.input_len, vocab, args.seed)


def run_throughput(args: argparse.Namespace) -> int:
    """One timed LLM.generate over the batch; print and optionally write the rates."""
    _check_positive(args, "num_prompts", "input_len", "output_len")
    check_writable("--result-file", args.result_file)
    params = _params(args)
    limits = _limits(args)
    llm, prompts = _setup(args, args.num_prompts)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    result: dict[str, Any] = {
        "num_prompts": len(outputs), "input_len": args.input_len, "output_len": args.output_len,
        "elapsed_s": elapsed, "requests_per_s": len(outputs) / elapsed,
        "output_tokens": output_tokens, "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (input_tokens + output_tokens) / elapsed, **limits,
    }
    print(format_table("Offline Throughput", [
        ("Requests:", f"{len(outputs)}"),
        ("Elapsed (s):", f"{elapsed:.2f}"),
        ("Requests/s:", f"{result['requests_per_s']:.2f}"),
        ("Output tokens:", f"{output_tokens}"),
        ("Output tokens/s:", f"{result['output_tokens_per_s']:.2f}"),
        ("Total tokens/s:", f"{result['total_tokens_per_s']:.2f}"),
    ]))
    if args.result_file:
        write_record(args.result_file, record_of("bench-throughput", result, vars(args)))
    return 0


def run_latency(args: argparse.Namespace) -> int:
    """Time the same batch repeatedly; print and optionally write the latency statistics."""
    _check_positive(args, "batch_size", "input_len", "output_len", "num_iters")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    check_writable("--result-file", args.result_file)
    params = _params(args)
    limits = _limits(args)
    llm, prompts = _setup(args, args.batch_size)
    for _ in range(args.num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    latencies = []
    for _ in range(args.num_iters):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        latencies.append(time.perf_counter() - start)
    stats = percentiles(latencies, args.percentiles)
    result = {"batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "latencies_s": latencies,
              **{f"latency_{k}_s": v for k, v in stats.items()}, **limits}
    print(format_table("Offline Latency", [
        ("Batch size:", f"{args.batch_size}"), ("Iterations:", f"{args.num_iters}"),
        *((f"{k.capitalize()} latency (s):", f"{v:.4f}") for k, v in stats.items()),
    ]))
    if args.result_file:
        write_record(args.result_file, record_of("bench-latency", result, vars(args)))
    return 0
