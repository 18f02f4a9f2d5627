"""Adversarial sampling sweep: every sampling feature users send, alone and all at once, at a
full batch and with prompts long enough to force preemption, against the headroom that measured
sizing kept. The successor of capacity.py's adversarial run (issue: top_p at a full batch ran
out of memory on the H200 because warmup never ran that path).

How to run (on the GPU machine, one model per call; JSON and run.log land in $OUT):

    TESTS=none BENCH_TIMEOUT=360 bash bench/run_gpu.sh \
        "adversarial --models qwen3-0.6b-shape --deadline-s 270"
    TESTS=none BENCH_TIMEOUT=420 TAG=_8b bash bench/run_gpu.sh \
        "adversarial --models qwen3-8b-shape --num-prompts 288 --prompt-len 16 96 \
         --max-tokens 12 --long-factor 1.1 --deadline-s 280"

Engine settings of a user's beyond the model: `--kv-cache-dtype fp8` (the e4m3 cache's
kernels and scratch), `--[no-]small-batch-kernels` (the one-node layers of steps of at most
16 tokens) and `--[no-]fused-decode-input` (a decode step's attention input in its attention
kernel), e.g. `"adversarial --models qwen3-0.6b-shape --kv-cache-dtype fp8 --deadline-s 270"`;
and a kernel switch, `--[no-]qkv-epilogue` (the attention input in the QKV projection's
kernel, with its head tickets: `ops/small_batch.QKV_EPILOGUE_DEFAULT`).

About 4 and 5-5.5 minutes. Filling the cache is the floor of each "all+long" run (8B: ~0.9M prompt
tokens at ~25k tok/s, four times). `--deadline-s` starts no run or engine once that many seconds
have passed, so a slow machine loses its last runs (marked skipped), not the whole call; a long
run started just before it can take a minute more. The JSON is rewritten after every run.
CPU smoke check (seconds; the host cache cannot overflow at its size cap, so no preemption):

    python3 bench/adversarial.py --device cpu --models kvfit-tiny --max-model-len 256 \
        --max-num-seqs 8 --num-prompts 12 --max-tokens 4 --out /tmp/a.json

What it does. One engine per (model, max_model_len, margin mode), dummy weights, reused across
its runs: margin "default" (the engine's) and "zero" (floor 0, fraction 0: the headroom is the
measured transient alone, so only the out-of-memory guard can save a step warmup missed). Runs:
one per feature of `feature_kwargs` (a new feature is one line there), then "all" (every
feature at once), then "all+long" (all features, long prompts, enough KV tokens in total to
exceed the cache's capacity so the scheduler preempts; where max_num_seqs x max_model_len fits
in the cache it cannot, and one full batch of long prompts runs instead, noted). Short runs
send more sequences than max_num_seqs (`--num-prompts` counts sequences: a run with n=4 sends a
quarter as many requests) with random prompt lengths and random token ids (`ignore_eos`).

Per run: headroom kept (the report's transient + margin); the true peak need (the allocator's
peak reserved above the live allocations at ready, torch's idle cache emptied before each run
so a row is its own run's need; on the CPU the host's resident high-water mark, KV pages
excluded, which counts the run's Python objects too: a smoke check, not a figure); need/kept
and kept/need; out-of-memory errors (caught, recorded; the engine is rebuilt for the next run);
preemptions; the largest batch scheduled; requests completed vs sent; guard events
(`llm.engine.oom_guard.events` where the guard exists, else none) and the committed KV blocks
after the run. Per sweep (model, margin mode): the worst kept/peak-need ratio, where an
engine's peak need is the largest over its runs (target <= 1.5 at default margins), OOMs
(target 0), guard events (target 0 at default margins), and whether every request completed
(target: yes with margin zero). Exit status 1 if any run failed other than by OOM (a bug).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from capacity import free_memory, print_table, shut_down
from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import bench_device, in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.engine.config import LOGPROBS_MODES
from kvfit.engine.sampling_params import MAX_TOKEN_LIST
from kvfit.kv.monitor import CudaMemoryMonitor, HostMemoryMonitor, MemoryMonitor
from kvfit.kv.report import format_bytes
from kvfit.ops import small_batch

MARGINS: dict[str, dict[str, Any]] = {
    "default": {},
    "zero": {"kv_cache_margin_floor_bytes": 0, "kv_cache_margin_fraction": 0.0},
}
ALL, LONG = "all", "all+long"
# A long run decodes this much longer than filling the cache takes, so the first sequences are
# still alive (holding their blocks) when the last prompt arrives.
LONG_DECODE_SLACK = 1.25


def token_lists(vocab_size: int) -> tuple[list[int], ...]:
    """Four disjoint runs of token ids (bias, bad words, stop ids, allowed ids), MAX_TOKEN_LIST
    long where the vocabulary allows, else a quarter of it each: the allowed tokens are never
    banned, so no row is left without a token."""
    size = min(MAX_TOKEN_LIST, vocab_size // 4)
    return tuple(list(range(i * size, (i + 1) * size)) for i in range(4))


def bad_words(ids: list[int]) -> list[list[int]]:
    """`len(ids)` bad words: half one token (banned outright), half two tokens (banned after
    their first, the check that reads each row's output on the host)."""
    half = len(ids) // 2
    return [[t] for t in ids[:half]] + [[ids[i], ids[i - half]] for i in range(half, len(ids))]


def feature_kwargs(vocab_size: int, max_logprobs: int, max_tokens: int) -> dict[str, dict]:
    """Each feature's SamplingParams settings as users send them; one line per feature."""
    bias, words, stops, allowed = token_lists(vocab_size)
    return {
        "temperature": {"temperature": 0.8},
        "top_k": {"top_k": 40},
        "top_p": {"top_p": 0.9},
        "min_p": {"min_p": 0.05},
        "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5,
                      "repetition_penalty": 1.2},
        "logit_bias": {"logit_bias": {t: 2.0 for t in bias}},
        "seed": {"seed": 1234},
        "n": {"n": 4},
        "bad_words": {"bad_words_token_ids": bad_words(words)},
        # min_tokens = max_tokens: the stop ids stay banned for the whole run.
        "min_tokens": {"min_tokens": max_tokens, "stop_token_ids": stops},
        # Each row's undo copies the row whole: the one dense [rows, V] copy of the sampler.
        "allowed_token_ids": {"allowed_token_ids": allowed},
        "logprobs": {"logprobs": max_logprobs},
        "prompt_logprobs": {"prompt_logprobs": max_logprobs},
    }


FEATURES = tuple(feature_kwargs(64, 1, 1))
RUNS = (*FEATURES, ALL, LONG)


def sampling_params(run: str, llm: LLM, max_tokens: int) -> SamplingParams:
    """The params of `run`: one feature, or every feature merged for "all" and "all+long"."""
    mc = llm.config.model_config
    table = feature_kwargs(mc.hf_config.vocab_size, mc.max_logprobs, max_tokens)
    kwargs = {k: v for f in table.values() for k, v in f.items()} if run in (ALL, LONG) \
        else table[run]
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kwargs)


def random_prompts(rng: np.random.Generator, lengths: list[int], vocab_size: int) -> list[dict]:
    return [{"prompt_token_ids": rng.integers(0, vocab_size, n).tolist()} for n in lengths]


def short_lengths(args: argparse.Namespace, llm: LLM, rng: np.random.Generator,
                  num_requests: int) -> list[int]:
    """Random prompt lengths within `--prompt-len`, leaving room for max_tokens."""
    hi = min(args.prompt_len[1], llm.config.model_config.max_model_len - args.max_tokens - 1)
    lo = min(args.prompt_len[0], hi)
    return rng.integers(lo, hi + 1, num_requests).tolist()


@dataclass
class LongPlan:
    """The "all+long" run: how many long requests, how long, and whether they can overflow."""

    num_requests: int
    prompt_len: tuple[int, int]
    max_tokens: int
    capacity_tokens: int
    forced: bool
    note: str


def plan_long_run(args: argparse.Namespace, llm: LLM, n: int) -> LongPlan:
    """Long prompts (7/8 to all of max_model_len less the output), as few as give
    `--long-factor` x the cache's token capacity, each sibling counted whole (prompt logprobs
    turn prefix hits off). Preemption needs more live KV than the cache holds, and at most
    max_num_seqs sequences live at once: where those fit, one full batch of long prompts runs."""
    sc, block_size = llm.config.scheduler_config, llm.config.cache_config.block_size
    capacity = llm.kv_cache_report.num_blocks * block_size
    prompt = sc.max_model_len * 15 // 16  # about the mean long prompt
    chunk = min(prompt, sc.max_num_batched_tokens)
    decode = args.long_max_tokens or max(
        args.max_tokens,
        # The first sequences must still be decoding (holding their blocks) when the cache
        # fills, which takes capacity / max_num_batched_tokens prefill steps...
        math.ceil(LONG_DECODE_SLACK * capacity / sc.max_num_batched_tokens),
        # ...and admission stops with up to one prompt chunk free. The last prompt's later
        # chunks use up prompt - chunk of it; the running sequences' decode growth must more
        # than use up the rest (about capacity / prompt of them are running).
        math.ceil(2 * max(0, 2 * chunk - prompt) * prompt / capacity))
    decode = min(decode, sc.max_model_len // 4)
    forced = sc.max_num_seqs * _long_lengths(sc.max_model_len, decode)[2] > capacity
    if not forced:
        decode = args.long_max_tokens or args.max_tokens  # no overflow to wait for
    shortest, longest, per_seq = _long_lengths(sc.max_model_len, decode)
    if forced:
        requests = math.ceil(args.long_factor * capacity / (n * per_seq))
        note = f"{requests} x n={n} x ~{per_seq:,} tokens vs capacity {capacity:,}"
    else:
        requests = -(-sc.max_num_seqs // n)
        note = (f"cannot force preemption: {sc.max_num_seqs} seqs x ~{per_seq:,} tokens fit in "
                f"capacity {capacity:,}; one full batch of long prompts instead")
    if args.long_prompts:
        requests = args.long_prompts
        note += f" (--long-prompts {requests})"
    return LongPlan(requests, (shortest, longest), decode, capacity, forced, note)


def _long_lengths(max_model_len: int, decode: int) -> tuple[int, int, int]:
    """Shortest and longest long prompt that leave room for `decode` tokens, and the mean KV
    tokens of one such sequence."""
    longest = max_model_len - decode - 1
    shortest = longest * 7 // 8
    return shortest, longest, (shortest + longest) // 2 + decode


def monitor_for(llm: LLM) -> MemoryMonitor:
    if llm.config.device.type == "cuda":
        return CudaMemoryMonitor(llm.config.device)
    return HostMemoryMonitor(llm.config.cache_config.cpu_kv_cache_space_bytes)


def kv_resident() -> int:
    """Host: resident KV pages (shared memory), which the high-water mark includes."""
    with open("/proc/self/status") as f:
        return int(re.search(r"^RssShmem:\s+(\d+) kB", f.read(), re.MULTILINE)[1]) * 1024


def guard_events(llm: LLM) -> list[Any]:
    """The out-of-memory guard's events so far; none where the engine has no guard yet."""
    guard = getattr(llm.engine, "oom_guard", None)
    return list(getattr(guard, "events", ())) if guard is not None else []


def event_dict(event: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(event):
        return dataclasses.asdict(event)
    return dict(vars(event)) if hasattr(event, "__dict__") else {"event": repr(event)}


def is_oom(error: BaseException) -> bool:
    """Device out of memory: torch's error, or a library's or kernel's that surfaces as a
    RuntimeError (CUBLAS/cuDNN workspaces, a raw CUDA 'out of memory')."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("ALLOC_FAILED" in text
                                                or "out of memory" in text)


class Probe:
    """Watches one engine: the live allocations at ready, and per run the allocator's peak,
    preemptions, batch sizes, finished requests and guard events."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.monitor = monitor_for(llm)
        self.cuda = llm.config.device.type == "cuda"
        self._sync()
        self.ready = self.monitor.snapshot()
        self.batch_sizes: list[int] = []
        self.finished: Counter[str] = Counter()
        self._spy()

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.llm.config.device)

    def _spy(self) -> None:
        """Wrap the scheduler and the engine step to record batch sizes and finished ids."""
        engine, scheduler = self.llm.engine, self.llm.engine.scheduler
        schedule, step = scheduler.schedule, engine.step

        def recording_schedule() -> Any:
            batch = schedule()
            if batch is not None:
                self.batch_sizes.append(len(batch))
            return batch

        def recording_step() -> Any:
            done = step()
            self.finished.update(seq.request_id for seq in done)
            return done

        scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        engine.step = recording_step  # type: ignore[method-assign]

    def start(self) -> None:
        self._sync()
        if self.cuda:
            # Each row is its own run's need: what earlier runs left idle in torch's cache would
            # otherwise set later rows' floor (the allocator frees it before failing anyway).
            torch.cuda.empty_cache()
        self.batch_sizes.clear()
        self.finished.clear()
        self.preemptions = self.llm.engine.scheduler.num_preemptions
        self.num_events = len(guard_events(self.llm))
        self.live_at_start = self.monitor.snapshot().torch_allocated
        self.monitor.reset_peak()

    def finish(self, n: int) -> dict[str, Any]:
        """What the run since `start` did; `n` completions per request."""
        self._sync()
        device = self.llm.config.device
        if self.cuda:
            peak_reserved = torch.cuda.max_memory_reserved(device)
            peak_allocated = torch.cuda.max_memory_allocated(device)
        else:
            peak_reserved = peak_allocated = self.monitor.step_peak().reserved_peak - kv_resident()
        report = self.llm.kv_cache_report
        kept = report.transient + report.margin
        # torch's idle reserve at ready counted as free for sizing: the need is measured from
        # the live allocations at ready, not from what the allocator held.
        need = max(0, peak_reserved - self.ready.torch_allocated)
        events = guard_events(self.llm)[self.num_events:]
        return {
            "headroom_kept": kept, "need_reserved": need,
            "need_allocated": max(0, peak_allocated - self.ready.torch_allocated),
            "live_growth": self.live_at_start - self.ready.torch_allocated,
            "used_fraction": need / kept if kept else None,
            "kept_over_need": kept / need if need else None,
            "preemptions": self.llm.engine.scheduler.num_preemptions - self.preemptions,
            "max_batch": max(self.batch_sizes, default=0), "num_steps": len(self.batch_sizes),
            "completed": sum(1 for c in self.finished.values() if c >= n),
            "guard_events": [event_dict(e) for e in events],
            "num_gpu_blocks": self.llm.config.cache_config.num_gpu_blocks,
        }


def run_one(llm: LLM, probe: Probe, args: argparse.Namespace, run: str) -> dict[str, Any]:
    """Send `run`'s requests to `llm` and wait for them; an error is recorded, not raised."""
    rng = np.random.default_rng([args.seed, zlib.crc32(run.encode())])
    vocab = llm.config.model_config.hf_config.vocab_size
    plan = None
    if run == LONG:
        plan = plan_long_run(args, llm, sampling_params(ALL, llm, 1).n)
        params = sampling_params(run, llm, plan.max_tokens)
        lengths = rng.integers(plan.prompt_len[0], plan.prompt_len[1] + 1,
                               plan.num_requests).tolist()
    else:
        params = sampling_params(run, llm, args.max_tokens)
        lengths = short_lengths(args, llm, rng, -(-args.num_prompts // params.n))
    prompts = random_prompts(rng, lengths, vocab)
    row: dict[str, Any] = {"run": run, "num_requests": len(prompts),
                           "num_seqs": len(prompts) * params.n, "prompt_tokens": sum(lengths),
                           "max_tokens": params.max_tokens, "oom": None, "error": None}
    if plan is not None:
        row["long_plan"] = dataclasses.asdict(plan)
        print(f"  {LONG}: {plan.note}", flush=True)
    probe.start()
    start = time.perf_counter()
    try:
        llm.generate(prompts, params, use_tqdm=False)  # outputs dropped: they can be GBs
    except Exception as error:  # one failed run must not end the sweep
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        row["oom" if is_oom(error) else "error"] = message
    row["elapsed_s"] = time.perf_counter() - start
    row.update(probe.finish(params.n))
    return row


@dataclass
class Sweep:
    """One engine configuration: each start of its engine (a run that fails rebuilds it) and
    each run, which names the start it ran on."""

    model: str
    max_model_len: int
    margin: str
    starts: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.model} len {self.max_model_len} margin {self.margin}"


def start_engine(args: argparse.Namespace, sweep: Sweep) -> LLM | None:
    """Build `sweep`'s engine and record its sizing; an OOM or a sizing error is recorded."""
    kwargs: dict[str, Any] = dict(
        model=sweep.model, device=args.device, load_format="dummy",
        max_model_len=sweep.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
        cpu_kv_cache_space_bytes=args.cpu_kv_cache_space_bytes,
        kv_cache_dtype=args.kv_cache_dtype, logprobs_mode=args.logprobs_mode,
        **MARGINS[sweep.margin])
    for name in ("small_batch_kernels", "fused_decode_input"):
        if getattr(args, name) is not None:  # else the engine's default
            kwargs[name] = getattr(args, name)
    info: dict[str, Any] = {"free_before": free_memory(torch.device(args.device))}
    sweep.starts.append(info)
    start = time.perf_counter()
    try:
        llm = LLM(**kwargs)
    except (ValueError, RuntimeError) as error:  # OOM is a RuntimeError; sizing a ValueError
        info.update(error=f"{type(error).__name__}: {str(error).splitlines()[0]}",
                    oom=is_oom(error))
        print(f"{sweep.name}: engine failed: {info['error']}", flush=True)
        return None
    report = llm.kv_cache_report
    info.update(startup_s=time.perf_counter() - start, method=report.method,
                num_blocks=report.num_blocks, kv_bytes=report.committed_bytes,
                transient=report.transient, margin_bytes=report.margin,
                headroom_kept=report.transient + report.margin)
    print(f"{sweep.name}: {report.num_blocks:,} KV blocks ({format_bytes(report.committed_bytes)})"
          f", transient {format_bytes(report.transient)}, margin {format_bytes(report.margin)},"
          f" ready in {info['startup_s']:.1f} s", flush=True)
    return llm


def run_sweep(args: argparse.Namespace, sweep: Sweep, past_deadline: Callable[[], bool],
              save: Callable[[], None]) -> None:
    """Every run of `sweep` on one engine, rebuilt after a run that failed (its state is
    unknown); runs past the deadline or without an engine are recorded as skipped."""
    llm = None if past_deadline() else start_engine(args, sweep)
    probe = Probe(llm) if llm is not None else None
    for run in args.features:
        if llm is None or past_deadline():
            reason = "deadline" if past_deadline() else "no engine"
            sweep.runs.append({"run": run, "skipped": reason})
            continue
        row = run_one(llm, probe, args, run)
        row["start"] = len(sweep.starts) - 1
        sweep.runs.append(row)
        print(f"  {run}: {progress(row)}", flush=True)
        save()
        if row["oom"] or row["error"]:
            sweep.starts[-1].update(shut_down(llm, sweep.starts[-1]["free_before"]))
            llm = None if past_deadline() else start_engine(args, sweep)
            probe = Probe(llm) if llm is not None else None
    if llm is not None:
        sweep.starts[-1].update(shut_down(llm, sweep.starts[-1]["free_before"]))
    save()


def progress(row: dict[str, Any]) -> str:
    failure = row["oom"] or row["error"] or "ok"
    return (f"need {format_bytes(row['need_reserved'])} of {format_bytes(row['headroom_kept'])}"
            f", {row['preemptions']} preempted, batch {row['max_batch']}, "
            f"{row['completed']}/{row['num_requests']} done, {len(row['guard_events'])} guard, "
            f"{row['elapsed_s']:.1f} s: {failure}")


def _ratio(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def print_runs(sweeps: list[Sweep]) -> None:
    rows = []
    for s in sweeps:
        for r in s.runs:
            head = [s.model, str(s.max_model_len), s.margin, r["run"]]
            if "skipped" in r:
                rows.append(head + ["-"] * 11 + [f"skipped ({r['skipped']})"])
                continue
            rows.append(head + [
                format_bytes(r["headroom_kept"]), format_bytes(r["need_reserved"]),
                _ratio(r["used_fraction"], "{:.0%}"), _ratio(r["kept_over_need"]),
                "OOM" if r["oom"] else "-", str(len(r["guard_events"])), str(r["preemptions"]),
                str(r["max_batch"]), f"{r['completed']}/{r['num_requests']}",
                f"{r['num_gpu_blocks']:,}", f"{r['elapsed_s']:.1f}", "ERROR" if r["error"] else ""])
    print_table("Adversarial sampling sweep, per run",
                ["model", "len", "margin", "run", "kept", "need", "need/kept", "kept/need",
                 "OOM", "guard", "preempt", "batch", "done/sent", "blocks", "s", ""], rows)
    failures = [(s, r) for s in sweeps for r in s.runs if r.get("oom") or r.get("error")]
    for s, r in failures:
        print(f"  {s.name} {r['run']}: {r['oom'] or r['error']}")


def peak_need(sweep: Sweep, start: int) -> int:
    """The largest need of the runs on start `start` of `sweep`'s engine."""
    return max((r["need_reserved"] for r in sweep.runs if r.get("start") == start), default=0)


def kept_over_peak(sweep: Sweep) -> list[float]:
    """Per engine start that ran anything: headroom kept / the largest need of its runs."""
    return [info["headroom_kept"] / need for i, info in enumerate(sweep.starts)
            if "headroom_kept" in info and (need := peak_need(sweep, i))]


def print_engines(sweeps: list[Sweep]) -> None:
    rows = []
    for s in sweeps:
        if not s.starts:
            rows.append([s.model, str(s.max_model_len), s.margin] + ["-"] * 8
                        + ["not started (deadline)"])
        for n, i in enumerate(s.starts):
            head = [s.model, str(s.max_model_len), s.margin, str(n)]
            if "error" in i:
                rows.append(head + ["-"] * 7 + [i["error"]])
                continue
            need = peak_need(s, n)
            rows.append(head + [
                f"{i['num_blocks']:,}", format_bytes(i["kv_bytes"]), format_bytes(i["transient"]),
                format_bytes(i["margin_bytes"]), format_bytes(need),
                _ratio(i["headroom_kept"] / need if need else None), f"{i['startup_s']:.1f}",
                f"memory returned: {i.get('returned', '-')}"])
    print_table("Engines (start n: rebuilt after a failed run)",
                ["model", "len", "margin", "start", "KV blocks", "KV", "transient", "margin",
                 "peak need", "kept/peak", "startup s", ""], rows)


def print_guard_events(sweeps: list[Sweep]) -> None:
    for s in sweeps:
        events = [(r["run"], e) for r in s.runs for e in r.get("guard_events", ())]
        if s.margin != "zero" and not events:
            continue
        print(f"\nGuard events, {s.name}: {len(events) or 'none'}")
        for run, e in events:
            print(f"  {run}: " + ", ".join(f"{k}={v:,}" if isinstance(v, int) else f"{k}={v}"
                                           for k, v in e.items()))


def summarize(sweeps: list[Sweep], model: str, margin: str) -> dict[str, Any]:
    """One (model, margin) sweep over its max_model_len values."""
    group = [s for s in sweeps if s.model == model and s.margin == margin]
    runs = [r for s in group for r in s.runs if "skipped" not in r]
    ratios = [x for s in group for x in kept_over_peak(s)]
    failed = [i["oom"] for s in group for i in s.starts if "error" in i]  # at (re)start
    return {
        "model": model, "margin": margin,
        "worst_kept_over_peak_need": max(ratios, default=None),
        "tightest_kept_over_peak_need": min(ratios, default=None),
        "ooms": sum(bool(r["oom"]) for r in runs) + sum(failed),
        "errors": sum(bool(r["error"]) for r in runs) + len(failed) - sum(failed),
        "guard_events": sum(len(r["guard_events"]) for r in runs),
        "preemptions": sum(r["preemptions"] for r in runs),
        "all_completed": all(r["completed"] == r["num_requests"] for r in runs)
        and not failed,
        "skipped": sum(1 for s in group for r in s.runs if "skipped" in r),
    }


def print_summaries(summaries: list[dict[str, Any]]) -> None:
    print()
    for m in summaries:
        default = m["margin"] == "default"
        print(f"SUMMARY {m['model']} margin {m['margin']}: worst kept/peak need "
              f"{_ratio(m['worst_kept_over_peak_need'])}{' (target <= 1.5)' if default else ''}"
              f" (tightest {_ratio(m['tightest_kept_over_peak_need'])})"
              f", OOMs {m['ooms']} (target 0), guard events {m['guard_events']}"
              f"{' (target 0)' if default else ''}, all completed "
              f"{'yes' if m['all_completed'] else 'NO'}{'' if default else ' (target yes)'}, "
              f"preemptions {m['preemptions']}, errors {m['errors']}, skipped {m['skipped']}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON output path")
    parser.add_argument("--device", default="cuda", type=bench_device)
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b-shape", "qwen3-8b-shape"])
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--margins", nargs="+", choices=list(MARGINS), default=list(MARGINS))
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--features", nargs="+", choices=RUNS, default=list(RUNS),
                        help="runs per engine (features, 'all', 'all+long'), in the given order")
    parser.add_argument("--num-prompts", type=int, default=0,
                        help="sequences per short run (requests x n); 0 = 1.25 x max_num_seqs")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per short request")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 256],
                        metavar=("MIN", "MAX"), help="short prompts' random length range")
    parser.add_argument("--long-factor", type=float, default=1.3,
                        help="long run's KV tokens as a multiple of the cache's token capacity")
    parser.add_argument("--long-prompts", type=int, default=0,
                        help="long requests (0 = as --long-factor gives)")
    parser.add_argument("--long-max-tokens", type=int, default=0,
                        help="tokens per long request (0 = long enough to overflow the cache)")
    parser.add_argument("--deadline-s", type=float, default=0,
                        help="start no run after this many seconds (0 = none)")
    parser.add_argument("--cpu-kv-cache-space-bytes", type=int, default=None,
                        help="host budget on the CPU (small: a cache that preemption can fill)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                        help="the engines' KV cache dtype: fp8 sizes and runs the e4m3 cache's "
                             "kernels under the same sweep")
    parser.add_argument("--logprobs-mode", choices=LOGPROBS_MODES, default="raw_logprobs",
                        help="the engines' logprobs_mode: the processed modes score the "
                             "logits as sampled, which warmup measures in the engine's mode")
    parser.add_argument("--small-batch-kernels", action=argparse.BooleanOptionalAction,
                        default=None, help="the engines' small_batch_kernels (unset: the "
                                           "engine's default)")
    parser.add_argument("--fused-decode-input", action=argparse.BooleanOptionalAction,
                        default=None, help="the engines' fused_decode_input (unset: the "
                                           "engine's default)")
    parser.add_argument("--qkv-epilogue", action=argparse.BooleanOptionalAction, default=None,
                        help="the small-batch kernels' QKV epilogue for every engine "
                             "(ops/small_batch.QKV_EPILOGUE_DEFAULT; unset: as it says)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if not args.num_prompts:
        args.num_prompts = args.max_num_seqs + args.max_num_seqs // 4
    if args.num_prompts <= args.max_num_seqs:
        print(f"note: --num-prompts {args.num_prompts} is not above max_num_seqs: no queue "
              f"waits behind a full batch", file=sys.stderr)
    return args


def main() -> None:
    args = parse_args()
    if args.qkv_epilogue is not None:  # a module switch: engines built after it follow it
        small_batch.QKV_EPILOGUE_DEFAULT = args.qkv_epilogue
    limits = in_run_limits(args.device)  # before any engine: it holds 2.4 GiB for a moment
    began = time.monotonic()
    device = torch.cuda.get_device_name(args.device) if args.device != "cpu" else "cpu"
    sweeps = [Sweep(model, length, margin) for model in args.models for margin in args.margins
              for length in args.max_model_len]

    def past_deadline() -> bool:
        return bool(args.deadline_s) and time.monotonic() - began > args.deadline_s

    def save(summaries: list[dict[str, Any]] | None = None) -> None:
        write_record(args.out, record_of("adversarial", {
            "device": device, "args": vars(args), **limits,
            "elapsed_s": time.monotonic() - began,
            "sweeps": [dataclasses.asdict(s) for s in sweeps], "summaries": summaries},
            vars(args)))

    for sweep in sweeps:
        print(f"== {sweep.name}", flush=True)
        run_sweep(args, sweep, past_deadline, save)
    summaries = [summarize(sweeps, model, margin) for model in args.models
                 for margin in args.margins]
    save(summaries)
    print_engines(sweeps)
    print_runs(sweeps)
    print_guard_events(sweeps)
    print_summaries(summaries)
    print(f"\n{device}: {time.monotonic() - began:.0f} s in all; JSON in {args.out}")
    if any(m["errors"] for m in summaries):
        sys.exit(1)  # a non-memory error is a bug to look at, not a measurement


if __name__ == "__main__":
    main()
