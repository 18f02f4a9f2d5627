"""A reserved address range and the physical chunks mapped into it, owned together."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from kvfit.vmm.driver import AllocationHandle, VmmDriver, VmmOutOfMemoryError


@dataclass(frozen=True)
class Chunk:
    """One physical allocation mapped at `offset` bytes into the reservation."""

    offset: int
    size: int
    handle: AllocationHandle

    @property
    def end(self) -> int:
        return self.offset + self.size


def _torch_holds_idle_memory(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_initialized():
        return False
    return torch.cuda.memory_reserved(device) > torch.cuda.memory_allocated(device)


class Reservation:
    """Owns a VA reservation and every chunk mapped in it; dropping the last reference unmaps
    and releases the chunks and frees the range.

    Views hold a reference, so the range stays reserved, and its pages mapped, for as long as
    any view exists, whatever happens to the object that made them.
    """

    def __init__(self, driver: VmmDriver, size: int, device: torch.device) -> None:
        self.driver = driver
        self.size = size
        self.device = device
        self.device_index = device.index or 0
        self.chunks: dict[int, Chunk] = {}
        self.va = driver.reserve(size)

    def create(self, size: int) -> AllocationHandle:
        """A physical allocation on this device, emptying torch's cache once if that makes room."""
        try:
            return self.driver.create(size, self.device_index)
        except VmmOutOfMemoryError:
            if not _torch_holds_idle_memory(self.device):
                raise
            torch.cuda.empty_cache()
            return self.driver.create(size, self.device_index)

    def map_at(self, va: int, size: int, handle: AllocationHandle) -> None:
        """Map `handle` at `va` and grant access; on failure nothing stays mapped."""
        self.driver.map(va, size, handle)
        try:
            self.driver.set_access(va, size, self.device_index)
        except BaseException:
            self.driver.unmap(va, size)
            raise

    def map(self, offset: int, size: int) -> Chunk:
        """Back `[offset, offset + size)` with a new chunk; on failure nothing is left behind."""
        handle = self.create(size)
        try:
            self.map_at(self.va + offset, size, handle)
        except BaseException:
            self.driver.release(handle)
            raise
        chunk = self.chunks[offset] = Chunk(offset, size, handle)
        return chunk

    def unmap(self, chunk: Chunk) -> None:
        """Unmap and release `chunk`; its pages go back to the driver, the addresses stay.
        Forgotten only once unmapped: a failed unmap leaves it listed, so it can be retried."""
        self.driver.unmap(self.va + chunk.offset, chunk.size)
        del self.chunks[chunk.offset]
        self.driver.release(chunk.handle)

    def unmap_all(self) -> None:
        for chunk in list(self.chunks.values()):
            self.unmap(chunk)

    @property
    def physical_bytes(self) -> int:
        return sum(chunk.size for chunk in self.chunks.values())

    def __del__(self, _is_finalizing=sys.is_finalizing) -> None:
        # At interpreter exit the process is about to return everything anyway, and module
        # globals the driver calls need may already be gone: do nothing rather than fail loudly.
        if _is_finalizing() or not hasattr(self, "va"):
            return
        self.unmap_all()
        self.driver.free_reserved(self.va, self.size)
