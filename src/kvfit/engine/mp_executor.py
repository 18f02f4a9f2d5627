"""The multiprocess executor: one spawned process per tensor-parallel rank, driven over pipes.

Each call is pickled once and the same bytes are written to every rank's pipe; a step crosses
as a `StepInput` (what changed since the last step), not as whole sequences. The engine waits
for every rank's reply and for the processes' sentinels at once, so:

- an exception in a worker is raised in the engine with its type, the rank, and the worker's
  traceback as its cause; the executor stays usable when every rank answered;
- when one rank raised and another has not answered `ERROR_GRACE_S` later (it waits in a
  collective for the failed one), or a worker process dies, every worker is stopped and
  `ExecutorFailedError` says which rank and why: no hang, no orphan. Workers also exit by
  themselves when the engine process dies (`worker_proc`).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from kvfit.engine.config import EngineConfig
from kvfit.engine.executor import Executor, ExecutorFailedError, StepOutput
from kvfit.engine.sequence import ModelOutput, ScheduledBatch
from kvfit.engine.step_input import StepEncoder
from kvfit.engine.worker_proc import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

ERROR_GRACE_S = 5.0
"""How long the other ranks may take to answer after one raised before they count as stuck."""
STOP_TIMEOUT_S = 5.0
"""How long a worker may take to exit after shutdown before it is killed."""


class RemoteTraceback(Exception):
    """A worker's traceback, as the cause of the exception re-raised in the engine."""

    def __str__(self) -> str:
        return str(self.args[0])


class MultiprocExecutor(Executor):
    """`tensor_parallel_size` worker processes (spawned, never forked: CUDA and threads do not
    survive a fork), rank r on the device r places past the configured one."""

    def __init__(self, config: EngineConfig) -> None:
        self.workers = []
        self.world_size = config.parallel_config.tensor_parallel_size
        self._encoder = StepEncoder()
        self._num_launched = 0
        self._unread: int | None = None  # the last launched step whose output is not read
        self._read: dict[int, ModelOutput] = {}  # outputs that came with a later launch
        self._failure: ExecutorFailedError | None = None
        context = multiprocessing.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        threads = max(1, torch.get_num_threads() // self.world_size)
        self._conns: list[Connection] = []
        self._procs: list[multiprocessing.Process] = []
        for rank in range(self.world_size):
            ours, theirs = context.Pipe()
            spec = WorkerSpec(config, rank, self.world_size, init_method, os.getpid(), threads)
            proc = context.Process(target=worker_main, args=(spec, theirs), daemon=True,
                                   name=f"kvfit-worker-{rank}")
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        # Workers stop with this object even when nobody calls shutdown.
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns)
        try:
            self._gather("start")
        except BaseException:
            # No shutdown call: a worker that failed to start has exited already (it would
            # read as a second failure); the others exit as their pipes close.
            self._finalizer()
            raise

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self._call(method, ("rpc", method, args))

    def launch(self, batch: ScheduledBatch) -> StepOutput:
        """Queue the step on every rank; the reply also brings the output of the step before
        it, if nobody asked for it yet (the engine reads it right after this launch)."""
        self._num_launched += 1
        step, wanted = self._num_launched, self._unread
        output = self._call("launch", ("launch", step, self._encoder.encode(batch), wanted))[0]
        self._unread = step  # (not when the launch raised: the step before is still unread)
        if wanted is not None:
            self._read[wanted] = output
        return _LaunchedStep(self, step)

    def result(self, step: int) -> ModelOutput:
        """Launched step `step`'s output (rank 0's); workers drop the steps before it."""
        if self._unread is not None and self._unread <= step:
            self._unread = None
        if step in self._read:
            output = self._read.pop(step)
            self._read.clear()  # older ones were dropped by the engine
            return output
        return self._call("the step's output", ("result", step))[0]

    def check_workers(self) -> None:
        if self._failure is not None:
            raise self._failure
        for rank, proc in enumerate(self._procs):
            if self._finalizer.alive and not proc.is_alive():
                raise self._fail(self._death(rank, "a request"))

    def shutdown(self) -> None:
        alive = all(proc.is_alive() for proc in self._procs)
        if self._finalizer.alive and self._failure is None and alive:
            try:
                self._call("shutdown", ("shutdown",))
            except Exception:  # noqa: BLE001 - stopping anyway
                logger.exception("worker shutdown failed; stopping the worker processes")
        self._finalizer()

    # -- the channel --------------------------------------------------------------------------

    def _call(self, what: str, message: tuple) -> list[Any]:
        if self._failure is not None:
            raise ExecutorFailedError(f"the workers stopped earlier: {self._failure}")
        if not self._finalizer.alive:
            raise ExecutorFailedError("the executor was shut down")
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self._conns:
                conn.send_bytes(payload)
        except OSError as error:  # a worker's pipe closed: it died
            self._gather(what)  # finds which one, and fails
            raise self._fail(f"a worker's pipe closed ({error})") from error
        return self._gather(what)

    def _gather(self, what: str) -> list[Any]:
        """Every rank's reply to `what`, in rank order; raises as the module docstring says."""
        replies: dict[int, Any] = {}
        errors: dict[int, tuple[BaseException | None, str]] = {}
        waiting = dict(enumerate(self._conns))
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        deadline = None
        try:
            while waiting:
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = wait([*waiting.values(), *(s for s, r in sentinels.items()
                                                   if r in waiting)], timeout)
                if not ready:
                    break  # the grace after an error is over
                for rank, conn in list(waiting.items()):
                    if conn in ready or conn.poll():
                        try:
                            status, *value = pickle.loads(conn.recv_bytes())
                        except (EOFError, OSError) as error:  # it closed its end: it died
                            self._procs[rank].join(1.0)
                            raise self._fail(self._death(rank, what)) from error
                        del waiting[rank]
                        if status == "ok":
                            replies[rank] = value[0]
                        else:
                            errors[rank] = (value[0], value[1])
                            deadline = deadline or time.monotonic() + ERROR_GRACE_S
                for sentinel in ready:
                    rank = sentinels.get(sentinel)
                    if rank in waiting:
                        raise self._fail(self._death(rank, what))
        except KeyboardInterrupt:
            self._fail("interrupted while waiting for the workers")
            raise
        if errors:
            self._raise(errors, sorted(waiting), what)
        return [replies[rank] for rank in range(self.world_size)]

    def _raise(self, errors: dict[int, tuple[BaseException | None, str]],
               stuck: list[int], what: str) -> None:
        rank = min(errors)
        error, text = errors[rank]
        where = f"worker rank {rank} raised in {what}"
        if stuck:
            failure = self._fail(f"{where}, and ranks {stuck} did not answer within "
                                 f"{ERROR_GRACE_S:.0f} s (waiting on it in a collective); "
                                 f"the worker's error:\n{text}")
            raise failure
        if error is None:
            raise RuntimeError(f"{where}:\n{text}")
        error.add_note(f"(in {where}; the worker's traceback is the cause above)")
        raise error from RemoteTraceback(text)

    def _death(self, rank: int, what: str) -> str:
        proc = self._procs[rank]
        proc.join(0.1)
        code = proc.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}" if code is not None else "closed its pipe")
        return (f"worker rank {rank} (pid {proc.pid}) {how} while the engine waited for {what}; "
                f"see its output above for the cause (the host's OOM killer leaves a line in "
                f"dmesg)")

    def _fail(self, message: str) -> ExecutorFailedError:
        """Stop every worker; the error to raise (and to raise again on any later call)."""
        self._failure = ExecutorFailedError(f"{message}. Every worker was stopped; the engine "
                                            f"cannot continue and must be created again.")
        for proc in self._procs:  # no grace: one may be stuck in a collective
            if proc.is_alive():
                proc.terminate()
        self._finalizer()
        return self._failure


class _LaunchedStep:
    def __init__(self, executor: MultiprocExecutor, step: int) -> None:
        self._executor, self._step = executor, step

    def result(self) -> ModelOutput:
        return self._executor.result(self._step)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list[multiprocessing.Process], conns: list[Connection]) -> None:
    """Close the pipes (a waiting worker exits on EOF), then terminate and kill what lingers."""
    for conn in conns:
        conn.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
