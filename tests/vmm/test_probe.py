"""Driver selection, the VMM probe and `kvfit probe`."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

from kvfit.vmm import get_driver, probe_report, vmm_unavailable_reason
from kvfit.vmm.cuda import load_library
from kvfit.vmm.host import HostDriver


def test_cpu_uses_the_host_driver_and_probes_usable() -> None:
    assert isinstance(get_driver("cpu"), HostDriver)
    assert vmm_unavailable_reason("cpu") is None
    report = probe_report("cpu")
    assert "HostDriver" in report and "usable" in report and "2048 KiB commit" in report


def test_unknown_device_is_a_reason_not_a_crash() -> None:
    reason = vmm_unavailable_reason("meta")
    assert reason is not None and "'cpu' or 'cuda[:N]'" in reason
    assert "unavailable" in probe_report("meta")


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
