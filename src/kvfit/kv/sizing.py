"""How many KV cache bytes fit, from memory measured after warmup. Pure functions, in bytes.

The measured path keeps free only what the measurement cannot see: the transient of a step
(the caching allocator's reserved peak less live allocations, which includes its rounding and
fragmentation) and a margin that is a share of that transient, for step shapes warmup ran
separately but real steps combine. The estimate path is the fallback where the cache cannot
be backed by VMM, and the baseline benchmarks compare against.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MiB = 1 << 20
DEFAULT_MARGIN_FLOOR = 256 * MiB
DEFAULT_MARGIN_FRACTION = 0.5


@dataclass(frozen=True)
class MemorySnapshot:
    """One reading of a memory monitor.

    On the host, `total` is the configured budget and the torch figures are the process's
    private resident memory (the KV cache's shared pages excluded).
    """

    total: int
    free: int
    torch_reserved: int
    torch_allocated: int

    @property
    def usable_free(self) -> int:
        """Free memory plus what torch's caching allocator holds idle (a step can reuse it)."""
        return self.free + self.torch_reserved - self.torch_allocated


@dataclass(frozen=True)
class StepPeak:
    """Memory of one profiling or warmup step: the reserved peak and what stayed live after."""

    reserved_peak: int
    live_allocated: int


@dataclass(frozen=True)
class MemoryProfile:
    """What one worker measured after warmup, the input of `available_kv_bytes`."""

    total: int  # device memory (host: the configured budget)
    free: int  # free on the device now
    weights: int  # model weights, part of `torch_live`
    torch_live: int  # live torch allocations: weights, buffers, graph pools
    non_torch: int  # the process's use outside torch: context, library workspaces
    committed_kv: int  # physical bytes the KV cache holds now
    transient: int  # see `transient_bytes`

    @property
    def non_kv_use(self) -> int:
        """Everything this process holds on the device except the KV cache."""
        return self.torch_live + self.non_torch


def transient_bytes(steps: Iterable[StepPeak]) -> int:
    """The largest reserved peak less live allocations over the profiling and warmup steps."""
    return max((max(0, s.reserved_peak - s.live_allocated) for s in steps), default=0)


def non_torch_bytes(baseline: MemorySnapshot, now: MemorySnapshot, committed_kv: int) -> int:
    """Device memory the process took since `baseline` outside torch's allocator.

    VMM pages are invisible to torch's statistics, so the KV cache's own pages are taken out.
    """
    device_growth = baseline.free - now.free
    torch_growth = now.torch_reserved - baseline.torch_reserved
    return max(0, device_growth - torch_growth - committed_kv)


def memory_profile(
    baseline: MemorySnapshot,
    now: MemorySnapshot,
    steps: Iterable[StepPeak],
    weights: int,
    committed_kv: int,
    vmm_weights: int = 0,
) -> MemoryProfile:
    """The profile of a worker from a snapshot taken before it loaded anything (`baseline`),
    one taken after warmup (`now`) and the step peaks in between.

    Memory torch's caching allocator holds idle counts as free: the transient reuses it.
    `vmm_weights`: bytes of weights mapped by VMM (a sleep-mode weight arena), invisible to
    torch's statistics: counted as live, not as non-torch use.
    """
    return MemoryProfile(
        total=now.total,
        free=now.usable_free,
        weights=weights,
        torch_live=now.torch_allocated + vmm_weights,
        non_torch=non_torch_bytes(baseline, now, committed_kv + vmm_weights),
        committed_kv=committed_kv,
        transient=transient_bytes(steps),
    )


def kv_margin(
    transient: int,
    floor: int = DEFAULT_MARGIN_FLOOR,
    fraction: float = DEFAULT_MARGIN_FRACTION,
) -> int:
    """Headroom for allocations warmup did not exercise: a share of the measured transient."""
    if floor < 0 or fraction < 0:
        raise ValueError(
            f"KV margin floor ({floor}) and fraction ({fraction}) must not be negative"
        )
    return max(floor, int(fraction * transient))


def memory_budget(total: int, utilization: float, setting: str = "gpu_memory_utilization") -> int:
    """`total * utilization`: the share of the device this engine may use."""
    if not 0 < utilization <= 1:
        raise ValueError(f"{setting} must be in (0, 1], got {utilization}")
    return int(total * utilization)


def _budget_below_use(setting: str, utilization: float, total: int, budget: int,
                      used: int) -> ValueError:
    """The error for a budget below what the model already uses, naming what to raise.
    `setting` is the utilization's own name on a device; on the host it is the byte budget
    (`cpu_kv_cache_space_bytes`), which gpu_memory_utilization scales."""
    if setting == "gpu_memory_utilization":
        made_of, raise_ = f"{setting}={utilization} of {total} bytes = {budget}", setting
    elif utilization < 1:
        made_of = f"gpu_memory_utilization {utilization} x {setting} {total} = {budget} bytes"
        raise_ = f"gpu_memory_utilization or {setting}"
    else:
        made_of, raise_ = f"{setting} {total} bytes", setting
    # On the host the budget counts the whole process, whose runtime outweighs a small model.
    user = ("the engine's process already uses (weights, Python, torch, ...)"
            if setting == "cpu_kv_cache_space_bytes" else "the model already uses")
    return ValueError(f"the memory budget ({made_of}) is below the {used} bytes {user}; "
                      f"raise {raise_}")


def available_kv_bytes(
    profile: MemoryProfile,
    utilization: float,
    margin_floor: int = DEFAULT_MARGIN_FLOOR,
    margin_fraction: float = DEFAULT_MARGIN_FRACTION,
    setting: str = "gpu_memory_utilization",
) -> int:
    """Bytes the KV cache may hold: within the budget, within what is free, less what is kept.

    `min(budget - non_kv_use, free + committed_kv) - transient - margin`, never negative.
    Raises `ValueError` naming `setting` when the budget is below what is already used.
    """
    budget = memory_budget(profile.total, utilization, setting)
    if budget < profile.non_kv_use:
        raise _budget_below_use(setting, utilization, profile.total, budget, profile.non_kv_use)
    margin = kv_margin(profile.transient, margin_floor, margin_fraction)
    usable = min(budget - profile.non_kv_use, profile.free + profile.committed_kv)
    return max(0, usable - profile.transient - margin)


def estimate_num_blocks(
    total: int,
    utilization: float,
    weights: int,
    activation_peak: int,
    graph_capture: int,
    non_torch: int,
    block_bytes: int,
    setting: str = "gpu_memory_utilization",
) -> int:
    """Blocks by estimate: `(budget - weights - activations - graph capture - non-torch)`
    divided by the bytes of one block. The fallback without VMM, and the benchmark baseline.
    """
    budget = memory_budget(total, utilization, setting)
    used = weights + non_torch
    if budget < used:
        raise _budget_below_use(setting, utilization, total, budget, used)
    return max(0, budget - used - activation_peak - graph_capture) // block_bytes


def min_over_workers(num_blocks: Sequence[int]) -> int:
    """The block count every worker can hold: the minimum of their counts."""
    if not num_blocks:
        raise ValueError("no worker reported a KV cache block count")
    return min(num_blocks)
