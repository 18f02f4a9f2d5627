"""One packed host-to-device copy for a step's inputs."""

from __future__ import annotations

import numpy as np
import torch

from kvfit.engine.transfer import to_device_packed


def test_packed_inputs_round_trip_at_16_byte_aligned_offsets() -> None:
    # Odd lengths: packed back to back, every view after the first would start off 16 bytes,
    # and Triton compiles a kernel variant per pointer alignment it meets.
    arrays = [np.arange(3, dtype=np.int64), np.arange(5, dtype=np.int32).reshape(5, 1),
              np.array([7], dtype=np.int64), np.arange(6, dtype=np.int32).reshape(2, 3)]
    views = to_device_packed(torch.device("cpu"), *arrays)
    for array, view in zip(arrays, views, strict=True):
        assert view.shape == array.shape and view.numpy().dtype == array.dtype
        assert view.tolist() == array.tolist()
        assert view.storage_offset() * view.element_size() % 16 == 0
