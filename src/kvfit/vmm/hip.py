"""HIP VMM driver: the CUDA ctypes driver over `libamdhip64` with ROCm's two quirks handled."""

from __future__ import annotations

import ctypes
from typing import ClassVar

from kvfit.vmm.cuda import CudaDriver
from kvfit.vmm.driver import AllocationHandle

MIN_ROCM = (7, 12)


def _hip_version(code: int) -> tuple[int, int]:
    # HIP_VERSION = major * 10**7 + minor * 10**5 + patch
    return code // 10_000_000, code // 100_000 % 100


class HipDriver(CudaDriver):
    """`VmmDriver` over `hipMem*`; refuses ROCm older than 7.12, whose `hipMemSetAccess` fails
    once a reservation holds several allocations (rocm-systems#2516)."""

    library: ClassVar[str] = "libamdhip64.so"
    library_pattern: ClassVar[str] = r"libamdhip64\.so(\.\d+)*"
    prefix: ClassVar[str] = "hip"
    versioned: ClassVar[dict[str, str]] = {}
    dlpack_device_type: ClassVar[int] = 10  # kDLROCM
    vmm_attribute: ClassVar[int | None] = None  # numbered differently from CUDA; probed instead

    def __init__(self, device: int) -> None:
        super().__init__(device)
        code = ctypes.c_int()
        self._call("RuntimeGetVersion", ctypes.byref(code))
        if _hip_version(code.value) < MIN_ROCM:
            found = ".".join(map(str, _hip_version(code.value)))
            raise RuntimeError(
                f"ROCm {found} rejects hipMemSetAccess once a reservation holds several "
                f"allocations; the extensible cache needs ROCm >= {MIN_ROCM[0]}.{MIN_ROCM[1]}"
            )
        # va -> size of every live mapping, to grant access mapping by mapping.
        self._mappings: dict[int, int] = {}

    def _error_name(self, code: int) -> str:
        name = self._symbol("GetErrorName")
        name.restype = ctypes.c_char_p
        return (name(code) or b"").decode()

    def map(self, va: int, size: int, handle: AllocationHandle) -> None:
        super().map(va, size, handle)
        self._mappings[va] = size

    def unmap(self, va: int, size: int) -> None:
        super().unmap(va, size)
        for start in [s for s in self._mappings if va <= s < va + size]:
            del self._mappings[start]

    def set_access(self, va: int, size: int, device: int) -> None:
        # ROCm rejects a range that starts inside a mapping, so grant per contiguous mapped run.
        starts = sorted(s for s in self._mappings if va <= s < va + size)
        if not starts:  # not a mapping we made: let ROCm judge the range
            super().set_access(va, size, device)
        for start in starts:
            super().set_access(start, self._mappings[start], device)
