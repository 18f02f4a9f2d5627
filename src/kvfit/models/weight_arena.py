"""`WeightArena`: a model's parameters moved into one VMM reservation, so sleep can drop their
pages and bring them back while every parameter keeps its address (captured graphs stay valid).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvfit.vmm import ExtensibleTensor

logger = logging.getLogger(__name__)

ALIGN = 256
"""Start alignment of each parameter in the arena, as the caching allocator gives (vector loads
and TMA descriptors assume it)."""

ADOPT_STEP = 1 << 30
"""Adoption commits ahead in steps of at most this much: few physical chunks, and a bounded
overlap of the arena with the parameters it has not taken over yet."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class WeightArena:
    """Every parameter of `model` as a view into one `ExtensibleTensor` (mixed dtypes share it:
    views are typed slices of its bytes). Buffers such as rotary tables stay ordinary tensors:
    they are small and computed at construction, so no sleep level can lose them.

    States: resident; offloaded (`offload`: a host copy, pages released); discarded
    (`discard`: pages released, no copy); `restore` makes it resident again at the same
    addresses, with the host copy's contents or zeroed.

    Memory: the arena holds the parameters' bytes (each start aligned to `ALIGN`) rounded up to
    one commit granule. Adoption copies one parameter at a time and the original is freed as
    soon as its view replaces it, so the peak is the weights plus at most `ADOPT_STEP` plus
    torch's cached blocks (emptied at the end). While offloaded, the device holds nothing of
    the weights and the host holds one copy (pinned on a GPU; torch's pinned-host cache keeps
    that memory after `restore` for the next sleep). While discarded, neither holds anything.
    """

    def __init__(self, model: nn.Module, device: torch.device | str) -> None:
        params = list(model.parameters())  # tied parameters appear once
        offsets, end = [], 0
        for param in params:
            end = _round_up(end, ALIGN)
            offsets.append(end)
            end += param.numel() * param.element_size()
        self.nbytes = end
        self.tensor = ExtensibleTensor(max(end, 1), device)
        self._host: torch.Tensor | None = None
        raw = self.tensor.full_view()
        with torch.no_grad():
            for param, offset in zip(params, offsets, strict=True):
                size = param.numel() * param.element_size()
                if offset + size > self.tensor.committed_bytes:
                    target = max(offset + size, self.tensor.committed_bytes + ADOPT_STEP)
                    self.tensor.commit(min(end, target))
                view = raw[offset : offset + size].view(param.dtype).view(param.shape)
                view.copy_(param.data)
                # Same Parameter object, new storage: modules, ties and optimizers-by-identity
                # all see the arena from now on, and the original storage is freed.
                param.data = view
        if self.tensor.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the originals' blocks back for the KV cache

    @property
    def physical_bytes(self) -> int:
        """Device memory the arena holds now (one granule-rounded `nbytes`, or 0 asleep)."""
        return self.tensor.physical_bytes

    @property
    def host_bytes(self) -> int:
        """Host memory of the copy `offload` made (0 when there is none)."""
        return 0 if self._host is None else self._host.numel()

    @property
    def is_released(self) -> bool:
        """Whether the pages are dropped (offloaded or discarded)."""
        return self.tensor.is_released

    def _contents(self) -> torch.Tensor:
        return self.tensor.segment_view(0)[: self.nbytes]

    def offload(self) -> int:
        """Copy the weights to host memory (pinned on a GPU, for a fast `restore`), then release
        the pages; returns the host bytes. Nothing is released if the copy fails."""
        self._check_resident("offload")
        pin = self.tensor.device.type == "cuda"
        try:
            host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as error:  # pinned memory is capped (ulimit -l, containers)
            logger.warning("no pinned host memory for %d bytes of weights (%s); offloading to "
                           "pageable memory, so waking up is slower", self.nbytes, error)
            host = torch.empty(self.nbytes, dtype=torch.uint8)
        host.copy_(self._contents())  # synchronous: it must finish before the pages go
        self._host = host
        self.tensor.release_physical()
        return self.host_bytes

    def discard(self) -> None:
        """Release the pages without a copy (sleep level 2): `restore` brings back zeros."""
        self._check_resident("discard")
        self.tensor.release_physical()

    def restore(self) -> bool:
        """Recommit the pages at the same addresses; copy the host copy back if there is one
        (then drop it). Returns whether the contents were restored (False: zeroed, reload
        them). On failure the arena stays released and keeps its host copy."""
        if not self.is_released:
            raise RuntimeError("WeightArena.restore() but the weights are resident")
        self.tensor.recommit()
        if self._host is None:
            return False
        try:
            self._contents().copy_(self._host)
        except BaseException:
            self.tensor.release_physical()
            raise
        self._host = None
        return True

    def _check_resident(self, what: str) -> None:
        if self.is_released:
            raise RuntimeError(f"WeightArena.{what}() but the weights are already released; "
                               f"restore() them first")
