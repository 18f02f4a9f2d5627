"""Fixtures of the server tests: one tiny engine (in its own process, as `kvfit serve` runs
it) and one uvicorn server per module, on a free port of 127.0.0.1, and the same engine
settings for `LLM` references."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")

import uvicorn  # noqa: E402

from kvfit.engine.config import EngineArgs  # noqa: E402
from kvfit.server.async_llm import AsyncLLM  # noqa: E402
from kvfit.server.openai_api import ServeConfig, build_app  # noqa: E402

# `engine_hooks` must import by a plain name in spawned engine processes too (they get this
# process's sys.path when they start).
sys.path.insert(0, str(Path(__file__).parent))

SRC = Path(__file__).resolve().parents[2] / "src"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 128


def in_engine(engine: AsyncLLM, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(llm, *args)` run in the engine (an `engine_hooks` function); its result."""
    return asyncio.run(engine.call_engine(fn, *args))


def engine_kwargs(model: Path) -> dict[str, Any]:
    return dict(model=str(model), device="cpu", max_model_len=MAX_MODEL_LEN,
                num_gpu_blocks_override=256, max_num_batched_tokens=256, max_num_seqs=64)


class ServerThread:
    """A uvicorn server for `app` on a thread, bound to a free port of 127.0.0.1."""

    def __init__(self, app: Any) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class ServeProcess:
    """`kvfit serve kvfit-tiny FLAGS` in a subprocess on a free port, up once /health answers
    (its output is read as it comes: `wait_for_output`, and all of it at `stop`); a fixed
    cache of `num_gpu_blocks` blocks (None: the extensible cache, sized as `kvfit serve`
    sizes it, which can resize)."""

    def __init__(self, *flags: str, env: dict[str, str] | None = None,
                 num_gpu_blocks: int | None = 64) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        code = ("import argparse, sys, torch; torch.set_num_threads(1); "
                "from kvfit.server import serve; root = argparse.ArgumentParser(); "
                "serve.add_serve_parser(root.add_subparsers()); "
                "args = root.parse_args(sys.argv[1:]); sys.exit(args.func(args))")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "kvfit-tiny", "--device", "cpu", "--port",
             str(self.port), "--max-model-len", "128", "--uvicorn-log-level", "warning",
             *([] if num_gpu_blocks is None else ["--num-gpu-blocks-override",
                                                  str(num_gpu_blocks)]), *flags],
            cwd=SRC, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=None if env is None else {**os.environ, **env})
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self.lines.extend, args=(self.proc.stdout,),
                                        daemon=True)
        self._reader.start()
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"the server did not come up:\n{self._output()}")
            try:
                if httpx.get(f"{self.url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)

    def engine_processes(self) -> list[psutil.Process]:
        """The server's spawned children (its engine process)."""
        return [child for child in psutil.Process(self.proc.pid).children()
                if "spawn_main" in " ".join(child.cmdline())]

    def wait_for_output(self, text: str, timeout: float = 60) -> None:
        """Until a line of output holds `text`. With several API processes, /health may
        answer from another before the first has printed its banner."""
        deadline = time.monotonic() + timeout
        while not any(text in line for line in list(self.lines)):
            assert time.monotonic() < deadline, f"no {text!r} in:\n{''.join(self.lines)}"
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60) -> str:
        """Send `sig` unless it has exited; its output once it has."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return self._output()

    def _output(self) -> str:
        """Everything it printed (once it has exited and the reader has drained the pipe)."""
        if self.proc.poll() is not None:
            self._reader.join(timeout=30)
        return "".join(self.lines)


@pytest.fixture(scope="module")
def model_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def start_server(engine: AsyncLLM) -> Iterator[Callable[..., ServerThread]]:
    """Factory: a server over the module's engine with the given `ServeConfig` fields."""
    servers: list[ServerThread] = []

    def start(**config: Any) -> ServerThread:
        config.setdefault("served_model_names", [MODEL_NAME])
        servers.append(ServerThread(build_app(engine, ServeConfig(**config))))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    """The official client on the module's server (no retries: a test sees every error)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http
