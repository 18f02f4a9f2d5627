"""The driver surface every VMM backend implements: reserve address space, back it with pages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeAlias

AllocationHandle: TypeAlias = int
"""A physical allocation: `CUmemGenericAllocationHandle`, `hipMemGenericAllocationHandle_t`'s
value, or a memfd file descriptor on the host."""


class VmmError(RuntimeError):
    """A driver call failed; `call` names it and `code` is its CUresult, hipError_t or errno."""

    def __init__(self, call: str, code: int, name: str = "") -> None:
        self.call = call
        self.code = code
        self.name = name
        super().__init__(f"{call} failed: {name or 'error'} ({code})")

    def __reduce__(self) -> tuple:
        # Pickled from a tensor-parallel worker to the engine, whose out-of-memory fallbacks
        # catch it by type; the default rebuilds it from the message alone, which fails.
        return type(self), (self.call, self.code, self.name)


class VmmOutOfMemoryError(VmmError):
    """The driver has no physical memory left for `create`."""


class VmmDriver(ABC):
    """Reserve virtual addresses, create physical allocations, map them in and out.

    `device` arguments are device ordinals: where pages live (`create`) and who may access them
    (`set_access`). Every failing call raises `VmmError`.
    """

    #: Whether `create` promises zeroed memory (memfd pages do; GPU drivers promise nothing
    #: for reused memory, so what must read as zero is zeroed after mapping).
    new_pages_are_zero: bool = False

    @abstractmethod
    def granularity(self, device: int) -> int:
        """Smallest size and alignment `create` and `map` accept, in bytes."""

    @abstractmethod
    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of address space with no memory behind it; returns the address."""

    @abstractmethod
    def free_reserved(self, va: int, size: int) -> None:
        """Return a reservation made by `reserve`; nothing may be mapped in it."""

    @abstractmethod
    def create(self, size: int, device: int) -> AllocationHandle:
        """Allocate `size` bytes of physical memory on `device`."""

    @abstractmethod
    def map(self, va: int, size: int, handle: AllocationHandle) -> None:
        """Map all of `handle` at `va` inside a reservation, still without access."""

    @abstractmethod
    def set_access(self, va: int, size: int, device: int) -> None:
        """Grant `device` read-write access to mapped range `[va, va + size)`."""

    @abstractmethod
    def unmap(self, va: int, size: int) -> None:
        """Unmap `[va, va + size)`, which must be whole mappings; the reservation stays."""

    @abstractmethod
    def release(self, handle: AllocationHandle) -> None:
        """Drop the handle; its memory is freed once no mapping refers to it."""

    @abstractmethod
    def dlpack_device(self, device: int) -> tuple[int, int]:
        """DLPack `(device_type, device_id)` of memory this driver maps, as `__dlpack_device__`."""

    @abstractmethod
    def mem_get_info(self, device: int) -> tuple[int, int]:
        """`(free, total)` bytes of the memory `create` draws from."""
