"""The executor: the engine's one door to its workers."""

from __future__ import annotations

from typing import Any

from kvfit.engine.async_output import AsyncModelOutput
from kvfit.engine.config import EngineConfig
from kvfit.engine.sequence import ScheduledBatch
from kvfit.engine.worker import Worker


class Executor:
    """Runs every worker in this process, one after another.

    The engine only ever talks to workers through `collective_rpc`, and reduces the answers
    itself (e.g. the minimum block count), so a multi-process executor can replace this one
    without touching the engine.
    """

    def __init__(self, config: EngineConfig, num_workers: int = 1) -> None:
        self.workers = [Worker(config, rank) for rank in range(num_workers)]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `method(*args)` on every worker; the answers in rank order."""
        return [getattr(worker, method)(*args) for worker in self.workers]

    def launch(self, batch: ScheduledBatch) -> AsyncModelOutput:
        """Queue one step on every worker without waiting; rank 0's output to wait on (rank 0
        holds the sampled output: a single device, for now)."""
        return self.collective_rpc("launch", batch)[0]
