"""Fixtures of the server tests: one tiny engine (in its own process, as `kvfit serve` runs
it) and one uvicorn server per module, on a free port of 127.0.0.1, and the same engine
settings for `LLM` references."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

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
