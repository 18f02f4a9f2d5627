"""Where a workload's device time goes: kernels by name, grouped into families (GEMM by library,
attention by kernel, norms, sampling, ...), split by the kind of engine step that launched them,
and how busy the device was; two profiles side by side with their difference.

`profile_run(run, llm)` runs `run()` under torch.profiler with every engine step annotated by its
kind (`annotate_steps`); `kernel_profile` turns the profiler's events into a `KernelProfile`,
giving each kernel to the step whose device-side span holds it (pure over the events, so it is
tested with fake ones); `profile_text` and `comparison_text` render one or two of them. Used by
`bench/throughput.py --profile` and `bench/determinism.py --profile`.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

FAMILIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # cuBLAS on Hopper names its kernels nvjet_*; older ones *gemm*/*gemv*, cutlass or xmma.
    ("gemm.cublas", re.compile(r"nvjet|gemm|gemv|cublas|cutlass|xmma|splitKreduce", re.I)),
    # `_skinny_kernel`: the linear layers of few rows (`ops/triton_skinny.py`).
    ("gemm.triton", re.compile(r"_matmul_kernel|_skinny_kernel")),
    ("attention.prefill", re.compile(r"_prefill_kernel")),
    # `_decode_input_kernel` (`--fused-decode-input`) holds the attention input too.
    # `_decode_fp8_pairs_kernel` reads an e4m3 cache computed in float16.
    ("attention.decode", re.compile(r"_decode_kernel|_decode_fp8_pairs_kernel|"
                                    r"_decode_input_kernel|_reduce_splits_kernel")),
    ("attention.input", re.compile(r"_attention_input_kernel|_write_kv_kernel|_rotary_kernel")),
    ("norm", re.compile(r"_rms_norm_kernel|rms_?norm", re.I)),
    ("activation", re.compile(r"_silu_and_mul_kernel")),
    # `_argmax_kernel`: greedy steps' argmax (`ops/triton_argmax.py`).
    ("sampling", re.compile(r"_argmax_kernel|_logsumexp_kernel|_key_range_kernel|"
                            r"_begin_kernel|_radix_kernel|_between_kernel|_mass_kernel|"
                            r"_finish_kernel|RadixSort|topk", re.I)),
    ("memcpy", re.compile(r"^(Memcpy|Memset)", re.I)),
)
"""(family, pattern) in the order they are tried: a kernel belongs to the first family whose
pattern occurs in its name (`re.search`), else to "other"."""
OTHER = "other"
FAMILY_NAMES = (*(name for name, _ in FAMILIES), OTHER)

STEP_PREFIX = "kvfit.step."
"""The profiler range each engine step is launched in: `kvfit.step.decode` (every sequence
computes one token) or `kvfit.step.mixed` (prefill chunks, alone or with decodes)."""

SPAN, LINK = "span", "link"
"""How `kernel_profile` gave kernels to step kinds: by the steps' device-side spans (time) or,
where the profile has none, by the profiler's kernel-to-launching-op links."""


def kernel_family(name: str) -> str:
    """The family of a device kernel's name (`FAMILIES`), "other" if none matches."""
    for family, pattern in FAMILIES:
        if pattern.search(name):
            return family
    return OTHER


@dataclass
class KernelStat:
    """One kernel name's device time (microseconds) and launches."""

    device_us: float = 0.0
    count: int = 0


@dataclass
class KernelProfile:
    """One profiled run: its wall time, the share of each twentieth of it in which a kernel ran
    (`busy`), every device kernel by name, and, per step kind, the device time of that kind's
    kernels by family (attributed by `attribution`, see `kernel_profile`), the steps' host
    time, their device span (first to last kernel of each step, gaps included, as the
    profiler's GPU range reports it) and their count."""

    wall_s: float
    busy: list[float]
    kernels: dict[str, KernelStat]
    step_families_us: dict[str, dict[str, float]] = field(default_factory=dict)
    step_host_us: dict[str, float] = field(default_factory=dict)
    step_device_span_us: dict[str, float] = field(default_factory=dict)
    step_counts: dict[str, int] = field(default_factory=dict)
    table: str = ""  # torch's own table, by device time
    attribution: str = SPAN  # how kernels were given to step kinds: SPAN or LINK

    @property
    def device_us(self) -> float:
        return sum(k.device_us for k in self.kernels.values())

    @property
    def busy_mean(self) -> float:
        return sum(self.busy) / len(self.busy) if self.busy else 0.0

    def families_us(self) -> dict[str, float]:
        return family_totals(self.kernels)

    def as_dict(self, top: int = 30) -> dict[str, Any]:
        """The JSON form: totals in ms, the families, the step split and the `top` kernels."""
        kernels = sorted(self.kernels.items(), key=lambda kv: -kv[1].device_us)[:top]
        attributed = sum(sum(f.values()) for f in self.step_families_us.values())
        return {
            "wall_s": self.wall_s, "busy": self.busy, "busy_mean": self.busy_mean,
            "device_ms": self.device_us / 1e3,
            "families_ms": {f: us / 1e3 for f, us in self.families_us().items()},
            "steps": {kind: {"count": self.step_counts.get(kind, 0),
                             "host_ms": self.step_host_us.get(kind, 0.0) / 1e3,
                             "device_span_ms": self.step_device_span_us.get(kind, 0.0) / 1e3,
                             "families_ms": {f: us / 1e3 for f, us in fams.items()}}
                      for kind, fams in self.step_families_us.items()},
            "attributed_to_steps": attributed / self.device_us if self.device_us else 0.0,
            "attribution": self.attribution,
            "top_kernels": [{"name": n, "family": kernel_family(n), "ms": k.device_us / 1e3,
                             "count": k.count} for n, k in kernels],
        }


def family_totals(kernels: dict[str, KernelStat]) -> dict[str, float]:
    """Device microseconds per family, every family present (zero where none ran)."""
    totals = dict.fromkeys(FAMILY_NAMES, 0.0)
    for name, stat in kernels.items():
        totals[kernel_family(name)] += stat.device_us
    return totals


def busy_fractions(events: Iterable[Any], start_us: float, end_us: float,
                   bins: int) -> list[float]:
    """Share of each of `bins` equal slices of [start_us, end_us] in which a kernel ran
    (`events` carry `time_range.start/end` in us)."""
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


def _on_device(event: Any) -> bool:
    return event.device_type != torch.autograd.DeviceType.CPU


def _is_kernel(event: Any) -> bool:
    """A device activity (kernel, copy, memset): not the device-side span the profiler adds
    for a `record_function` range (flagged as a user annotation; the step ranges are also
    known by name, should a torch version not flag them)."""
    return (_on_device(event) and not getattr(event, "is_user_annotation", False)
            and not event.name.startswith(STEP_PREFIX))


def kernel_profile(events: list[Any], table: str = "", bins: int = 20) -> KernelProfile:
    """The profile of torch.profiler's `events` (FunctionEvents: `name`, `device_type`,
    `device_index`, `device_resource_id` (the stream), `time_range`, and for CPU ones
    `cpu_children` and the `kernels` linked to them).

    Kernels go to step kinds by time: each `STEP_PREFIX` range also appears as device-side
    spans, one per device and stream its step ran kernels on (first to last of them), and a
    kernel belongs to the kind of the span on its device and stream that contains its start
    (`[start, end)`). A stream runs its kernels in order, so its spans of consecutive steps
    should not overlap; should some all the same (nested ranges, say), the latest-starting span
    containing the kernel wins, the step that began most recently. Kernels in no span
    (launched between or outside steps) count in the totals, not in any kind.

    Only a profile with kernels but no device-side span at all (a tracer that emits none) falls
    back to the links: a kernel linked to a step's range or any CPU event under it. The links
    miss most kernels of an engine that replays CUDA graphs and overlaps its steps (on the H200,
    2026-12-04, they reached 6% of the device time in the default mode, 0% in the
    deterministic one), hence time first. `attribution` says which rule ran and
    `as_dict()['attributed_to_steps']` how much device time it gave to some kind.
    """
    kernels: dict[str, KernelStat] = {}
    device = [e for e in events if _is_kernel(e)]
    for e in device:
        stat = kernels.setdefault(e.name, KernelStat())
        stat.device_us += e.time_range.end - e.time_range.start
        stat.count += 1
    start = min((e.time_range.start for e in events), default=0.0)
    end = max((e.time_range.end for e in events), default=0.0)
    busy = busy_fractions(device, start, end, bins) if end > start else []
    host: dict[str, float] = {}
    span: dict[str, float] = {}
    counts: dict[str, int] = {}
    steps: list[Any] = []  # the ranges on the host
    spans: list[tuple[Any, str]] = []  # their device-side spans, with their kinds
    for e in events:
        if _is_kernel(e) or not e.name.startswith(STEP_PREFIX):
            continue
        kind = e.name.removeprefix(STEP_PREFIX)
        duration = e.time_range.end - e.time_range.start
        if _on_device(e):
            span[kind] = span.get(kind, 0.0) + duration
            spans.append((e, kind))
            continue
        steps.append(e)
        host[kind] = host.get(kind, 0.0) + duration
        counts[kind] = counts.get(kind, 0) + 1
    step_families = {kind: dict.fromkeys(FAMILY_NAMES, 0.0)
                     for kind in dict.fromkeys([*counts, *span])}
    # A CPU profile has neither kernels nor spans, so either rule gives nothing there; the link
    # rule is kept for a device profile without spans, where it is the only one that can run.
    attribution = SPAN if spans or not device else LINK
    if attribution == SPAN:
        for kernel, kind in _kernels_in_spans(device, spans):
            step_families[kind][kernel_family(kernel.name)] += (kernel.time_range.end
                                                                - kernel.time_range.start)
    else:
        for step in steps:
            families = step_families[step.name.removeprefix(STEP_PREFIX)]
            for kernel in _linked_kernels(step):
                families[kernel_family(kernel.name)] += kernel.duration
    return KernelProfile((end - start) / 1e6, busy, kernels, step_families, host, span, counts,
                         table, attribution)


def _kernels_in_spans(kernels: Iterable[Any], spans: Iterable[tuple[Any, str]]
                      ) -> Iterator[tuple[Any, str]]:
    """(kernel, kind) for every kernel whose start lies in a span on its device and stream:
    the latest-starting such span, `[start, end)`."""
    by_stream: dict[Any, list[tuple[float, float, str]]] = {}
    for e, kind in spans:
        by_stream.setdefault(_stream_of(e), []).append((e.time_range.start, e.time_range.end,
                                                        kind))
    index = {}
    for key, ranges in by_stream.items():
        ranges.sort(key=lambda r: r[0])
        reach, latest_end = [], float("-inf")  # reach[i]: the latest end among ranges[:i + 1]
        for _, span_end, _ in ranges:
            latest_end = max(latest_end, span_end)
            reach.append(latest_end)
        index[key] = ([r[0] for r in ranges], reach, ranges)
    for kernel in kernels:
        if (found := index.get(_stream_of(kernel))) is None:
            continue
        starts, reach, ranges = found
        t = kernel.time_range.start
        i = bisect_right(starts, t) - 1  # the latest span starting at or before t
        while i >= 0 and reach[i] > t:  # no earlier span can hold t once reach[i] <= t
            if t < ranges[i][1]:
                yield kernel, ranges[i][2]
                break
            i -= 1


def _stream_of(event: Any) -> tuple[Any, int, int]:
    """Kineto gives a range's device span the device and stream of the kernels it covers."""
    return (event.device_type, getattr(event, "device_index", 0),
            getattr(event, "device_resource_id", 0))


def _linked_kernels(event: Any) -> Iterator[Any]:
    """The kernels linked to `event` and to every CPU event under it."""
    stack = [event]
    while stack:
        e = stack.pop()
        yield from e.kernels
        stack.extend(e.cpu_children)


@contextmanager
def annotate_steps(llm: Any) -> Iterator[None]:
    """Within `with`, every step `llm`'s engine launches runs inside a profiler range named
    for its kind (`STEP_PREFIX`). Wraps the executor's `launch` like `bench/throughput.py`'s
    StepRecorder, restoring whatever was there before on exit (so the two nest)."""
    executor = llm.engine.executor
    saved = vars(executor).get("launch")
    launch = executor.launch

    def annotated_launch(batch: Any) -> Any:
        kind = "decode" if batch.is_decode_only else "mixed"
        with torch.profiler.record_function(STEP_PREFIX + kind):
            return launch(batch)

    executor.launch = annotated_launch
    try:
        yield
    finally:
        if saved is None:
            del executor.launch  # the class's method again
        else:
            executor.launch = saved


def profile_run(run: Callable[[], object], llm: Any, device: torch.device,
                table_rows: int = 40) -> KernelProfile:
    """`run()` (which should end by synchronising the device) under torch.profiler, CUDA
    kernels included on a CUDA device, with `llm`'s steps annotated (`annotate_steps`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof, annotate_steps(llm):
        run()
    sort = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=table_rows)
    return kernel_profile(list(prof.events()), table)


def _pct(part: float, whole: float) -> str:
    return f"{part / whole:6.1%}" if whole else f"{'-':>6}"


def profile_text(profile: KernelProfile) -> str:
    """One profile: the header `bench/throughput.py --profile` always wrote (wall time, busy
    share), then the families and torch's kernel table."""
    lines = [f"offline workload under the profiler: {profile.wall_s:.2f} s, device busy "
             f"{profile.busy_mean:.0%}",
             "busy by twentieth of the run: " + " ".join(f"{b:.0%}" for b in profile.busy), "",
             f"{'family':<18} {'device ms':>10} {'share':>6}"]
    total = profile.device_us
    for family, us in profile.families_us().items():
        lines.append(f"{family:<18} {us / 1e3:>10.1f} {_pct(us, total)}")
    lines += [f"{'total':<18} {total / 1e3:>10.1f}", "", profile.table]
    return "\n".join(lines)


def per_step_text(profile: KernelProfile, label: str, kind: str = "decode") -> str:
    """A profile of steps of one `kind` alone (`bench/throughput.py --profile-decode`): per
    step, the device span (first kernel's start to last kernel's end), the kernels' summed
    time and the idle rest (launch gaps, graph-node latency), then every kernel by its time
    per step, with its launches per step and its mean per launch."""
    steps = profile.step_counts.get(kind, 0)
    if not steps:
        return f"{label}: no {kind} step in the profile"
    span = profile.step_device_span_us.get(kind, 0.0) / steps
    busy = profile.device_us / steps
    lines = [f"{label}: {steps} {kind} steps, per step: device span {span:.1f} us, kernels "
             f"{busy:.1f} us, idle {span - busy:.1f} us ({_pct(span - busy, span).strip()})",
             f"{'us/step':>9} {'n/step':>6} {'us/launch':>9}  kernel"]
    for name, stat in sorted(profile.kernels.items(), key=lambda kv: -kv[1].device_us):
        lines.append(f"{stat.device_us / steps:>9.1f} {stat.count / steps:>6.1f} "
                     f"{stat.device_us / stat.count:>9.2f}  {name[:110]}")
    return "\n".join(lines)


def comparison_text(profiles: dict[str, KernelProfile], top: int = 40) -> str:
    """Two profiles (first = the baseline) side by side: wall time and busy share, device time
    per family, per step kind and family (with the share of device time each profile gave to
    some kind, and by which rule: `kernel_profile`), and the `top` kernels, each with the
    difference (second - first) and that difference as a share of the baseline's device
    time."""
    (base_name, base), (name, other) = profiles.items()
    base_total = base.device_us
    w = max(14, len(base_name), len(name))
    lines = ["offline workload under the profiler, once per mode (differences: "
             f"{name} - {base_name}; % of {base_name}'s device time)", ""]
    for n, p in profiles.items():
        lines.append(f"{n:<{w}}: {p.wall_s:.2f} s wall, device busy {p.busy_mean:.0%}, "
                     f"{p.device_us / 1e6:.2f} s of kernels, idle "
                     f"{p.wall_s * (1 - p.busy_mean):.2f} s; busy by twentieth: "
                     + " ".join(f"{b:.0%}" for b in p.busy))
    head = (f"{base_name + ' ms':>{w + 3}} {'share':>6} {name + ' ms':>{w + 3}} {'share':>6} "
            f"{'diff ms':>10} {'diff %':>7}")

    def row(label: str, width: int, a: float, b: float, a_total: float, b_total: float) -> str:
        return (f"{label:<{width}} {a / 1e3:>{w + 3}.1f} {_pct(a, a_total)} "
                f"{b / 1e3:>{w + 3}.1f} {_pct(b, b_total)} {(b - a) / 1e3:>10.1f} "
                f"{_pct(b - a, base_total):>7}")

    fa, fb = base.families_us(), other.families_us()
    lines += ["", f"{'family':<18} {head}"]
    lines += [row(f, 18, fa[f], fb[f], base_total, other.device_us) for f in FAMILY_NAMES]
    lines.append(row("total", 18, base_total, other.device_us, base_total, other.device_us))

    kinds = list(dict.fromkeys([*base.step_families_us, *other.step_families_us]))
    if kinds:
        shares = ", ".join(f"{n} {p.as_dict()['attributed_to_steps']:.0%} by {p.attribution}"
                           for n, p in profiles.items())
        lines += ["", f"by step kind (device time attributed: {shares}): by {SPAN}, a "
                      f"kernel goes to the step whose device span holds its start (the "
                      f"latest-starting one where steps overlap), by {LINK}, to the step whose "
                      f"host range the profiler links it to; host ms = the steps' launch time "
                      f"on the host (forward and sampling enqueued), device span = first to "
                      f"last kernel of each step, gaps included", ""]
        for kind in kinds:
            sa = base.step_families_us.get(kind, {})
            sb = other.step_families_us.get(kind, {})
            lines.append(f"{kind} steps ({base_name} / {name}): "
                         f"{base.step_counts.get(kind, 0)} / {other.step_counts.get(kind, 0)}, "
                         f"host ms {base.step_host_us.get(kind, 0.0) / 1e3:.1f} / "
                         f"{other.step_host_us.get(kind, 0.0) / 1e3:.1f}, device span ms "
                         f"{base.step_device_span_us.get(kind, 0.0) / 1e3:.1f} / "
                         f"{other.step_device_span_us.get(kind, 0.0) / 1e3:.1f}")
            lines.append(f"  {'family':<18} {head}")
            ta, tb = sum(sa.values()), sum(sb.values())
            for f in FAMILY_NAMES:
                a, b = sa.get(f, 0.0), sb.get(f, 0.0)
                if a or b:
                    lines.append("  " + row(f, 18, a, b, ta, tb))
            lines.append("  " + row("total", 18, ta, tb, ta, tb))

    names = sorted(set(base.kernels) | set(other.kernels),
                   key=lambda k: -max(base.kernels.get(k, KernelStat()).device_us,
                                      other.kernels.get(k, KernelStat()).device_us))[:top]
    lines += ["", f"kernels (top {top} by the larger of the two):",
              f"{'kernel':<60} {'family':<18} {base_name + ' ms':>{w + 3}} {'calls':>7} "
              f"{name + ' ms':>{w + 3}} {'calls':>7} {'diff ms':>10}"]
    for k in names:
        a, b = base.kernels.get(k, KernelStat()), other.kernels.get(k, KernelStat())
        lines.append(f"{k[:60]:<60} {kernel_family(k):<18} {a.device_us / 1e3:>{w + 3}.1f} "
                     f"{a.count:>7} {b.device_us / 1e3:>{w + 3}.1f} {b.count:>7} "
                     f"{(b.device_us - a.device_us) / 1e3:>10.1f}")
    for n, p in profiles.items():
        lines += ["", f"torch.profiler's table, {n}:", p.table]
    return "\n".join(lines)
