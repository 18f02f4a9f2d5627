"""The batch-invariant (deterministic) mode switch that the model and the sampler read.

A context variable, not a global: the model runner turns it on around each step it launches
and each CUDA graph it captures, so two engines in one process (one in the mode, one not) each
run their own kernels, and a graph replays the kernels that were chosen when it was captured.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_ENABLED: ContextVar[bool] = ContextVar("kvfit_batch_invariant", default=False)


def is_batch_invariant() -> bool:
    """Whether the ops called now must reduce in an order independent of the batch."""
    return _ENABLED.get()


@contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """Run the block with the mode on (or off); the previous state comes back on exit."""
    token = _ENABLED.set(enabled)
    try:
        yield
    finally:
        _ENABLED.reset(token)
