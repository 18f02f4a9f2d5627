"""HIP driver without a GPU: a fake `libamdhip64` behind `load_library` records every hip* call,
so the ROCm version gate and the per-mapping access grants are checked on the CPU."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterator

import pytest
import torch

from kvfit.vmm import VmmError, vmm_unavailable_reason
from kvfit.vmm import cuda as cuda_module
from kvfit.vmm import probe as probe_module
from kvfit.vmm.hip import HipDriver

KiB = 1 << 10
GRANULE = 4 * KiB  # what ROCm reports
ERROR_NAMES = {1: b"hipErrorInvalidValue"}


def hip_version(major: int, minor: int, patch: int = 42) -> int:
    """HIP_VERSION as hipRuntimeGetVersion reports it."""
    return major * 10_000_000 + minor * 100_000 + patch


def _value(arg: object) -> object:
    """A by-value ctypes argument as a Python int; an error code passed bare stays as it is."""
    return getattr(arg, "value", arg)


class _EntryPoint:
    """One exported function: callable, with a settable `restype` as ctypes functions have."""

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn
        self.restype: object = ctypes.c_int

    def __call__(self, *args: object) -> object:
        return self.fn(*args)


class FakeHip:
    """The hip* entry points `HipDriver` calls. Out-parameters (`byref`) are written, every call
    is recorded as `(name, by-value args)`, and `fail` makes one entry point return an error."""

    def __init__(self, version: int) -> None:
        self.version = version
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.fail: dict[str, int] = {}
        self.context, self.current, self.saved = 0xC7C7, 0, []
        self.next_va, self.next_handle = 0x7F00_0000_0000, 1
        self.loaded_as: tuple[str, str] | None = None  # (file name, fallback pattern)

    def __getattr__(self, name: str) -> _EntryPoint:
        fn = getattr(type(self), "_" + name, None)
        if not name.startswith("hip") or fn is None:
            raise AttributeError(f"undefined symbol: {name}")  # as a CDLL reports one
        return _EntryPoint(lambda *args: self._enter(name, fn, args))

    def _enter(self, name: str, fn: Callable[..., object], args: tuple[object, ...]) -> object:
        self.calls.append((name, tuple(_value(a) for a in args if not _is_out(a))))
        if name in self.fail:
            return self.fail[name]
        result = fn(self, *(a._obj if _is_out(a) else _value(a) for a in args))
        return 0 if result is None else result

    def calls_to(self, name: str) -> list[tuple[object, ...]]:
        return [args for called, args in self.calls if called == name]

    # --- entry points (by-value args arrive as ints, out-parameters as ctypes objects) -----

    def _hipInit(self, flags: int) -> None:
        pass

    def _hipDeviceGet(self, device: ctypes.c_int, ordinal: int) -> None:
        device.value = ordinal

    def _hipDevicePrimaryCtxRetain(self, context: ctypes.c_void_p, device: int) -> None:
        context.value = self.context

    def _hipRuntimeGetVersion(self, version: ctypes.c_int) -> None:
        version.value = self.version

    def _hipGetErrorName(self, code: int) -> bytes:
        return ERROR_NAMES.get(code, b"")

    def _hipCtxGetCurrent(self, context: ctypes.c_void_p) -> None:
        context.value = self.current or None

    def _hipCtxPushCurrent(self, context: int) -> None:
        self.saved.append(self.current)
        self.current = context

    def _hipCtxPopCurrent(self, context: ctypes.c_void_p) -> None:
        context.value, self.current = self.current, self.saved.pop()

    def _hipMemGetAllocationGranularity(self, size: ctypes.c_size_t, prop: object,
                                        option: int) -> None:
        size.value = GRANULE

    def _hipMemAddressReserve(self, va: ctypes.c_uint64, size: int, *rest: int) -> None:
        va.value = self.next_va
        self.next_va += size

    def _hipMemCreate(self, handle: ctypes.c_uint64, size: int, prop: object,
                      flags: int) -> None:
        handle.value = self.next_handle
        self.next_handle += 1

    def _hipMemMap(self, *args: int) -> None:
        pass

    def _hipMemUnmap(self, *args: int) -> None:
        pass

    def _hipMemRelease(self, handle: int) -> None:
        pass

    def _hipMemAddressFree(self, va: int, size: int) -> None:
        pass

    def _hipMemSetAccess(self, va: int, size: int, desc: object, count: int) -> None:
        pass


def _is_out(arg: object) -> bool:
    return type(arg).__name__ == "CArgObject"  # what ctypes.byref returns


@pytest.fixture
def fake_hip(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int], FakeHip]]:
    """Installs a `FakeHip` of a given version where `CudaDriver` loads its library, and makes
    torch look like a ROCm build so `get_driver` picks `HipDriver`."""
    def install(version: int) -> FakeHip:
        lib = FakeHip(version)

        def load(file_name: str, pattern: str) -> FakeHip:
            lib.loaded_as = (file_name, pattern)
            return lib

        monkeypatch.setattr(cuda_module, "load_library", load)
        return lib

    monkeypatch.setattr(torch.version, "hip", "7.12.0-fake")
    probe_module._driver.cache_clear()
    yield install
    probe_module._driver.cache_clear()  # no fake driver may outlive the test


@pytest.mark.parametrize(("major", "minor"), [(6, 4), (7, 0), (7, 11)])
def test_rocm_older_than_7_12_is_refused_naming_its_version(
    fake_hip: Callable[[int], FakeHip], major: int, minor: int
) -> None:
    # Older runtimes reject hipMemSetAccess once a reservation holds several allocations
    # (rocm-systems#2516): the cache would fail at its second commit, so refuse up front.
    fake_hip(hip_version(major, minor))
    with pytest.raises(RuntimeError, match=rf"ROCm {major}\.{minor} .*ROCm >= 7\.12"):
        HipDriver(0)
    # The probe turns the refusal into the reason the engine logs before falling back.
    reason = vmm_unavailable_reason("cuda")
    assert reason is not None and f"RuntimeError: ROCm {major}.{minor} rejects" in reason


@pytest.mark.parametrize(("major", "minor"), [(7, 12), (7, 13), (8, 0)])
def test_rocm_7_12_and_newer_is_accepted_and_probes_usable(
    fake_hip: Callable[[int], FakeHip], major: int, minor: int
) -> None:
    lib = fake_hip(hip_version(major, minor))
    assert vmm_unavailable_reason("cuda") is None
    assert [name for name, _ in lib.calls if name.startswith("hipMem")] == [
        "hipMemGetAllocationGranularity", "hipMemAddressReserve", "hipMemCreate", "hipMemMap",
        "hipMemSetAccess", "hipMemUnmap", "hipMemRelease", "hipMemAddressFree",
    ]


def test_set_access_is_granted_mapping_by_mapping(fake_hip: Callable[[int], FakeHip]) -> None:
    # ROCm rejects an access range that starts inside a mapping, so a range made of several
    # mappings is granted one call per mapping, each exactly that mapping's extent.
    lib = fake_hip(hip_version(7, 12))
    driver = HipDriver(0)
    g = driver.granularity(0)
    va = driver.reserve(16 * g)
    layout = [(0, g), (g, 2 * g), (3 * g, g), (6 * g, 3 * g), (12 * g, g)]  # offset, size
    for offset, size in layout:
        driver.map(va + offset, size, driver.create(size, 0))
    lib.calls.clear()

    driver.set_access(va, 10 * g, 3)  # the mapping at 12 g lies outside the range
    grants = lib.calls_to("hipMemSetAccess")
    assert [(start, size) for start, size, _ in grants] == [
        (va + offset, size) for offset, size in layout[:4]
    ]
    assert all(count == 1 for *_, count in grants)  # one access descriptor each

    driver.unmap(va + g, 2 * g)  # an unmapped run is no longer granted
    lib.calls.clear()
    driver.set_access(va, 10 * g, 3)
    assert [args[:2] for args in lib.calls_to("hipMemSetAccess")] == [
        (va, g), (va + 3 * g, g), (va + 6 * g, 3 * g)
    ]

    other = driver.reserve(4 * g)  # a range the driver did not map: ROCm judges it as given
    lib.calls.clear()
    driver.set_access(other, 4 * g, 3)
    assert [args[:2] for args in lib.calls_to("hipMemSetAccess")] == [(other, 4 * g)]


def test_the_driver_loads_libamdhip64_by_its_exact_file_name(
    fake_hip: Callable[[int], FakeHip],
) -> None:
    lib = fake_hip(hip_version(7, 12))
    HipDriver(0)
    assert lib.loaded_as is not None
    name, pattern = lib.loaded_as
    assert name == "libamdhip64.so"
    assert re.fullmatch(pattern, "libamdhip64.so.7.12.60000")
    assert not re.fullmatch(pattern, "libamdhip64_static.so")  # a look-alike is no match


def test_a_failing_hip_call_names_the_call_and_hips_error(
    fake_hip: Callable[[int], FakeHip],
) -> None:
    lib = fake_hip(hip_version(7, 12))
    driver = HipDriver(0)
    lib.fail["hipMemCreate"] = 1
    with pytest.raises(VmmError, match=r"hipMemCreate failed: hipErrorInvalidValue \(1\)"):
        driver.create(GRANULE, 0)
    assert driver.dlpack_device(0) == (10, 0)  # kDLROCM: torch sees ROCm memory
