"""Sleep/wake and the shared-storage KV connector on the extensible cache.

How to run (on the GPU machine, about 1-2 minutes; JSON and run.log in $OUT):

    TESTS=none BENCH_TIMEOUT=240 bash bench/run_gpu.sh "sleep --model qwen3-8b-shape"

CPU smoke check (seconds):

    python3 bench/sleep.py --device cpu --model kvfit-tiny --prompt-len 512 --out /tmp/s.json

One engine (dummy weights, sleep mode, `--kv-connector shared_storage` on a temporary store,
the cache sized by measurement, so on an H200 with the 8B shape it is ~120 GiB):

- Connector TTFT at `--prompt-len` tokens (offline, max_tokens=1, one request at a time): a
  new random prompt is computed with the connector off (`recompute`: a plain prefill), then
  again with its full blocks saved (`first pass`), then once more with every full block loaded
  from the store (`external hit`); the local prefix cache is reset between the three. Best of
  `--ttft-rounds` prompts. The store's files are in the page cache then (just written): it
  measures the connector, not the disk. (Before 2026-12-03 evening, `recompute` was the first
  pass less the connector's save time, which also took out the prefill the save waits for.)
- Components, `--repeats` times each on the idle engine: the KV cache's release + recommit,
  zeroed, both as sleep does it without a connector (chunks of up to 1 GiB) and with one
  (one physical chunk per segment, which a connector registers), and the weight arena's
  offload to pinned host memory + restore, with GB/s.
- End to end, `--cycles` times per level: `LLM.sleep(level)`, device memory in use while
  asleep above the process's baseline (`torch.cuda.mem_get_info` before the engine existed),
  then `wake_up(["kv_cache"])` and `wake_up(["weights"])` timed apart (level 2 reloads the
  dummy weights from their seed). Greedy outputs after every wake are checked against before.

Targets: KV release + recommit <= 0.3 s for a 100 GiB cache (scaled from the cache measured;
judged on the chunked recommit, the one-chunk figure reported beside it), weight offload and
restore >= 20 GB/s, <= 1 GiB in use while asleep at level 2.
On the CPU the device is the host: memory figures are the process's resident set, a smoke
check, not a figure.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record

GiB = 1 << 30
TARGETS = {"kv_release_recommit_s_per_100GiB": 0.3, "weights_GBps": 20.0,
           "asleep_level2_GiB": 1.0}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-8b-shape")
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default="sleep.json", help="JSON results")
    p.add_argument("--prompt-len", type=int, default=8192, help="connector TTFT prompt tokens")
    p.add_argument("--ttft-rounds", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="component timings, each")
    p.add_argument("--pause-s", type=float, default=2.0,
                   help="seconds between a release and the recommit timed after a pause")
    p.add_argument("--cycles", type=int, default=2, help="end-to-end sleep/wake per level")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--store", default=None, help="store directory (default: a temporary one)")
    return p.parse_args(argv)


def device_used(device: torch.device) -> int:
    """Device memory in use by everyone (CUDA), or this process's resident set (CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return total - free
    import psutil

    return psutil.Process().memory_info().rss


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """`(seconds, fn())`, the device synchronized on both sides."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, result


def random_prompt(length: int, vocab: int, seed: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(seed)
    return {"prompt_token_ids": torch.randint(3, vocab, (length,), generator=g).tolist()}


def ttft(llm: LLM, args: argparse.Namespace, vocab: int, device: torch.device) -> dict:
    """Per prompt: recompute (the connector off), first pass (recompute + save) and external
    hit (every full block loaded); best of `--ttft-rounds` prompts."""
    conn = llm.engine.executor.workers[0].kv_connector
    scheduler = llm.engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    block_size = llm.config.cache_config.block_size

    def first_token(prompt: dict) -> tuple[float, Any]:
        result = timed(lambda: llm.generate(prompt, params, use_tqdm=False), device)
        llm.reset_prefix_cache()  # the next pass must not hit the local prefix cache
        return result

    rounds = []
    for r in range(args.ttft_rounds + 1):  # round 0 warms the 8k path (kernels, files)
        prompt = random_prompt(args.prompt_len, vocab, seed=100 + r)
        # The scheduler side plans every load and save: without it the engine neither looks
        # the prompt up nor saves it, a plain prefill.
        connector, scheduler.kv_connector = scheduler.kv_connector, None
        try:
            recompute_s, plain = first_token(prompt)
        finally:
            scheduler.kv_connector = connector
        saved_s, saved = conn.stats.save_seconds, conn.stats.saved_blocks
        first_s, first = first_token(prompt)
        loaded, load_s0 = conn.stats.loaded_blocks, conn.stats.load_seconds
        hit_s, hit = first_token(prompt)
        if r == 0:
            continue
        blocks = conn.stats.loaded_blocks - loaded
        rounds.append({
            "recompute_s": recompute_s, "first_pass_s": first_s,
            "save_s": conn.stats.save_seconds - saved_s,
            "saved_blocks": conn.stats.saved_blocks - saved, "external_hit_s": hit_s,
            "load_s": conn.stats.load_seconds - load_s0, "loaded_blocks": blocks,
            "expected_blocks": (args.prompt_len - 1) // block_size,
            "load_GBps": blocks * conn.format.nbytes / max(conn.stats.load_seconds - load_s0,
                                                          1e-9) / 1e9,
            "same_token": (plain[0].outputs[0].token_ids == first[0].outputs[0].token_ids
                           == hit[0].outputs[0].token_ids),
        })
    best = min(rounds, key=lambda x: x["external_hit_s"])
    return {"prompt_len": args.prompt_len, "block_bytes": conn.format.nbytes,
            "best": best, "rounds": rounds,
            "hit_over_recompute": best["external_hit_s"] / min(x["recompute_s"] for x in rounds)}


def components(llm: LLM, args: argparse.Namespace, device: torch.device) -> dict:
    """KV release + recommit and weight offload + restore, on the idle engine."""
    runner = llm.engine.executor.workers[0].runner
    cache, arena = runner.kv_cache, runner.weight_arena
    kv_bytes = cache.physical_bytes
    release, recommit, recommit_one, offload, restore = [], [], [], [], []
    recommit_paused = []
    for _ in range(args.repeats):
        release.append(timed(cache.release_physical, device)[0])
        recommit.append(timed(cache.recommit, device)[0])
        # As an RL trainer wakes the engine: seconds after the release, not at once.
        cache.release_physical()
        time.sleep(args.pause_s)
        recommit_paused.append(timed(cache.recommit, device)[0])
        chunks = cache.tensor.num_physical_chunks
        cache.release_physical()
        # Last, so the connector's cache is one chunk per segment again afterwards.
        recommit_one.append(timed(lambda: cache.recommit(defragment=True), device)[0])
        offload.append(timed(arena.offload, device)[0])
        restore.append(timed(arena.restore, device)[0])
    llm.reset_prefix_cache()  # the recommitted cache is zeroed
    per_100GiB = 100 * GiB / kv_bytes
    return {
        "kv_bytes": kv_bytes, "kv_chunks": chunks,
        "kv_release_s": release, "kv_recommit_s": recommit, "kv_recommit_one_chunk_s": recommit_one,
        "kv_release_recommit_s_per_100GiB": (min(release) + min(recommit)) * per_100GiB,
        "kv_recommit_after_pause_s": recommit_paused, "pause_s": args.pause_s,
        "kv_release_recommit_after_pause_s_per_100GiB":
            (min(release) + min(recommit_paused)) * per_100GiB,
        "kv_release_recommit_one_chunk_s_per_100GiB":
            (min(release) + min(recommit_one)) * per_100GiB,
        "weights_bytes": arena.nbytes, "offload_s": offload, "restore_s": restore,
        "offload_GBps": arena.nbytes / min(offload) / 1e9,
        "restore_GBps": arena.nbytes / min(restore) / 1e9,
    }


def sleep_cycles(llm: LLM, args: argparse.Namespace, baseline: int, vocab: int,
                 device: torch.device) -> list[dict]:
    probe = [random_prompt(64, vocab, seed=7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(probe, greedy, use_tqdm=False)]
    rows = []
    for level in (1, 2):
        for cycle in range(args.cycles):
            awake = device_used(device)
            sleep_s, report = timed(lambda lv=level: llm.sleep(level=lv), device)
            asleep = device_used(device)
            wake_kv_s, _ = timed(lambda: llm.wake_up(tags=["kv_cache"]), device)
            wake_weights_s, _ = timed(lambda: llm.wake_up(tags=["weights"]), device)
            llm.reset_prefix_cache()
            after = [o.outputs[0].token_ids for o in llm.generate(probe, greedy, use_tqdm=False)]
            rows.append({
                "level": level, "cycle": cycle, "sleep_s": sleep_s, "wake_kv_s": wake_kv_s,
                "wake_weights_s": wake_weights_s, "released": report.released,
                "kept": report.kept, "host_bytes": report.host_bytes,
                "awake_above_baseline": awake - baseline,
                "asleep_above_baseline": asleep - baseline,
                "outputs_equal_after_wake": after == before,
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    limits = in_run_limits(device)  # in a process of its own: not part of the baseline
    if device.type == "cuda":
        torch.zeros(1, device=device)  # the context is part of the baseline
    else:
        torch.set_num_threads(1)  # a tiny model gains nothing from threads that spin
    baseline = device_used(device)
    store_dir = tempfile.TemporaryDirectory(prefix="kvfit-store-") if args.store is None else None
    store = args.store or store_dir.name
    block = 16
    max_len = -(-(args.prompt_len + 16) // block) * block
    start = time.perf_counter()
    llm = LLM(args.model, device=str(device), enable_sleep_mode=True, max_model_len=max_len,
              max_num_seqs=args.max_num_seqs, kv_connector="shared_storage",
              kv_connector_path=store)
    startup_s = time.perf_counter() - start
    vocab = llm.config.model_config.hf_config.vocab_size
    try:
        result = {
            "model": args.model, "device": str(device),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else "cpu"),
            "startup_s": startup_s, "num_blocks": llm.config.cache_config.num_gpu_blocks,
            "baseline_bytes": baseline, **limits,
            "ttft": ttft(llm, args, vocab, device),
            "components": components(llm, args, device),
        }
        result["sleep"] = sleep_cycles(llm, args, baseline, vocab, device)
    finally:
        llm.shutdown()
        if store_dir is not None:
            store_dir.cleanup()
    result["targets"] = check_targets(result)
    write_record(args.out, record_of("sleep", result, vars(args)))
    print_table(result)
    return 0


def check_targets(result: dict) -> dict:
    c = result["components"]
    level2 = [r["asleep_above_baseline"] for r in result["sleep"] if r["level"] == 2]
    # The target's figure is the recommit seconds after the release, as a sleeping engine is
    # woken; back to back the driver may still be returning the pages it just took back, which
    # no wake meets (both are in `components` and printed).
    measured = {
        "kv_release_recommit_s_per_100GiB": c.get(
            "kv_release_recommit_after_pause_s_per_100GiB",
            c["kv_release_recommit_s_per_100GiB"]),
        "weights_GBps": min(c["offload_GBps"], c["restore_GBps"]),
        "asleep_level2_GiB": max(level2) / GiB,
    }
    met = {
        "kv_release_recommit_s_per_100GiB": measured["kv_release_recommit_s_per_100GiB"]
        <= TARGETS["kv_release_recommit_s_per_100GiB"],
        "weights_GBps": measured["weights_GBps"] >= TARGETS["weights_GBps"],
        "asleep_level2_GiB": measured["asleep_level2_GiB"] <= TARGETS["asleep_level2_GiB"],
    }
    return {k: {"measured": measured[k], "target": TARGETS[k], "met": met[k]} for k in TARGETS}


def print_table(r: dict) -> None:
    c, t = r["components"], r["ttft"]
    print(f"\n{r['model']} on {r['device_name']}: {r['num_blocks']} blocks, "
          f"{c['kv_bytes'] / GiB:.2f} GiB KV in {c['kv_chunks']} chunk(s) when recommitted, "
          f"{c['weights_bytes'] / GiB:.2f} GiB weights, startup {r['startup_s']:.1f} s")
    print(f"KV release {min(c['kv_release_s']):.4f} s + recommit {min(c['kv_recommit_s']):.4f} s"
          f" -> {c['kv_release_recommit_s_per_100GiB']:.3f} s per 100 GiB; recommitted as one"
          f" chunk (a connector's) {min(c['kv_recommit_one_chunk_s']):.4f} s -> "
          f"{c['kv_release_recommit_one_chunk_s_per_100GiB']:.3f} s per 100 GiB")
    print(f"recommit {c['pause_s']:g} s after the release {min(c['kv_recommit_after_pause_s']):.4f}"
          f" s -> {c['kv_release_recommit_after_pause_s_per_100GiB']:.3f} s per 100 GiB")
    print(f"weights offload {c['offload_GBps']:.1f} GB/s, restore {c['restore_GBps']:.1f} GB/s "
          f"(median {statistics.median(c['offload_s']):.3f} / "
          f"{statistics.median(c['restore_s']):.3f} s)")
    print(f"\n{'level':>5} {'cycle':>5} {'sleep s':>8} {'wake kv s':>9} {'wake w s':>9} "
          f"{'released GiB':>12} {'asleep GiB':>10} {'same out':>8}")
    for s in r["sleep"]:
        print(f"{s['level']:>5} {s['cycle']:>5} {s['sleep_s']:>8.3f} {s['wake_kv_s']:>9.3f} "
              f"{s['wake_weights_s']:>9.3f} {sum(s['released'].values()) / GiB:>12.2f} "
              f"{s['asleep_above_baseline'] / GiB:>10.2f} {str(s['outputs_equal_after_wake']):>8}")
    b = t["best"]
    print(f"\nconnector TTFT at {t['prompt_len']} tokens: recompute {b['recompute_s']:.3f} s "
          f"(first pass {b['first_pass_s']:.3f} s with {b['saved_blocks']} blocks saved in "
          f"{b['save_s']:.3f} s), external hit {b['external_hit_s']:.3f} s "
          f"({b['loaded_blocks']}/{b['expected_blocks']} blocks, {b['load_GBps']:.1f} GB/s); "
          f"hit/recompute {t['hit_over_recompute']:.2f}")
    print(f"\ntargets (KV release + recommit: the recommit {c['pause_s']:g} s after the release; "
          f"back to back {c['kv_release_recommit_s_per_100GiB']:.3f} s per 100 GiB):")
    for name, v in r["targets"].items():
        print(f"  {name:36} {v['measured']:10.3f}  target {v['target']:<6} "
              f"{'met' if v['met'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
