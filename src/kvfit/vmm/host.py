"""Host VMM driver: the GPU's reserve/map semantics built from Linux `mmap` and `memfd`.

A reservation is inaccessible, unbacked address space; a physical allocation is a memfd whose
pages are allocated at once (`posix_fallocate`); mapping places the file over part of the
reservation with `MAP_FIXED`. Unmapping maps fresh inaccessible
anonymous memory over the range, so the address stays reserved while the file's pages are dropped
once its descriptor is closed. Everything above the driver thereby runs, and is tested, on a CPU.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from kvfit.vmm.driver import AllocationHandle, VmmDriver, VmmError, VmmOutOfMemoryError

_PROT_NONE = 0
_MAP_FIXED = 0x10
_MAP_NORESERVE = 0x4000
_RESERVED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
_MAP_FAILED = ctypes.c_void_p(-1).value
_DLPACK_CPU = 1


def _load_libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def _available_bytes() -> int:
    """Memory the host can hand out without swapping (`MemAvailable`)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62  # no figure (an old kernel): leave the judgement to the allocation


def _raise_errno(call: str, code: int) -> None:
    error = VmmOutOfMemoryError if code == errno.ENOMEM else VmmError
    raise error(call, code, errno.errorcode.get(code, ""))


class HostDriver(VmmDriver):
    """`VmmDriver` over process memory (device `"cpu"`); handles are memfd descriptors."""

    new_pages_are_zero = True

    def __init__(self) -> None:
        self._libc = _load_libc()

    def granularity(self, device: int) -> int:
        return mmap.PAGESIZE

    def _mmap(self, va: int | None, size: int, prot: int, flags: int, fd: int) -> int:
        address = self._libc.mmap(va, size, prot, flags, fd, 0)
        if address == _MAP_FAILED:
            _raise_errno("mmap", ctypes.get_errno())
        return address

    def reserve(self, size: int) -> int:
        return self._mmap(None, size, _PROT_NONE, _RESERVED, -1)

    def free_reserved(self, va: int, size: int) -> None:
        if self._libc.munmap(va, size) != 0:
            _raise_errno("munmap", ctypes.get_errno())

    def create(self, size: int, device: int) -> AllocationHandle:
        """A memfd of `size` bytes whose pages are allocated now, as `cuMemCreate` allocates
        device memory: the memory is charged at commit (what `free` shows and sizing reads)
        and a commit the host cannot hold fails here, with ENOMEM, instead of the process
        being killed at first touch. Costs about the time to zero the pages (~0.1-1 s/GiB)."""
        if size > _available_bytes():
            _raise_errno("memfd_create", errno.ENOMEM)
        try:
            fd = os.memfd_create("kvfit-vmm", os.MFD_CLOEXEC)
        except OSError as e:
            _raise_errno("memfd_create", e.errno)
        call = "ftruncate"
        try:
            os.ftruncate(fd, size)
            call = "posix_fallocate"
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            os.close(fd)
            # Shared memory out of room reports ENOSPC: the host's memory is what ran out.
            _raise_errno(call, errno.ENOMEM if e.errno == errno.ENOSPC else e.errno)
        return fd

    def map(self, va: int, size: int, handle: AllocationHandle) -> None:
        # Mapped without access, as cuMemMap leaves it: access is granted by set_access.
        self._mmap(va, size, _PROT_NONE, mmap.MAP_SHARED | _MAP_FIXED, handle)

    def set_access(self, va: int, size: int, device: int) -> None:
        if self._libc.mprotect(va, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            _raise_errno("mprotect", ctypes.get_errno())

    def unmap(self, va: int, size: int) -> None:
        self._mmap(va, size, _PROT_NONE, _RESERVED | _MAP_FIXED, -1)

    def release(self, handle: AllocationHandle) -> None:
        try:
            os.close(handle)
        except OSError as e:
            _raise_errno("close", e.errno)

    def dlpack_device(self, device: int) -> tuple[int, int]:
        return (_DLPACK_CPU, 0)

    def mem_get_info(self, device: int) -> tuple[int, int]:
        import psutil  # only the probe asks; keep `import kvfit.vmm` light

        memory = psutil.virtual_memory()
        return memory.available, memory.total
