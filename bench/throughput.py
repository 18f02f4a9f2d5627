"""Engine benchmark: offline throughput, decode step time and time to first token, each against
the physical limit of the same work on the same device.

    python3 bench/throughput.py --out throughput.json                 # on the GPU machine
    python3 bench/throughput.py --device cpu --model kvfit-tiny --num-seqs 8 --min-len 8 \\
        --max-len 64 --decode-models kvfit-tiny --decode-batches 1 4 --decode-context 32 \\
        --ttft-models kvfit-tiny --ttft-len 64 --out t.json

Throughput: `--num-seqs` requests of random token ids, prompt and output lengths uniform in
[`--min-len`, `--max-len`], ignore_eos, sampled at temperature 1 (dummy weights), after an untimed
run of the same shape (kernel compilation); the median of `--repeat` timed runs. Decode: the mean
engine step while a batch of sequences of about `--decode-context` tokens all decode, over
`--iters` steps of the engine loop as it runs (the median of `--decode-repeat` such runs;
overlapped: step k + 1 is launched before step k's tokens are read; CUDA graphs unless
--enforce-eager); and, for reference, the median synchronous
model-runner step (host work and device work one after the other). TTFT: one prompt of
`--ttft-len` random tokens, one output token, in one prefill step (median of `--ttft-repeat`).
`--small-batch-kernels both` runs each decode row with the engine's `small_batch_kernels` off
and then on (one engine each), side by side; offline and TTFT runs use the first setting.

Limits (`kvfit.benchmarks.limits`): the copy bandwidth and bf16 GEMM throughput are measured
first, in the same run; every step each measurement launched is recorded as scheduled, and its
limit is max(bytes / bandwidth, FLOPs / GEMM throughput), summed over the steps. Each figure
carries `of_limit` = limit time / measured time (1.0 = at the limit). Writes JSON to --out and
prints a table.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from types import ModuleType

import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import (
    DeviceLimits,
    ModelShape,
    RunLimit,
    StepShape,
    limit_keys,
    measure_device_limits,
    run_limit,
)
from kvfit.benchmarks.profiling import KernelProfile, per_step_text, profile_run, profile_text
from kvfit.benchmarks.record import write_record
from kvfit.engine.config import at_least_one
from kvfit.engine.sequence import ScheduledBatch, Sequence
from kvfit.ops import small_batch as small_batch_ops
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


class StepRecorder:
    """Within `with`, the shape of every step `llm`'s engine launches (`steps`), taken before
    the launch advances its sequences; a launch that raises (an OOM the guard retries) is not
    kept. Costs one pass over each step's sequences on the host."""

    def __init__(self, llm: LLM) -> None:
        self.executor = llm.engine.executor
        self.steps: list[StepShape] = []

    def __enter__(self) -> StepRecorder:
        launch = self.executor.launch

        def recording_launch(batch: ScheduledBatch) -> object:
            starts = [s.num_computed_tokens for s in batch.seqs]
            logits = sum(a + n == len(s) for a, n, s in
                         zip(starts, batch.num_new_tokens, batch.seqs, strict=True))
            launched = launch(batch)
            self.steps.append(StepShape(starts, list(batch.num_new_tokens), logits))
            return launched

        self.executor.launch = recording_launch
        return self

    def __exit__(self, *exc: object) -> None:
        del self.executor.launch  # the class's method again


def model_shape(llm: LLM) -> ModelShape:
    """The counted shape of `llm`'s model in its dtype, its KV cache in the cache's dtype (an
    fp8 cache moves half the bytes of a bf16 one, and its limit says so)."""
    mc = llm.config.model_config
    return ModelShape.from_hf_config(mc.hf_config, dtype_bytes=mc.dtype.itemsize,
                                     kv_dtype_bytes=llm.config.kv_cache_spec().dtype.itemsize)


def limit_of(llm: LLM, steps: list[StepShape], limits: DeviceLimits) -> RunLimit:
    """The limit of `steps` on one device; tensor-parallel ranks each do 1/TP of it at once."""
    limit = run_limit(model_shape(llm), steps, limits)
    tp = llm.config.parallel_config.tensor_parallel_size
    return RunLimit(limit.seconds / tp, limit.work, limit.num_steps, limit.memory_bound_steps)


# Counts of requests, tokens, runs and steps: 0 left a median of no runs (an IndexError) or a
# rate over no work (a ZeroDivisionError), after the engines had run.
count = at_least_one("a count")


def check_lengths(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--min-len` at most `--max-len`: the lengths are drawn from between them."""
    if args.min_len > args.max_len:
        parser.error(f"--min-len {args.min_len} is more than --max-len {args.max_len}")


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


def bench_throughput(args: argparse.Namespace, limits: DeviceLimits, backend: str = "uni",
                     cudagraph_mode: str = "FULL_DECODE_ONLY") -> dict:
    """The offline workload: tokens per second from submission to the last completion, median
    of `--repeat` timed runs of the same shape (other token ids each, so no prefix-cache hits),
    with the workers run by `backend` (`--distributed-executor-backend`) and the graphs
    `cudagraph_mode` asks for; each run against the limit of the steps it ran."""
    llm = LLM(args.model, device=args.device, load_format="dummy",
              max_model_len=2 * args.max_len + 1, enforce_eager=args.enforce_eager,
              tensor_parallel_size=args.tensor_parallel_size,
              distributed_executor_backend=backend, cudagraph_mode=cudagraph_mode,
              small_batch_kernels=small_batch_settings(args)[0],
              fused_decode_input=SMALL_BATCH_SETTINGS[args.fused_decode_input][0])
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
        with triton_compiles() as compiled, StepRecorder(llm) as recorder:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            _sync(llm.config.device)
            elapsed = time.perf_counter() - start
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        limit = limit_of(llm, recorder.steps, limits)
        runs.append({
            "seed": seed, "elapsed_s": elapsed,
            "output_tokens": output_tokens, "prompt_tokens": prompt_tokens,
            "output_tokens_per_s": output_tokens / elapsed,
            "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed,
            "limit_output_tokens_per_s": output_tokens / limit.seconds,
            "of_limit": limit.seconds / elapsed, "limit": limit.as_dict(),
            "kernels_compiled": compiled,  # inside the timed run: each costs ~1 s
        })
    profile = None
    if args.profile:
        profile = profile_offline(llm, args, vocab, seeds[-1] + 2)
        Path(args.profile).write_text(profile_text(profile))
    llm.shutdown()
    median = sorted(runs, key=lambda r: r["output_tokens_per_s"])[(len(runs) - 1) // 2]
    return {"model": args.model, "num_seqs": args.num_seqs, "warmup": args.warmup,
            "backend": backend, "cudagraph_mode": cudagraph_mode,
            "tensor_parallel_size": args.tensor_parallel_size, **median, "runs": runs,
            **({"profile": profile.as_dict()} if profile else {})}


def profile_offline(llm: LLM, args: argparse.Namespace, vocab: int, seed: int) -> KernelProfile:
    """The offline workload once more (other token ids) under torch.profiler: the kernels by
    device time and family, split by step kind, and how busy the device was through the run
    (`kvfit.benchmarks.profiling`)."""
    prompts, params = offline_workload(args, vocab, seed)

    def run() -> None:
        llm.generate(prompts, params, use_tqdm=False)
        _sync(llm.config.device)

    return profile_run(run, llm, llm.config.device)


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
    llm: LLM, batch_size: int, context: int, iters: int, profile: bool = False,
    repeat: int = 1,
) -> tuple[list[float], float, list[StepShape], KernelProfile | None]:
    """`(seconds per engine step of each of `repeat` timed runs, mean context, the steps
    launched, their profile)`, each run `iters` engine steps while `batch_size` sequences of
    about `context` tokens all decode: the loop as it runs, step k + 1 launched before step
    k's tokens are read, so host work hidden behind the device is not counted. With `profile`,
    `iters` more steps, untimed, run under torch.profiler (`profile_run`); else the profile
    is None."""
    engine, cfg = llm.engine, llm.config
    vocab = cfg.model_config.hf_config.vocab_size
    # The first sequences to finish prefill decode while the others prefill: enough tokens
    # that none stops before the timed steps end.
    prefill_steps = -(-batch_size * context // cfg.scheduler_config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0,
                            max_tokens=prefill_steps + iters * (repeat + profile) + 8,
                            ignore_eos=True)
    rng = random.Random(batch_size)
    seqs = [seq for i in range(batch_size) for seq in llm.make_request(
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(context - 1)]}, params, str(i))]
    for seq in seqs:
        engine.add_request(seq)
    while min(seq.num_output_tokens for seq in seqs) < 2:  # every sequence decoding
        engine.step()
    first = statistics.mean(len(seq) for seq in seqs)

    def steps() -> None:
        for _ in range(iters):
            engine.step()
        _sync(cfg.device)

    _sync(cfg.device)
    times = []
    with StepRecorder(llm) as recorder:
        for _ in range(repeat):
            start = time.perf_counter()
            steps()
            times.append((time.perf_counter() - start) / iters)
    mean_context = (first + statistics.mean(len(seq) for seq in seqs)) / 2
    profiled = profile_run(steps, llm, cfg.device) if profile else None
    while engine.has_unfinished():
        engine.step()
    return times, mean_context, recorder.steps, profiled


def runner_step(llm: LLM, batch: ScheduledBatch, iters: int) -> float:
    """Median seconds of one synchronous model-runner step (host preparation, forward,
    sampling, results on the host), nothing overlapped."""
    runner = llm.engine.executor.workers[0].runner
    for _ in range(3):
        runner.execute(batch)
    return median_seconds(lambda: runner.execute(batch), llm.config.device, iters)


SMALL_BATCH_SETTINGS = {"off": [False], "on": [True], "both": [False, True]}


def small_batch_settings(args: argparse.Namespace) -> list[bool]:
    """The engine's `small_batch_kernels` per decode run (`--small-batch-kernels`)."""
    return SMALL_BATCH_SETTINGS[args.small_batch_kernels]


def decode_settings(args: argparse.Namespace
                    ) -> list[tuple[bool, bool, bool | None, str | None, bool | None,
                                    bool | None]]:
    """(fused_decode_input, small_batch_kernels, PDL, its trigger, QKV epilogue, one-row MMA)
    per decode engine: each `--fused-decode-input` setting by each `--small-batch-kernels`
    setting, the ones with the kernels on once per `--pdl` setting (None:
    `ops.pdl.PDL_DEFAULT`), those with PDL on once per `--pdl-trigger` (None: as
    `ops.pdl.PDL_EARLY` says), and each of those once per `--qkv-epilogue` setting (None:
    `small_batch.QKV_EPILOGUE_DEFAULT`) and `--one-row-mma` setting (None:
    `triton_skinny.ROW_MMA_PROLOGUE`)."""
    default = {"default": [None], **SMALL_BATCH_SETTINGS}
    pdl, qkv, mma = default[args.pdl], default[args.qkv_epilogue], default[args.one_row_mma]
    triggers = args.pdl_trigger or [None]
    return [(fused, small, p, t, e, m)
            for fused in SMALL_BATCH_SETTINGS[args.fused_decode_input]
            for small in small_batch_settings(args)
            for p in (pdl if small else [None]) for t in (triggers if p else [None])
            for e in (qkv if small else [None]) for m in (mma if small else [None])]


@contextmanager
def pdl_default(pdl: bool | None, trigger: str | None = None) -> Iterator[None]:
    """The small-batch step's kernels launch with programmatic dependent launch per `pdl`
    (None: as they would), releasing their successors as `trigger` says ("early", "late";
    None: as they would), within the block: an engine built in it captures its graphs so."""
    if pdl is None or not torch.cuda.is_available():
        yield
        return
    from kvfit.ops import pdl as ops_pdl  # imports Triton

    saved = ops_pdl.PDL_DEFAULT, ops_pdl.PDL_EARLY
    ops_pdl.PDL_DEFAULT = pdl
    if trigger is not None:
        ops_pdl.PDL_EARLY = trigger == "early"
    try:
        yield
    finally:
        ops_pdl.PDL_DEFAULT, ops_pdl.PDL_EARLY = saved


@contextmanager
def module_setting(module: ModuleType, name: str, value: bool | None) -> Iterator[None]:
    """`module.name` set to `value` (None: as it is) within the block, then back: an engine
    built in it reads the setting at its build and its graphs' capture."""
    if value is None:
        yield
        return
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def qkv_epilogue_default(epilogue: bool | None) -> AbstractContextManager[None]:
    """`small_batch.QKV_EPILOGUE_DEFAULT` set to `epilogue` (None: as it is) within the
    block: an engine built in it allocates its head tickets, or not, and runs so."""
    return module_setting(small_batch_ops, "QKV_EPILOGUE_DEFAULT", epilogue)


def one_row_mma(enabled: bool | None) -> AbstractContextManager[None]:
    """`triton_skinny.ROW_MMA_PROLOGUE` set to `enabled` (None: as it is) within the block:
    an engine built in it captures its one-row graphs with the fused prologues' MMA, or not."""
    if enabled is None or not torch.cuda.is_available():
        return nullcontext()
    from kvfit.ops import triton_skinny  # imports Triton

    return module_setting(triton_skinny, "ROW_MMA_PROLOGUE", enabled)


def bench_decode(model: str, args: argparse.Namespace, limits: DeviceLimits,
                 small_batch: bool = False, pdl: bool | None = None,
                 trigger: str | None = None, fused: bool = False,
                 epilogue: bool | None = None, mma: bool | None = None) -> list[dict]:
    """Decode step time at each batch size against the limit of the same steps (weights and
    KV reads over the copy bandwidth, unless the GEMMs' FLOPs take longer), with the engine's
    `small_batch_kernels` set to `small_batch`, its kernels' PDL to `pdl` with `trigger`
    (`pdl_default`), its QKV epilogue to `epilogue` (`qkv_epilogue_default`), its fused
    one-row prologues' product to `mma` (`one_row_mma`) and its
    `fused_decode_input` to `fused`. With `--profile-decode`, each row's steps once more
    under the profiler, appended to that file (`per_step_text`)."""
    with pdl_default(pdl, trigger), qkv_epilogue_default(epilogue), one_row_mma(mma):
        rows = _bench_decode(model, args, limits, small_batch, pdl, trigger, fused)
    for row in rows:
        row["qkv_epilogue"], row["one_row_mma"] = epilogue, mma
    return rows


def _bench_decode(model: str, args: argparse.Namespace, limits: DeviceLimits,
                  small_batch: bool, pdl: bool | None, trigger: str | None,
                  fused: bool) -> list[dict]:
    llm = LLM(model, device=args.device, load_format="dummy", max_num_seqs=max(args.decode_batches),
              max_model_len=args.decode_context + 256, enforce_eager=args.enforce_eager,
              cudagraph_mode=args.cudagraph_mode[0], small_batch_kernels=small_batch,
              fused_decode_input=fused)
    runner = llm.engine.executor.workers[0].runner
    spec = runner.kv_cache_spec
    shape = model_shape(llm)
    rows = []
    for batch_size in args.decode_batches:
        batch = decode_batch(batch_size, args.decode_context, spec.block_size)
        needed = batch_size * len(batch.seqs[0].block_table)
        if needed > runner.num_blocks:
            print(f"skip {model} batch {batch_size}: needs {needed} blocks, "
                  f"the cache holds {runner.num_blocks}")
            continue
        times, context, steps, profile = engine_decode_step(
            llm, batch_size, args.decode_context, args.iters, bool(args.profile_decode),
            args.decode_repeat)
        step = statistics.median(times)
        if profile is not None:
            label = (f"{model} batch {batch_size}, small_batch_kernels {small_batch}, "
                     f"PDL {pdl}{f' ({trigger} trigger)' if trigger else ''}, "
                     f"fused_decode_input {fused}")
            with open(args.profile_decode, "a") as f:
                f.write(per_step_text(profile, label) + "\n\n")
        sync_step = runner_step(llm, batch, args.iters)  # after the engine's run has drained
        limit = limit_of(llm, steps, limits)
        roofline = limit.seconds / len(steps)
        sync_roofline = run_limit(shape, [StepShape([args.decode_context - 1] * batch_size,
                                                    [1] * batch_size, batch_size)],
                                  limits).seconds
        rows.append({
            "model": model, "batch": batch_size, "context": context,
            "small_batch_kernels": small_batch, "pdl": pdl, "pdl_trigger": trigger,
            "fused_decode_input": fused,
            "step_ms": step * 1e3, "step_ms_runs": [t * 1e3 for t in times],
            "roofline_ms": roofline * 1e3, "ratio": step / roofline,
            "of_limit": roofline / step,
            "sync_step_ms": sync_step * 1e3, "sync_ratio": sync_step / sync_roofline,
            "weight_gib": limit.work.weight_bytes / len(steps) / GiB,
            "kv_gib": limit.work.kv_read_bytes / len(steps) / GiB,
            "memory_bound": limit.memory_bound_steps == limit.num_steps,
            "graphs": runner.graphs is not None and runner.graphs.can_run(batch),
        })
    llm.shutdown()
    return rows


def bench_ttft(model: str, args: argparse.Namespace, limits: DeviceLimits) -> dict:
    """Time to first token of one prompt of `--ttft-len` random tokens (one output token,
    prefilled in one step), median of `--ttft-repeat` after an untimed one; against the limit
    of the steps it ran (compute-bound: the GEMMs' and attention's FLOPs)."""
    llm = LLM(model, device=args.device, load_format="dummy", max_model_len=args.ttft_len + 1,
              max_num_batched_tokens=args.ttft_len, max_num_seqs=1,
              enable_prefix_caching=False, enforce_eager=args.enforce_eager,
              cudagraph_mode=args.cudagraph_mode[0],
              small_batch_kernels=small_batch_settings(args)[0],
              fused_decode_input=SMALL_BATCH_SETTINGS[args.fused_decode_input][0])
    vocab = llm.config.model_config.hf_config.vocab_size
    rng = random.Random(args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, limit = [], None
    for i in range(args.ttft_repeat + 1):
        prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.ttft_len)]}
        _sync(llm.config.device)
        with StepRecorder(llm) as recorder:
            start = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            _sync(llm.config.device)
            elapsed = time.perf_counter() - start
        if i:  # the first call compiles and warms: not timed
            times.append(elapsed)
            limit = limit_of(llm, recorder.steps, limits)
    llm.shutdown()
    ttft = statistics.median(times)
    return {"model": model, "prompt_len": args.ttft_len, "ttft_s": ttft, "runs_s": times,
            "limit_s": limit.seconds, "of_limit": limit.seconds / ttft, "limit": limit.as_dict()}


def _pdl_label(row: dict) -> str:
    return f"{row.get('pdl')}" + (f"/{row['pdl_trigger']}" if row.get("pdl_trigger") else "")


def _kernel_setting(parser: argparse.ArgumentParser, flag: str, what: str,
                    default: str) -> None:
    """A flag for a setting of the small-batch kernels' module (`default`): off, on, both (one
    engine each, side by side) or default (as the module says)."""
    parser.add_argument(flag, choices=["default", *sorted(SMALL_BATCH_SETTINGS)],
                        default="default",
                        help=f"with the small-batch kernels on, {what}: off, on, both (one "
                             f"engine each, side by side), or default: as {default} says")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="qwen3-0.6b-shape")
    parser.add_argument("--num-seqs", type=count, default=256)
    parser.add_argument("--min-len", type=count, default=100)
    parser.add_argument("--max-len", type=count, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-models", nargs="*",
                        default=["qwen3-0.6b-shape", "qwen3-8b-shape"])
    parser.add_argument("--decode-batches", type=count, nargs="+", default=[1, 64, 256])
    parser.add_argument("--decode-context", type=count, default=1024)
    parser.add_argument("--iters", type=count, default=20)
    parser.add_argument("--decode-repeat", type=count, default=3,
                        help="timed runs of --iters steps per decode row; the median is "
                             "reported, every run kept in the record (a slow host or one "
                             "hiccup moves a 20-step run of a 1 ms step by 10%%)")
    parser.add_argument("--ttft-models", nargs="*", default=["qwen3-8b-shape"],
                        help="models whose time to first token is measured (none: skip)")
    parser.add_argument("--ttft-len", type=count, default=8192, help="TTFT prompt length")
    parser.add_argument("--ttft-repeat", type=count, default=3,
                        help="timed TTFT runs (after one untimed); the median is reported")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--repeat", type=count, default=1,
                        help="timed offline runs; the median (lower middle) is reported")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks of the throughput run (decode runs one in-process rank)")
    parser.add_argument("--distributed-executor-backend", nargs="+", default=["uni"],
                        choices=["uni", "mp"], metavar="BACKEND",
                        help="uni and/or mp: one throughput run each, side by side, with the "
                             "ratio to the first (uni mp: what the process boundary costs)")
    parser.add_argument("--cudagraph-mode", nargs="+", type=str.upper, metavar="MODE",
                        default=["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"],
                        help="one offline run per mode, side by side, with the ratio to the "
                             "first (the default: prefill and mixed steps eager, then from "
                             "piecewise graphs); decode and TTFT runs use the first")
    parser.add_argument("--small-batch-kernels", choices=sorted(SMALL_BATCH_SETTINGS),
                        default="on",
                        help="the engine's small_batch_kernels (CUDA only: a no-op on the "
                             "CPU): off, on, or both: each decode row off then on, side by "
                             "side; offline and TTFT runs use the first (default: "
                             "%(default)s, as the engine's)")
    parser.add_argument("--fused-decode-input", choices=sorted(SMALL_BATCH_SETTINGS),
                        default="off",
                        help="the engine's fused_decode_input (a decode step's attention input "
                             "inside its attention kernel): off, on, or both: each decode row "
                             "off then on, side by side; offline and TTFT runs use the first "
                             "(default: %(default)s, as the engine's)")
    _kernel_setting(parser, "--pdl", "launch a small step's kernels with programmatic "
                    "dependent launch (sm_90+)", "ops/pdl.PDL_DEFAULT")
    parser.add_argument("--pdl-trigger", nargs="+", choices=["early", "late"],
                        help="where a PDL kernel lets its successor start (ops/pdl.PDL_EARLY): "
                             "right after its wait, or after its main loop; each engine with "
                             "PDL on once per trigger given (default: as PDL_EARLY says)")
    _kernel_setting(parser, "--qkv-epilogue", "run each layer's attention input in its QKV "
                    "projection's kernel", "ops/small_batch.QKV_EPILOGUE_DEFAULT")
    _kernel_setting(parser, "--one-row-mma", "feed a one-row fused norm's output to the "
                    "16-row MMA in kernels wider than 32 rows of W, not FMAs",
                    "ops/triton_skinny.ROW_MMA_PROLOGUE")
    parser.add_argument("--profile-decode", metavar="PATH",
                        help="profile each decode row's steps once more and append, per step, "
                             "the device span, the kernels' time and each kernel to PATH")
    parser.add_argument("--profile", metavar="PATH",
                        help="after the timed run, profile the offline workload once more and "
                             "write the kernel table and device busy time to PATH")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="an untimed run of the offline workload's shape first (kernel "
                             "compilation)")
    args = parser.parse_args(argv)
    check_lengths(parser, args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)

    result: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                    else "cpu"}
    # First, before any engine holds memory: the limits every figure is held against (on the
    # CPU too, unlike `in_run_limits`: the CPU figures are held against them as well).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the engine's default
    limits = measure_device_limits(device, dtype)
    result |= limit_keys(limits, dtype)
    if not args.skip_throughput:
        result["throughputs"] = []
        for backend in args.distributed_executor_backend:
            for mode in args.cudagraph_mode:
                result["throughputs"].append(bench_throughput(args, limits, backend, mode))
                gc.collect()
        result["throughput"] = result["throughputs"][0]
    result["decode"] = []
    for model in args.decode_models:
        for fused, small, pdl, trigger, epilogue, mma in decode_settings(args):
            result["decode"] += bench_decode(model, args, limits, small, pdl, trigger, fused,
                                             epilogue, mma)
            gc.collect()
    result["ttft"] = []
    for model in args.ttft_models:
        result["ttft"].append(bench_ttft(model, args, limits))
        gc.collect()
    write_record(args.out, record_of("throughput", result, vars(args)))
    print_tables(result)


def print_tables(result: dict) -> None:
    """The figures of a run, each with its share of the limit."""
    print(f"device: {result['device']}, copy bandwidth {result['copy_bandwidth_gbps']:.0f} GB/s, "
          f"{result['gemm_dtype']} GEMM {result['gemm_tflops']:.1f} TFLOP/s")
    for t in result.get("throughputs", []):
        each = ", ".join(f"{r['output_tokens_per_s']:,.0f} ({len(r['kernels_compiled'])} "
                         f"compiles)" for r in t["runs"])
        ratio = t["output_tokens_per_s"] / result["throughput"]["output_tokens_per_s"]
        print(f"offline {t['model']} ({t['backend']}, TP={t['tensor_parallel_size']}, "
              f"{t['cudagraph_mode']}): "
              f"{t['num_seqs']} seqs in {t['elapsed_s']:.2f} s, "
              f"{t['output_tokens_per_s']:,.0f} output tok/s ({ratio:.3f} x the first), "
              f"{t['total_tokens_per_s']:,.0f} total tok/s (median of {len(t['runs'])}: {each}); "
              f"limit {t['limit_output_tokens_per_s']:,.0f} output tok/s "
              f"({t['limit']['memory_bound_steps']}/{t['limit']['num_steps']} steps "
              f"memory-bound): {t['of_limit']:.1%} of the limit")
    print(f"{'model':<18} {'batch':>5} {'context':>7} {'step ms':>8} {'limit ms':>8} "
          f"{'ratio':>5} {'of limit':>8} {'sync step ms':>12} {'sync ratio':>10} graphs "
          f"small-batch pdl        fused qkv-epilogue mma   runs ms")
    for r in result["decode"]:
        runs = " ".join(f"{t:.3f}" for t in r.get("step_ms_runs", []))
        print(f"{r['model']:<18} {r['batch']:>5} {r['context']:>7.0f} {r['step_ms']:>8.3f} "
              f"{r['roofline_ms']:>8.3f} {r['ratio']:>5.2f} {r['of_limit']:>8.1%} "
              f"{r['sync_step_ms']:>12.3f} {r['sync_ratio']:>10.2f} {r['graphs']!s:6} "
              f"{r.get('small_batch_kernels', False)!s:11} {_pdl_label(r):10} "
              f"{r.get('fused_decode_input', False)!s:5} {r.get('qkv_epilogue')!s:12} "
              f"{r.get('one_row_mma')!s:5} {runs}")
    for r in result.get("ttft", []):
        print(f"TTFT {r['model']} {r['prompt_len']} tokens: {r['ttft_s'] * 1e3:.1f} ms, limit "
              f"{r['limit_s'] * 1e3:.1f} ms ({r['limit']['gemm_tflop']:.3g} TFLOP GEMM + "
              f"{r['limit']['attention_tflop']:.3g} TFLOP attention): "
              f"{r['of_limit']:.1%} of the limit")


if __name__ == "__main__":
    main()
