"""`KVConnectorConfig`: which connector the engine uses and where its store lives."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

CONNECTOR_NAMES = ("shared_storage",)
"""Connectors `--kv-connector` accepts."""

BLOCK_COMPACT_LAYOUTS = ("block_outer", "layer_outer")
"""KV layouts with at most one segment per layer: what a connector can register."""


@dataclass(frozen=True)
class KVConnectorConfig:
    """`kv_connector` (a name from `CONNECTOR_NAMES`) and its store directory."""

    kv_connector: str
    kv_connector_path: str

    @staticmethod
    def create(kv_connector: str | None, kv_connector_path: str | None,
               kv_cache_layout: str) -> KVConnectorConfig | None:
        """Validate the settings (None when no connector is asked for); each error names the
        setting to change. The store directory is created if missing and must be writable."""
        if kv_connector is None:
            if kv_connector_path is not None:
                raise ValueError("kv_connector_path is set but kv_connector is not; pass "
                                 "kv_connector='shared_storage' or drop kv_connector_path")
            return None
        if kv_connector not in CONNECTOR_NAMES:
            raise ValueError(f"kv_connector must be one of {', '.join(CONNECTOR_NAMES)}; got "
                             f"{kv_connector!r}")
        if not kv_connector_path:
            raise ValueError(f"kv_connector={kv_connector!r} stores blocks in a directory; "
                             f"set kv_connector_path")
        if kv_cache_layout not in BLOCK_COMPACT_LAYOUTS:
            raise ValueError(f"kv_cache_layout={kv_cache_layout!r} splits each layer into "
                             f"several segments, which a KV connector cannot register; use "
                             f"kv_cache_layout in {BLOCK_COMPACT_LAYOUTS} or drop kv_connector")
        path = Path(kv_connector_path).expanduser().resolve()
        _check_writable(path)
        return KVConnectorConfig(kv_connector, str(path))


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
