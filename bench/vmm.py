"""VMM benchmark: commit cost by chunk size, release/recommit, copy bandwidth vs torch memory.

    python3 bench/vmm.py --out vmm.json             # on the GPU machine (100 GiB bulk)
    python3 bench/vmm.py --device cpu --bulk-gib 2 --out vmm.json

Writes JSON to --out and prints a table. Bandwidth of VMM memory and of a torch (cudaMalloc)
buffer is measured in the same run, alternating, with CUDA events; figures are medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record
from kvfit.vmm import ExtensibleTensor

GiB = 1 << 30


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def bench_growth(device: torch.device, gib: float) -> dict[str, float]:
    """Grow to `gib` one granule at a time, as warmup's `ensure_blocks` does."""
    with ExtensibleTensor(int(gib * GiB), device) as t:
        steps = range(t.granularity, t.capacity_bytes + 1, t.granularity)
        total = sum(_seconds(lambda n=n: t.commit(n), device) for n in steps)
        return {"growth_gib": gib, "growth_s": total, "growth_chunks": t.num_physical_chunks,
                "growth_us_per_chunk": total / t.num_physical_chunks * 1e6}


def bench_bulk(device: torch.device, gib: float, pause_s: float) -> dict[str, float]:
    """Commit, release and recommit `gib` in bulk (large chunks)."""
    with ExtensibleTensor(int(gib * GiB), device) as t:
        commit = _seconds(lambda: t.commit(t.capacity_bytes), device)
        chunks = t.num_physical_chunks
        release = _seconds(t.release_physical, device)
        recommit = _seconds(t.recommit, device)
        # The same seconds after the release (as a wake follows a sleep): whether the time is
        # the driver's work on the pages just released rather than the recommit's own.
        t.release_physical()
        time.sleep(pause_s)
        recommit_paused = _seconds(t.recommit, device)
        return {"bulk_gib": gib, "bulk_chunks": chunks, "bulk_commit_s": commit,
                "release_s": release, "recommit_s": recommit,
                "release_plus_recommit_s": release + recommit,
                "recommit_after_pause_s": recommit_paused, "pause_s": pause_s}


def bench_recommit_parts(device: torch.device, gib: float, chunk_gib: float) -> dict[str, float]:
    """Where a recommit's time goes: physical allocation, mapping, access, and zeroing (as
    uint8, the way `recommit` zeroes, and through wider int64 stores), for `gib` in
    `chunk_gib` chunks of one reservation, on memory no release has just returned."""
    n, chunk = int(gib * GiB), int(chunk_gib * GiB)
    offsets = range(0, n, chunk)
    timings: dict[str, float] = {}
    with ExtensibleTensor(n, device) as t:
        res = t._live()
        drv, index = res.driver, res.device_index

        def each(fn: Callable[[int], object]) -> Callable[[], object]:
            return lambda: [fn(o) for o in offsets]

        handles = {o: drv.create(chunk, index) for o in offsets[:1]}  # compiled/initialized
        drv.release(handles.pop(0))
        timings["create_s"] = _seconds(each(lambda o: handles.setdefault(o, drv.create(
            chunk, index))), device)
        timings["map_s"] = _seconds(each(lambda o: drv.map(res.va + o, chunk, handles[o])),
                                    device)
        timings["set_access_s"] = _seconds(each(lambda o: drv.set_access(res.va + o, chunk,
                                                                         index)), device)
        whole = t._bytes(res.va, n)
        timings["zero_uint8_s"] = _seconds(each(lambda o: whole[o:o + chunk].zero_()), device)
        timings["zero_uint8_again_s"] = _seconds(each(lambda o: whole[o:o + chunk].zero_()),
                                                 device)
        timings["zero_int64_s"] = _seconds(
            each(lambda o: whole[o:o + chunk].view(torch.int64).zero_()), device)
        timings["zero_int64_whole_s"] = _seconds(lambda: whole.view(torch.int64).zero_(), device)
        timings["unmap_release_s"] = _seconds(
            each(lambda o: (drv.unmap(res.va + o, chunk), drv.release(handles[o]))), device)
    return {f"parts_{k}": v for k, v in timings.items()} | {"parts_gib": gib,
                                                            "parts_chunk_gib": chunk_gib}


def _copy_seconds(dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> float:
    if device.type != "cuda":
        return _seconds(lambda: dst.copy_(src), device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def bench_bandwidth(device: torch.device, gib: float, repeats: int) -> dict[str, float]:
    """Copy `gib` within VMM memory and within a torch buffer, alternating; GB/s read+write."""
    n = int(gib * GiB)
    with ExtensibleTensor(2 * n, device) as t:
        t.commit(2 * n)
        vmm = t.full_view()
        plain = torch.empty(2 * n, dtype=torch.uint8, device=device)
        vmm.fill_(1)
        plain.fill_(1)
        times: dict[str, list[float]] = {"vmm": [], "torch": []}
        for _ in range(repeats + 1):  # the first round warms up
            for name, buf in (("vmm", vmm), ("torch", plain)):
                times[name].append(_copy_seconds(buf[n:], buf[:n], device))
        del plain, vmm
        gbps = {name: 2 * n / statistics.median(ts[1:]) / 1e9 for name, ts in times.items()}
    return {"copy_gib": gib, "vmm_gbps": gbps["vmm"], "torch_gbps": gbps["torch"],
            "bandwidth_ratio": gbps["vmm"] / gbps["torch"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--growth-gib", type=float, default=1.0)
    parser.add_argument("--bulk-gib", type=float, default=100.0,
                        help="size of the bulk commit/release/recommit (size down on small GPUs)")
    parser.add_argument("--copy-gib", type=float, default=1.0)
    parser.add_argument("--pause-s", type=float, default=2.0,
                        help="seconds between a release and a second, paused recommit")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--parts-gib", type=float, default=None,
                        help="size of the recommit breakdown (allocation, map, access, zeroing); "
                        "default 32, at most --bulk-gib")
    parser.add_argument("--parts-chunk-gib", type=float, nargs="*", default=None,
                        help="chunk sizes of the breakdown, each dividing --parts-gib "
                        "(default: 1 and 4, those that fit)")
    parser.add_argument("--out", required=True, help="JSON results path")
    args = parser.parse_args(argv)
    # The breakdown commits --parts-gib at once: sized with --bulk-gib, so a run sized down for
    # a small device (the CPU smoke check's 2 GiB on the host) does not ask for 32 GiB.
    if args.parts_gib is None:
        args.parts_gib = min(32.0, args.bulk_gib)
    if args.parts_chunk_gib is None:
        args.parts_chunk_gib = [c for c in (1.0, 4.0) if c <= args.parts_gib] or [args.parts_gib]
    parts = round(args.parts_gib * GiB)
    for chunk_gib in args.parts_chunk_gib:
        chunk = round(chunk_gib * GiB)
        # Each chunk is mapped whole inside the reservation of --parts-gib: one past its end
        # would map over whatever lies beyond it.
        if chunk <= 0 or parts % chunk:
            parser.error(f"--parts-chunk-gib {chunk_gib:g} does not divide --parts-gib "
                         f"{args.parts_gib:g}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (host driver)"
    results: dict[str, object] = {"device": name, "torch": torch.__version__,
                                  **in_run_limits(device)}
    results |= bench_growth(device, args.growth_gib)
    results |= bench_bulk(device, args.bulk_gib, args.pause_s)
    results |= bench_bandwidth(device, args.copy_gib, args.repeats)
    for chunk_gib in args.parts_chunk_gib:
        parts = bench_recommit_parts(device, args.parts_gib, chunk_gib)
        print(" ".join(f"{k}={v * 1e3:.1f}ms" if k.endswith("_s") else f"{k}={v}"
                       for k, v in parts.items()))
        results |= {f"{k}_{chunk_gib:g}": v for k, v in parts.items()}
    write_record(args.out, record_of("vmm", results, vars(args)))

    rows = [
        (f"grow {args.growth_gib:g} GiB in granules", f"{results['growth_s'] * 1e3:.2f} ms",
         f"{results['growth_chunks']} chunks, {results['growth_us_per_chunk']:.0f} us/chunk"),
        (f"bulk commit {args.bulk_gib:g} GiB", f"{results['bulk_commit_s'] * 1e3:.2f} ms",
         f"{results['bulk_chunks']} chunks"),
        ("release_physical", f"{results['release_s'] * 1e3:.2f} ms", ""),
        ("recommit (zeroed)", f"{results['recommit_s'] * 1e3:.2f} ms", ""),
        ("release + recommit", f"{results['release_plus_recommit_s'] * 1e3:.2f} ms",
         "target <= 300 ms"),
        (f"recommit {args.pause_s:g} s later", f"{results['recommit_after_pause_s'] * 1e3:.2f} ms",
         ""),
        (f"copy {args.copy_gib:g} GiB, VMM", f"{results['vmm_gbps']:.0f} GB/s", "median"),
        (f"copy {args.copy_gib:g} GiB, torch", f"{results['torch_gbps']:.0f} GB/s", "median"),
        ("bandwidth ratio VMM/torch", f"{results['bandwidth_ratio']:.3f}", "target >= 0.98"),
    ]
    print(f"kvfit vmm bench on {name}")
    for row in rows:
        print(f"| {row[0]:<30} | {row[1]:>12} | {row[2]:<32} |")


if __name__ == "__main__":
    main()
