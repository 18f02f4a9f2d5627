"""The host driver allocates a commit's pages at commit time, as a GPU driver does: the memory
is charged when the cache says it is committed, and a commit the host cannot hold fails then,
leaving the tensor as it was."""

from __future__ import annotations

import os

import pytest
import torch

from kvfit.vmm import ExtensibleTensor, VmmOutOfMemoryError, get_driver
from kvfit.vmm import host as host_module

MiB = 1 << 20


def _memfd_bytes() -> int:
    """Bytes allocated to this process's kvfit memfds (what the kernel has charged for them)."""
    total = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:kvfit-vmm" in os.readlink(f"/proc/self/fd/{fd}"):
                total += os.fstat(int(fd)).st_blocks * 512
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
    return total


def test_create_allocates_the_pages_now() -> None:
    driver = get_driver("cpu")
    fd = driver.create(8 * MiB, 0)
    try:
        assert os.fstat(fd).st_blocks * 512 >= 8 * MiB  # before any page is touched
    finally:
        driver.release(fd)


def test_commit_charges_what_it_commits_and_release_returns_it() -> None:
    before = _memfd_bytes()
    with ExtensibleTensor(64 * MiB, "cpu") as t:
        t.commit(48 * MiB)
        assert _memfd_bytes() - before == t.physical_bytes == 48 * MiB
        t.commit(16 * MiB)
        assert _memfd_bytes() - before == 16 * MiB
        t.release_physical()
        assert _memfd_bytes() == before


def test_commit_beyond_the_host_memory_fails_and_keeps_the_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with ExtensibleTensor(256 * MiB, "cpu") as t:
        t.commit(8 * MiB)
        t.full_view()[: 8 * MiB].fill_(7)
        before = _memfd_bytes()
        # A host with 32 MiB left: growing by 120 MiB cannot be backed.
        monkeypatch.setattr(host_module, "_available_bytes", lambda: 32 * MiB)
        with pytest.raises(VmmOutOfMemoryError, match="ENOMEM"):
            t.commit(128 * MiB)
        assert t.physical_bytes == t.committed_bytes == 8 * MiB
        assert _memfd_bytes() == before
        assert torch.all(t.full_view()[: 8 * MiB] == 7)
        t.commit(24 * MiB)  # what the host still has is committed as before
        assert t.physical_bytes == 24 * MiB


def test_kv_cache_commit_beyond_the_host_memory_keeps_its_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvfit.kv.cache import ExtensibleKVCache
    from kvfit.kv.spec import KVCacheSpec

    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=64,
                       dtype=torch.float32)  # 32 KiB per block
    cache = ExtensibleKVCache(spec, capacity_blocks=4096, device="cpu")
    cache.allocate()
    cache.commit(256)  # 8 MiB
    k, _ = cache.layer_views()[0]
    k[:256].fill_(3.0)
    monkeypatch.setattr(host_module, "_available_bytes", lambda: 16 * MiB)
    with pytest.raises(VmmOutOfMemoryError):
        cache.commit(4096)  # 128 MiB
    assert cache.committed_blocks == 256 and cache.physical_bytes == 8 * MiB
    assert torch.all(cache.layer_views()[0][0][:256] == 3.0)
    cache.free()
