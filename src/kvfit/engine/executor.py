"""The executor: the engine's one door to its workers, wherever they run.

`create_executor` picks the implementation from `distributed_executor_backend`: `uni` runs the
worker in this process, `mp` one spawned process per tensor-parallel rank
(`mp_executor.MultiprocExecutor`), `external_launcher` is one rank of a torchrun launch
(`external_launcher.ExternalLauncherExecutor`). The engine reduces the answers itself (the
minimum block count, the VMM decision), so it does not know which one it has.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import Any, Protocol

import torch

from kvfit.engine.config import EngineConfig
from kvfit.engine.sequence import ModelOutput, ScheduledBatch
from kvfit.engine.worker import Worker


class ExecutorFailedError(RuntimeError):
    """The workers cannot go on (one died, or one raised while the others were stuck in a
    collective); every worker was stopped, and the engine must be recreated."""


class StepOutput(Protocol):
    """A launched step; `result()` waits for it."""

    def result(self) -> ModelOutput: ...


class Executor(ABC):
    """Runs a callable on every worker and steps them.

    `workers` lists the workers in this process (none for `mp`: they live in theirs).
    """

    workers: list[Worker]

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call `Worker.method(*args)` on every worker; the answers in rank order. A worker's
        exception is raised here, noting its rank."""

    @abstractmethod
    def launch(self, batch: ScheduledBatch) -> StepOutput:
        """Queue one step on every worker without waiting for it; rank 0's output to wait on."""

    def check_workers(self) -> None:  # noqa: B027 - a no-op unless workers have processes
        """Raise `ExecutorFailedError` if a worker's process died, without a call to any
        (an idle server looks for that between requests); a no-op where the workers live in
        this process."""

    def shutdown(self) -> None:
        """Release every worker's model and KV cache (and its process); idempotent."""
        for worker in self.workers:
            worker.shutdown()


class UniProcExecutor(Executor):
    """Runs the workers in this process, one after another (`num_workers` > 1: replicas of
    one rank, which tests use to check the engine's agreement rules)."""

    def __init__(self, config: EngineConfig, num_workers: int = 1) -> None:
        self.workers = [create_worker(config, rank) for rank in range(num_workers)]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(worker, method)(*args) for worker in self.workers]

    def launch(self, batch: ScheduledBatch) -> StepOutput:
        return self.collective_rpc("launch", batch)[0]


def create_executor(config: EngineConfig, num_workers: int = 1) -> Executor:
    """The executor `config.parallel_config.distributed_executor_backend` names."""
    backend = config.parallel_config.distributed_executor_backend
    if backend == "mp":
        from kvfit.engine.mp_executor import MultiprocExecutor

        return MultiprocExecutor(config)
    if backend == "external_launcher":
        from kvfit.engine.external_launcher import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config)
    return UniProcExecutor(config, num_workers)


def create_worker(config: EngineConfig, rank: int, device: torch.device | None = None) -> Worker:
    """Rank `rank`'s worker (on `device` when given), after which the configured
    `worker_init_fn` (`module:function`) is called with it."""
    if device is not None:
        config = replace(config, device=device)
    worker = Worker(config, rank)
    hook = config.parallel_config.worker_init_fn
    if hook:
        module, _, name = hook.partition(":")
        getattr(importlib.import_module(module), name)(worker)
    return worker
