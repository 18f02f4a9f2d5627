"""Zero-copy torch tensors over raw device or host addresses, keeping an owner alive.

Both paths hand torch an exporter object and let torch hold the Python reference: torch keeps
the object passed to `torch.as_tensor` (`__cuda_array_interface__`) or `torch.from_numpy`
(`__array_interface__` via numpy) until the storage dies, so the owner outlives every view and
is released by an ordinary reference drop. DLPack would instead need a ctypes deleter callback,
which may run during interpreter teardown after ctypes itself is gone.
"""

from __future__ import annotations

import numpy as np
import torch


class _Exporter:
    """Describes `nbytes` at `ptr` as a flat uint8 array and pins `owner`."""

    def __init__(self, ptr: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        interface = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self.__array_interface__ = interface
        self.__cuda_array_interface__ = interface


def tensor_at(ptr: int, nbytes: int, device: torch.device, owner: object) -> torch.Tensor:
    """A uint8 tensor over `[ptr, ptr + nbytes)` whose storage keeps `owner` alive.

    `untyped_storage().nbytes()` is exactly `nbytes`. CUDA memory needs an indexed `device`:
    torch then takes the device as given instead of asking the driver about the pointer, which
    fails where nothing is mapped yet.
    """
    if device.type == "cpu":
        return torch.from_numpy(np.asarray(_Exporter(ptr, nbytes, owner)))
    # An empty array's pointer must be null: torch would ask the driver about an unmapped one.
    return torch.as_tensor(_Exporter(ptr if nbytes else 0, nbytes, owner), device=device)
