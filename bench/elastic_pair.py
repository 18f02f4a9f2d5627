"""Engines share one device under bursty load that moves between them: elastic against a
static split (two by default, alternating; `--models` names one engine each).

    python3 bench/elastic_pair.py --out pair.json                  # on the H200, < 4 minutes
    python3 bench/elastic_pair.py --device cpu --models kvfit-tiny kvfit-tiny \\
        --max-model-len 256 --max-num-seqs 8 --concurrency 8 --input-len 32 --output-len 16 \\
        --phase-s 2 --num-phases 2 --idle-s 0.5 --min-interval 0.5 --out pair.json

Each engine (`--models`: the 0.6B and 8B shapes, dummy weights, by default) runs in its own
spawned process on the same device. Of N engines, engine i is busy in the phases p where
(p - i) mod N < `--busy-per-phase` (1: in turn; two engines: phases i, i + 2, ...;
`--phase-s` each, `--num-phases` in all) and idle in the others: busy, it keeps
`--concurrency` requests of `--input-len` random tokens and `--output-len` outputs in flight
(a burst at the phase's start, refilled as they finish; requests still running when the phase
ends are aborted); idle, it only steps, so its governor polls. Both modes run one after the other:

- static: `--gpu-memory-utilization-static` each (default 0.9 / N: 0.45 for two), no elastic
  cache: the usual split.
- elastic: `--elastic-kv-cache` with `--elastic-idle-s`, the engines sharing their demand on a
  board of their own (`--elastic-demand-dir`, a fresh folder per run): an idle engine gives
  back what the busy one lacks and keeps the rest. `elastic-alone` (opt-in in `--modes`): the
  same without the board, so each idle engine gives back all it does not use. Startup order
  matters on one device:
  an engine sizes its cache from measured memory, so the first would take everything. Each
  engine therefore starts with `--gpu-memory-utilization` (0.9: the most it may ever grow to,
  its budget); the bench shrinks each but the last with `LLM.resize_kv_cache` to its share of
  what it found (engine i of N: 1 / (N - i), or `--start-share` for the first) before the
  next starts, which sizes itself from what is then free (measured sizing sets other
  processes' memory aside). From there on only the
  governors move memory: the idle engine gives back what it does not use after `--idle-s`, the
  busy one grows into it.

`--workload chat` replaces independent prompts with `--concurrency` multi-turn conversations
per engine (`Conversations`): each turn's prompt is the conversation's history plus
`--turn-len` new tokens, so the engine that can keep more histories in its prefix cache
recomputes less. It is the workload where memory, not bandwidth, bounds throughput: on
independent prompts decode reads the weights once per step and each sequence's KV once per
token, so more cache adds throughput only in proportion to M / (W + M). `--kv-offloading-size`
gives both engines, in both modes, a host-memory tier under the prefix cache: histories the
device cache lost (evicted, or given back by an idle elastic engine) load back over PCIe
rather than being computed again.

Reported per mode: output tokens served within the phases (aborted requests' tokens count:
they were served), TTFT percentiles (arrival -> first token; a request still waiting when its
phase ends counts as the phase's length), each engine's KV cache bytes and output tokens so
far every `--sample-ms` (plot-ready `samples`, seconds since the load started) and its
resizes; and the elastic / static token ratio, overall and by phase (`phase_tokens`,
`phase_token_ratios`: the busy engines' tokens in each phase). The target: >= 1.3x the tokens
with p99 TTFT no worse. Four engines with two busy at a time (`--models` four times,
`--busy-per-phase 2`) is where a cache that grew for one burst must give its tail to a peer
whose burst began while it is still busy (`KVCacheGovernor.share_shrink`).
On the CPU both engines read host memory, which other processes move too: a smoke test of the
flow, not a measurement.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import bench_device, in_run_limits
from kvfit.benchmarks.record import write_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", type=bench_device)
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b-shape", "qwen3-8b-shape"],
                   help="one model per engine, two or more")
    p.add_argument("--busy-per-phase", type=int, default=1,
                   help="engines busy in each phase (engine i in phases p with "
                   "(p - i) mod N below it)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=256, help="requests a busy engine keeps")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--workload", choices=["random", "chat"], default="random",
                   help="random: independent prompts; chat: multi-turn conversations whose "
                   "histories the prefix cache can keep")
    p.add_argument("--turn-len", type=int, default=128,
                   help="chat: new user tokens each turn after the first")
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--num-phases", type=int, default=4)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="elastic: each engine's budget, the most it may grow to")
    p.add_argument("--gpu-memory-utilization-static", type=float,
                   help="static: each engine's share of the device (default 0.9 / N)")
    p.add_argument("--start-share", type=float,
                   help="elastic: the fraction of its startup cache the first engine keeps "
                   "before the next one starts (default 1 / N; engine i keeps 1 / (N - i))")
    p.add_argument("--low-watermark", default="2GiB", help="--elastic-low-watermark")
    p.add_argument("--high-watermark", default="6GiB", help="--elastic-high-watermark")
    p.add_argument("--min-interval", type=float, default=2.0, help="--elastic-min-interval")
    p.add_argument("--idle-s", type=float, default=0.5, help="--elastic-idle-s")
    p.add_argument("--kv-offloading-size", type=float, nargs="+", metavar="GIB",
                   help="give each engine, in every mode, a host-memory tier of this many GiB "
                   "(one value: every engine; else one each, in turn)")
    p.add_argument("--modes", nargs="+", default=["static", "elastic"],
                   choices=["static", "elastic", "elastic-alone"])
    p.add_argument("--sample-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="elastic_pair.json")
    args = p.parse_args(argv)
    n = len(args.models)
    if n < 2:
        p.error(f"--models names one model per engine: at least two, got {n}")
    if not 1 <= args.busy_per_phase < n:
        p.error(f"--busy-per-phase must be from 1 to {n - 1} (one engine idle at least), "
                f"got {args.busy_per_phase}")
    if args.gpu_memory_utilization_static is None:
        args.gpu_memory_utilization_static = round(0.9 / n, 4)
    return args


def is_busy(args: argparse.Namespace, rank: int, phase: int) -> bool:
    """Whether engine `rank` is busy in `phase`."""
    return (phase - rank) % len(args.models) < args.busy_per_phase


def engine(args: argparse.Namespace, rank: int, elastic: bool, board: str | None) -> LLM:
    """Engine `rank`: elastic (sharing demand on `board`, None: alone) or static."""
    kwargs: dict[str, Any] = dict(
        elastic_kv_cache=True, elastic_low_watermark=args.low_watermark,
        elastic_high_watermark=args.high_watermark, elastic_min_interval=args.min_interval,
        elastic_idle_s=args.idle_s, elastic_demand_dir=board or "none") if elastic else {}
    if args.device != "cpu":
        kwargs["gpu_memory_utilization"] = (args.gpu_memory_utilization if elastic
                                            else args.gpu_memory_utilization_static)
    if args.kv_offloading_size:
        sizes = args.kv_offloading_size
        kwargs["kv_offloading_size"] = sizes[rank % len(sizes)]
    return LLM(args.models[rank], device=args.device, load_format="dummy",
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, **kwargs)


def serve(rank: int, args: argparse.Namespace, elastic: bool, board: str | None, ready: Any,
          start: Any, results: Any) -> None:
    """One engine's process: start (shrinking to its start share when elastic), say ready,
    then run its phases from the shared start time and put its result on `results`."""
    llm = engine(args, rank, elastic, board)
    remaining = len(args.models) - rank
    if elastic and remaining > 1:  # the next sizes itself from what this one leaves free
        share = args.start_share if rank == 0 and args.start_share else 1 / remaining
        bm = llm.engine.scheduler.block_manager
        llm.resize_kv_cache(max(llm.engine.kv_resizer.floor, int(bm.num_blocks * share)))
    ready.set()
    t0 = start.get()
    results.put((rank, run_phases(llm, rank, args, t0)))
    llm.shutdown()


class Conversations:
    """`--concurrency` multi-turn chats with zero think time: a conversation's next prompt is
    its whole history (every earlier prompt and answer) plus `--turn-len` new tokens, so the
    prefix cache can serve the history if it kept it. A conversation starts from a first
    prompt of 1/4 to 1x `--input-len` tokens and starts over once its next turn would pass
    `--max-model-len`. A turn aborted at a phase's end is asked again in the engine's next
    busy phase (the user comes back)."""

    def __init__(self, args: argparse.Namespace, rng: random.Random, vocab: int) -> None:
        self.args, self.rng, self.vocab = args, rng, vocab
        self.idle: list[list[int]] = [[] for _ in range(args.concurrency)]  # histories
        self.asked: dict[str, tuple[list[int], list[int]]] = {}  # rid -> (history, prompt)

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def next_turn(self, rid: str) -> list[int]:
        history = self.idle.pop()
        fits = len(history) + self.args.turn_len + self.args.output_len <= self.args.max_model_len
        if history and fits:
            prompt = history + self._tokens(self.args.turn_len)
        else:  # a new conversation
            history = []
            prompt = self._tokens(self.rng.randint(self.args.input_len // 4, self.args.input_len))
        self.asked[rid] = (history, prompt)
        return prompt

    def answered(self, rid: str, token_ids: list[int]) -> None:
        self.asked.pop(rid)
        self.idle.append(list(token_ids))

    def abandoned(self, rid: str) -> None:
        self.idle.append(self.asked.pop(rid)[0])


def run_phases(llm: LLM, rank: int, args: argparse.Namespace, t0: float) -> dict[str, Any]:
    rng = random.Random(args.seed + rank)
    vocab = llm.config.model_config.hf_config.vocab_size
    chats = Conversations(args, rng, vocab) if args.workload == "chat" else None
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    core, end = llm.engine, t0 + args.phase_s * args.num_phases
    arrived: dict[str, float] = {}
    due: dict[str, float] = {}  # the end of the phase a request arrived in
    ttfts: list[float] = []
    live: dict[str, Any] = {}
    tokens, samples, next_sample, n = 0, [], t0, 0
    phase_tokens = [0] * args.num_phases  # by the phase the step began in
    while (now := time.monotonic()) < end:
        phase = int((now - t0) // args.phase_s)
        busy = is_busy(args, rank, phase)
        if busy:
            while len(live) < args.concurrency:
                rid, n = f"{rank}-{n}", n + 1
                ids = (chats.next_turn(rid) if chats is not None
                       else [rng.randrange(vocab) for _ in range(args.input_len)])
                [seq] = llm.make_request({"prompt_token_ids": ids}, params, rid)
                core.add_request(seq)
                live[rid], arrived[rid] = seq, time.monotonic()
                due[rid] = t0 + (phase + 1) * args.phase_s
        if not busy and live:  # the phase ended: abort what is still running
            for rid, seq in live.items():
                if seq.num_output_tokens == 0:
                    ttfts.append(due[rid] - arrived[rid])
                core.abort_request(rid)
                if chats is not None:
                    chats.abandoned(rid)
            live.clear()
        before = {rid: seq.num_output_tokens for rid, seq in live.items()}
        core.step()
        stepped = time.monotonic()
        for rid, seq in list(live.items()):
            served = seq.num_output_tokens - before[rid]
            tokens += served
            phase_tokens[phase] += served
            if before[rid] == 0 and seq.num_output_tokens > 0:
                # A step begun before the phase's end may finish after it: its request was
                # still waiting when the phase ended, which counts as the phase's length.
                ttfts.append(min(stepped, due[rid]) - arrived[rid])
            if seq.is_finished:
                del live[rid]
                if chats is not None:
                    chats.answered(rid, seq.token_ids)
        if not live:
            time.sleep(0.01)  # idle: the governor polls on each step
        if stepped >= next_sample:
            samples.append({"t": stepped - t0, "kv_blocks": core.scheduler.block_manager.num_blocks,
                            "kv_bytes": core.stats().committed_kv_bytes, "output_tokens": tokens})
            next_sample = stepped + args.sample_ms / 1e3
    # Still waiting when the last phase ended: that phase's length, as at every other end.
    ttfts += [due[rid] - arrived[rid] for rid, seq in live.items() if seq.num_output_tokens == 0]
    stats = core.stats()
    return {"model": args.models[rank], "output_tokens": tokens, "phase_tokens": phase_tokens,
            "ttft_s": ttfts,
            "prefix_cache_hit_rate": (stats.prefix_cache_hit_tokens
                                      / max(stats.prefix_cache_queried_tokens, 1)),
            "kv_connector_hit_tokens": stats.kv_connector_hit_tokens,
            "samples": samples, "num_preemptions": stats.num_preemptions,
            "kv_cache_idle_shrinks": stats.kv_cache_idle_shrinks,
            "kv_cache_share_shrinks": stats.kv_cache_share_shrinks,
            "kv_cache_shrinks": stats.kv_cache_shrinks, "kv_cache_grows": stats.kv_cache_grows,
            "resizes": [{**e.__dict__, "time": e.time - t0}
                        for e in core.kv_resizer.events if e.time >= t0]}


def run_mode(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Start the engines one after the other, run the phases, gather their results."""
    ctx = mp.get_context("spawn")
    start, results = ctx.Queue(), ctx.Queue()
    elastic = mode != "static"
    # A board of this run's own: no entry of another run or engine on the device joins it.
    board = tempfile.mkdtemp(prefix="kvfit-pair-") if mode == "elastic" else None
    procs = []
    for rank in range(len(args.models)):  # each sizes itself after the one before has
        ready = ctx.Event()
        proc = ctx.Process(target=serve,
                           args=(rank, args, elastic, board, ready, start, results))
        proc.start()
        procs.append(proc)
        while not ready.wait(1.0):
            if not proc.is_alive():
                raise RuntimeError(f"engine {rank} ({args.models[rank]}) failed to start")
    t0 = time.monotonic() + 1.0  # one clock for all: CLOCK_MONOTONIC is system-wide
    for _ in procs:
        start.put(t0)
    engines = dict(results.get(timeout=args.phase_s * args.num_phases + 600) for _ in procs)
    for proc in procs:
        proc.join(timeout=120)
    if board is not None:
        shutil.rmtree(board, ignore_errors=True)
    ttfts = [t for e in engines.values() for t in e["ttft_s"]]
    return {"output_tokens": sum(e["output_tokens"] for e in engines.values()),
            "ttft_p50_s": float(np.percentile(ttfts, 50)) if ttfts else None,
            "ttft_p99_s": float(np.percentile(ttfts, 99)) if ttfts else None,
            "engines": [engines[rank] for rank in range(len(args.models))]}


def phase_ratios(args: argparse.Namespace, static: dict[str, Any],
                 elastic: dict[str, Any]) -> list[float]:
    """Elastic / static output tokens of each phase's busy engines: each engine's first busy
    phase starts both modes from fresh conversations; later ones start from wherever each
    mode's earlier phases left its conversations (longer ones cost more to recompute)."""
    def busy(mode: dict[str, Any], phase: int) -> int:
        return sum(e["phase_tokens"][phase] for rank, e in enumerate(mode["engines"])
                   if is_busy(args, rank, phase))
    num_phases = len(static["engines"][0]["phase_tokens"])
    return [busy(elastic, i) / max(busy(static, i), 1) for i in range(num_phases)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    limits = in_run_limits(args.device)  # before the engines, in a process that has exited
    modes = {mode: run_mode(args, mode) for mode in args.modes}
    result: dict[str, Any] = {"args": vars(args), "modes": modes, **limits}
    if {"static", "elastic"} <= modes.keys() and modes["static"]["output_tokens"]:
        result["token_ratio"] = modes["elastic"]["output_tokens"] / modes["static"]["output_tokens"]
        result["phase_token_ratios"] = phase_ratios(args, modes["static"], modes["elastic"])
    write_record(args.out, record_of("elastic-pair", result, vars(args)))
    for mode, r in modes.items():
        print(f"{mode:<8} tokens {r['output_tokens']:>9} "
              f"{[e['output_tokens'] for e in r['engines']]}  TTFT p50 {r['ttft_p50_s']} s  "
              f"p99 {r['ttft_p99_s']} s  idle shrinks "
              f"{[e['kv_cache_idle_shrinks'] for e in r['engines']]}  share shrinks "
              f"{[e['kv_cache_share_shrinks'] for e in r['engines']]}  prefix hits "
              f"{[round(e['prefix_cache_hit_rate'], 3) for e in r['engines']]}")
    if "token_ratio" in result:
        print(f"elastic / static tokens: {result['token_ratio']:.2f} (target >= 1.3)")
        print("by phase, elastic / static (the busy engines'):",
              " ".join(f"{r:.2f}" for r in result["phase_token_ratios"]))
    return result


if __name__ == "__main__":
    main()
