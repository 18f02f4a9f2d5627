"""Watching Triton compile: a kernel compiled while serving stalls every request for ~1 s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """Collect the names of the Triton kernels compiled inside the block (a variant not in
    Triton's in-memory cache), through `triton.knobs.runtime.jit_post_compile_hook`. Without
    Triton (CPU-only installs) nothing compiles and the list stays empty."""
    compiled: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        yield compiled
        return
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs: object) -> object:
        compiled.append(f"{kwargs['fn'].name}: {kwargs['repr']}")
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = previous
