"""Host <-> device copies that never make the host wait for the device.

The engine launches step k + 1 before it reads step k's results, so a copy that blocks on the
work queued before it would stall the host behind the step in flight.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64}


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy a host tensor to `device` without waiting for the device.

    A copy from pageable memory waits for all work queued before it, which would stall the host
    behind the step in flight; staging through pinned memory makes it a queued copy like any
    kernel. (The pinned buffer is not reused until the copy has run: torch records it.)
    """
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Queue a copy of a device tensor into pinned host memory; read it after the step's event."""
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return host.copy_(tensor, non_blocking=True)


# Triton compiles one variant of a kernel per pointer alignment it sees (16 bytes or not): views
# at offsets that move with the batch would compile new variants in the middle of serving.
_ALIGN = 16


def to_device_packed(device: torch.device, *arrays: np.ndarray) -> list[torch.Tensor]:
    """`arrays` (int32/int64) on `device` in one host-to-device copy: packed at 16-byte aligned
    offsets into one pinned buffer, viewed back by dtype and shape there. Each copy costs host
    time whatever its size, and the host sets the pace of small steps."""
    sizes = [-(-a.nbytes // _ALIGN) * _ALIGN for a in arrays]
    offsets = list(itertools.accumulate(sizes, initial=0))
    host = torch.empty(offsets[-1], dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = host.numpy()
    for array, offset in zip(arrays, offsets, strict=False):
        flat[offset : offset + array.nbytes] = array.ravel().view(np.uint8)
    packed = host.to(device, non_blocking=True)
    # One dtype view of the whole buffer per dtype, then a slice per array: three tensor ops an
    # array (a slice and two views) were half the step's input preparation at batch 1.
    by_dtype = {np_dtype: packed.view(dtype) for np_dtype, dtype in _TORCH_DTYPES.items()}
    views = []
    for array, offset in zip(arrays, offsets, strict=False):
        start = offset // array.itemsize
        view = by_dtype[array.dtype][start : start + array.size]
        views.append(view if array.ndim == 1 else view.view(array.shape))
    return views
