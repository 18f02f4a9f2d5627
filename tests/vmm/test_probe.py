"""Driver selection, the VMM probe and `kvfit probe`."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from kvfit.vmm import VmmError, get_driver, probe_report, vmm_unavailable_reason
from kvfit.vmm import probe as probe_module
from kvfit.vmm.cuda import load_library
from kvfit.vmm.driver import AllocationHandle
from kvfit.vmm.host import HostDriver

# The driver entry point each probe step stands for, as a real driver's error would name it.
CALL_NAMES = {"create": "cuMemCreate", "map": "cuMemMap", "set_access": "cuMemSetAccess",
              "unmap": "cuMemUnmap", "release": "cuMemRelease"}


class RecordingDriver(HostDriver):
    """The host driver, recording every call in order and failing the one named `fail`
    (before it takes effect), while tracking what is still live so leaks show."""

    def __init__(self, fail: str = "") -> None:
        super().__init__()
        self.fail = fail
        self.calls: list[str] = []
        self.reserved: set[int] = set()
        self.handles: set[AllocationHandle] = set()
        self.mapped: set[int] = set()

    def _record(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail:
            raise VmmError(CALL_NAMES[name], 999, "INJECTED")

    def granularity(self, device: int) -> int:
        self.calls.append("granularity")
        return super().granularity(device)

    def reserve(self, size: int) -> int:
        self.calls.append("reserve")
        va = super().reserve(size)
        self.reserved.add(va)
        return va

    def free_reserved(self, va: int, size: int) -> None:
        self.calls.append("free_reserved")
        super().free_reserved(va, size)
        self.reserved.remove(va)
        self.mapped.discard(va)  # munmap of the whole range takes any mapping with it

    def create(self, size: int, device: int) -> AllocationHandle:
        self._record("create")
        handle = super().create(size, device)
        self.handles.add(handle)
        return handle

    def map(self, va: int, size: int, handle: AllocationHandle) -> None:
        self._record("map")
        super().map(va, size, handle)
        self.mapped.add(va)

    def set_access(self, va: int, size: int, device: int) -> None:
        self._record("set_access")
        super().set_access(va, size, device)

    def unmap(self, va: int, size: int) -> None:
        self._record("unmap")
        super().unmap(va, size)
        self.mapped.remove(va)

    def release(self, handle: AllocationHandle) -> None:
        self._record("release")
        super().release(handle)
        self.handles.remove(handle)


def probe_with(monkeypatch: pytest.MonkeyPatch, driver: RecordingDriver) -> str | None:
    monkeypatch.setattr(probe_module, "get_driver", lambda device: driver)
    return vmm_unavailable_reason("cpu")


def test_cpu_uses_the_host_driver_and_probes_usable() -> None:
    assert isinstance(get_driver("cpu"), HostDriver)
    assert vmm_unavailable_reason("cpu") is None
    report = probe_report("cpu")
    assert "HostDriver" in report and "usable" in report and "2048 KiB commit" in report


def test_unknown_device_is_a_reason_not_a_crash() -> None:
    reason = vmm_unavailable_reason("meta")
    assert reason is not None and "'cpu' or 'cuda[:N]'" in reason
    assert "unavailable" in probe_report("meta")


def test_probe_runs_one_full_round_trip_of_a_granule(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reserve/free alone passes on drivers that cannot back memory (e.g. WSL2-like stubs):
    # only creating, mapping and touching the access rights of real pages proves VMM works.
    driver = RecordingDriver()
    assert probe_with(monkeypatch, driver) is None
    assert driver.calls == ["granularity", "reserve", "create", "map", "set_access", "unmap",
                            "release", "free_reserved"]
    assert not (driver.reserved or driver.handles or driver.mapped)


# Each failing step and the calls the probe makes from `create` on: every step that succeeded
# is undone, innermost first, and the reservation always goes.
FAILURES = {
    "create": ["create", "free_reserved"],
    "map": ["create", "map", "release", "free_reserved"],
    "set_access": ["create", "map", "set_access", "unmap", "release", "free_reserved"],
    "unmap": ["create", "map", "set_access", "unmap", "release", "free_reserved"],
    "release": ["create", "map", "set_access", "unmap", "release", "free_reserved"],
}


@pytest.mark.parametrize("step", FAILURES)
def test_a_failing_round_trip_step_is_a_reason_naming_the_call_and_leaks_nothing(
    monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    driver = RecordingDriver(fail=step)
    reason = probe_with(monkeypatch, driver)
    assert reason is not None and reason.startswith(f"VmmError: {CALL_NAMES[step]} failed")
    assert driver.calls == ["granularity", "reserve", *FAILURES[step]]
    assert not driver.reserved and not driver.mapped
    # Only a handle whose own release failed can outlive the probe.
    assert len(driver.handles) == (step == "release")
    for handle in driver.handles:
        HostDriver.release(driver, handle)  # close it for the test's sake


def test_library_fallback_matches_the_mapped_file_name_exactly() -> None:
    ctypes.CDLL("libc.so.6")
    lib = load_library("libkvfit-missing.so.1", r"libc\.so(\.\d+)*")
    assert lib.getpid() > 0
    with pytest.raises(OSError, match="libkvfit-missing"):
        load_library("libkvfit-missing.so.1", r"libc")  # a prefix of libc.so.6 is no match


def test_cli_probe_runs() -> None:
    result = subprocess.run([sys.executable, "-m", "kvfit.cli", "probe", "--device", "cpu"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "vmm:     usable" in result.stdout


@pytest.mark.gpu
def test_cuda_probe_works_before_torch_touches_the_device() -> None:
    script = (
        "import torch\n"
        "from kvfit.vmm import vmm_unavailable_reason, probe_report\n"
        "print(vmm_unavailable_reason('cuda'))\n"
        "print(torch.cuda.is_initialized())\n"
        "print(probe_report('cuda'))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["None", "False"]
    assert "CudaDriver" in result.stdout and "vmm:     usable" in result.stdout


@pytest.mark.gpu
def test_ctypes_structs_match_cuda_bindings() -> None:
    from cuda.bindings import driver as cu

    from kvfit.vmm import cuda

    assert ctypes.sizeof(cuda.MemAllocationProp) == 32
    assert ctypes.sizeof(cuda.MemAccessDesc) == 12
    enums = {
        cuda._ALLOCATION_TYPE_PINNED: cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED,
        cuda._LOCATION_TYPE_DEVICE: cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE,
        cuda._ACCESS_FLAGS_PROT_READWRITE: cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        cuda._GRANULARITY_MINIMUM:
            cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        cuda._ERROR_OUT_OF_MEMORY: cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY,
        cuda.CudaDriver.vmm_attribute:
            cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
    }
    assert all(ours == int(theirs) for ours, theirs in enums.items()), enums

    # Same field values on both sides must give the same bytes: every offset agrees.
    theirs = cu.CUmemAllocationProp()
    theirs.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    handle_types = cu.CUmemAllocationHandleType
    theirs.requestedHandleTypes = handle_types.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    theirs.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    theirs.location.id = 0x55
    theirs.allocFlags.gpuDirectRDMACapable = 0x66
    theirs.allocFlags.usage = 0x7788
    ours = cuda.MemAllocationProp(
        type=1, requestedHandleTypes=int(theirs.requestedHandleTypes),
        location=cuda.MemLocation(1, 0x55),
        allocFlags=cuda.AllocFlags(gpuDirectRDMACapable=0x66, usage=0x7788),
    )
    assert ctypes.string_at(theirs.getPtr(), 32) == bytes(ours)

    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = 0x55
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    assert ctypes.string_at(access.getPtr(), 12) == bytes(cuda.MemAccessDesc(
        cuda.MemLocation(1, 0x55), 3))
