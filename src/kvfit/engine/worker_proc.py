"""A worker in its own process: the far end of the multiprocess executor's pipe.

Messages are pickled tuples: `("rpc", method, args)`, `("launch", n, StepInput, m)` (step n
queued on the device, then step m's output when m is not None: the engine launches step
k + 1 before it reads step k, so one round trip serves both), `("result", n)` (step n's
output; rank 0 sends outputs, the others `None`; older steps whose output the engine dropped
are discarded) and `("shutdown",)`. Every message gets one reply:
`("ok", value)` or `("error", exception | None, traceback text)`.

The process exits when the engine's end of the pipe closes, and within a second of the engine
process dying (a watchdog thread compares the parent pid), so no worker outlives its engine.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvfit.engine.config import EngineConfig

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    """What a spawned worker needs to start: the engine config, its rank in a world of
    `world_size` joined at `init_method`, the engine's pid, and its share of the CPU threads."""

    config: EngineConfig
    rank: int
    world_size: int
    init_method: str
    parent_pid: int
    num_threads: int


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The process's entry point: join the group, create the worker (the reply to the
    executor's implicit `start` call), then serve messages until shutdown or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    threading.Thread(target=_exit_with_parent, args=(spec.parent_pid,), daemon=True).start()
    torch.set_num_threads(spec.num_threads)
    from kvfit.distributed.parallel_state import (
        DistributedInit,
        destroy_distributed,
        init_distributed,
        rank_device,
    )
    from kvfit.engine.executor import create_worker

    try:
        device = rank_device(spec.config.device, spec.rank)
        init_distributed(DistributedInit(spec.rank, spec.world_size, spec.init_method, device))
        worker = create_worker(spec.config, spec.rank, device)
    except BaseException as error:  # noqa: BLE001 - every failure goes back to the engine
        _reply_error(conn, error)
        return
    _reply(conn, ("ok", None))
    try:
        _serve(worker, spec.rank, conn)
    finally:
        destroy_distributed()


def _serve(worker: Any, rank: int, conn: Connection) -> None:
    try:
        _serve_messages(worker, rank, conn)
    except (BrokenPipeError, ConnectionResetError):
        # The engine died while this rank worked on its message: nobody to answer, and a
        # traceback from every rank would bury the engine's own reason in its log.
        return


def _serve_messages(worker: Any, rank: int, conn: Connection) -> None:
    from kvfit.engine.step_input import StepDecoder

    decoder, launched = StepDecoder(), deque()
    while True:
        try:
            payload = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the engine is gone
        try:
            message = pickle.loads(payload)
            kind = message[0]
            if kind == "launch":
                _, step, step_input, wanted = message
                launched.append((step, worker.launch(decoder.decode(step_input))))
                value = None if wanted is None else _output(launched, wanted, rank)
            elif kind == "result":
                value = _output(launched, message[1], rank)
            elif kind == "rpc":
                value = getattr(worker, message[1])(*message[2])
            else:  # shutdown
                worker.shutdown()
                _reply(conn, ("ok", None))
                return
        except BaseException as error:  # noqa: BLE001
            _reply_error(conn, error)
            continue
        _reply(conn, ("ok", value))


def _output(launched: deque, step: int, rank: int) -> Any:
    """Step `step`'s output (waited for; rank 0's only), dropping the steps before it; None
    for a step that is not there (its launch or its output raised: the engine dropped it)."""
    while launched and launched[0][0] < step:
        launched.popleft()
    if not launched or launched[0][0] != step:
        return None
    output = launched.popleft()[1].result()
    return output if rank == 0 else None


def _reply(conn: Connection, reply: tuple) -> None:
    try:
        payload = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as error:  # noqa: BLE001 - an answer that cannot cross is an error
        _reply_error(conn, error)
        return
    conn.send_bytes(payload)


def _reply_error(conn: Connection, error: BaseException) -> None:
    text = "".join(traceback.format_exception(error))
    try:
        payload = pickle.dumps(("error", error, text))
        pickle.loads(payload)  # an exception whose constructor takes other arguments fails here
    except Exception:  # noqa: BLE001
        payload = pickle.dumps(("error", None, text))
    conn.send_bytes(payload)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        time.sleep(PARENT_POLL_S)
        if os.getppid() != parent_pid:
            os._exit(1)  # the engine died: nothing here can be of use
