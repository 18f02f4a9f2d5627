"""Co-tenancy: kvfit serves while another process allocates device memory, holds it, frees it.

    python3 bench/elastic.py --out elastic.json                      # on the H200, < 3 minutes
    python3 bench/elastic.py --device cpu --model kvfit-tiny --max-model-len 256 \\
        --max-num-seqs 8 --num-prompts 8 --input-len 32 --output-len 16 \\
        --cotenant-gib 0.25 --chunk-mib 32 --idle-s 1 --hold-s 2 --after-s 3 --out e.json

One engine (`--elastic-kv-cache`, dummy weights) serves offline load from a thread:
`LLM.generate` over batches of random prompts in a loop, each output checked to be finished at
its full length. A spawned co-tenant process starts its device context (before the engine
sizes its cache), waits until the load has run `--idle-s`, then allocates `--cotenant-gib` in
`--chunk-mib` pieces, retrying each piece on out of memory until the engine has given room;
it holds them `--hold-s`, frees them and the run goes on `--after-s`. A sampler records every
`--sample-ms` the engine's KV cache blocks, device free memory and the co-tenant's bytes.

Reported: `time_to_shrink_s` (the co-tenant's first piece asked -> all held: how long kvfit
took to make room), `first_shrink_s` (-> the governor's first shrink), `regrow_s` (the
co-tenant freed -> the cache back within 1% of its size before), requests completed and failed, the
out-of-memory guard's events, every resize, and the time series (plot-ready: `samples`,
seconds since the co-tenant started asking). The target: a shrink within a second, no
request failed, the cache regrown after the free.
On the CPU the co-tenant takes host memory and the engine reads host available memory (other
processes move it too): a smoke test of the flow, not a measurement.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
from typing import Any

import psutil
import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import bench_device, in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.kv.report import format_bytes

GiB, MiB = 1 << 30, 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", type=bench_device)
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=512, help="prompts per generate batch")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--low-watermark", default="2GiB", help="--elastic-low-watermark")
    p.add_argument("--high-watermark", default="6GiB", help="--elastic-high-watermark")
    p.add_argument("--min-interval", type=float, default=2.0, help="--elastic-min-interval")
    p.add_argument("--cotenant-gib", type=float, default=20.0)
    p.add_argument("--chunk-mib", type=int, default=256, help="the co-tenant's piece size")
    p.add_argument("--idle-s", type=float, default=10.0,
                   help="load alone before the co-tenant asks")
    p.add_argument("--hold-s", type=float, default=20.0)
    p.add_argument("--after-s", type=float, default=20.0, help="load after the co-tenant freed")
    p.add_argument("--sample-ms", type=float, default=20.0)
    p.add_argument("--out", default="elastic.json")
    return p.parse_args(argv)


# --- the co-tenant (a spawned process) --------------------------------------------------------


def cotenant(device: str, nbytes: int, chunk: int, hold_s: float, go: Any, held: Any,
             events: Any) -> None:
    """Start a device context, wait for `go`, take `nbytes` piece by piece (retrying a piece
    on out of memory), hold, free; report `(name, time.monotonic())` events and the bytes
    held."""
    dev = torch.device(device)
    pieces: list[torch.Tensor] = []
    if dev.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=dev)  # the context now, not while timing
    events.put(("ready", time.monotonic()))
    go.wait()
    events.put(("asking", time.monotonic()))
    retries = 0
    while held.value < nbytes:
        try:
            piece = torch.empty(min(chunk, nbytes - held.value), dtype=torch.uint8, device=dev)
            if dev.type == "cpu":
                piece.fill_(1)  # touch the pages: host memory is committed lazily
        except torch.OutOfMemoryError:
            retries += 1
            time.sleep(0.002)
            continue
        pieces.append(piece)
        held.value += piece.numel()
    events.put(("holding", time.monotonic()))
    events.put(("retries", retries))
    time.sleep(hold_s)
    pieces.clear()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    held.value = 0
    events.put(("freed", time.monotonic()))


# --- the engine under load --------------------------------------------------------------------


class Load:
    """`LLM.generate` over batches of random prompts on a thread until stopped; counts what
    finished whole and what did not."""

    def __init__(self, llm: LLM, args: argparse.Namespace) -> None:
        self.llm, self.args = llm, args
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                     ignore_eos=True)
        self.completed = self.failed = self.batches = self.output_tokens = 0
        self.errors: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="load", daemon=True)

    def _prompts(self, seed: int) -> list[dict[str, list[int]]]:
        g = torch.Generator().manual_seed(seed)
        vocab = self.llm.config.model_config.hf_config.vocab_size
        return [{"prompt_token_ids": torch.randint(10, vocab, (self.args.input_len,),
                                                   generator=g).tolist()}
                for _ in range(self.args.num_prompts)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                outputs = self.llm.generate(self._prompts(self.batches), self.params,
                                            use_tqdm=False)
            except Exception as error:  # a failed batch fails every request in it
                self.failed += self.args.num_prompts
                self.errors.append(repr(error))
                return
            for o in outputs:
                ok = o.finished and len(o.outputs[0].token_ids) == self.args.output_len
                self.completed += ok
                self.failed += not ok
                self.output_tokens += len(o.outputs[0].token_ids)
            self.batches += 1


def free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def engine(args: argparse.Namespace) -> LLM:
    return LLM(args.model, device=args.device, load_format="dummy",
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               elastic_kv_cache=True, elastic_low_watermark=args.low_watermark,
               elastic_high_watermark=args.high_watermark,
               elastic_min_interval=args.min_interval,
               elastic_idle_s=0)  # part (a): free memory alone decides


def cpu_watermarks(args: argparse.Namespace) -> None:
    """On the host, watermarks around the available memory now: the co-tenant's taking half
    of its bytes crosses the low one, its free the high one."""
    available, cotenant_bytes = psutil.virtual_memory().available, int(args.cotenant_gib * GiB)
    args.low_watermark = str(available - cotenant_bytes // 2)
    args.high_watermark = str(available - cotenant_bytes // 4)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    limits = in_run_limits(args.device)  # before the co-tenant and the engine
    ctx = mp.get_context("spawn")
    go, held, events = ctx.Event(), ctx.Value("q", 0), ctx.Queue()
    # The co-tenant's context exists before the engine sizes its cache, as a process sharing
    # the device would.
    tenant = ctx.Process(target=cotenant, args=(args.device, int(args.cotenant_gib * GiB),
                                                args.chunk_mib * MiB, args.hold_s, go, held,
                                                events))
    tenant.start()
    try:
        return measure(args, tenant, go, held, events, limits)
    finally:  # an engine that failed must not leave the co-tenant waiting for its signal
        if tenant.is_alive():
            tenant.terminate()
            tenant.join(timeout=10)


def measure(args: argparse.Namespace, tenant: Any, go: Any, held: Any, events: Any,
            limits: dict[str, Any]) -> dict[str, Any]:
    """Serve under load while the co-tenant takes and frees its memory; the record."""
    marks: dict[str, Any] = dict([events.get(timeout=600)])
    if args.device == "cpu":
        cpu_watermarks(args)
    llm = engine(args)
    device = llm.config.device
    load = Load(llm, args)
    load.thread.start()
    ask_at, end = time.monotonic() + args.idle_s, None
    samples: list[dict[str, float]] = []
    while end is None or time.monotonic() < end:
        if not go.is_set() and time.monotonic() >= ask_at:
            go.set()
        while not events.empty():
            name, value = events.get()
            marks[name] = value
            if name == "freed":
                end = value + args.after_s
        samples.append({"t": time.monotonic(), "kv_blocks": llm.config.cache_config.num_gpu_blocks,
                        "free_bytes": free_bytes(device), "cotenant_bytes": held.value})
        if load.errors or not tenant.is_alive() and "freed" not in marks:
            break
        time.sleep(args.sample_ms / 1e3)
    load.stop.set()
    load.thread.join()
    tenant.join(timeout=60)
    result = summarize(args, llm, load, marks, samples) | limits
    llm.shutdown()
    write_record(args.out, record_of("elastic", result, vars(args)))
    print_table(result)
    return result


def summarize(args: argparse.Namespace, llm: LLM, load: Load, marks: dict[str, Any],
              samples: list[dict[str, float]]) -> dict[str, Any]:
    t0 = marks.get("asking", samples[0]["t"])
    resizes = [{**e.__dict__, "time": e.time - t0} for e in llm.engine.kv_resizer.events]
    before = [s["kv_blocks"] for s in samples if s["t"] < t0]
    size_before = before[-1] if before else None
    freed = marks.get("freed")
    # Back within 1% (the free memory the cache grows into moves a little with the steps').
    regrown = next((s["t"] for s in samples if freed is not None and s["t"] >= freed
                    and size_before is not None and s["kv_blocks"] >= 0.99 * size_before),
                   None)
    first_shrink = next((r["time"] for r in resizes if r["delta_bytes"] < 0 and r["time"] >= 0),
                        None)
    return {
        "args": vars(args),
        "kv_cache_report": llm.kv_cache_report.__dict__,
        "time_to_shrink_s": marks["holding"] - t0 if "holding" in marks else None,
        "first_shrink_s": first_shrink,
        "regrow_s": None if regrown is None else regrown - freed,
        "kv_blocks_before": size_before,
        "kv_blocks_min": min(s["kv_blocks"] for s in samples),
        "kv_blocks_end": samples[-1]["kv_blocks"],
        "cotenant_retries": marks.get("retries"),
        "completed": load.completed, "failed": load.failed, "errors": load.errors,
        "output_tokens": load.output_tokens,
        "oom_guard_events": llm.engine.oom_guard.num_events,
        "resizes": resizes,
        "samples": [{**s, "t": s["t"] - t0} for s in samples],
        "device": torch.cuda.get_device_name(llm.config.device)
        if llm.config.device.type == "cuda" else "cpu",
    }


def print_table(r: dict[str, Any]) -> None:
    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.3f} s"

    rows = [
        ("co-tenant took", format_bytes(int(r["args"]["cotenant_gib"] * GiB))),
        ("time to shrink (asked -> held)", secs(r["time_to_shrink_s"])),
        ("first governor shrink", secs(r["first_shrink_s"])),
        ("regrow (freed -> size before)", secs(r["regrow_s"])),
        ("KV blocks before / min / end",
         f"{r['kv_blocks_before']} / {r['kv_blocks_min']} / {r['kv_blocks_end']}"),
        ("resizes", str(len(r["resizes"]))),
        ("requests completed / failed", f"{r['completed']} / {r['failed']}"),
        ("out-of-memory guard events", str(r["oom_guard_events"])),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
