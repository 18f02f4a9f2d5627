"""ExtensibleTensor: a reserved device buffer whose committed size changes while its base stays."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfit.vmm.driver import AllocationHandle, VmmDriver
from kvfit.vmm.probe import get_driver, resolve_device
from kvfit.vmm.reservation import Chunk, Reservation
from kvfit.vmm.view import tensor_at

MIN_GRANULE = 2 << 20
"""Commit granule floor: ROCm reports 4 KiB and the host a page; per-chunk cost dominates."""

BULK_CHUNK_BYTES = 1 << 30
"""Largest chunk of an ordinary commit. Cost is per chunk (~50 us for 2 MiB, ~0.1 ms for 1 GiB on
an H200), so bulk growth wants large chunks; capping them bounds the extra memory a shrink needs
to keep the prefix of the chunk it cuts."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _size(value: int, name: str) -> int:
    """`value` as a Python int (numpy and torch integers too): a float size would be rounded
    somewhere below and reach the driver, or be kept as the committed size."""
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer number of bytes, got {value!r}") from None


def commit_granule(driver_granularity: int) -> int:
    """The commit granule for a driver granularity: the smallest multiple of it >= 2 MiB."""
    return _round_up(MIN_GRANULE, driver_granularity)


@dataclass
class _Cut:
    """A chunk a shrink cuts: its kept prefix is copied onto a fresh allocation `handle`, mapped
    meanwhile at the scratch reservation `scratch_va`."""

    chunk: Chunk
    keep: int
    handle: AllocationHandle
    scratch_va: int
    scratch_mapped: bool = False
    scratch_reserved: bool = True
    old_released: bool = False  # the cut chunk's own handle, once the copy replaced it


class ExtensibleTensor:
    """`capacity_bytes` of address space split into `num_segments` equal segments whose
    committed prefixes grow and shrink in lockstep, the base address fixed for life.

    Physical memory comes in chunks of whole commit granules (driver granularity, 2 MiB floor).
    Each segment's chunks lie in the granules starting in that segment, so a granule straddling
    two segments is mapped once, by the later one. Views are uint8 tensors on the tensor's device;
    they keep the reservation (and whatever is mapped in it) alive after this object is gone.

    `tail_bytes` / `tail_chunk_bytes`: a grow maps the last `tail_bytes` of each segment it
    reaches in chunks of `tail_chunk_bytes` (both rounded down to the granule), the rest in
    large chunks. A shrink that cannot copy (the device out of memory) unmaps whole chunks, so
    near the committed end it then gives back at most a small chunk per segment beyond its
    need, at the cost of a few more driver calls per grow.
    """

    def __init__(
        self,
        capacity_bytes: int,
        device: str | torch.device,
        num_segments: int = 1,
        *,
        driver: VmmDriver | None = None,
        tail_bytes: int = 0,
        tail_chunk_bytes: int = BULK_CHUNK_BYTES,
    ) -> None:
        capacity_bytes = _size(capacity_bytes, "capacity_bytes")
        num_segments = _size(num_segments, "num_segments")
        if num_segments < 1 or capacity_bytes < num_segments:
            raise ValueError(
                f"capacity_bytes ({capacity_bytes}) must hold num_segments ({num_segments}) >= 1 "
                "non-empty segments"
            )
        if capacity_bytes % num_segments:
            raise ValueError(
                f"capacity_bytes ({capacity_bytes}) must split into num_segments ({num_segments}) "
                "equal segments"
            )
        self.device = resolve_device(device)
        driver = driver or get_driver(self.device)
        self.granularity = commit_granule(driver.granularity(self.device.index or 0))
        self.capacity_bytes = capacity_bytes
        self.num_segments = num_segments
        self.segment_capacity = capacity_bytes // num_segments
        self.tail_bytes = tail_bytes // self.granularity * self.granularity
        self.tail_chunk_bytes = max(tail_chunk_bytes // self.granularity, 1) * self.granularity
        self.committed_bytes = 0
        self._released = False
        # Cuts whose scratch range or old handle a failed driver call left to give back.
        self._owed: list[_Cut] = []
        self._reservation: Reservation | None = Reservation(
            driver, _round_up(capacity_bytes, self.granularity), self.device
        )
        self.base_ptr = self._reservation.va
        granule, size = self.granularity, self._reservation.size
        # Segment i's chunks live in [starts[i], starts[i + 1]): granules starting in segment i.
        self._home_starts = [i * self.segment_capacity // granule * granule
                             for i in range(num_segments)] + [size]

    # --- state -----------------------------------------------------------------------------

    @property
    def physical_bytes(self) -> int:
        """Bytes of physical memory mapped now (0 after `release_physical`)."""
        return self._live().physical_bytes

    @property
    def reserved_bytes(self) -> int:
        """Bytes of address space reserved: `capacity_bytes` rounded up to the granule, the
        most `physical_bytes` can reach."""
        return self._live().size

    @property
    def num_physical_chunks(self) -> int:
        """Physical allocations mapped now."""
        return len(self._live().chunks)

    def _live(self) -> Reservation:
        if self._reservation is None:
            raise RuntimeError("ExtensibleTensor was freed")
        return self._reservation

    # --- views -----------------------------------------------------------------------------

    def full_view(self) -> torch.Tensor:
        """uint8 view of all `capacity_bytes`, committed or not."""
        return tensor_at(self.base_ptr, self.capacity_bytes, self.device, self._live())

    def segment_view(self, i: int) -> torch.Tensor:
        """uint8 view of segment `i`'s committed prefix; its storage is exactly that long."""
        if not 0 <= i < self.num_segments:
            raise IndexError(f"segment {i} out of range for num_segments={self.num_segments}")
        ptr = self.base_ptr + i * self.segment_capacity
        return tensor_at(ptr, self.committed_bytes, self.device, self._live())

    # --- commit ----------------------------------------------------------------------------

    def commit(self, bytes_per_segment: int, defragment: bool = False,
               max_chunk_bytes: int = BULK_CHUNK_BYTES) -> None:
        """Grow or shrink every segment to `bytes_per_segment` rounded up to the granule.

        Growth keeps contents, and maps chunks of up to `max_chunk_bytes` (rounded down to the
        granule, at least one); a shrink keeps each segment's prefix (a chunk it cuts is copied
        onto a smaller allocation, so it briefly needs that chunk's kept part again).
        `defragment=True` remaps each segment as a single allocation, as RDMA registration needs,
        and discards the contents. A failing commit leaves the tensor as it was, but for a
        shrink whose clean-up fails once the kept prefix is in place (an unmap): the tensor
        then has the new size and holds the pages it could not give back until the next
        commit gives them back (nothing leaks, nothing is left mapped without access).
        """
        reservation = self._live()
        if self._released:
            raise RuntimeError("commit() after release_physical(): call recommit() first")
        target = self._target(bytes_per_segment)
        # What an earlier shrink's failed driver call left: given back before anything else.
        self._settle_owed(reservation)
        self._drop_beyond(self.committed_bytes, reservation)
        if defragment:
            self._defragment(target, reservation)
        elif target > self.committed_bytes:
            self._grow(target, max_chunk_bytes, reservation)
        elif target < self.committed_bytes:
            self._shrink(target, reservation)
        self.committed_bytes = target

    def _target(self, bytes_per_segment: int) -> int:
        """`bytes_per_segment` rounded up to the granule (capped at the segment), checked."""
        bytes_per_segment = _size(bytes_per_segment, "bytes_per_segment")
        if not 0 <= bytes_per_segment <= self.segment_capacity:
            raise ValueError(
                f"cannot commit {bytes_per_segment} bytes per segment: segment_capacity is "
                f"{self.segment_capacity} (capacity_bytes {self.capacity_bytes} / num_segments "
                f"{self.num_segments}); reserve a larger capacity_bytes"
            )
        return min(_round_up(bytes_per_segment, self.granularity), self.segment_capacity)

    def release_physical(self) -> None:
        """Drop every physical page; the reservation, `committed_bytes` and views stay."""
        reservation = self._live()
        self._synchronize()
        # Marked released even if a driver call fails part way: the contents are forfeit
        # either way, and `recommit` starts from whatever is still mapped.
        self._released = True
        reservation.unmap_all()

    @property
    def is_released(self) -> bool:
        """Whether `release_physical` dropped the pages and no `recommit` has restored them."""
        return self._released

    def recommit(self, defragment: bool = False, bytes_per_segment: int | None = None) -> None:
        """Back the committed size again after `release_physical`, with zeroed pages, in chunks
        of up to `BULK_CHUNK_BYTES` (`defragment=True`: one allocation per segment, as after
        `commit(defragment=True)`). `bytes_per_segment`: back that size instead (rounded up to
        the granule), which becomes the committed size. Needs no memory beyond what it maps. A
        failure leaves the tensor released (nothing mapped), so it can be retried."""
        reservation = self._live()
        if bytes_per_segment is not None:
            if not self._released:
                raise RuntimeError("recommit(bytes_per_segment) needs release_physical() first")
            self.committed_bytes = self._target(bytes_per_segment)
        if not self._released:
            return
        reservation.unmap_all()  # what a release that failed part way left mapped
        max_chunk = reservation.size if defragment else BULK_CHUNK_BYTES
        self._grow(self.committed_bytes, max_chunk, reservation, tail=not defragment)
        self._released = False
        if not reservation.driver.new_pages_are_zero:
            for chunk in reservation.chunks.values():
                self._bytes(reservation.va + chunk.offset, chunk.size).zero_()

    def check_room(self, bytes_per_segment: int) -> None:
        """Raise `VmmOutOfMemoryError`, changing nothing, unless the device holds what backing
        `bytes_per_segment` (rounded up to the granule) would take beyond the pages mapped
        now, as `release_physical` then `recommit` does: allocates that much at once and
        releases it. A check, not a hold: another process may take the memory before the
        recommit."""
        reservation = self._live()
        need = self.num_segments * self._target(bytes_per_segment) - reservation.physical_bytes
        if need > 0:
            reservation.driver.release(reservation.create(need))

    def free(self) -> None:
        """Return the physical memory now. The address range is freed once no view is left."""
        if self._reservation is None:
            return
        self._settle_owed(self._reservation)
        self.release_physical()
        self._reservation = None

    def __enter__(self) -> ExtensibleTensor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.free()

    # --- planning --------------------------------------------------------------------------

    def uncut_bytes(self, bytes_per_segment: int) -> int:
        """The largest size <= `bytes_per_segment` that a shrink reaches by unmapping whole
        physical chunks: a chunk the shrink cuts is copied onto a smaller allocation, which
        needs memory that a device out of memory does not have. A multiple of the granule."""
        granule, chunks = self.granularity, list(self._live().chunks.values())
        size = min(bytes_per_segment, self.committed_bytes) // granule * granule
        # A size cuts a chunk when its segment's end falls inside it; the largest smaller size
        # that does not ends that segment at the chunk's start. Lowering one segment's end
        # moves every segment's, which may fall inside other chunks: repeat until none does
        # (each pass only lowers, so a few passes, where a granule at a time took hundreds).
        while size > 0:
            lower = size
            for chunk in chunks:
                if self._cuts(chunk, size):
                    home_start = self._home_of(chunk.offset) * self.segment_capacity
                    lower = min(lower, max(0, chunk.offset - home_start) // granule * granule)
            if lower == size:
                break
            size = lower
        return size

    def _cuts(self, chunk: Chunk, committed: int) -> bool:
        end = self._needed_end(self._home_of(chunk.offset), committed)
        return chunk.offset < end < chunk.end

    def _needed_end(self, home: int, committed: int) -> int:
        """End offset of what home range `home` must map for `committed` bytes per segment.

        Segment i's first byte lies in its home's first granule and it ends at most one granule
        into the next home, whose own first granule is mapped whenever anything is; so clipping
        each segment's need to its home still covers every byte of every segment.
        """
        start, end = self._home_starts[home], self._home_starts[home + 1]
        if committed == 0 or start == end:
            return start
        last_byte = home * self.segment_capacity + committed
        return min(_round_up(last_byte, self.granularity), end)

    def _home_of(self, offset: int) -> int:
        return bisect.bisect_right(self._home_starts, offset) - 1

    def _mapped_ends(self, reservation: Reservation) -> list[int]:
        ends = self._home_starts[:-1]
        for chunk in reservation.chunks.values():
            home = self._home_of(chunk.offset)
            ends[home] = max(ends[home], chunk.end)
        return ends

    # --- mapping ---------------------------------------------------------------------------

    def _grow(self, target: int, max_chunk: int, reservation: Reservation,
              tail: bool = True) -> None:
        """Map each segment up to `target`: chunks of `max_chunk`, then (`tail`) the last
        `tail_bytes` in chunks of `tail_chunk_bytes`. On failure nothing it mapped stays."""
        max_chunk = max(max_chunk // self.granularity, 1) * self.granularity
        tail_bytes = self.tail_bytes if tail else 0
        mapped: list[Chunk] = []
        try:
            for home, start in enumerate(self._mapped_ends(reservation)):
                end = self._needed_end(home, target)
                split = max(start, end - tail_bytes)
                for lo, hi, size in ((start, split, max_chunk),
                                     (split, end, min(max_chunk, self.tail_chunk_bytes))):
                    for offset in range(lo, hi, size):
                        mapped.append(reservation.map(offset, min(size, hi - offset)))
        except BaseException:
            for chunk in reversed(mapped):
                reservation.unmap(chunk)
            raise

    def _defragment(self, target: int, reservation: Reservation) -> None:
        previous = self.committed_bytes
        self._synchronize()
        reservation.unmap_all()
        self.committed_bytes = 0
        try:
            self._grow(target, reservation.size, reservation, tail=False)
        except BaseException:
            # Contents were forfeit anyway; restore the size the caller had.
            self._grow(previous, BULK_CHUNK_BYTES, reservation)
            self.committed_bytes = previous
            raise

    def _shrink(self, target: int, reservation: Reservation) -> None:
        cut: list[tuple[Chunk, int]] = []
        for chunk in reservation.chunks.values():
            end = self._needed_end(self._home_of(chunk.offset), target)
            if chunk.offset < end and self._cuts(chunk, target):
                cut.append((chunk, end - chunk.offset))
        self._synchronize()
        cuts = self._copy_kept(cut, reservation)
        self._swap_in(cuts, reservation)
        # The kept prefix is in place: the tensor has its new size from here on. What the
        # cleanup fails to give back stays listed (a dropped chunk: `reservation.chunks`) or
        # owed (a cut's scratch range and old handle), and the next commit retries it.
        self.committed_bytes = target
        self._owed += cuts
        errors = self._attempt_each(lambda: self._settle_owed(reservation),
                                    lambda: self._drop_beyond(target, reservation))
        if errors:
            raise errors[0]

    def _drop_beyond(self, committed: int, reservation: Reservation) -> None:
        """Unmap the chunks `committed` bytes per segment do not need, highest first, stopping
        at a failure: what stays mapped is then still contiguous from each segment's start, so
        a later grow maps from its end with no hole, and the next commit drops it."""
        beyond = [chunk for chunk in reservation.chunks.values()
                  if chunk.offset >= self._needed_end(self._home_of(chunk.offset), committed)]
        for chunk in sorted(beyond, key=lambda chunk: -chunk.offset):
            reservation.unmap(chunk)

    def _settle_owed(self, reservation: Reservation) -> None:
        """Give back what earlier shrinks' cuts still hold: the scratch mapping and range, then
        the replaced chunk's handle. Raises the first failure; what failed stays owed."""
        owed, self._owed = self._owed, []
        errors = self._attempt_each(*[lambda c=c: self._settle_cut(c, reservation) for c in owed])
        self._owed = [c for c in owed if c.scratch_reserved or not c.old_released]
        if errors:
            raise errors[0]

    @staticmethod
    def _settle_cut(c: _Cut, reservation: Reservation) -> None:
        driver = reservation.driver
        if c.scratch_mapped:
            driver.unmap(c.scratch_va, c.keep)
            c.scratch_mapped = False
        if c.scratch_reserved:
            driver.free_reserved(c.scratch_va, c.keep)
            c.scratch_reserved = False
        if not c.old_released:
            driver.release(c.chunk.handle)
            c.old_released = True

    @staticmethod
    def _attempt_each(*calls: Callable[[], object]) -> list[BaseException]:
        """Make every call, whatever the others raise; the errors in order."""
        errors = []
        for call in calls:
            try:
                call()
            except Exception as error:
                errors.append(error)
        return errors

    def _copy_kept(self, cut: list[tuple[Chunk, int]], reservation: Reservation) -> list[_Cut]:
        """Copy each cut chunk's kept prefix onto a new allocation mapped at a scratch range."""
        driver, cuts = reservation.driver, []
        try:
            for chunk, keep in cut:
                handle = reservation.create(keep)
                try:
                    scratch_va = driver.reserve(keep)
                except BaseException:
                    driver.release(handle)
                    raise
                cuts.append(_Cut(chunk, keep, handle, scratch_va))
                reservation.map_at(scratch_va, keep, handle)
                cuts[-1].scratch_mapped = True
                self._bytes(scratch_va, keep).copy_(
                    self._bytes(reservation.va + chunk.offset, keep))
            self._synchronize()
        except BaseException:
            for c in cuts:
                self._drop_scratch(c, reservation)
                driver.release(c.handle)
            raise
        return cuts

    def _swap_in(self, cuts: list[_Cut], reservation: Reservation) -> None:
        """Map each copy where its chunk was; on failure put every old chunk back."""
        driver, done = reservation.driver, []
        try:
            for c in cuts:
                va = reservation.va + c.chunk.offset
                driver.unmap(va, c.chunk.size)
                done.append(c)
                reservation.map_at(va, c.keep, c.handle)
                reservation.chunks[c.chunk.offset] = Chunk(c.chunk.offset, c.keep, c.handle)
        except BaseException:
            for c in reversed(done):
                va = reservation.va + c.chunk.offset
                if reservation.chunks[c.chunk.offset].handle == c.handle:
                    driver.unmap(va, c.keep)
                reservation.map_at(va, c.chunk.size, c.chunk.handle)
                reservation.chunks[c.chunk.offset] = c.chunk
            for c in cuts:
                self._drop_scratch(c, reservation)
                driver.release(c.handle)
            raise

    def _drop_scratch(self, c: _Cut, reservation: Reservation) -> None:
        if c.scratch_mapped:
            reservation.driver.unmap(c.scratch_va, c.keep)
        reservation.driver.free_reserved(c.scratch_va, c.keep)

    # --- helpers ---------------------------------------------------------------------------

    def _bytes(self, ptr: int, nbytes: int) -> torch.Tensor:
        return tensor_at(ptr, nbytes, self.device, None)

    def _synchronize(self) -> None:
        # Unmapping memory an in-flight kernel still touches faults the device.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
