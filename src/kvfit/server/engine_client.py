"""Where `AsyncLLM`'s engine core loop runs: `EngineProcess` (its own process, the default)
or `InThreadEngine` (a thread of the front end's process).

In a process the engine steps without sharing a GIL with the HTTP server: in one process every
torch op lets the event loop in, so the engine's steps and the server's HTTP, SSE and text
decoding serialize. The process is spawned and fed over a socket pair (`_Channel`): commands one
way, one pickled `EngineOutputs` per step the other. It ignores SIGINT (the front end stops it)
and exits when the pipe closes, so it never outlives its front end.

With `num_api_servers` N > 1 (`kvfit serve --api-server-count N`) the engine process gets one
pipe per API server process: the first process's `EngineProcess` hands the others' ends over,
each of those attaches with `AttachedEngine`, and `ChannelRouter` splits the outputs by pipe.

Every client takes two callbacks, called from a thread of theirs: `on_outputs(EngineOutputs)`
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
import socket
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
from kvfit.server.engine_router import ChannelRouter

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
            messages = batch[:-1] if end else batch
            try:
                self._channel.send_many(messages)
            except OSError:
                return
            except Exception:
                # A message that does not pickle must not take the others with it, nor stop
                # this thread (every later command would wait forever): the rest go alone.
                for message in messages:
                    try:
                        self._channel.send(message)
                    except OSError:
                        return
                    except Exception:
                        logger.exception("dropped a command that does not pickle: %.200r",
                                         message)
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
            # Stopped as asked: freed here, between two steps, also where `shutdown` stopped
            # waiting (its timeout) while a step ran.
            self._llm.shutdown()
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

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop and free the model and KV cache. `timeout` bounds the wait for the
        loop; the loop frees the model as it stops, between two steps all the same (a thread
        cannot be stopped in one, nor its model freed under a running step)."""
        if self._thread.is_alive():
            self._loop.submit(("stop",))
            self._thread.join(timeout)
        if not self._thread.is_alive():  # the loop died before (else a no-op: it freed it)
            self._llm.shutdown()


class EngineProcess:
    """The engine core loop in a spawned process, fed over a pipe. `__init__` returns once
    the engine is up (raising what its startup raised); a reader thread hands each
    `EngineOutputs` to `on_outputs`, and an engine process that dies (killed, crashed) is
    reported to `on_dead` as an `EngineDeadError` within one read."""

    def __init__(self, engine_args: EngineArgs, on_outputs: OnOutputs, on_dead: OnDead,
                 stop_timeout_s: float = 60.0, num_api_servers: int = 1) -> None:
        if num_api_servers < 1:
            raise ValueError(f"num_api_servers must be >= 1, got {num_api_servers}")
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding threads
        # One pipe per API server; this one's is the first, the others' ends wait in
        # `api_server_conns` until handed to their processes.
        pipes = [ctx.Pipe() for _ in range(num_api_servers)]
        conn, child_conns = pipes[0][0], [child for _, child in pipes]
        self.api_server_conns: list[Connection] = [mine for mine, _ in pipes[1:]]
        self._process = ctx.Process(
            target=run_engine_process, name="kvfit-engine", daemon=False,
            args=(child_conns, engine_args, torch.get_num_threads(), _log_setup()))
        self._process.start()
        for child_conn in child_conns:
            child_conn.close()  # the child's ends live in the child only: its exit is our EOF
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
            # The spawned process imports the script's main module again: one that starts
            # an engine at import (vLLM's fork needs no guard) fails there, before our code.
            raise RuntimeError(f"the engine process exited (exit code "
                               f"{self._process.exitcode}) before it was ready; its log "
                               f"says why. A script that starts the engine must do so under "
                               f"`if __name__ == \"__main__\":`, since the engine process "
                               f"is spawned and runs the script's top level again") from None
        if isinstance(message, EngineStartFailed):
            raise message.error from RuntimeError(f"in the engine process:\n{message.traceback}")
        return message

    def _read(self) -> None:
        error: BaseException | None = None
        failed: EngineStartFailed | None = None  # why the engine stopped, as it said
        try:
            while True:
                for message in self._channel.receive():
                    if isinstance(message, EngineStartFailed):
                        failed = message
                    else:
                        self._on_outputs(message)
        except (EOFError, OSError):
            if not self._stopping:
                self._process.join(timeout=5)
                why = "" if failed is None else f": {type(failed.error).__name__}: {failed.error}"
                error = EngineDeadError(f"the engine process exited (exit code "
                                        f"{self._process.exitcode}){why}")
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
        command = _pickled_call(command)
        try:
            if not self._process.is_alive():
                raise OSError("the engine process exited")
            self._outbox.put(command)
        except OSError as e:  # shut down, or the process died
            raise EngineDeadError("the engine process is gone") from e

    def shutdown(self, timeout: float | None = None) -> None:
        """Ask the engine to stop (it frees its model and cache) and wait for it; terminate
        it after `timeout` seconds (None: `stop_timeout_s`), kill it if that fails.
        Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        atexit.unregister(self.shutdown)
        with contextlib.suppress(EngineDeadError):
            self.send(("stop",))
        stop_timeout_s = self._stop_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + stop_timeout_s  # for the write and the exit both
        self._outbox.close(timeout=stop_timeout_s)
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
        for conn in self.api_server_conns:  # not handed over: close them here
            conn.close()


class AttachedEngine:
    """A client of an engine process that another API process started
    (`EngineProcess(num_api_servers=N)`), over one of its pipes: this process sends its own
    commands and receives only its own requests' outputs, plus the engine-wide state. It
    does not own the engine: `shutdown` detaches (the engine aborts this process's requests
    and serves on); an engine that stops is reported to `on_dead` like `EngineProcess`'s."""

    def __init__(self, conn: Connection, on_outputs: OnOutputs, on_dead: OnDead,
                 engine_pid: int | None = None) -> None:
        self.pid = engine_pid
        self._conn = conn
        self._channel = _Channel(conn)
        self._outbox = _Outbox(self._channel)
        self._stopping = False
        self._outbox.put(("attach",))  # the engine answers with its `EngineReady`
        try:
            message, *self._early = self._channel.receive()  # the early ones: the reader's
        except (EOFError, OSError):
            self._channel.close()
            raise EngineDeadError("the engine process closed the pipe before it "
                                  "attached this API server") from None
        self.ready: EngineReady = message
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._dead = False
        self._reader = threading.Thread(target=self._read, name="kvfit-engine-outputs",
                                        daemon=True)
        self._reader.start()

    def _read(self) -> None:
        error: BaseException | None = None
        try:
            for message in self._early:
                self._on_outputs(message)
            while True:
                for message in self._channel.receive():
                    self._on_outputs(message)
        except (EOFError, OSError):
            if not self._stopping:
                error = EngineDeadError("the engine process closed its pipe (it exited)")
        except BaseException as e:
            logger.exception("reading the engine's outputs failed")
            error = EngineDeadError(f"reading the engine's outputs failed: {e}")
        self._dead = True
        self._on_dead(error)

    def is_alive(self) -> bool:
        return not self._dead

    def send(self, command: tuple[Any, ...]) -> None:
        """Queue a command for the engine (thread-safe, never blocks on the pipe);
        EngineDeadError once detached or the engine is gone."""
        command = _pickled_call(command)
        try:
            if self._dead:
                raise OSError("the engine process exited")
            self._outbox.put(command)
        except OSError as e:
            raise EngineDeadError("the engine process is gone") from e

    def shutdown(self, timeout: float | None = None) -> None:
        """Detach from the engine: send what is queued (for at most `timeout` seconds, None:
        5), then close the pipe (the engine aborts this process's requests). Idempotent."""
        if self._stopping:
            return
        self._stopping = True
        self._outbox.close(timeout=5 if timeout is None else timeout)
        # Shut the socket down rather than only closing it: that wakes the reader blocked
        # on it (a close under a blocked read does not) and is the engine's EOF.
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._conn.fileno())) as s:
            s.shutdown(socket.SHUT_RDWR)
        if self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        self._channel.close()


def _pickled_call(command: tuple[Any, ...]) -> tuple[Any, ...]:
    """A `call` of a function (`AsyncLLM.call_engine`, rare) with the function and its
    arguments pickled here, into bytes that `_run_pickled` unpickles inside the call: one that
    does not pickle (a lambda, a local function) raises to its caller, and one that does not
    unpickle in the engine process (its module not importable there) fails only itself. In
    the pipe, either error would stop a thread that every later command needs."""
    if command[0] != "call" or isinstance(command[2], str):
        return command
    _, call_id, fn, args = command
    try:
        payload = pickle.dumps((fn, args), _PROTOCOL)
    except Exception as e:
        raise TypeError(f"a call to the engine process must pickle (a module-level function, "
                        f"arguments that pickle): {type(e).__name__}: {e}") from e
    return "call", call_id, _run_pickled, (payload,)


def _run_pickled(llm: LLM, payload: bytes) -> Any:
    fn, args = pickle.loads(payload)
    return fn(llm, *args)


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


def run_engine_process(conns: list[Connection], engine_args: EngineArgs, num_threads: int,
                       log_setup: tuple[int, str | None]) -> None:
    """The engine process's main: start the `LLM`, send `EngineReady`, then run the core loop
    until told to stop or the front end's end of the pipe closes. With several pipes (one per
    API server) a `ChannelRouter` shares the engine between them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group
    torch.set_num_threads(num_threads)
    level, fmt = log_setup
    if fmt is not None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
        logging.getLogger("kvfit").addHandler(handler)
    logging.getLogger("kvfit").setLevel(level)

    channels = [_Channel(conn) for conn in conns]
    try:
        llm = LLM(**dataclasses.asdict(engine_args))
    except BaseException as e:
        channels[0].send(EngineStartFailed(portable(e), traceback.format_exc()))
        return
    try:
        if len(channels) > 1:
            _run_routed(llm, channels)
            return
        channel = channels[0]
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
    except Exception as e:
        # Tell the front end why (its workers died, ...): it only sees the exit code else.
        with contextlib.suppress(OSError):
            channels[0].send(EngineStartFailed(portable(e), traceback.format_exc()))
        raise
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


def _run_routed(llm: LLM, channels: list[_Channel]) -> None:
    """The core loop for several API servers: one command reader per channel, every output
    split by `ChannelRouter`. A channel whose API process is gone is detached (its requests
    aborted); the engine serves the others, and stops when every channel has closed."""
    router = ChannelRouter(len(channels), llm.engine.stats(), llm.engine.is_sleeping)

    def send(outputs: EngineOutputs) -> None:
        for i, message in router.route(outputs):
            with contextlib.suppress(OSError):  # its API process is gone: its reader detaches it
                channels[i].send(message)

    loop = EngineCoreLoop(llm, send)
    gc.collect()
    gc.freeze()
    channels[0].send(loop.ready())
    for i in range(len(channels)):
        threading.Thread(target=_route_commands, args=(channels, i, router, loop),
                         name=f"kvfit-commands-{i}", daemon=True).start()
    loop.run()


def _route_commands(channels: list[_Channel], index: int, router: ChannelRouter,
                    loop: EngineCoreLoop) -> None:
    """Read channel `index`'s commands into the loop's queue through `router`; detach the
    channel once it closes (or its API process asks to stop)."""
    channel = channels[index]
    try:
        while True:
            for command in channel.receive():
                if command[0] == "attach":
                    # Ready first, live second: nothing reaches the channel ahead of it.
                    channel.send(loop.ready())
                    router.attach(index)
                    continue
                if command[0] == "stop" and index != 0:
                    raise EOFError("the API server detached")
                engine_command, reply = router.command(index, command)
                if reply is not None:
                    channel.send(reply)
                if engine_command is not None:
                    loop.submit(engine_command)
                    if engine_command[0] == "stop":
                        return
    except (EOFError, OSError):
        pass
    except Exception:  # a malformed command: this channel is lost, the others go on
        logger.exception("reading API server %d's commands failed; detaching it", index)
    for command in router.detach(index):
        loop.submit(command)
    channel.close()
