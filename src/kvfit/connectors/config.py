"""`KVConnectorConfig`: which connector the engine uses and where its store lives."""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

CONNECTOR_NAMES = ("shared_storage", "host")
"""Connectors `--kv-connector` accepts."""

BLOCK_COMPACT_LAYOUTS = ("block_outer", "layer_outer")
"""KV layouts with at most one segment per layer: what a connector can register."""


@dataclass(frozen=True)
class KVConnectorConfig:
    """`kv_connector` (a name from `CONNECTOR_NAMES`) and its store: a directory
    (`shared_storage`) or `kv_offloading_bytes` of host memory (`host`)."""

    kv_connector: str
    kv_connector_path: str | None = None
    kv_offloading_bytes: int = 0

    @staticmethod
    def create(kv_connector: str | None, kv_connector_path: str | None,
               kv_cache_layout: str,
               kv_offloading_size: float | None = None) -> KVConnectorConfig | None:
        """Validate the settings (None when no connector is asked for); each error names the
        setting to change. `kv_offloading_size` (GiB of host memory, vLLM's setting) alone
        asks for the `host` connector. The store directory is created if missing and must be
        writable."""
        if kv_connector is None and kv_offloading_size is not None:
            kv_connector = "host"
        if kv_connector is None:
            if kv_connector_path is not None:
                raise ValueError("kv_connector_path is set but kv_connector is not; pass "
                                 "kv_connector='shared_storage' or drop kv_connector_path")
            return None
        if kv_connector not in CONNECTOR_NAMES:
            raise ValueError(f"kv_connector must be one of {', '.join(CONNECTOR_NAMES)}; got "
                             f"{kv_connector!r}")
        if kv_cache_layout not in BLOCK_COMPACT_LAYOUTS:
            raise ValueError(f"kv_cache_layout={kv_cache_layout!r} splits each layer into "
                             f"several segments, which a KV connector cannot register; use "
                             f"kv_cache_layout in {BLOCK_COMPACT_LAYOUTS} or drop kv_connector")
        if kv_connector == "host":
            return KVConnectorConfig(kv_connector, kv_offloading_bytes=_offloading_bytes(
                kv_offloading_size, kv_connector_path))
        if kv_offloading_size is not None:
            raise ValueError(f"kv_offloading_size keeps blocks in host memory (the 'host' "
                             f"connector), not with kv_connector={kv_connector!r}; drop one")
        if not kv_connector_path:
            raise ValueError(f"kv_connector={kv_connector!r} stores blocks in a directory; "
                             f"set kv_connector_path")
        path = Path(kv_connector_path).expanduser().resolve()
        _check_writable(path)
        return KVConnectorConfig(kv_connector, str(path))


def _offloading_bytes(kv_offloading_size: float | None, kv_connector_path: str | None) -> int:
    if kv_connector_path is not None:
        raise ValueError("kv_connector='host' keeps blocks in host memory, not in a directory; "
                         "drop kv_connector_path")
    if kv_offloading_size is None:
        raise ValueError("kv_connector='host' needs the host memory it may take; set "
                         "kv_offloading_size (GiB)")
    if not (math.isfinite(kv_offloading_size) and kv_offloading_size > 0):
        raise ValueError(f"kv_offloading_size must be a positive number of GiB, got "
                         f"{kv_offloading_size!r}")
    return int(kv_offloading_size * (1 << 30))


def _check_writable(path: Path) -> None:
    """Create `path` if needed and write (then remove) a file in it, so an unusable store fails
    at startup rather than on the first save."""
    probe = path / f".kvfit-write-probe-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"kv_connector_path {str(path)!r} is not a writable directory "
                         f"({e.strerror or e}); pass a writable kv_connector_path") from None
