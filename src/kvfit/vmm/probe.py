"""Which VMM driver serves a device, whether it works there, and a report for `kvfit probe`."""

from __future__ import annotations

import functools

import torch

from kvfit.vmm.driver import VmmDriver, VmmError
from kvfit.vmm.host import HostDriver

_GIB = 1 << 30


def resolve_device(device: str | torch.device) -> torch.device:
    """`device` as a `torch.device`, with an index for CUDA (torch's current device once torch
    has initialized CUDA, else 0: resolving must not initialize it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
        return torch.device("cuda", index)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"no VMM driver for device {str(device)!r}: use 'cpu' or 'cuda[:N]'")
    return device


@functools.cache
def _driver(device_type: str, index: int) -> VmmDriver:
    if device_type == "cpu":
        return HostDriver()
    if torch.version.hip:
        from kvfit.vmm.hip import HipDriver

        return HipDriver(index)
    from kvfit.vmm.cuda import CudaDriver

    return CudaDriver(index)


def get_driver(device: str | torch.device) -> VmmDriver:
    """The driver for `device`: host for `cpu`, HIP on ROCm builds of torch, else CUDA.

    One instance per device for the process. Raises `OSError` (library), `VmmError` (driver
    call) or `RuntimeError` (unsupported device or runtime) when there is none.
    """
    device = resolve_device(device)
    return _driver(device.type, device.index or 0)


def vmm_unavailable_reason(device: str | torch.device) -> str | None:
    """Why an `ExtensibleTensor` cannot live on `device`, or None when it can.

    Loads the driver and runs one reserve/create/map/set-access/unmap/release/free round trip
    of a granule. Safe before torch has touched the device.
    """
    try:
        device = resolve_device(device)
        driver = get_driver(device)
        index = device.index or 0
        granule = driver.granularity(index)
        va = driver.reserve(granule)
        try:
            handle = driver.create(granule, index)
            try:
                driver.map(va, granule, handle)
                try:
                    driver.set_access(va, granule, index)
                finally:
                    driver.unmap(va, granule)
            finally:
                driver.release(handle)
        finally:
            driver.free_reserved(va, granule)
    except (OSError, VmmError, RuntimeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def probe_report(device: str) -> str:
    """Human-readable report: driver, VMM usable or why not, commit granule, device memory.

    `device="auto"` picks CUDA when torch sees a GPU, else the CPU (host driver).
    """
    return probe(device)[0]


def probe(device: str) -> tuple[str, str | None]:
    """`probe_report(device)` and `vmm_unavailable_reason` of the device it probed."""
    from kvfit.vmm.extensible_tensor import commit_granule

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    reason = vmm_unavailable_reason(device)
    lines = [f"device:  {device}"]
    if reason is not None:
        return "\n".join([*lines, f"vmm:     unavailable ({reason})"]), reason
    resolved = resolve_device(device)
    driver = get_driver(resolved)
    index = resolved.index or 0
    granule = driver.granularity(index)
    free, total = driver.mem_get_info(index)
    return "\n".join([
        *lines,
        f"driver:  {type(driver).__name__}",
        "vmm:     usable",
        f"granule: {commit_granule(granule) >> 10} KiB commit ({granule >> 10} KiB driver)",
        f"memory:  {free / _GIB:.2f} GiB free of {total / _GIB:.2f} GiB",
    ]), None
