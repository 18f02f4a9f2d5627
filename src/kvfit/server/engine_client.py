"""Where `AsyncLLM`'s engine core loop runs: `EngineProcess` (its own process, the default)
or `InThreadEngine` (a thread of the front end's process).

In a process the engine steps without sharing a GIL with the HTTP server: in one process every
torch op lets the event loop in, so the engine's steps and the server's HTTP, SSE and text
decoding serialize. The process is spawned and fed over a socket pair (`_Channel`): commands one
way, one pickled `EngineOutputs` per step the other. It ignores SIGINT (the front end stops it)
and exits when the pipe closes, so it never outlives its front end.

Both clients take two callbacks, called from a thread of theirs: `on_outputs(EngineOutputs)`
and, once, `on_dead(error)` when the engine stops (`error` None for `shutdown`).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import gc
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvfit.engine.config import EngineArgs
from kvfit.engine.llm import LLM
from kvfit.server.engine_core_loop import EngineCoreLoop
from kvfit.server.engine_messages import (
    EngineDeadError,
    EngineOutputs,
    EngineReady,
    EngineStartFailed,
    portable,
)

logger = logging.getLogger(__name__)

OnOutputs = Callable[[EngineOutputs], None]
OnDead = Callable[[BaseException | None], None]
_PROTOCOL = pickle.HIGHEST_PROTOCOL


class _Channel:
    """Pickled messages over one end of a `multiprocessing.Pipe` (a socket pair), each framed
    by its 8-byte length.

    `receive` returns every message that has arrived, read with one `os.read`: a reader thread
    competing for the GIL with a busy event loop waits up to a switch interval (5 ms) after each
    syscall, so reading one message per syscall (as `Connection.recv_bytes` does, two syscalls
    per message) would fall behind an engine stepping every few milliseconds, fill the pipe and
    stall the engine's sends. `send` is thread-safe.
    """

    _READ_BYTES = 1 << 20

    def __init__(self, conn: Connection) -> None:
        self._conn, self._fd = conn, conn.fileno()
        self._buffer = bytearray()
        self._send_lock = threading.Lock()
        self._closed = False

    def send(self, message: Any) -> None:
        """OSError once closed (never a write to a descriptor number reused since)."""
        self.send_many([message])

    def send_many(self, messages: list[Any]) -> None:
        """`send` each of `messages`, in order, in one write: a socket charges every write
        its own buffer overhead, so hundreds of small ones fill it long before their bytes
        would."""
        frames = []
        for message in messages:
            data = pickle.dumps(message, _PROTOCOL)
            frames += (len(data).to_bytes(8, "little"), data)
        view = memoryview(b"".join(frames))
        with self._send_lock:
            if self._closed:
                raise OSError("the channel is closed")
            while view:
                view = view[os.write(self._fd, view):]

    def close(self) -> None:
        with self._send_lock:
            self._closed = True
            self._conn.close()

    def receive(self) -> list[Any]:
        """Every whole message that has arrived (at least one, blocking until then); EOFError
        once the other end is closed."""
        while not (messages := self._parse()):
            chunk = os.read(self._fd, self._READ_BYTES)
            if not chunk:
                raise EOFError("the other end of the channel is closed")
            self._buffer += chunk
        return messages

    def _parse(self) -> list[Any]:
        messages, pos, buffer = [], 0, self._buffer
        while len(buffer) - pos >= 8:
            size = int.from_bytes(buffer[pos:pos + 8], "little")
            if len(buffer) - pos - 8 < size:
                break
            messages.append(pickle.loads(buffer[pos + 8:pos + 8 + size]))
            pos += 8 + size
        del buffer[:pos]
        return messages


class _Outbox:
    """Sends a channel's messages from a thread of its own, so a caller on the event loop never
    blocks on a full pipe while the engine is busy stepping; whatever queued up meanwhile goes
    out in one write (`send_many`), in order. After a failed write the rest is dropped: the
    reader sees the peer's end close and reports the engine dead."""

    def __init__(self, channel: _Channel) -> None:
        self._channel = channel
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvfit-engine-commands",
                                        daemon=True)
        self._thread.start()

    def put(self, message: Any) -> None:
        """Queue `message` (thread-safe, never blocks); OSError once closed."""
        if self._closed:
            raise OSError("the channel is closed")
        self._queue.put(message)

    def close(self, timeout: float | None = None) -> None:
        """Send what is queued, then stop the thread (waiting at most `timeout`)."""
        if not self._closed:
            self._closed = True
            self._queue.put(_OUTBOX_END)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while batch[-1] is not _OUTBOX_END:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            end = batch[-1] is _OUTBOX_END
            try:
                self._channel.send_many(batch[:-1] if end else batch)
            except OSError:
                return
            if end:
                return


_OUTBOX_END = object()


class InThreadEngine:
    """The engine core loop on a thread of this process (tests, debugging)."""

    pid: int | None = None

    def __init__(self, engine_args: EngineArgs, on_outputs: OnOutputs,
                 on_dead: OnDead) -> None:
        self._llm = LLM(**dataclasses.asdict(engine_args))
        self._loop = EngineCoreLoop(self._llm, on_outputs)
        self.ready = self._loop.ready()
        self._on_dead = on_dead
        self._thread = threading.Thread(target=self._run, name="kvfit-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        error = None
        try:
            self._loop.run()
        except BaseException as e:
            logger.exception("the engine thread stopped")
            error = EngineDeadError(f"the engine thread stopped: {e}")
        finally:
            self._on_dead(error)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def send(self, command: tuple[Any, ...]) -> None:
        """Queue a command (thread-safe); EngineDeadError once the loop has stopped."""
        if not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        self._loop.submit(command)

    def shutdown(self) -> None:
        """Stop the loop and free the model and KV cache."""
        if self._thread.is_alive():
            self._loop.submit(("stop",))
            self._thread.join()
        self._llm.shutdown()


class EngineProcess:
    """The engine core loop in a spawned process, fed over a pipe. `__init__` returns once
    the engine is up (raising what its startup raised); a reader thread hands each
    `EngineOutputs` to `on_outputs`, and an engine process that dies (killed, crashed) is
    reported to `on_dead` as an `EngineDeadError` within one read."""

    def __init__(self, engine_args: EngineArgs, on_outputs: OnOutputs, on_dead: OnDead,
                 stop_timeout_s: float = 60.0) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding threads
        conn, child_conn = ctx.Pipe()
        self._process = ctx.Process(
            target=run_engine_process, name="kvfit-engine", daemon=False,
            args=(child_conn, engine_args, torch.get_num_threads(), _log_setup()))
        self._process.start()
        child_conn.close()  # the child's end lives in the child only: its exit is our EOF
        self._channel = _Channel(conn)
        self._outbox = _Outbox(self._channel)
        self.pid: int | None = self._process.pid
        self._stop_timeout_s = stop_timeout_s
        self._stopping = False
        # Runs before multiprocessing's own exit hook (which would wait for the child).
        atexit.register(self.shutdown)
        try:
            self.ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._reader = threading.Thread(target=self._read, name="kvfit-engine-outputs",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineReady:
        try:
            message, *_ = self._channel.receive()  # nothing follows it unasked
        except (EOFError, OSError):
            self._process.join(timeout=5)
            raise RuntimeError(f"the engine process exited (exit code "
                               f"{self._process.exitcode}) before it was ready; its log "
                               f"says why") from None
        if isinstance(message, EngineStartFailed):
            raise message.error from RuntimeError(f"in the engine process:\n{message.traceback}")
        return message

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            while True:
                for message in self._channel.receive():
                    self._on_outputs(message)
        except (EOFError, OSError):
            if not self._stopping:
                self._process.join(timeout=5)
                error = EngineDeadError(f"the engine process exited (exit code "
                                        f"{self._process.exitcode})")
        except BaseException as e:
            logger.exception("reading the engine's outputs failed")
            error = EngineDeadError(f"reading the engine's outputs failed: {e}")
            self._process.kill()  # it can no longer be heard: it must not run on
        self._on_dead(error)

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def send(self, command: tuple[Any, ...]) -> None:
        """Queue a command for the engine (thread-safe, never blocks on the pipe);
        EngineDeadError once the process is gone or shut down."""
        try:
            if not self._process.is_alive():
                raise OSError("the engine process exited")
            self._outbox.put(command)
        except OSError as e:  # shut down, or the process died
            raise EngineDeadError("the engine process is gone") from e

    def shutdown(self) -> None:
        """Ask the engine to stop (it frees its model and cache) and wait for it; terminate
        it after `stop_timeout_s`, kill it if that fails. Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        with contextlib.suppress(EngineDeadError):
            self.send(("stop",))
        deadline = time.monotonic() + self._stop_timeout_s  # for the write and the exit both
        self._outbox.close(timeout=self._stop_timeout_s)
        self._process.join(timeout=max(0.0, deadline - time.monotonic()))
        for end in (self._process.terminate, self._process.kill):
            if self._process.exitcode is not None:
                break
            logger.warning("the engine process did not stop; %s", end.__name__)
            end()
            self._process.join(timeout=5)
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(timeout=5)
        self._channel.close()


def _log_setup() -> tuple[int, str | None]:
    """The level of the `kvfit` logger here and its first handler's format (None: no
    handler), for the engine process to log its startup stages the same way."""
    kvfit_logger = logging.getLogger("kvfit")
    handler = next(iter(kvfit_logger.handlers), None)
    fmt = None
    if handler is not None and handler.formatter is not None:
        fmt = handler.formatter._fmt
    elif handler is not None:
        fmt = "%(message)s"
    return kvfit_logger.level, fmt


def run_engine_process(conn: Connection, engine_args: EngineArgs, num_threads: int,
                       log_setup: tuple[int, str | None]) -> None:
    """The engine process's main: start the `LLM`, send `EngineReady`, then run the core loop
    until told to stop or the front end's end of the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group
    torch.set_num_threads(num_threads)
    level, fmt = log_setup
    if fmt is not None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        logging.getLogger("kvfit").addHandler(handler)
    logging.getLogger("kvfit").setLevel(level)

    channel = _Channel(conn)
    try:
        llm = LLM(**dataclasses.asdict(engine_args))
    except BaseException as e:
        channel.send(EngineStartFailed(portable(e), traceback.format_exc()))
        return
    try:
        loop = EngineCoreLoop(llm, channel.send)
        # Startup's objects live as long as the engine: keep the collector off them.
        gc.collect()
        gc.freeze()
        channel.send(loop.ready())
        threading.Thread(target=_forward_commands, args=(channel, loop), name="kvfit-commands",
                         daemon=True).start()
        loop.run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the front end is gone: nobody to serve
    finally:
        llm.shutdown()


def _forward_commands(channel: _Channel, loop: EngineCoreLoop) -> None:
    """Read commands into the loop's queue as they come (so a front end never blocks on a
    full pipe while a step runs); a closed pipe stops the loop."""
    try:
        while True:
            for command in channel.receive():
                loop.submit(command)
                if command[0] == "stop":
                    return
    except (EOFError, OSError):
        loop.submit(("stop",))
