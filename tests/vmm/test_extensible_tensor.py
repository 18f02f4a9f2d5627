"""ExtensibleTensor behaviour, on the host driver and (marker `gpu`) on CUDA."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
import torch

from kvfit.vmm import ExtensibleTensor
from kvfit.vmm.host import HostDriver

from .conftest import MiB, committed_memory


def pattern(nbytes: int, seed: int, device: str) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed)).to(device)


def test_views_are_tensors_of_the_device_at_the_reservation(device: str) -> None:
    with ExtensibleTensor(8 * MiB, device, num_segments=2) as t:
        t.commit(1)
        full, seg1 = t.full_view(), t.segment_view(1)
        assert full.device.type == seg1.device.type == device
        assert full.dtype == torch.uint8 and full.numel() == t.capacity_bytes
        assert full.data_ptr() == t.base_ptr
        assert seg1.data_ptr() == t.base_ptr + t.segment_capacity
        assert seg1.untyped_storage().nbytes() == t.committed_bytes == t.granularity
        with pytest.raises(IndexError, match="num_segments=2"):
            t.segment_view(2)


def test_growth_keeps_base_and_contents(device: str) -> None:
    with ExtensibleTensor(64 * MiB, device) as t:
        base = t.base_ptr
        written = 0
        for step in (1, 3 * MiB, 8 * MiB, 40 * MiB, 64 * MiB):
            t.commit(step)
            assert t.base_ptr == base and t.full_view().data_ptr() == base
            view = t.segment_view(0)
            assert view.untyped_storage().nbytes() == t.committed_bytes
            assert torch.equal(view[:written], pattern(written, 0, device)[:written])
            view.copy_(pattern(t.committed_bytes, 0, device)[: t.committed_bytes])
            written = t.committed_bytes
        assert t.physical_bytes == 64 * MiB


def test_commit_rounds_up_to_the_granule(device: str) -> None:
    with ExtensibleTensor(10 * MiB, device) as t:
        assert t.granularity >= 2 * MiB and t.granularity % (2 * MiB) == 0
        t.commit(t.granularity + 1)
        assert t.committed_bytes == 2 * t.granularity
        t.commit(0)
        assert t.committed_bytes == 0 and t.physical_bytes == 0
        assert t.segment_view(0).numel() == 0


def test_reserved_bytes_hold_every_committed_granule(device: str) -> None:
    # The reservation is the capacity rounded up to the granule, so a full commit of a
    # capacity that is no granule multiple never maps more than it reserved.
    with ExtensibleTensor(3 * MiB, device) as t:
        t.commit(3 * MiB)
        assert t.committed_bytes == 3 * MiB
        assert t.reserved_bytes == t.physical_bytes == 2 * t.granularity


def test_fine_growth_maps_granules_and_bulk_growth_large_chunks(device: str) -> None:
    with ExtensibleTensor(3 << 30, device) as t:
        g = t.granularity
        for n in range(1, 5):
            t.commit(n * g)
        assert t.num_physical_chunks == 4
        t.commit(t.segment_capacity)  # one bulk step maps the rest in chunks of up to 1 GiB
        assert t.num_physical_chunks == 4 + 3
        assert t.physical_bytes == 3 << 30


def test_shrink_keeps_the_prefix_and_releases_the_tail(device: str) -> None:
    with ExtensibleTensor(64 * MiB, device, num_segments=2) as t:
        t.commit(t.segment_capacity)  # one chunk per segment: the shrink cuts both
        assert t.num_physical_chunks == 2
        data = [pattern(t.segment_capacity, i, device) for i in range(2)]
        for i in range(2):
            t.segment_view(i).copy_(data[i])
        t.commit(10 * MiB)
        assert t.physical_bytes == 2 * 10 * MiB
        for i in range(2):
            assert torch.equal(t.segment_view(i), data[i][: 10 * MiB])
        t.commit(2 * MiB)
        assert t.physical_bytes == 2 * 2 * MiB
        assert torch.equal(t.segment_view(1), data[1][: 2 * MiB])


def test_release_returns_memory_and_recommit_zeroes(device: str) -> None:
    size = 64 * MiB
    with ExtensibleTensor(size, device, num_segments=2) as t:
        t.commit(t.segment_capacity)
        view = t.full_view()
        view.fill_(0xAB)
        held = committed_memory(device)
        t.release_physical()
        assert t.physical_bytes == 0 and t.committed_bytes == size // 2
        assert held - committed_memory(device) >= size * 0.9
        t.recommit()
        assert t.physical_bytes == size and t.full_view().data_ptr() == view.data_ptr()
        assert int(view.count_nonzero()) == 0  # the old view sees the new, zeroed pages
        view.fill_(1)
        assert int(t.segment_view(1).sum()) == size // 2


def test_segments_grow_in_lockstep(device: str) -> None:
    n = 4
    with ExtensibleTensor(n * 16 * MiB, device, num_segments=n) as t:
        t.commit(2 * MiB)
        for i in range(n):
            t.segment_view(i).fill_(i + 1)
        t.commit(9 * MiB)
        for i in range(n):
            view = t.segment_view(i)
            assert view.numel() == t.committed_bytes == 10 * MiB
            assert view.data_ptr() == t.base_ptr + i * t.segment_capacity
            assert torch.all(view[: 2 * MiB] == i + 1)
            view[2 * MiB :].fill_(i + 1)
        assert all(torch.all(t.segment_view(i) == i + 1) for i in range(n))
        assert t.physical_bytes == n * 10 * MiB


def test_straddling_granule_is_mapped_once(device: str) -> None:
    n = 3
    with ExtensibleTensor(n * 3 * MiB, device, num_segments=n) as t:
        g = t.granularity
        assert t.segment_capacity % g  # segments 1 and 2 start inside a granule
        t.commit(t.segment_capacity)
        reserved = -(-t.capacity_bytes // g) * g
        assert t.physical_bytes == reserved  # every granule once, shared ones included
        for i in range(n):
            t.segment_view(i).fill_(i + 1)
        for i in range(n):
            assert torch.all(t.segment_view(i) == i + 1)
        t.commit(1)
        assert all(torch.all(t.segment_view(i) == i + 1) for i in range(n))


def test_commit_beyond_capacity_names_it(device: str) -> None:
    with ExtensibleTensor(8 * MiB, device, num_segments=2) as t:
        with pytest.raises(ValueError, match=f"segment_capacity is {4 * MiB}"):
            t.commit(4 * MiB + 1)
        with pytest.raises(ValueError, match="capacity_bytes"):
            t.commit(-1)
        with pytest.raises(TypeError, match="bytes_per_segment must be an integer"):
            t.commit(1.5 * MiB)  # a float size was committed, and kept as the size
        with pytest.raises(TypeError, match="bytes_per_segment must be an integer"):
            t.release_physical() or t.recommit(bytes_per_segment=2.0 * MiB)
        t.recommit()
        assert t.committed_bytes == 0 and not t.is_released
        t.commit(np.int64(2 * MiB))  # what a size computed with numpy is
        assert t.committed_bytes == 2 * MiB and type(t.committed_bytes) is int
    with pytest.raises(ValueError, match="num_segments"):
        ExtensibleTensor(10 * MiB + 1, device, num_segments=2)
    with pytest.raises(TypeError, match="capacity_bytes must be an integer"):
        ExtensibleTensor(4.5 * MiB, device)  # reached the driver as a ctypes ArgumentError


def test_defragment_maps_each_segment_as_one_allocation(device: str) -> None:
    with ExtensibleTensor(2 * 32 * MiB, device, num_segments=2) as t:
        for n in range(1, 9):
            t.commit(n * 2 * MiB)
        assert t.num_physical_chunks == 16
        t.commit(20 * MiB, defragment=True)
        assert t.num_physical_chunks == 2 and t.physical_bytes == 40 * MiB
        t.segment_view(1).fill_(5)
        assert torch.all(t.segment_view(1) == 5)


def test_torch_kernels_write_segments_and_read_the_full_view(device: str) -> None:
    n, seg = 3, 8 * MiB
    with ExtensibleTensor(n * seg, device, num_segments=n) as t:
        t.commit(2 * MiB)
        for i in range(n):
            torch.mul(torch.ones(2 * MiB // 4, device=device), i + 1,
                      out=t.segment_view(i).view(torch.float32))
        t.commit(6 * MiB)
        for i in range(n):
            t.segment_view(i)[2 * MiB :].view(torch.float32).copy_(
                torch.arange(4 * MiB // 4, device=device, dtype=torch.float32))
        full = t.full_view().view(n, seg)[:, : 6 * MiB]
        head = full[:, : 2 * MiB].contiguous().view(torch.float32)
        tail = full[:, 2 * MiB :].contiguous().view(torch.float32)
        assert torch.equal(head[:, 0], torch.tensor([1.0, 2.0, 3.0], device=device))
        assert torch.equal(tail.sum(1), torch.arange(4 * MiB // 4, device=device).sum().float()
                           .expand(n))


def test_views_keep_the_reservation_alive(device: str) -> None:
    t = ExtensibleTensor(8 * MiB, device)
    t.commit(4 * MiB)
    view = t.segment_view(0)
    view.fill_(9)
    del t
    gc.collect()
    assert torch.all(view == 9)
    view.fill_(3)
    assert int(view.sum()) == 3 * 4 * MiB


def test_free_returns_memory_and_ends_the_tensor(device: str) -> None:
    t = ExtensibleTensor(128 * MiB, device)
    t.commit(128 * MiB)
    t.full_view().fill_(1)
    held = committed_memory(device)
    t.free()
    assert held - committed_memory(device) >= 128 * MiB * 0.9
    with pytest.raises(RuntimeError, match="freed"):
        t.commit(0)
    t.free()  # idempotent


def test_commit_after_release_asks_for_recommit(device: str) -> None:
    with ExtensibleTensor(8 * MiB, device) as t:
        t.commit(2 * MiB)
        t.release_physical()
        with pytest.raises(RuntimeError, match="recommit"):
            t.commit(4 * MiB)
        t.recommit()
        t.commit(4 * MiB)
        assert t.physical_bytes == 4 * MiB


def test_recommit_at_a_new_size_maps_one_chunk_per_segment_and_only_it(device: str) -> None:
    with ExtensibleTensor(64 * MiB, device, num_segments=2) as t:
        t.commit(20 * MiB)
        with pytest.raises(RuntimeError, match="release_physical"):
            t.recommit(defragment=True, bytes_per_segment=4 * MiB)
        for i in range(2):
            t.segment_view(i).fill_(0xAB)
        held = committed_memory(device)
        t.release_physical()
        t.recommit(defragment=True, bytes_per_segment=5 * MiB)  # rounded up to the granule
        assert held - committed_memory(device) >= 2 * 14 * MiB * 0.9  # the old pages went
        assert t.committed_bytes == 6 * MiB and t.physical_bytes == 2 * 6 * MiB
        assert t.num_physical_chunks == 2 and not t.is_released
        assert t.segment_view(1).untyped_storage().nbytes() == 6 * MiB
        assert int(t.segment_view(1).count_nonzero()) == 0
        t.release_physical()
        t.recommit(defragment=True, bytes_per_segment=30 * MiB)  # larger works the same way
        assert t.physical_bytes == 2 * 30 * MiB and t.num_physical_chunks == 2


class RecyclingHostDriver(HostDriver):
    """Hands released pages back out as they were, as a GPU driver may: nothing promised."""

    new_pages_are_zero = False

    def __init__(self) -> None:
        super().__init__()
        self.pool: list[int] = []

    def create(self, size: int, device: int) -> int:
        return self.pool.pop() if self.pool else super().create(size, device)

    def release(self, handle: int) -> None:
        self.pool.append(handle)


def test_recommit_zeroes_pages_a_driver_hands_back_dirty() -> None:
    driver = RecyclingHostDriver()
    with ExtensibleTensor(8 * MiB, "cpu", driver=driver) as t:
        t.commit(8 * MiB)
        view = t.full_view()
        view.fill_(0x5A)
        t.release_physical()
        assert driver.pool  # the pages (and their bytes) are waiting to be reused
        t.recommit()
        assert not driver.pool and int(view.count_nonzero()) == 0


def test_uncut_sizes_end_on_chunk_boundaries_so_a_shrink_there_copies_nothing() -> None:
    driver = RecyclingHostDriver()
    with ExtensibleTensor(64 * MiB, "cpu", driver=driver) as t:
        t.commit(2 * MiB)  # one 2 MiB chunk
        t.commit(10 * MiB)  # and one bulk chunk of 8 MiB after it
        assert t.num_physical_chunks == 2
        assert t.uncut_bytes(10 * MiB) == 10 * MiB
        assert t.uncut_bytes(9 * MiB) == t.uncut_bytes(4 * MiB) == 2 * MiB
        assert t.uncut_bytes(64 * MiB) == 10 * MiB  # never more than is committed
        creates = []
        original = driver.create
        driver.create = lambda size, device: (creates.append(size), original(size, device))[1]
        t.commit(t.uncut_bytes(9 * MiB))
        assert creates == [] and t.num_physical_chunks == 1 and t.physical_bytes == 2 * MiB


@pytest.mark.parametrize("seed", range(40))
def test_uncut_bytes_is_the_largest_size_that_cuts_no_chunk(seed: int) -> None:
    """Against a search one granule at a time, on random chunk layouts of several segments
    (sizes not a granule multiple, so granules straddle segments)."""
    rng = random.Random(seed)
    g = 2 * MiB
    segments = rng.choice([1, 2, 3, 5])
    segment = rng.randrange(4, 24) * g + rng.choice([0, g // 2, 12345 * 8])
    with ExtensibleTensor(segments * segment, "cpu", segments,
                          driver=RecyclingHostDriver()) as t:
        for _ in range(rng.randrange(1, 6)):  # grows in chunks of random sizes
            target = min(t.committed_bytes + rng.randrange(1, 6) * g, t.segment_capacity)
            t.commit(target, max_chunk_bytes=rng.choice([g, 2 * g, 3 * g, 1 << 30]))
        chunks = list(t._live().chunks.values())
        for asked in sorted({rng.randrange(0, t.committed_bytes + 1) for _ in range(8)}):
            expected = min(asked, t.committed_bytes) // g * g
            while expected > 0 and any(t._cuts(c, expected) for c in chunks):
                expected -= g
            assert t.uncut_bytes(asked) == expected


def test_a_grow_maps_its_tail_in_small_chunks_also_on_recommit_but_not_defragmented() -> None:
    """`tail_bytes` of each segment's end come in `tail_chunk_bytes` chunks, after large ones;
    a recommit (wake) lays out the same way; a defragmenting commit stays one chunk."""
    g = 2 * MiB
    with ExtensibleTensor(2 * 32 * MiB, "cpu", 2, tail_bytes=6 * MiB + 1,
                          tail_chunk_bytes=2 * g + 1) as t:
        assert (t.tail_bytes, t.tail_chunk_bytes) == (6 * MiB, 2 * g)  # down to the granule

        def layout() -> list[tuple[int, int]]:
            return sorted((c.offset // MiB, c.size // MiB) for c in t._live().chunks.values())

        t.commit(20 * MiB)
        expected = [(0, 14), (14, 4), (18, 2), (32, 14), (46, 4), (50, 2)]
        assert layout() == expected
        t.release_physical()
        t.recommit()
        assert layout() == expected
        t.commit(20 * MiB, defragment=True)
        assert layout() == [(0, 20), (32, 20)]
        t.commit(4 * MiB)  # a grow smaller than the tail: tail chunks only
        t.commit(10 * MiB)
        assert layout() == [(0, 4), (4, 4), (8, 2), (32, 4), (36, 4), (40, 2)]
