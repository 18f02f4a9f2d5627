"""Virtual memory management: a device buffer whose base address never moves."""

from __future__ import annotations

from kvfit.vmm.driver import AllocationHandle, VmmDriver, VmmError, VmmOutOfMemoryError
from kvfit.vmm.extensible_tensor import BULK_CHUNK_BYTES, ExtensibleTensor
from kvfit.vmm.probe import get_driver, probe_report, vmm_unavailable_reason

__all__ = [
    "BULK_CHUNK_BYTES",
    "AllocationHandle",
    "ExtensibleTensor",
    "VmmDriver",
    "VmmError",
    "VmmOutOfMemoryError",
    "get_driver",
    "probe_report",
    "vmm_unavailable_reason",
]
