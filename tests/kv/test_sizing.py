"""Sizing policy on hand-computed numbers, including the edge cases."""

from __future__ import annotations

import pytest

from kvfit.kv.sizing import (
    MemoryProfile,
    MemorySnapshot,
    StepPeak,
    available_kv_bytes,
    estimate_num_blocks,
    kv_margin,
    memory_profile,
    min_over_workers,
    non_torch_bytes,
    transient_bytes,
)

MiB = 1 << 20
GiB = 1 << 30


def profile(**kw: int) -> MemoryProfile:
    args = dict(
        total=80 * GiB,
        free=60 * GiB,
        weights=16 * GiB,
        torch_live=17 * GiB,
        non_torch=1 * GiB,
        committed_kv=2 * GiB,
        transient=2 * GiB,
    )
    args.update(kw)
    return MemoryProfile(**args)


def test_transient_is_the_largest_reserved_peak_less_live() -> None:
    steps = [StepPeak(10 * GiB, 9 * GiB), StepPeak(12 * GiB, 9 * GiB), StepPeak(11 * GiB, 7 * GiB)]
    assert transient_bytes(steps) == 4 * GiB
    assert transient_bytes([]) == 0
    # Live above the peak (a step that freed nothing) counts as no transient, never negative.
    assert transient_bytes([StepPeak(5 * GiB, 6 * GiB)]) == 0


def test_margin_is_half_the_transient_with_a_256_mib_floor() -> None:
    assert kv_margin(4 * GiB) == 2 * GiB
    assert kv_margin(100 * MiB) == 256 * MiB
    assert kv_margin(512 * MiB) == 256 * MiB
    assert kv_margin(4 * GiB, floor=1 * GiB, fraction=0.1) == 1 * GiB
    assert kv_margin(40 * GiB, floor=1 * GiB, fraction=0.1) == 4 * GiB
    with pytest.raises(ValueError, match="fraction"):
        kv_margin(GiB, fraction=-0.5)


def test_available_limited_by_budget() -> None:
    # budget 72 GiB - use 18 GiB = 54 GiB; free + committed = 62 GiB; less 2 + 1 GiB kept.
    assert available_kv_bytes(profile(), 0.9) == 51 * GiB


def test_available_limited_by_free_memory() -> None:
    # A co-tenant holds memory: free 30 + committed 2 = 32 GiB < budget 80 - 18 = 62 GiB.
    assert available_kv_bytes(profile(free=30 * GiB), 1.0) == 29 * GiB


def test_available_counts_committed_kv_as_usable() -> None:
    # All but 1 GiB is already the KV cache: it may keep it, less what is kept free.
    p = profile(free=1 * GiB, committed_kv=61 * GiB, transient=512 * MiB)
    assert available_kv_bytes(p, 1.0) == 62 * GiB - 512 * MiB - 256 * MiB


def test_available_with_configured_margin() -> None:
    p = profile()
    assert available_kv_bytes(p, 0.9, margin_floor=0, margin_fraction=0.25) == 54 * GiB - 2560 * MiB


def test_nothing_free_gives_zero_not_negative() -> None:
    assert available_kv_bytes(profile(free=0, committed_kv=0), 1.0) == 0


def test_transient_larger_than_free_gives_zero() -> None:
    assert available_kv_bytes(profile(free=3 * GiB, committed_kv=0, transient=8 * GiB), 1.0) == 0


def test_budget_below_use_is_an_error_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        available_kv_bytes(profile(), 0.2)  # 16 GiB budget < 18 GiB in use
    with pytest.raises(ValueError, match="cpu_memory_budget"):
        available_kv_bytes(profile(total=10 * GiB), 1.0, setting="cpu_memory_budget")


def test_a_host_budget_below_use_names_the_utilization_and_the_budget() -> None:
    """On the CPU the budget is gpu_memory_utilization x cpu_kv_cache_space_bytes. With the
    utilization at 0.01 the error read 'cpu_kv_cache_space_bytes=0.01 of ... bytes; raise
    cpu_kv_cache_space_bytes': the utilization's value under the other setting's name, and
    not the setting that made the budget small."""
    setting = "cpu_kv_cache_space_bytes"
    match = (r"gpu_memory_utilization 0\.01 x cpu_kv_cache_space_bytes 10737418240 = "
             r"107374182 bytes\) .*raise gpu_memory_utilization or cpu_kv_cache_space_bytes")
    with pytest.raises(ValueError, match=match):
        available_kv_bytes(profile(total=10 * GiB), 0.01, setting=setting)
    with pytest.raises(ValueError, match=match):
        estimate_num_blocks(10 * GiB, 0.01, 6 * GiB, 0, 0, 0, 2 * MiB, setting=setting)
    with pytest.raises(ValueError, match=r"\(cpu_kv_cache_space_bytes 10737418240 bytes\) .*"
                                         r"raise cpu_kv_cache_space_bytes$"):
        available_kv_bytes(profile(total=10 * GiB), 1.0, setting=setting)
    # It said "the model already uses" of ~320 MiB, 23 MiB of them a small model's weights.
    with pytest.raises(ValueError, match=r"bytes the engine's process already uses "
                                         r"\(weights, Python, torch, \.\.\.\)"):
        available_kv_bytes(profile(total=10 * GiB), 1.0, setting=setting)


@pytest.mark.parametrize("utilization", [0.0, 1.5, -0.1])
def test_utilization_out_of_range_is_an_error(utilization: float) -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        available_kv_bytes(profile(), utilization)


def test_non_torch_growth_excludes_torch_and_kv_pages() -> None:
    baseline = MemorySnapshot(total=80 * GiB, free=79 * GiB, torch_reserved=0, torch_allocated=0)
    now = MemorySnapshot(
        total=80 * GiB, free=50 * GiB, torch_reserved=20 * GiB, torch_allocated=18 * GiB
    )
    # 29 GiB left the device: 20 GiB to torch, 8 GiB to KV pages, 1 GiB to context/workspaces.
    assert non_torch_bytes(baseline, now, committed_kv=8 * GiB) == 1 * GiB
    # Another process freeing memory meanwhile must not make it negative.
    assert non_torch_bytes(baseline, now, committed_kv=20 * GiB) == 0


def test_memory_profile_from_snapshots() -> None:
    baseline = MemorySnapshot(total=80 * GiB, free=79 * GiB, torch_reserved=0, torch_allocated=0)
    now = MemorySnapshot(
        total=80 * GiB, free=50 * GiB, torch_reserved=20 * GiB, torch_allocated=18 * GiB
    )
    steps = [StepPeak(21 * GiB, 18 * GiB), StepPeak(20 * GiB, 18 * GiB)]
    p = memory_profile(baseline, now, steps, weights=16 * GiB, committed_kv=8 * GiB)
    assert p == MemoryProfile(
        total=80 * GiB,
        free=52 * GiB,  # 2 GiB the caching allocator holds idle is free to the transient
        weights=16 * GiB,
        torch_live=18 * GiB,
        non_torch=1 * GiB,
        committed_kv=8 * GiB,
        transient=3 * GiB,
    )
    # min(80 - 19, 52 + 8) - 3 - 1.5 GiB
    assert available_kv_bytes(p, 1.0) == 55 * GiB + 512 * MiB


def test_estimate_by_hand() -> None:
    block = 2 * MiB
    # budget 0.92 * 10000 MiB = 9200 MiB; 9200 - 4000 - 1500 - 300 - 400 = 3000 MiB -> 1500 blocks.
    total = 10000 * MiB
    args = dict(weights=4000 * MiB, activation_peak=1500 * MiB, graph_capture=300 * MiB)
    assert estimate_num_blocks(total, 0.92, **args, non_torch=400 * MiB, block_bytes=block) == 1500
    # One byte short of a block rounds down.
    assert (
        estimate_num_blocks(total, 0.92, **args, non_torch=400 * MiB + 1, block_bytes=block) == 1499
    )
    # Activations beyond the budget: zero, not negative.
    args["activation_peak"] = 9000 * MiB
    assert estimate_num_blocks(total, 0.92, **args, non_torch=0, block_bytes=block) == 0


def test_estimate_budget_below_weights_is_an_error() -> None:
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        estimate_num_blocks(10 * GiB, 0.5, 6 * GiB, 0, 0, 0, 2 * MiB)


def test_min_over_workers() -> None:
    assert min_over_workers([120, 96, 130]) == 96
    with pytest.raises(ValueError, match="no worker"):
        min_over_workers([])
