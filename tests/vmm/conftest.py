"""Fixtures for the vmm suite: every device-parametrized test runs on the host driver and, under
the `gpu` marker, on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvfit.vmm import ExtensibleTensor, get_driver
from kvfit.vmm.driver import AllocationHandle, VmmDriver, VmmError

MiB = 1 << 20


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def committed_memory(device: str) -> int:
    """Bytes of physical memory the process holds through VMM mappings on `device`."""
    if device == "cpu":
        # memfd pages count as shared-memory RSS while mapped and touched.
        status = open("/proc/self/status").read()  # noqa: SIM115 (read at once, closed by GC)
        return int(status.split("RssShmem:")[1].split()[0]) * 1024
    free, total = get_driver(device).mem_get_info(torch.device(device).index or 0)
    return total - free


class FaultyDriver(VmmDriver):
    """Wraps a real driver, fails the `fail_at`-th call of kind `fail_kind`, and tracks what is
    live so a test can check nothing leaked and nothing is mapped without access."""

    def __init__(self, inner: VmmDriver, fail_kind: str = "", fail_at: int = 0) -> None:
        self.inner, self.fail_kind, self.fail_at = inner, fail_kind, fail_at
        self.calls: dict[str, int] = {}
        self.handles: set[AllocationHandle] = set()
        self.mappings: dict[int, tuple[int, bool]] = {}  # va -> (size, accessible)
        self.reserved: set[int] = set()

    def _count(self, kind: str) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if kind == self.fail_kind and self.calls[kind] == self.fail_at:
            raise VmmError(f"injected {kind}", 999)

    def granularity(self, device: int) -> int:
        return self.inner.granularity(device)

    def reserve(self, size: int) -> int:
        va = self.inner.reserve(size)
        self.reserved.add(va)
        return va

    def free_reserved(self, va: int, size: int) -> None:
        self.inner.free_reserved(va, size)
        self.reserved.remove(va)

    def create(self, size: int, device: int) -> AllocationHandle:
        self._count("create")
        handle = self.inner.create(size, device)
        self.handles.add(handle)
        return handle

    def map(self, va: int, size: int, handle: AllocationHandle) -> None:
        self._count("map")
        self.inner.map(va, size, handle)
        self.mappings[va] = (size, False)

    def set_access(self, va: int, size: int, device: int) -> None:
        self._count("set_access")
        self.inner.set_access(va, size, device)
        assert self.mappings[va][0] == size, "access granted to a range that is not one mapping"
        self.mappings[va] = (size, True)

    def unmap(self, va: int, size: int) -> None:
        self._count("unmap")
        self.inner.unmap(va, size)
        assert self.mappings.pop(va)[0] == size, "unmapped a range that is not one mapping"

    def release(self, handle: AllocationHandle) -> None:
        self.inner.release(handle)
        self.handles.remove(handle)

    def dlpack_device(self, device: int) -> tuple[int, int]:
        return self.inner.dlpack_device(device)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return self.inner.mem_get_info(device)


def assert_consistent(tensor: ExtensibleTensor, driver: FaultyDriver) -> None:
    """Driver state is exactly the tensor's chunks: mapped, accessible, nothing else alive."""
    chunks = tensor._live().chunks.values()
    assert driver.handles == {c.handle for c in chunks}
    assert driver.mappings == {tensor.base_ptr + c.offset: (c.size, True) for c in chunks}
    assert driver.reserved == {tensor.base_ptr}
