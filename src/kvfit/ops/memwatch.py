"""Watching what an op allocates: the peak of its extra memory, and the aten ops it runs."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass
class Watch:
    """Filled in by `watch_memory`: the peak bytes allocated above the level at entry, and (off
    CUDA) the names of the aten ops that ran."""

    peak_bytes: int = 0
    ops: set[str] = field(default_factory=set)


class _StorageTracker(TorchDispatchMode):
    """Counts the bytes of every storage an op creates until the storage dies (views share
    their base's storage, so it is counted once and lives as long as any view)."""

    def __init__(self, watch: Watch) -> None:
        super().__init__()
        self.watch = watch
        self.live = 0
        self.tracked: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        self.watch.ops.add(func.__name__)
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs:  # views and in-place results are not new
                self._track(storage)
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.tracked or nbytes == 0:
            return
        self.tracked.add(ptr)
        self.live += nbytes
        self.watch.peak_bytes = max(self.watch.peak_bytes, self.live)
        weakref.finalize(storage, self._free, ptr, nbytes)

    def _free(self, ptr: int, nbytes: int) -> None:
        self.live -= nbytes
        self.tracked.discard(ptr)


def _tensors(tree: object) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


@contextlib.contextmanager
def watch_memory(device: torch.device | str) -> Iterator[Watch]:
    """Measure the peak extra memory of the block on `device`: on CUDA, the caching allocator's
    peak over its level at entry; elsewhere, the storages the block's torch ops create (inputs
    that already existed are not counted), which also records the ops' names."""
    watch = Watch()
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield watch
        torch.cuda.synchronize(device)
        watch.peak_bytes = torch.cuda.max_memory_allocated(device) - base
        return
    with _StorageTracker(watch):
        yield watch
