"""A commit that fails at any create/map/set_access leaves the tensor exactly as it was."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvfit.vmm import ExtensibleTensor, VmmError, VmmOutOfMemoryError, get_driver
from kvfit.vmm import reservation as reservation_module

from .conftest import FaultyDriver, MiB, assert_consistent

SEGMENTS = 3
SEGMENT = 6 * MiB


def _fill(t: ExtensibleTensor) -> list[torch.Tensor]:
    for i in range(SEGMENTS):
        t.segment_view(i).fill_(i + 1)
    return [t.segment_view(i).clone() for i in range(SEGMENTS)]


Step = Callable[[ExtensibleTensor], object]
# Each operation: (prepare the tensor, the commit that will be made to fail).
OPERATIONS: dict[str, tuple[Step, Step]] = {
    "grow": (lambda t: t.commit(2 * MiB), lambda t: t.commit(SEGMENT)),
    "shrink_cutting_chunks": (lambda t: t.commit(SEGMENT), lambda t: t.commit(2 * MiB)),
    "defragment": (lambda t: [t.commit(n * 2 * MiB) for n in (1, 2)],
                   lambda t: t.commit(6 * MiB, defragment=True)),
    "recommit": (lambda t: (t.commit(SEGMENT), t.release_physical()), lambda t: t.recommit()),
}
KINDS = ("create", "map", "set_access")


# A layout whose grows end in small chunks (`tail_bytes`), as the KV cache's do: more calls.
TAILS = {"bulk": {}, "tail": {"tail_bytes": 2 * MiB, "tail_chunk_bytes": 2 * MiB}}


def _calls(device: str, operation: str, tail: str) -> dict[str, int]:
    prepare, act = OPERATIONS[operation]
    driver = FaultyDriver(get_driver(device))
    with ExtensibleTensor(SEGMENTS * SEGMENT, device, SEGMENTS, driver=driver,
                          **TAILS[tail]) as t:
        prepare(t)
        driver.calls.clear()
        act(t)
    return dict(driver.calls)


@pytest.mark.parametrize("tail", TAILS)
@pytest.mark.parametrize("operation", OPERATIONS)
def test_failed_commit_rolls_back_exactly(device: str, operation: str, tail: str) -> None:
    prepare, act = OPERATIONS[operation]
    counts = _calls(device, operation, tail)
    assert sum(counts.get(kind, 0) for kind in KINDS) >= 3
    for kind in KINDS:
        for k in range(1, counts.get(kind, 0) + 1):
            driver = FaultyDriver(get_driver(device))
            with ExtensibleTensor(SEGMENTS * SEGMENT, device, SEGMENTS, driver=driver,
                                  **TAILS[tail]) as t:
                prepare(t)
                before = (t.committed_bytes, t.physical_bytes, dict(t._live().chunks))
                contents = None if t.physical_bytes == 0 else _fill(t)
                driver.calls.clear()
                driver.fail_kind, driver.fail_at = kind, k
                with pytest.raises(VmmError, match=f"injected {kind}"):
                    act(t)
                assert_consistent(t, driver)
                assert (t.committed_bytes, t.physical_bytes) == before[:2], (kind, k)
                if operation != "defragment":  # defragment discards contents and chunks
                    assert dict(t._live().chunks) == before[2]
                    if contents is not None:
                        for i in range(SEGMENTS):
                            assert torch.equal(t.segment_view(i), contents[i]), (kind, k, i)
                driver.fail_kind = ""
                act(t)  # the same commit can be retried
                assert_consistent(t, driver)


def test_release_failing_part_way_leaves_a_tensor_recommit_restores(device: str) -> None:
    driver = FaultyDriver(get_driver(device))
    with ExtensibleTensor(SEGMENTS * SEGMENT, device, SEGMENTS, driver=driver) as t:
        t.commit(SEGMENT)
        _fill(t)
        chunks = t.num_physical_chunks
        driver.calls.clear()
        driver.fail_kind, driver.fail_at = "unmap", 2
        with pytest.raises(VmmError, match="injected unmap"):
            t.release_physical()
        assert t.is_released and 0 < t.num_physical_chunks < chunks
        assert_consistent(t, driver)
        with pytest.raises(RuntimeError, match="recommit"):
            t.commit(SEGMENT)
        driver.fail_kind = ""
        t.recommit()
        assert not t.is_released and t.committed_bytes == SEGMENT
        assert_consistent(t, driver)
        assert all(not t.segment_view(i).any() for i in range(SEGMENTS))


def test_out_of_memory_retries_once_after_emptying_torch_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emptied: list[int] = []
    monkeypatch.setattr(reservation_module, "_torch_holds_idle_memory", lambda device: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))

    class OutOfMemoryOnce(FaultyDriver):
        def create(self, size: int, device: int) -> int:
            self.calls["create"] = self.calls.get("create", 0) + 1
            if self.calls["create"] <= self.fail_at:
                raise VmmOutOfMemoryError("create", 2)
            return super().create(size, device)

    with ExtensibleTensor(8 * MiB, "cpu", driver=OutOfMemoryOnce(get_driver("cpu"), "", 1)) as t:
        t.commit(4 * MiB)
        assert t.physical_bytes == 4 * MiB and emptied == [1]
    with ExtensibleTensor(8 * MiB, "cpu", driver=OutOfMemoryOnce(get_driver("cpu"), "", 2)) as t:
        with pytest.raises(VmmOutOfMemoryError):
            t.commit(4 * MiB)
        assert emptied == [1, 1] and t.physical_bytes == 0
    monkeypatch.setattr(reservation_module, "_torch_holds_idle_memory", lambda device: False)
    with ExtensibleTensor(8 * MiB, "cpu", driver=OutOfMemoryOnce(get_driver("cpu"), "", 1)) as t:
        with pytest.raises(VmmOutOfMemoryError):
            t.commit(4 * MiB)
        assert emptied == [1, 1]


@pytest.mark.gpu
def test_out_of_memory_is_relieved_by_torch_idle_cache() -> None:
    free, _ = torch.cuda.mem_get_info()
    hog = torch.empty(free - (512 << 20), dtype=torch.uint8, device="cuda")
    del hog  # torch's caching allocator now holds nearly all free memory idle
    assert torch.cuda.memory_reserved() > torch.cuda.memory_allocated() + (2 << 30)
    with ExtensibleTensor(4 << 30, "cuda") as t:
        t.commit(2 << 30)
        assert t.physical_bytes == 2 << 30


@pytest.mark.parametrize("operation", ["shrink_cutting_chunks", "shrink_dropping_chunks"])
def test_failed_unmap_in_a_shrink_keeps_the_prefix_and_the_next_commit_gives_back(
    device: str, operation: str,
) -> None:
    """An unmap fails after the kept prefix is in place: the tensor has the new size, its
    contents intact; what it could not give back (a scratch range, a dropped chunk) is given
    back by the next commit, so nothing leaks and a grow maps no hole."""
    prepare, act = (OPERATIONS[operation] if operation in OPERATIONS
                    else (lambda t: [t.commit(n * 2 * MiB) for n in (1, 2, 3)],
                          lambda t: t.commit(2 * MiB)))
    driver = FaultyDriver(get_driver(device))
    with ExtensibleTensor(SEGMENTS * SEGMENT, device, SEGMENTS, driver=driver) as t:
        prepare(t)
        driver.calls.clear()
        act(t)
        num_unmaps = driver.calls["unmap"]
    assert num_unmaps >= 2
    for k in range(1, num_unmaps + 1):
        driver = FaultyDriver(get_driver(device))
        with ExtensibleTensor(SEGMENTS * SEGMENT, device, SEGMENTS, driver=driver) as t:
            prepare(t)
            contents = _fill(t)
            driver.calls.clear()
            driver.fail_kind, driver.fail_at = "unmap", k
            with pytest.raises(VmmError, match="injected unmap"):
                act(t)
            driver.fail_kind = ""
            for i in range(SEGMENTS):  # whatever size it has now, its prefix is intact
                kept = t.segment_view(i)
                assert torch.equal(kept, contents[i][: kept.numel()]), (k, i)
            t.commit(t.committed_bytes)  # gives back what the failure left
            assert_consistent(t, driver)
            act(t)
            assert_consistent(t, driver)
            t.commit(SEGMENT)  # a grow afterwards leaves no hole
            assert_consistent(t, driver)
            assert t.physical_bytes == SEGMENTS * SEGMENT


@pytest.mark.parametrize("error", [VmmError("cuMemMap", 1, "CUDA_ERROR_INVALID_VALUE"),
                                   VmmOutOfMemoryError("cuMemCreate", 2,
                                                       "CUDA_ERROR_OUT_OF_MEMORY")])
def test_driver_errors_cross_a_process_boundary_with_their_type(error: VmmError) -> None:
    """A tensor-parallel worker's driver error reaches the engine pickled: it must come back
    as itself, since the engine's out-of-memory fallbacks catch it by type."""
    import pickle

    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert (copy.call, copy.code, copy.name) == (error.call, error.code, error.name)
