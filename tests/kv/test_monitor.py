"""Memory monitors: the host one against a budget here, the CUDA one on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from kvfit.kv import monitor
from kvfit.kv.monitor import CudaMemoryMonitor, HostMemoryMonitor, MemoryMonitor
from kvfit.kv.sizing import transient_bytes

MiB = 1 << 20
CHUNK = 64 * MiB


def run_step(mon: MemoryMonitor, device: str) -> None:
    """A step whose transient is one CHUNK: allocate it, touch it, let it go."""
    mon.reset_peak()
    scratch = torch.ones(CHUNK // 4, dtype=torch.float32, device=device)
    del scratch


def test_host_snapshot_reports_the_budget_and_this_process() -> None:
    mon = HostMemoryMonitor(8 << 30)
    snap = mon.snapshot()
    assert snap.total == 8 << 30
    assert snap.free > 0
    held = torch.ones(CHUNK // 4)
    assert mon.snapshot().torch_allocated - snap.torch_allocated >= CHUNK * 0.9
    del held


def test_host_step_peak_sees_a_freed_allocation_and_resets() -> None:
    mon = HostMemoryMonitor(8 << 30)
    run_step(mon, "cpu")
    assert transient_bytes([mon.step_peak()]) >= CHUNK * 0.9
    # step_peak started a new step: nothing allocated since, so the old peak is gone.
    assert transient_bytes([mon.step_peak()]) < CHUNK * 0.5
    assert mon.peak_resettable


def test_host_peak_without_reset_permission_only_grows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(monitor, "_CLEAR_REFS", "/nonexistent/clear_refs")
    mon = HostMemoryMonitor(8 << 30)
    run_step(mon, "cpu")
    assert not mon.peak_resettable
    # The peak cannot be reset, so the transient is overstated, never understated.
    assert transient_bytes([mon.step_peak()]) >= CHUNK * 0.9
    assert transient_bytes([mon.step_peak()]) >= CHUNK * 0.9


def test_bad_monitor_settings_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="kv_budget_bytes"):
        HostMemoryMonitor(0, budget_setting="kv_budget_bytes")
    with pytest.raises(ValueError, match="cuda"):
        CudaMemoryMonitor("cpu")


@pytest.mark.gpu
def test_cuda_monitor_measures_the_reserved_transient() -> None:
    mon = CudaMemoryMonitor("cuda")
    snap = mon.snapshot()
    assert 0 < snap.free <= snap.total
    run_step(mon, "cuda")
    # The caching allocator keeps the freed chunk reserved: reserved peak less live >= CHUNK.
    assert transient_bytes([mon.step_peak()]) >= CHUNK
    torch.cuda.empty_cache()
    mon.reset_peak()
    assert transient_bytes([mon.step_peak()]) < CHUNK
