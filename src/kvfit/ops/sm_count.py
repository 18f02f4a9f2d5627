"""The device's streaming multiprocessor count, which sizes launches that should give every SM
a program (the skinny linear kernels' tiles, the decode attention's splits)."""

from __future__ import annotations

import functools

import torch

DEFAULT_SMS = 132
"""An H100's or H200's count, for launches captured without a GPU (tools, the interpreter)."""


@functools.cache
def num_sms(device: torch.device) -> int:
    """The SM count of a CUDA `device`; `DEFAULT_SMS` for any other."""
    if device.type != "cuda":
        return DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count
