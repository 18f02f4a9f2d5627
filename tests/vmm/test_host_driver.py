"""Host driver: GPU reserve/map semantics on process memory, errors naming the call."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
import torch

from kvfit.vmm import VmmError
from kvfit.vmm.host import HostDriver
from kvfit.vmm.view import tensor_at

MiB = 1 << 20


def test_map_needs_set_access_and_unmap_keeps_the_reservation() -> None:
    driver = HostDriver()
    va = driver.reserve(4 * MiB)
    handle = driver.create(2 * MiB, 0)
    driver.map(va + 2 * MiB, 2 * MiB, handle)
    driver.set_access(va + 2 * MiB, 2 * MiB, 0)
    view = tensor_at(va + 2 * MiB, 2 * MiB, torch.device("cpu"), None)
    view.fill_(7)
    driver.unmap(va + 2 * MiB, 2 * MiB)
    driver.map(va + 2 * MiB, 2 * MiB, handle)  # same pages come back while the handle lives
    driver.set_access(va + 2 * MiB, 2 * MiB, 0)
    assert torch.all(view == 7)
    driver.unmap(va + 2 * MiB, 2 * MiB)
    driver.release(handle)
    driver.free_reserved(va, 4 * MiB)


def test_errors_name_the_failing_call() -> None:
    driver = HostDriver()
    va = driver.reserve(2 * MiB)
    with pytest.raises(VmmError, match=r"mmap failed: EBADF") as error:
        driver.map(va, 2 * MiB, 10_000)
    assert error.value.call == "mmap" and error.value.code > 0
    with pytest.raises(VmmError, match="close failed"):
        driver.release(10_000)
    with pytest.raises(VmmError, match="ftruncate failed"):
        driver.create(-1, 0)
    driver.free_reserved(va, 2 * MiB)


@pytest.mark.parametrize("step", ["mapped_without_access", "unmapped"])
def test_pages_without_access_fault(step: str) -> None:
    script = f"""
import torch
from kvfit.vmm.host import HostDriver
from kvfit.vmm.view import tensor_at
d = HostDriver(); va = d.reserve(1 << 21); h = d.create(1 << 21, 0)
d.map(va, 1 << 21, h)
if "{step}" == "unmapped":
    d.set_access(va, 1 << 21, 0); d.unmap(va, 1 << 21)
print(int(tensor_at(va, 1 << 21, torch.device("cpu"), None)[0]))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert result.returncode == -signal.SIGSEGV, result.stderr.decode()
