"""KV connectors: the API through which the engine moves KV blocks to and from stores outside
it (`KVConnector`, scheduler and worker sides), the shared-storage connector and the host
memory tier."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from kvfit.connectors.base import (
    BlockTransfer,
    KVConnector,
    KVConnectorMetadata,
    KVLoadError,
    ScheduledSeq,
)
from kvfit.connectors.config import BLOCK_COMPACT_LAYOUTS, CONNECTOR_NAMES, KVConnectorConfig
from kvfit.connectors.host import HostConnector
from kvfit.connectors.shared_storage import SharedStorageConnector
from kvfit.kv.spec import KVCacheSpec

__all__ = [
    "BLOCK_COMPACT_LAYOUTS",
    "CONNECTOR_NAMES",
    "BlockTransfer",
    "HostConnector",
    "KVConnector",
    "KVConnectorConfig",
    "KVConnectorMetadata",
    "KVLoadError",
    "ScheduledSeq",
    "SharedStorageConnector",
    "check_kv_connector",
    "create_kv_connector",
    "kv_connector_host_bytes",
    "kv_connector_one_chunk",
    "model_identity",
]


def model_identity(model: str, load_format: str, dtype: torch.dtype) -> str:
    """What names the weights a store's K/V were computed with: the model folder's real path
    (or the built-in name), whether its weights are the seeded dummy ones, the dtype the model
    runs in (an fp8 cache holds K/V of a bf16 and a float32 model alike), and the size and
    modification time of its config.json and weight files: a checkpoint saved again into the
    same folder (a fine-tune, an RL step) computes other K/V, which the old ones must not
    stand in for."""
    from kvfit.models.loader import is_builtin, resolve_load_format, resolve_model

    load_format = resolve_load_format(model, load_format)
    folder = resolve_model(model).resolve()
    files = [folder / "config.json"]
    if load_format != "dummy":
        files += sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.safetensors.*"))
    stats = [(f.name, st.st_size, st.st_mtime_ns)
             for f in files if (st := _stat(f)) is not None]
    files_id = hashlib.sha256(json.dumps(stats).encode()).hexdigest()[:16]
    name = model if is_builtin(model) else str(folder)
    return f"{name}:{load_format}:{str(dtype).removeprefix('torch.')}:{files_id}"


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


_CONNECTORS: dict[str, type[KVConnector]] = {"shared_storage": SharedStorageConnector,
                                              "host": HostConnector}


def create_kv_connector(config: KVConnectorConfig, role: str, spec: KVCacheSpec,
                        model_id: str) -> KVConnector:
    """The connector `config` names, for `role` ("scheduler" or "worker")."""
    return _CONNECTORS[config.kv_connector](role, config, spec, model_id)


def check_kv_connector(config: KVConnectorConfig, spec: KVCacheSpec) -> None:
    """Raise ValueError naming the setting where the connector `config` names cannot serve a
    cache of `spec` (`KVConnector.check`): known before any model loads."""
    _CONNECTORS[config.kv_connector].check(config, spec)


def kv_connector_host_bytes(config: KVConnectorConfig, spec: KVCacheSpec) -> int:
    """The most host memory the worker side of the connector `config` names allocates for a
    cache of `spec` (`KVConnector.host_buffer_bytes`), known before it is created."""
    return _CONNECTORS[config.kv_connector].host_buffer_bytes(config, spec)


def kv_connector_one_chunk(config: KVConnectorConfig) -> bool:
    """Whether the connector `config` names keeps each cache segment one physical allocation
    (`KVConnector.needs_one_chunk`), known before it is created."""
    return _CONNECTORS[config.kv_connector].needs_one_chunk
