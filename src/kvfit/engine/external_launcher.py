"""The external-launcher executor: this process is one rank of a `torchrun` launch.

Every rank runs the whole engine (same requests, same schedule, identical sampled tokens, so
their schedulers never diverge) over its one local worker. There is no engine process to take
the minimum over workers, so each collective call is answered by every rank: the answers are
exchanged over the gloo group and the engine reduces them exactly as it does for `mp`
(minimum block counts, one VMM decision). An exception on one rank is raised on every rank,
so none waits in a later collective for one that dropped out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvfit.distributed import all_gather_object, destroy_distributed, init_from_env
from kvfit.engine.config import EngineConfig
from kvfit.engine.executor import Executor, StepOutput, create_worker
from kvfit.engine.sequence import ScheduledBatch


class ExternalLauncherExecutor(Executor):
    """One worker, on the device LOCAL_RANK places past the configured one."""

    def __init__(self, config: EngineConfig) -> None:
        init = init_from_env(config.parallel_config.tensor_parallel_size, config.device)
        self.rank = init.rank
        self.workers = [self._agreed(create_worker, config, init.rank, init.device)]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return all_gather_object(self._agreed(getattr(self.workers[0], method), *args))

    def _agreed(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` here, once every rank's call returned; when one raised, every rank
        raises (the one that did, its own exception)."""
        try:
            value, failure = fn(*args), None
        except Exception as error:  # noqa: BLE001 - the other ranks must hear of it
            value, failure = error, f"{type(error).__name__}: {error}"
        failures = [(rank, f) for rank, f in enumerate(all_gather_object(failure)) if f]
        if not failures:
            return value
        if failure is not None:
            raise value
        rank, what = failures[0]
        raise RuntimeError(f"rank {rank} raised: {what}")

    def launch(self, batch: ScheduledBatch) -> StepOutput:
        return self.workers[0].launch(batch)

    def shutdown(self) -> None:
        super().shutdown()
        destroy_distributed()
