"""How the engine's errors reach a client: which are the request's fault, which the engine's."""

from __future__ import annotations

from kvfit.engine.kv_resize import KVCacheReleasedError
from kvfit.server.async_llm import EngineDeadError, EngineSleepingError, RequestFailedError
from kvfit.server.protocol import APIError

UNAVAILABLE = (EngineDeadError, EngineSleepingError, KVCacheReleasedError)
"""Errors of an engine that cannot serve now: 503, retry later or elsewhere."""
ENGINE_ERRORS = (ValueError, RequestFailedError, *UNAVAILABLE)
"""Every engine error a request can meet (`engine_error` maps each)."""


def engine_error(e: Exception) -> APIError:
    """The API error for engine error `e`: 400 for a refused request (a ValueError), 503 for an
    engine that cannot serve now, 500 for a step that failed on the request."""
    if isinstance(e, ValueError):
        return APIError(str(e))
    if isinstance(e, UNAVAILABLE):
        return APIError(str(e), 503, "service_unavailable")
    return APIError(str(e), 500, "internal_server_error")
