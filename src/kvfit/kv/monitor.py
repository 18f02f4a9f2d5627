"""Memory monitors: the measured numbers sizing needs, from a CUDA device or from the host.

Both answer the same questions (free/total now, the peak of a step against what stayed live) so
the same sizing code runs on a GPU and, against a configured budget, on the CPU.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import psutil
import torch

from kvfit.kv.sizing import MemorySnapshot, StepPeak


class MemoryMonitor(ABC):
    """Reads the memory of one device for KV cache sizing."""

    #: The setting that scales `total` into the budget; named in sizing errors.
    budget_setting: str = "gpu_memory_utilization"

    @abstractmethod
    def snapshot(self) -> MemorySnapshot:
        """Total, free and torch usage now."""

    def free_and_total(self) -> tuple[int, int]:
        """Free and total bytes now, as cheaply as the device answers (the elastic KV cache's
        governor reads it between steps)."""
        s = self.snapshot()
        return s.free, s.total

    @abstractmethod
    def reset_peak(self) -> None:
        """Start a new step: forget the peak seen so far."""

    @abstractmethod
    def step_peak(self) -> StepPeak:
        """The peak since the last reset against what is live now; then starts a new step."""


class CudaMemoryMonitor(MemoryMonitor):
    """A CUDA device through `torch.cuda` (free/total from the driver, peaks from the allocator)."""

    def __init__(self, device: torch.device | str | int) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaMemoryMonitor needs a cuda device, got {self.device}")

    def snapshot(self) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(
            total=total,
            free=free,
            torch_reserved=torch.cuda.memory_reserved(self.device),
            torch_allocated=torch.cuda.memory_allocated(self.device),
        )

    def free_and_total(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)  # one driver call, no synchronization

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def step_peak(self) -> StepPeak:
        peak = StepPeak(
            reserved_peak=torch.cuda.max_memory_reserved(self.device),
            live_allocated=torch.cuda.memory_allocated(self.device),
        )
        self.reset_peak()
        return peak


_STATUS_FIELD = re.compile(r"^(\w+):\s+(\d+) kB$", re.MULTILINE)
_CLEAR_REFS = "/proc/self/clear_refs"


def _proc_status() -> dict[str, int]:
    with open("/proc/self/status") as f:
        return {k: int(v) * 1024 for k, v in _STATUS_FIELD.findall(f.read())}


class HostMemoryMonitor(MemoryMonitor):
    """The host, against a configured budget (Linux `/proc`).

    Free memory is the system's available memory; the peak is the process's resident
    high-water mark (`VmHWM`), which `ru_maxrss` cannot provide because it never resets. Writing
    "5" to `/proc/self/clear_refs` resets it; where that is not permitted the peak only grows,
    which overstates the transient (safe, not exact).
    """

    def __init__(self, budget_bytes: int, budget_setting: str = "cpu_memory_budget") -> None:
        if budget_bytes <= 0:
            raise ValueError(f"{budget_setting} must be a positive number of bytes")
        self.budget_bytes = budget_bytes
        self.budget_setting = budget_setting
        self.peak_resettable = True

    def snapshot(self) -> MemorySnapshot:
        status = _proc_status()
        # Private memory only: the KV cache's memfd pages are shared memory (RssShmem).
        private = status["RssAnon"] + status["RssFile"]
        return MemorySnapshot(
            total=self.budget_bytes,
            free=psutil.virtual_memory().available,
            torch_reserved=private,
            torch_allocated=private,
        )

    def free_and_total(self) -> tuple[int, int]:
        return psutil.virtual_memory().available, self.budget_bytes

    def reset_peak(self) -> None:
        if not self.peak_resettable:
            return
        try:
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:
            self.peak_resettable = False

    def step_peak(self) -> StepPeak:
        status = _proc_status()
        self.reset_peak()
        return StepPeak(reserved_peak=status["VmHWM"], live_allocated=status["VmRSS"])
