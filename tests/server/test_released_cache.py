"""A KV cache that a failed resize released (a KV connector's one-chunk cache whose recommit
found no memory for even one sequence): `/health` answers 503 so a load balancer routes
elsewhere, a request sent meanwhile waits rather than fails, and once the device has the
memory again the engine backs the cache by itself: the request completes with the same text
and `/health` is 200 again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.engine.kv_resize import KVCacheResizeError
from kvfit.engine.llm import LLM
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.openai_api import ServeConfig, build_app
from kvfit.vmm import VmmOutOfMemoryError

from .conftest import MODEL_NAME, ServerThread, engine_kwargs, in_engine

COMPLETION = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}
DEADLINE_S = 30.0


def _reservation(llm: LLM) -> Any:
    return llm.engine.executor.workers[0].runner.kv_cache.tensor._reservation


def release_cache(llm: LLM) -> None:
    """Refuse every physical allocation, then resize: the recommit releases the cache."""
    reservation = _reservation(llm)
    reservation.real_create = reservation.create

    def refuse(size: int) -> Any:
        raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")

    reservation.create = refuse
    llm.engine.released_retry_s = 0.2
    with pytest.raises(KVCacheResizeError, match="released"):
        llm.resize_kv_cache(llm.engine.scheduler.block_manager.num_blocks // 2)


def give_memory_back(llm: LLM) -> None:
    reservation = _reservation(llm)
    reservation.create = reservation.real_create


@pytest.fixture
def engine(model_path: Path, tmp_path: Path) -> Iterator[AsyncLLM]:
    kwargs = engine_kwargs(model_path)
    del kwargs["num_gpu_blocks_override"]  # a fixed-size cache cannot resize
    engine = AsyncLLM(EngineArgs(**kwargs, kv_connector="shared_storage",
                                 kv_connector_path=str(tmp_path)), engine_process=False)
    yield engine
    engine.shutdown()


def _wait_for(http: httpx.Client, status: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while http.get("/health").status_code != status:
        assert time.monotonic() < deadline, f"/health never answered {status}"
        time.sleep(0.05)


def test_health_is_503_while_a_failure_released_the_cache_and_requests_wait(
        engine: AsyncLLM) -> None:
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME])))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            before = http.post("/v1/completions", json=COMPLETION)
            assert before.status_code == 200, before.text
            in_engine(engine, release_cache)
            _wait_for(http, 503)
            assert engine.kv_cache_released and not engine.sleeping
            results: list[httpx.Response] = []
            waiting = threading.Thread(
                target=lambda: results.append(http.post("/v1/completions", json=COMPLETION)))
            waiting.start()
            time.sleep(0.5)  # several retries find no memory: it waits, it does not fail
            assert not results and http.get("/health").status_code == 503
            in_engine(engine, give_memory_back)
            waiting.join(timeout=DEADLINE_S)
            assert results and results[0].status_code == 200, results and results[0].text
            assert (results[0].json()["choices"][0]["text"]
                    == before.json()["choices"][0]["text"])
            _wait_for(http, 200)
            assert not engine.kv_cache_released
    finally:
        server.stop()


def shorten_released_timeout(llm: LLM) -> None:
    llm.engine.released_timeout_s = 0.3


def test_requests_on_a_cache_that_stays_released_get_503_not_a_hang(engine: AsyncLLM) -> None:
    """Memory that never comes back: a request waited forever (until the client gave up).
    Past the engine's released_timeout_s it is 503 with the cause and what to do, a request
    sent later is refused the same way at once, and the server serves again once the engine
    backs the cache."""
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME])))
    try:
        with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as http:
            in_engine(engine, shorten_released_timeout)
            in_engine(engine, release_cache)
            _wait_for(http, 503)
            for _ in range(2):  # each refused: none waits past the limit
                response = http.post("/v1/completions", json=COMPLETION)
                assert response.status_code == 503, response.text
                error = response.json()["error"]
                assert error["type"] == "service_unavailable"
                assert "released" in error["message"] and "/health" in error["message"]
            assert engine.num_requests == 0
            in_engine(engine, give_memory_back)
            _wait_for(http, 200)
            assert http.post("/v1/completions", json=COMPLETION).status_code == 200
    finally:
        server.stop()


def test_an_idle_server_comes_back_without_traffic(engine: AsyncLLM) -> None:
    """A load balancer sends nothing while /health is 503: the engine retries when idle."""
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME])))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            in_engine(engine, release_cache)
            _wait_for(http, 503)
            in_engine(engine, give_memory_back)
            _wait_for(http, 200)
    finally:
        server.stop()


def test_a_resize_while_the_cache_is_released_is_unavailable_not_a_bad_num_blocks(
        engine: AsyncLLM) -> None:
    """The engine backs a released cache by itself; a resize meanwhile is refused for now
    (503, as a grow that finds no memory), not blamed on a `num_blocks` that is valid."""
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME],
                                                        enable_kv_cache_endpoints=True)))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            num_blocks = http.get("/kv_cache").json()["num_blocks"]
            in_engine(engine, release_cache)
            _wait_for(http, 503)
            response = http.post("/kv_cache/resize", params={"num_blocks": num_blocks})
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["type"] == "service_unavailable" and error["param"] is None
            assert "released" in error["message"]
            in_engine(engine, give_memory_back)
            _wait_for(http, 200)
            assert http.post("/kv_cache/resize", params={"num_blocks": num_blocks}
                             ).status_code == 200
    finally:
        server.stop()
