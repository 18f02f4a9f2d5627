"""The elastic KV cache's co-tenancy policy: when to give device memory back to other processes
and when to take it again, and what kvfit engines on one device tell each other they lack. The
engine applies it (`kvfit.engine.kv_resize`)."""

from __future__ import annotations

from kvfit.elastic.demand import DemandBoard
from kvfit.elastic.governor import ElasticConfig, KVCacheGovernor, MemoryAmount
from kvfit.elastic.usage import KVUsage

__all__ = ["DemandBoard", "ElasticConfig", "KVCacheGovernor", "KVUsage", "MemoryAmount"]
