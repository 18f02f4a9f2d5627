"""`/sleep`, `/wake_up` and `/is_sleeping`: served only with sleep mode and the development
flag; a sleeping engine answers generation with 503, gives the same greedy text after wake,
and finishes (or aborts) what ran when it went to sleep."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import engine_hooks
import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.server import serve
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.openai_api import ServeConfig, build_app

from .conftest import MODEL_NAME, ServerThread, engine_kwargs, in_engine

COMPLETION = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}


def _sleep_mode_kwargs(model: Path) -> dict[str, Any]:
    kwargs = engine_kwargs(model)
    del kwargs["num_gpu_blocks_override"]  # a fixed-size cache stays resident while asleep
    return {**kwargs, "enable_sleep_mode": True}


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(**_sleep_mode_kwargs(model_path)))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def http(start_server: Callable[..., ServerThread]) -> Iterator[httpx.Client]:
    server = start_server(enable_sleep_endpoints=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@pytest.fixture(autouse=True)
def awake(http: httpx.Client, engine: AsyncLLM) -> Iterator[None]:
    yield
    if engine.sleeping:
        assert http.post("/wake_up").status_code == 200


def _text(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_refuses_generation_and_wake_gives_the_same_text(http: httpx.Client,
                                                               level: int) -> None:
    before = _text(http)
    response = http.post("/sleep", params={"level": level})
    assert response.status_code == 200, response.text
    report = response.json()
    assert report["level"] == level
    assert report["released"]["kv_cache"] > 0 and report["released"]["weights"] > 0
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    refused = http.post("/v1/completions", json=COMPLETION)
    assert refused.status_code == 503
    assert "asleep" in refused.json()["error"]["message"]
    assert http.get("/health").status_code == 200  # asleep, not dead
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert _text(http) == before


def test_bad_sleep_and_wake_requests_are_400(http: httpx.Client) -> None:
    response = http.post("/sleep", params={"level": 3})
    assert response.status_code == 400 and "level" in response.json()["error"]["message"]
    for params, param in (({"level": "one"}, "level"), ({"mode": "later"}, "mode")):
        response = http.post("/sleep", params=params)
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert http.post("/wake_up").status_code == 400  # awake already
    assert http.post("/sleep").status_code == 200
    assert http.post("/sleep").status_code == 400  # asleep already
    response = http.post("/wake_up", params={"tags": "nonsense"})
    assert response.status_code == 400
    assert http.post("/wake_up", params={"tags": ["weights", "kv_cache"]}).status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_twice_or_wake_awake_name_the_route_to_call(http: httpx.Client) -> None:
    """The state is wrong, not a parameter: the error names the route that fixes it (the
    engine's own names `LLM.sleep()`, which an HTTP client cannot call) and blames no
    parameter (no `tags` were sent)."""
    response = http.post("/wake_up")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None and "POST /sleep" in error["message"], error
    assert http.post("/sleep").status_code == 200
    response = http.post("/sleep")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] is None and "POST /wake_up" in error["message"], error


def _running(http: httpx.Client) -> bool:
    running = f'kvfit:num_requests_running{{model_name="{MODEL_NAME}"}} 1.0'
    return running in http.get("/metrics").text


def _start_a_long_request(http: httpx.Client) -> tuple[threading.Thread, list[httpx.Response]]:
    """A 100-token request on a thread (the engine slowed by `engine_hooks.slow`), once the
    engine runs it: (the thread, where its response lands)."""
    long = {**COMPLETION, "prompt": "slow", "max_tokens": 100}
    results: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: results.append(
        http.post("/v1/completions", json=long)))
    worker.start()
    deadline = time.monotonic() + 30
    while not _running(http):  # a sleep must meet the request running
        assert worker.is_alive() and time.monotonic() < deadline, "it never ran, or ran out"
    return worker, results


@pytest.mark.parametrize(("mode", "finish_reason"), [("wait", "length"), ("abort", "abort")])
def test_sleep_waits_for_a_running_request_or_aborts_it(http: httpx.Client, engine: AsyncLLM,
                                                        mode: str, finish_reason: str) -> None:
    # 100 steps of at least 20 ms: the request runs for seconds, so the poll below always
    # meets it running, however busy the machine.
    in_engine(engine, engine_hooks.slow, "slow", 0.02)
    try:
        worker, results = _start_a_long_request(http)
        assert http.post("/sleep", params={"mode": mode}).status_code == 200
        worker.join(timeout=60)
        assert results[0].status_code == 200, results[0].text
        assert results[0].json()["choices"][0]["finish_reason"] == finish_reason
        assert not _running(http)
    finally:
        in_engine(engine, engine_hooks.clear)


def test_a_request_sent_while_a_sleep_drains_is_refused_at_once(
        http: httpx.Client, engine: AsyncLLM) -> None:
    """A sleep (mode wait) runs what was queued to its end, taking no other command meanwhile:
    a request sent after it is refused at once with 503 naming the route, not held for the
    whole drain and refused then (in the engine's words, which name LLM calls)."""
    # 100 steps: 5 s of drain, so that on a loaded machine (CI) the sleep and the refused
    # request meet it still draining (at 2 s, one CI run saw the drain end first).
    in_engine(engine, engine_hooks.slow, "slow", 0.05)
    try:
        worker, results = _start_a_long_request(http)
        deadline = time.monotonic() + 30
        slept: list[httpx.Response] = []
        sleeper = threading.Thread(target=lambda: slept.append(http.post("/sleep")))
        sleeper.start()
        while (late := http.post("/v1/completions", json={**COMPLETION, "max_tokens": 1})
               ).status_code == 200:  # sent before the sleep was
            assert time.monotonic() < deadline, "never refused"
        refused_while_draining = worker.is_alive()
        worker.join(timeout=60)
        sleeper.join(timeout=60)
        assert late.status_code == 503, late.text
        assert late.json()["error"]["message"] == (
            "the engine is asleep: wake it up first (POST /wake_up)")
        assert refused_while_draining, "the request waited for the drain to end"
        assert slept[0].status_code == 200 and results[0].status_code == 200
        assert results[0].json()["choices"][0]["finish_reason"] == "length"
    finally:
        in_engine(engine, engine_hooks.clear)


def test_a_wake_sent_while_a_sleep_drains_runs_after_it(http: httpx.Client,
                                                        engine: AsyncLLM) -> None:
    """The engine takes commands in order, as vLLM's does: a wake sent while a sleep (mode
    wait) still drains is not refused as "not asleep" (the engine would then fall asleep
    after the caller had asked it to wake) but runs once the sleep is done; so is a second
    sleep refused naming the route, not in the engine's words."""
    before = _text(http)
    in_engine(engine, engine_hooks.slow, "slow", 0.02)  # 100 steps: seconds of drain
    try:
        worker, results = _start_a_long_request(http)
        slept: list[httpx.Response] = []
        sleeper = threading.Thread(target=lambda: slept.append(http.post("/sleep")))
        sleeper.start()
        deadline = time.monotonic() + 30
        while http.post("/v1/completions", json={**COMPLETION, "max_tokens": 1}
                        ).status_code == 200:  # sent before the sleep was
            assert time.monotonic() < deadline, "the sleep never reached the front end"
        draining = worker.is_alive()
        again = http.post("/sleep")
        woke = http.post("/wake_up")  # answered once the sleep, then the wake, ran
        sleeper.join(timeout=60)
        worker.join(timeout=60)
        assert draining, "the drain ended before the wake was sent"
        assert slept[0].status_code == 200, slept[0].text
        assert woke.status_code == 200, woke.text
        assert woke.json() == {"is_sleeping": False}
        assert again.status_code == 400 and "POST /wake_up" in again.json()["error"]["message"]
        assert results[0].json()["choices"][0]["finish_reason"] == "length"
    finally:
        in_engine(engine, engine_hooks.clear)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert _text(http) == before


def test_the_routes_need_sleep_mode_and_the_development_flag(
        monkeypatch: pytest.MonkeyPatch, start_server: Callable[..., ServerThread],
        model_path: Path) -> None:
    with httpx.Client(base_url=start_server().url, timeout=60) as plain:
        assert plain.post("/sleep").status_code == 404
        assert plain.get("/is_sleeping").status_code == 404
    args = EngineArgs(**_sleep_mode_kwargs(model_path))
    monkeypatch.delenv(serve.DEV_MODE_ENV, raising=False)
    assert not serve.sleep_endpoints(args)
    monkeypatch.setenv(serve.DEV_MODE_ENV, "1")
    assert serve.sleep_endpoints(args)
    args.enable_sleep_mode = False
    assert not serve.sleep_endpoints(args)


def test_vllms_wake_order_runs_on_a_kept_kv_cache(model_path: Path) -> None:
    """vLLM's RLHF order over HTTP, the weights then the KV cache, on a fixed-size cache (an
    override, or a device without VMM), which the sleep keeps: the weights' wake leaves
    nothing asleep, and the KV cache's that follows is its no-op, not a 400."""
    engine = AsyncLLM(EngineArgs(**{**engine_kwargs(model_path), "enable_sleep_mode": True}),
                      engine_process=False)
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME],
                                                        enable_sleep_endpoints=True)))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as fixed:
            before = _text(fixed)
            slept = fixed.post("/sleep").json()
            assert slept["kept"]["kv_cache"] > 0 and "kv_cache" not in slept["released"]
            woke = fixed.post("/wake_up", params={"tags": "weights"})
            assert woke.json() == {"is_sleeping": False}, woke.text
            woke = fixed.post("/wake_up", params={"tags": "kv_cache"})
            assert woke.status_code == 200 and woke.json() == {"is_sleeping": False}, woke.text
            assert _text(fixed) == before
            again = fixed.post("/wake_up", params={"tags": "kv_cache"})  # once per sleep
            assert again.status_code == 400
            assert again.json()["error"]["message"] == "the engine is not asleep: POST /sleep first"
    finally:
        server.stop()
        engine.shutdown()


@pytest.mark.parametrize("what", ["weights", "kv_cache"])
def test_a_wake_with_no_device_memory_is_503_and_stays_asleep(
        http: httpx.Client, engine: AsyncLLM, what: str) -> None:
    """A wake that finds no memory is the server's state, not a bad request: 503 (as a resize
    that finds none), so a client retries once memory frees; nothing changed meanwhile."""
    before = _text(http)
    assert http.post("/sleep").status_code == 200
    in_engine(engine, engine_hooks.refuse_device_memory, what, True)
    try:
        response = http.post("/wake_up")
    finally:
        in_engine(engine, engine_hooks.refuse_device_memory, what, False)
    assert response.status_code == 503, response.text
    assert "no device memory" in response.json()["error"]["message"]
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    assert http.post("/wake_up").json() == {"is_sleeping": False}
    assert _text(http) == before


def test_a_resize_while_asleep_is_503_naming_the_state_not_num_blocks(
        start_server: Callable[..., ServerThread]) -> None:
    """Asleep is the engine's state, not a bad `num_blocks`: 503 as generation gets while
    asleep, saying to wake it first, with no parameter blamed; nothing changes."""
    server = start_server(enable_sleep_endpoints=True, enable_kv_cache_endpoints=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        size = http.get("/kv_cache").json()["num_blocks"]
        assert http.post("/sleep").status_code == 200
        response = http.post("/kv_cache/resize", params={"num_blocks": 20})
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and error["param"] is None
        assert "asleep" in error["message"] and "/wake_up" in error["message"]
        assert http.post("/wake_up").status_code == 200
        assert http.get("/kv_cache").json()["num_blocks"] == size


def test_reset_prefix_cache_is_vllms_development_route(
        start_server: Callable[..., ServerThread], engine: AsyncLLM) -> None:
    """vLLM's `POST /reset_prefix_cache`, behind the development flag: reset at once when
    idle; while a request runs, nothing is reset (saying why) unless
    `reset_running_requests=true` preempts it, and its text does not change."""
    with httpx.Client(base_url=start_server().url, timeout=60) as plain:
        assert plain.post("/reset_prefix_cache").status_code == 404
    server = start_server(enable_sleep_endpoints=True, enable_kv_cache_endpoints=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.post("/reset_prefix_cache").json() == {"reset": True}
        # No KV connector: vLLM logs it and answers 200; the prefix cache is reset.
        unconnected = http.post("/reset_prefix_cache", params={"reset_external": "true"})
        assert unconnected.status_code == 200 and unconnected.json()["reset"] is False
        assert "no KV connector" in unconnected.json()["message"]
        long = {**COMPLETION, "prompt": "slow", "max_tokens": 100}
        expect = http.post("/v1/completions", json=long).json()["choices"][0]["text"]
        in_engine(engine, engine_hooks.slow, "slow", 0.02)
        try:
            worker, results = _start_a_long_request(http)
            busy = http.post("/reset_prefix_cache").json()
            forced = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
            worker.join(timeout=60)
        finally:
            in_engine(engine, engine_hooks.clear)
        assert busy["reset"] is False and "reset_running_requests" in busy["message"]
        assert forced.json() == {"reset": True}
        assert results[0].json()["choices"][0]["text"] == expect


def test_is_sleeping_is_vllms_coroutine_after_the_commands_sent_before(engine: AsyncLLM) -> None:
    # vLLM's `await engine.is_sleeping()` was a TypeError ('bool' object is not callable): it
    # was a property here (now `sleeping`). As vLLM's, it answers after the commands sent
    # before it: asked while a sleep is on its way, it says asleep.
    async def run() -> list[bool]:
        seen = [await engine.is_sleeping()]
        sleep = asyncio.create_task(engine.sleep(level=1))
        await asyncio.sleep(0)  # the sleep is sent
        seen.append(await engine.is_sleeping())
        await sleep
        seen.append(engine.sleeping)
        await engine.wake_up()
        seen.append(await engine.is_sleeping())
        return seen

    assert asyncio.run(run()) == [False, True, True, False]
    assert not engine.sleeping
