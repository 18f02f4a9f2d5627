"""`kvfit serve --api-server-count N`: N API server processes in front of one engine process.

One API process spends a GIL on every streamed token (HTTP send, SSE JSON, the async generator
chain, metrics); several share that work. The `kvfit serve` process is API server 0: it starts
the engine (`EngineProcess(num_api_servers=N)`, one pipe per API server) and then the N-1 others
(`ApiServerProcesses`), each attached to the engine over its own pipe (`AttachedEngine`).

They share the port through SO_REUSEPORT: the first process binds one socket per API process
on the same port (all before the engine loads: a port in use fails at once, port 0 works, and
no other process slips into the group between two binds), listens on them once the engine is
up, and hands each its own.
The kernel then spreads new connections over the sockets by a hash of their addresses. One
socket shared by every process would leave the choice to whichever event loop wakes first, and
an asyncio or uvloop server accepts everything queued when it wakes: a burst of connections
(a benchmark's clients starting together) would all land in one process.

The others ignore SIGINT (a Ctrl-C reaches the whole process group: the first process stops
them, with SIGTERM), and exit when their engine pipe closes or the first process dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvfit.engine.config import EngineArgs
    from kvfit.server.openai_api import ServeConfig

from kvfit.server.request_log import show_request_log

logger = logging.getLogger(__name__)

PROMETHEUS_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
"""prometheus_client's multiprocess mode: every API process writes its counts to files in this
folder, and `/metrics` (in whichever process answers it) adds them all up. It must be set before
prometheus_client is imported."""


def bind_sockets(host: str, port: int, count: int,
                 reuse_port: bool = True) -> list[socket.socket]:
    """`count` TCP sockets bound to `host:port` (SO_REUSEPORT unless `reuse_port` is False),
    one per API process; OSError if the port is taken or `host` is no address here. They do
    not listen yet (`listen`): while the engine loads (minutes for a large model) a client or
    health probe is refused at once, as by a server not up, instead of being accepted into
    the backlog and left without an answer until the load ends."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0: the others take the port the first got
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def listen(sockets: list[socket.socket], backlog: int = 2048) -> None:
    """Accept connections on `bind_sockets`' sockets, once the engine is up. OSError when
    another process took the port meanwhile (two bound sockets that do not listen may share
    a port; the first to listen keeps it)."""
    for sock in sockets:
        sock.listen(backlog)


@dataclass
class ApiServerSpec:
    """What an API server process needs besides its pipe and the socket (pickled to it)."""

    engine_args: EngineArgs
    config: ServeConfig
    engine_pid: int | None
    stream_interval: int = 1
    uvicorn_log_level: str = "info"


class ApiServerProcesses:
    """The API server processes 1..N-1: spawned with their engine pipe ends and the listening
    socket; `wait_ready` returns once every one serves; `stop` ends them (SIGTERM, then
    SIGKILL after `stop_timeout_s`)."""

    def __init__(self, conns: list[Connection], sockets: list[socket.socket],
                 spec: ApiServerSpec, stop_timeout_s: float = 30.0) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding threads
        self.stop_timeout_s = stop_timeout_s
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._status: list[Connection] = []
        for index, (conn, sock) in enumerate(zip(conns, sockets, strict=True), start=1):
            status, child_status = ctx.Pipe(duplex=False)
            process = ctx.Process(target=run_api_server, name=f"kvfit-api-server-{index}",
                                  args=(index, conn, sock, spec, child_status), daemon=False)
            process.start()
            # Their ends live in the child only: its exit is the engine's EOF (and ours), and
            # closes its socket, whose connections the kernel then hashes to the others.
            for end in (conn, sock, child_status):
                end.close()
            self.processes.append(process)
            self._status.append(status)
        # Only the watcher reaps (joins) them: two threads waiting on one child would race.
        self._exited = [threading.Event() for _ in self.processes]
        self._admission_counts = spec.config.admission_counts
        self._stopping = False
        threading.Thread(target=self._watch, name="kvfit-api-servers", daemon=True).start()

    def _watch(self) -> None:
        """Reap each process as it exits; say so if it exits before `stop` (the engine has
        aborted its requests; the other processes serve on)."""
        pending = {process.sentinel: i for i, process in enumerate(self.processes)}
        while pending:
            for sentinel in multiprocessing.connection.wait(list(pending)):
                i = pending.pop(sentinel)
                process = self.processes[i]
                process.join()
                if self._admission_counts is not None:
                    # A process that died with requests in progress holds no slot any more.
                    self._admission_counts[i + 1] = 0
                self._exited[i].set()
                if not self._stopping:
                    print(f"kvfit serve: {process.name} exited (exit code {process.exitcode});"
                          f" the other API processes serve on", file=sys.stderr, flush=True)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Wait until each process serves; RuntimeError if one exits first."""
        for i, (process, status) in enumerate(zip(self.processes, self._status, strict=True)):
            try:
                if not status.poll(timeout_s):
                    raise RuntimeError(f"{process.name} did not start in {timeout_s:.0f} s")
                status.recv()
            except EOFError:
                self._exited[i].wait(5)
                raise RuntimeError(f"{process.name} exited (exit code {process.exitcode}) "
                                   f"before it served; its log says why") from None
            finally:
                status.close()

    def begin_stop(self) -> None:
        """SIGTERM every process, once: each stops taking requests and drains as the first
        one does (`uvicorn_server`). The first calls it as its own shutdown begins, so that
        the others neither take new requests through its drain nor start theirs only after
        it. Once only: uvicorn takes a second signal as "exit now", skipping the drain."""
        if self._stopping:
            return
        self._stopping = True
        for process, exited in zip(self.processes, self._exited, strict=True):
            if not exited.is_set():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGTERM)

    def stop(self) -> None:
        """`begin_stop` (uvicorn finishes what it serves), then wait; SIGKILL what is left
        after `stop_timeout_s`. Idempotent."""
        self.begin_stop()
        deadline = time.monotonic() + self.stop_timeout_s
        for process, exited in zip(self.processes, self._exited, strict=True):
            if not exited.wait(max(0.0, deadline - time.monotonic())):
                logger.warning("%s did not stop; killing it", process.name)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGKILL)
                exited.wait(5)


def run_api_server(index: int, conn: Connection, sock: socket.socket, spec: ApiServerSpec,
                   status: Connection) -> None:
    """An API server process's main: attach to the engine, build the app, tell the first
    process it is up, and serve on the shared socket until SIGTERM, the engine's exit or the
    first process's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group
    from kvfit.server.async_llm import AsyncLLM
    from kvfit.server.engine_client import AttachedEngine
    from kvfit.server.openai_api import build_app

    def attach(_: Any, on_outputs: Any, on_dead: Any) -> AttachedEngine:
        return AttachedEngine(conn, on_outputs, on_dead, spec.engine_pid)

    spec.config.api_server_index = index  # its entry of the shared admission counts
    engine = AsyncLLM(spec.engine_args, stream_interval=spec.stream_interval, client=attach)
    died: list[BaseException] = []
    try:
        app = build_app(engine, spec.config)
        server = uvicorn_server(app, spec.uvicorn_log_level, sigterm_only=True)

        def stop(error: BaseException | None = None) -> None:
            if error is not None:
                died.append(error)
            server.should_exit = True  # polled by uvicorn's main loop: a clean exit

        engine.add_dead_callback(stop)
        parent = multiprocessing.parent_process()
        if parent is not None:  # its sentinel turns ready when it exits, however it exits
            threading.Thread(target=lambda: (parent.join(), stop()), name="kvfit-parent",
                             daemon=True).start()
        gc.collect()
        gc.freeze()
        status.send(os.getpid())
        status.close()
        server.run(sockets=[sock])
    finally:
        # Exiting now: a SIGTERM from the first process (stopping everything) must not cut
        # the detach and the last words short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        engine.shutdown()
    if died:
        print(f"kvfit serve: API server {index} exiting, the engine stopped: {died[0]}",
              file=sys.stderr, flush=True)
        sys.exit(1)


SHUTDOWN_CLOSE_S = 5.0
"""How long a stopping server waits, once it has aborted the requests left, for its
connections to close before it drops them: a client that stopped reading its stream, or never
sent the rest of its request, would otherwise keep the process from exiting."""


def uvicorn_server(app: Any, log_level: str, sigterm_only: bool = False,
                   on_shutdown: Callable[[], None] | None = None) -> Any:
    """The uvicorn server of an API server process (`kvfit serve` and each of
    `--api-server-count`); its "auto" takes uvloop and httptools where they are installed.

    Stopped by SIGINT or SIGTERM (SIGTERM only with `sigterm_only`: the first process sends
    it to stop the others), or by `should_exit`, it takes no more connections and answers new
    generation requests with 503, gives those in progress the app's `shutdown_timeout`
    (`--shutdown-timeout`) to finish, aborts what is left, and `SHUTDOWN_CLOSE_S` later drops
    the connections still open, so the process always exits. uvicorn alone would wait for
    every connection to close, however long a client holds one. `on_shutdown` is called as
    the shutdown begins (the first process stops the others with it)."""
    import uvicorn

    serving = app.state.serving
    timeout = app.state.config.shutdown_timeout

    class ApiServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if not sigterm_only:
                with super().capture_signals():
                    yield
                return
            previous = signal.signal(signal.SIGTERM, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(signal.SIGTERM, previous)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            serving.stop_admitting()
            if on_shutdown is not None:
                on_shutdown()
            stopping = asyncio.ensure_future(super().shutdown(sockets))
            for wait_s, then in ((timeout, serving.abort_all),
                                 (SHUTDOWN_CLOSE_S, self.drop_connections)):
                if (await asyncio.wait({stopping}, timeout=wait_s))[0]:
                    break
                then()
            await stopping

        def drop_connections(self) -> None:
            """Close every connection left at once: its request sees the client leave."""
            for connection in list(self.server_state.connections):
                if connection.transport is not None:
                    connection.transport.abort()

    # uvicorn's own bound: should a request ignore its dropped connection, it is cancelled.
    server = ApiServer(uvicorn.Config(app, log_level=log_level,
                                      access_log=not app.state.config.disable_uvicorn_access_log,
                                      timeout_graceful_shutdown=timeout + 2 * SHUTDOWN_CLOSE_S))
    # After the Config, which sets uvicorn's loggers up; one filter a process, the latest's.
    access = logging.getLogger("uvicorn.access")
    for old in [f for f in access.filters if isinstance(f, QuietPaths)]:
        access.removeFilter(old)
    if app.state.config.disable_access_log_for_endpoints:
        access.addFilter(QuietPaths(app.state.config.disable_access_log_for_endpoints))
    if app.state.config.enable_log_requests:
        show_request_log()
    return server


class QuietPaths(logging.Filter):
    """Drops uvicorn's access log lines of requests to `paths` (`--disable-access-log-for-
    endpoints`: a load balancer's /health probes would drown the rest), whatever their query."""

    def __init__(self, paths: list[str]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with query, HTTP version, status).
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].partition("?")[0] not in self.paths
        return True
