"""CUDA VMM driver (`cuMem*`) through ctypes, shared with HIP.

`hipMem*` mirrors `cuMem*` call for call and struct for struct, so one implementation serves
both: `HipDriver` only swaps the library, the symbol prefix and the error-name call. Running the
CUDA driver on a GPU therefore exercises the very struct layouts HIP uses; a `gpu` test checks
them against NVIDIA's `cuda-bindings`.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

from kvfit.vmm.driver import AllocationHandle, VmmDriver, VmmError, VmmOutOfMemoryError

_ALLOCATION_TYPE_PINNED = 1
_LOCATION_TYPE_DEVICE = 1
_ACCESS_FLAGS_PROT_READWRITE = 3
_GRANULARITY_MINIMUM = 0
_ERROR_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY and hipErrorOutOfMemory alike


class MemLocation(ctypes.Structure):
    """`CUmemLocation` / `hipMemLocation`."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    """`allocFlags` of `CUmemAllocationProp`. HIP lacks `reserved`, but the enclosing struct's
    8-byte alignment pads it to the same size, so the layouts agree."""

    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class MemAllocationProp(ctypes.Structure):
    """`CUmemAllocationProp` / `hipMemAllocationProp`."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", MemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class MemAccessDesc(ctypes.Structure):
    """`CUmemAccessDesc` / `hipMemAccessDesc`."""

    _fields_ = [("location", MemLocation), ("flags", ctypes.c_int)]


def _device_location(device: int) -> MemLocation:
    return MemLocation(_LOCATION_TYPE_DEVICE, device)


def _pinned_prop(device: int) -> MemAllocationProp:
    return MemAllocationProp(type=_ALLOCATION_TYPE_PINNED, location=_device_location(device))


def load_library(file_name: str, pattern: str) -> ctypes.CDLL:
    """Load a driver library by its real file name, else the one already mapped whose file name
    matches `pattern` exactly (a loose match would take libcudart for libcuda)."""
    try:
        return ctypes.CDLL(file_name)
    except OSError as error:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[-1]
            if re.fullmatch(pattern, Path(path).name):
                return ctypes.CDLL(path)
        raise OSError(f"cannot load {file_name}: {error}") from error


class CudaDriver(VmmDriver):
    """`VmmDriver` over the CUDA driver API for one device.

    Holds that device's primary context (retained for the process lifetime) and makes it current
    around every call, so the driver works before and independently of torch.
    """

    library: ClassVar[str] = "libcuda.so.1"
    library_pattern: ClassVar[str] = r"libcuda\.so(\.\d+)*"
    prefix: ClassVar[str] = "cu"
    # Entry points whose ABI was revised keep the old name for the old ABI.
    versioned: ClassVar[dict[str, str]] = {
        "CtxPushCurrent": "_v2",
        "CtxPopCurrent": "_v2",
        "MemGetInfo": "_v2",
    }
    dlpack_device_type: ClassVar[int] = 2  # kDLCUDA
    vmm_attribute: ClassVar[int | None] = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_...

    def __init__(self, device: int) -> None:
        self.device = device
        self._lib = load_library(self.library, self.library_pattern)
        self._call("Init", ctypes.c_uint(0))
        handle = ctypes.c_int()
        self._call("DeviceGet", ctypes.byref(handle), ctypes.c_int(device))
        self._context = ctypes.c_void_p()
        self._call("DevicePrimaryCtxRetain", ctypes.byref(self._context), handle)
        if self.vmm_attribute is not None:
            supported = ctypes.c_int()
            self._call("DeviceGetAttribute", ctypes.byref(supported),
                       ctypes.c_int(self.vmm_attribute), handle)
            if not supported.value:
                raise RuntimeError(f"device {device} does not support virtual memory management")

    def _symbol(self, name: str) -> Callable[..., int]:
        return getattr(self._lib, self.prefix + name + self.versioned.get(name, ""))

    def _error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._symbol("GetErrorName")(code, ctypes.byref(name)) != 0 or not name.value:
            return ""
        return name.value.decode()

    def _call(self, name: str, *args: object) -> None:
        code = self._symbol(name)(*args)
        if code != 0:
            error = VmmOutOfMemoryError if code == _ERROR_OUT_OF_MEMORY else VmmError
            raise error(self.prefix + name, code, self._error_name(code))

    @contextmanager
    def _current(self) -> Iterator[None]:
        current = ctypes.c_void_p()
        self._call("CtxGetCurrent", ctypes.byref(current))
        if current.value == self._context.value:
            yield
            return
        self._call("CtxPushCurrent", self._context)
        try:
            yield
        finally:
            self._call("CtxPopCurrent", ctypes.byref(current))

    def granularity(self, device: int) -> int:
        size = ctypes.c_size_t()
        prop = _pinned_prop(device)
        with self._current():
            self._call("MemGetAllocationGranularity", ctypes.byref(size), ctypes.byref(prop),
                       ctypes.c_int(_GRANULARITY_MINIMUM))
        return size.value

    def reserve(self, size: int) -> int:
        va = ctypes.c_uint64()
        with self._current():
            self._call("MemAddressReserve", ctypes.byref(va), ctypes.c_size_t(size),
                       ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return va.value

    def free_reserved(self, va: int, size: int) -> None:
        with self._current():
            self._call("MemAddressFree", ctypes.c_uint64(va), ctypes.c_size_t(size))

    def create(self, size: int, device: int) -> AllocationHandle:
        handle = ctypes.c_uint64()
        prop = _pinned_prop(device)
        with self._current():
            self._call("MemCreate", ctypes.byref(handle), ctypes.c_size_t(size),
                       ctypes.byref(prop), ctypes.c_ulonglong(0))
        return handle.value

    def map(self, va: int, size: int, handle: AllocationHandle) -> None:
        with self._current():
            self._call("MemMap", ctypes.c_uint64(va), ctypes.c_size_t(size), ctypes.c_size_t(0),
                       ctypes.c_uint64(handle), ctypes.c_ulonglong(0))

    def set_access(self, va: int, size: int, device: int) -> None:
        desc = MemAccessDesc(_device_location(device), _ACCESS_FLAGS_PROT_READWRITE)
        with self._current():
            self._call("MemSetAccess", ctypes.c_uint64(va), ctypes.c_size_t(size),
                       ctypes.byref(desc), ctypes.c_size_t(1))

    def unmap(self, va: int, size: int) -> None:
        with self._current():
            self._call("MemUnmap", ctypes.c_uint64(va), ctypes.c_size_t(size))

    def release(self, handle: AllocationHandle) -> None:
        with self._current():
            self._call("MemRelease", ctypes.c_uint64(handle))

    def dlpack_device(self, device: int) -> tuple[int, int]:
        return (self.dlpack_device_type, device)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        # The context's device, which is `device` for the driver `get_driver` hands out.
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        with self._current():
            self._call("MemGetInfo", ctypes.byref(free), ctypes.byref(total))
        return free.value, total.value
