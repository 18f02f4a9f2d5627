"""Engine benchmark: offline throughput, and decode step time against the memory roofline.

    python3 bench/throughput.py --out throughput.json                 # on the GPU machine
    python3 bench/throughput.py --device cpu --model kvfit-tiny --num-seqs 8 --min-len 8 \\
        --max-len 64 --decode-models kvfit-tiny --decode-batches 1 4 --decode-context 32 \\
        --out t.json

Throughput: `--num-seqs` requests of random token ids, prompt and output lengths uniform in
[`--min-len`, `--max-len`], ignore_eos, sampled at temperature 1 (dummy weights), after an untimed
run of the same shape (kernel compilation); the median of `--repeat` timed runs. Decode: the mean
engine step while a batch of sequences of about `--decode-context` tokens all decode, over
`--iters` steps of the engine loop as it runs (overlapped: step k + 1 is launched before step k's
tokens are read; CUDA graphs unless --enforce-eager); and, for reference, the median synchronous
model-runner step (host work and device work one after the other). The roofline is (weight bytes +
KV bytes read) over the device-to-device copy bandwidth measured in the same run. Writes JSON to
--out and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.record import write_record
from kvfit.engine.sequence import ScheduledBatch, Sequence
from kvfit.ops.compiles import triton_compiles

GiB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median wall time of `fn()`, the device synchronised before and after each call."""
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = GiB, iters: int = 10) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy, median."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device, iters)


def offline_workload(args: argparse.Namespace, vocab: int, seed: int) -> tuple[list, list]:
    """`--num-seqs` requests of random token ids, prompt and output lengths uniform in
    [`--min-len`, `--max-len`], ignore_eos, temperature 1."""
    rng = random.Random(seed)
    lengths = [(rng.randint(args.min_len, args.max_len), rng.randint(args.min_len, args.max_len))
               for _ in range(args.num_seqs)]
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(p)]} for p, _ in lengths]
    # Unseeded: per-request seeds are not what is measured here.
    params = [SamplingParams(temperature=1.0, max_tokens=o, ignore_eos=True) for _, o in lengths]
    return prompts, params


def bench_throughput(args: argparse.Namespace, backend: str = "uni") -> dict:
    """The offline workload: tokens per second from submission to the last completion, median
    of `--repeat` timed runs of the same shape (other token ids each, so no prefix-cache hits),
    with the workers run by `backend` (`--distributed-executor-backend`)."""
    llm = LLM(args.model, device=args.device, load_format="dummy",
              max_model_len=2 * args.max_len + 1, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size,
              distributed_executor_backend=backend)
    vocab = llm.config.model_config.hf_config.vocab_size
    seeds = [args.seed + i for i in range(args.repeat)]
    if args.warmup:
        # Triton compiles a kernel specialization the first time its shapes occur, a one-time
        # cost that is not throughput: run a workload of the same shape untimed first.
        llm.generate(*offline_workload(args, vocab, seeds[-1] + 1), use_tqdm=False)
    runs = []
    for seed in seeds:
        prompts, params = offline_workload(args, vocab, seed)
        _sync(llm.config.device)
        with triton_compiles() as compiled:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            _sync(llm.config.device)
            elapsed = time.perf_counter() - start
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        runs.append({
            "seed": seed, "elapsed_s": elapsed,
            "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed,
            "kernels_compiled": compiled,  # inside the timed run: each costs ~1 s
        })
    if args.profile:
        profile_offline(llm, args, vocab, seeds[-1] + 2)
    llm.shutdown()
    median = sorted(runs, key=lambda r: r["output_tokens_per_s"])[(len(runs) - 1) // 2]
    return {"model": args.model, "num_seqs": args.num_seqs, "warmup": args.warmup,
            "backend": backend, "tensor_parallel_size": args.tensor_parallel_size, **median,
            "runs": runs}


def busy_fractions(events: list, start_us: float, end_us: float, bins: int) -> list[float]:
    """Share of each of `bins` equal slices of [start_us, end_us] in which a kernel ran."""
    width = (end_us - start_us) / bins
    busy = [0.0] * bins
    merged_end = start_us
    for begin, end in sorted((e.time_range.start, e.time_range.end) for e in events):
        begin = max(begin, merged_end)  # overlapping kernels count once
        if end <= begin:
            continue
        merged_end = end
        first, last = int((begin - start_us) // width), int((end - start_us) // width)
        for i in range(first, min(last, bins - 1) + 1):
            lo, hi = start_us + i * width, start_us + (i + 1) * width
            busy[i] += max(0.0, min(end, hi) - max(begin, lo))
    return [b / width for b in busy]


def profile_offline(llm: LLM, args: argparse.Namespace, vocab: int, seed: int) -> None:
    """The offline workload once more (other token ids) under torch.profiler: the kernels by
    device time and how busy the device was through the run, written to `--profile`."""
    from torch.profiler import ProfilerActivity, profile

    prompts, params = offline_workload(args, vocab, seed)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        _sync(llm.config.device)
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    start = min(e.time_range.start for e in events)
    end = max(e.time_range.end for e in events)
    busy = busy_fractions(kernels, start, end, bins=20)
    with open(args.profile, "w") as f:
        f.write(f"offline workload under the profiler: {(end - start) / 1e6:.2f} s, device busy "
                f"{sum(busy) / len(busy):.0%}\nbusy by twentieth of the run: "
                f"{' '.join(f'{b:.0%}' for b in busy)}\n\n")
        f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))


def decode_batch(batch_size: int, context: int, block_size: int) -> ScheduledBatch:
    """`batch_size` sequences of `context` tokens, each computing its last one, on disjoint
    blocks (sequence i holds blocks i*n .. i*n + n - 1)."""
    num_blocks = -(-context // block_size)
    seqs = []
    for i in range(batch_size):
        seq = Sequence([1] * context, SamplingParams(temperature=0.0, max_tokens=1))
        seq.num_computed_tokens = context - 1
        seq.block_table = list(range(i * num_blocks, (i + 1) * num_blocks))
        seqs.append(seq)
    return ScheduledBatch(seqs, [1] * batch_size)


def engine_decode_step(
    llm: LLM, batch_size: int, context: int, iters: int
) -> tuple[float, float]:
    """`(seconds per engine step, mean context)` over `iters` engine steps while `batch_size`
    sequences of about `context` tokens all decode: the loop as it runs, step k + 1 launched
    before step k's tokens are read, so host work hidden behind the device is not counted."""
    engine, cfg = llm.engine, llm.config
    vocab = cfg.model_config.hf_config.vocab_size
    # The first sequences to finish prefill decode while the others prefill: enough tokens
    # that none stops before the timed steps end.
    prefill_steps = -(-batch_size * context // cfg.scheduler_config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + iters + 8,
                            ignore_eos=True)
    rng = random.Random(batch_size)
    seqs = [seq for i in range(batch_size) for seq in llm.make_request(
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context - 1)]}, params, str(i))]
    for seq in seqs:
        engine.add_request(seq)
    while min(seq.num_output_tokens for seq in seqs) < 2:  # every sequence decoding
        engine.step()
    first = statistics.mean(len(seq) for seq in seqs)
    _sync(cfg.device)
    start = time.perf_counter()
    for _ in range(iters):
        engine.step()
    _sync(cfg.device)
    elapsed = time.perf_counter() - start
    mean_context = (first + statistics.mean(len(seq) for seq in seqs)) / 2
    while engine.has_unfinished():
        engine.step()
    return elapsed / iters, mean_context


def runner_step(llm: LLM, batch: ScheduledBatch, iters: int) -> float:
    """Median seconds of one synchronous model-runner step (host preparation, forward,
    sampling, results on the host), nothing overlapped."""
    runner = llm.engine.executor.workers[0].runner
    for _ in range(3):
        runner.execute(batch)
    return median_seconds(lambda: runner.execute(batch), llm.config.device, iters)


def bench_decode(model: str, args: argparse.Namespace, bandwidth: float) -> list[dict]:
    """Decode step time at each batch size against (weights + KV read) / copy bandwidth."""
    llm = LLM(model, device=args.device, load_format="dummy", max_num_seqs=max(args.decode_batches),
              max_model_len=args.decode_context + 256, enforce_eager=args.enforce_eager)
    worker = llm.engine.executor.workers[0]
    runner = worker.runner
    spec = runner.kv_cache_spec
    weight_bytes = worker.weights
    kv_bytes_per_token = spec.block_bytes // spec.block_size
    rows = []
    for batch_size in args.decode_batches:
        batch = decode_batch(batch_size, args.decode_context, spec.block_size)
        needed = batch_size * len(batch.seqs[0].block_table)
        if needed > runner.num_blocks:
            print(f"skip {model} batch {batch_size}: needs {needed} blocks, "
                  f"the cache holds {runner.num_blocks}")
            continue
        step, context = engine_decode_step(llm, batch_size, args.decode_context, args.iters)
        sync_step = runner_step(llm, batch, args.iters)  # after the engine's run has drained
        roofline = (weight_bytes + batch_size * context * kv_bytes_per_token) / bandwidth
        sync_roofline = (weight_bytes + batch_size * args.decode_context * kv_bytes_per_token
                         ) / bandwidth
        rows.append({
            "model": model, "batch": batch_size, "context": context,
            "step_ms": step * 1e3, "roofline_ms": roofline * 1e3, "ratio": step / roofline,
            "sync_step_ms": sync_step * 1e3, "sync_ratio": sync_step / sync_roofline,
            "weight_gib": weight_bytes / GiB,
            "kv_gib": batch_size * context * kv_bytes_per_token / GiB,
            "graphs": runner.graphs is not None and runner.graphs.can_run(batch),
        })
    llm.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="qwen3-0.6b-shape")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-models", nargs="*",
                        default=["qwen3-0.6b-shape", "qwen3-8b-shape"])
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed offline runs; the median (lower middle) is reported")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks of the throughput run (decode runs one in-process rank)")
    parser.add_argument("--distributed-executor-backend", nargs="+", default=["uni"],
                        choices=["uni", "mp"], metavar="BACKEND",
                        help="uni and/or mp: one throughput run each, side by side, with the "
                             "ratio to the first (uni mp: what the process boundary costs)")
    parser.add_argument("--profile", metavar="PATH",
                        help="after the timed run, profile the offline workload once more and "
                             "write the kernel table and device busy time to PATH")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="an untimed run of the offline workload's shape first (kernel "
                             "compilation)")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)

    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu"}
    if not args.skip_throughput:
        result["throughputs"] = []
        for backend in args.distributed_executor_backend:
            result["throughputs"].append(bench_throughput(args, backend))
            gc.collect()
        result["throughput"] = result["throughputs"][0]
    result["copy_bandwidth_gbps"] = copy_bandwidth(device) / 1e9
    result["decode"] = []
    for model in args.decode_models:
        result["decode"] += bench_decode(model, args, result["copy_bandwidth_gbps"] * 1e9)
        gc.collect()
    write_record(args.out, record_of("throughput", result, vars(args)))

    print(f"device: {result['device']}, copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s")
    for t in result.get("throughputs", []):
        each = ", ".join(f"{r['output_tokens_per_s']:,.0f} ({len(r['kernels_compiled'])} "
                         f"compiles)" for r in t["runs"])
        ratio = t["output_tokens_per_s"] / result["throughput"]["output_tokens_per_s"]
        print(f"offline {t['model']} ({t['backend']}, TP={t['tensor_parallel_size']}): "
              f"{t['num_seqs']} seqs in {t['elapsed_s']:.2f} s, "
              f"{t['output_tokens_per_s']:,.0f} output tok/s ({ratio:.3f} x the first), "
              f"{t['total_tokens_per_s']:,.0f} total tok/s (median of {len(t['runs'])}: {each})")
    print(f"{'model':<18} {'batch':>5} {'context':>7} {'step ms':>8} {'roofline ms':>11} "
          f"{'ratio':>5} {'sync step ms':>12} {'sync ratio':>10} graphs")
    for r in result["decode"]:
        print(f"{r['model']:<18} {r['batch']:>5} {r['context']:>7.0f} {r['step_ms']:>8.3f} "
              f"{r['roofline_ms']:>11.3f} {r['ratio']:>5.2f} {r['sync_step_ms']:>12.3f} "
              f"{r['sync_ratio']:>10.2f} {r['graphs']}")


if __name__ == "__main__":
    main()
