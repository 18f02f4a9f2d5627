"""vLLM's `/pause`, `/resume` and `/is_paused` (`AsyncLLM.pause_generation`): behind the
development flag; a pause aborts or waits for the requests in flight; a request sent while
paused is held in the engine (waiting, not refused) and answered after the resume with the text
it would have had; a pause from one of two front ends pauses the one engine for both."""

from __future__ import annotations

import argparse
import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import engine_hooks
import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.engine.sampling_params import SamplingParams
from kvfit.server import serve
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.engine_client import AttachedEngine, EngineProcess

from .conftest import MODEL_NAME, ServerThread, engine_kwargs, in_engine

COMPLETION = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(start_server: Callable[..., ServerThread]) -> Iterator[httpx.Client]:
    server = start_server(enable_pause_endpoints=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@pytest.fixture(autouse=True)
def resumed(http: httpx.Client, engine: AsyncLLM) -> Iterator[None]:
    yield
    in_engine(engine, engine_hooks.clear)
    assert http.post("/resume").json() == {"status": "resumed"}


def _gauge(http: httpx.Client, name: str) -> float:
    prefix = f'kvfit:{name}{{model_name="{MODEL_NAME}"}} '
    line = next(line for line in http.get("/metrics").text.splitlines()
                if line.startswith(prefix))
    return float(line[len(prefix):])


def _send(http: httpx.Client, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    results: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: results.append(
        http.post("/v1/completions", json=body)))
    worker.start()
    return worker, results


def _until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize(("params", "finish_reason"), [
    ({}, "abort"), ({"mode": "wait"}, "length"),
    ({"wait_for_inflight_requests": "true"}, "length")])  # vLLM's older mode="wait"
def test_pause_ends_the_request_in_flight_and_holds_a_later_one_until_resume(
        http: httpx.Client, engine: AsyncLLM, params: dict, finish_reason: str) -> None:
    expected = http.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
    # 100 steps of at least 20 ms: the pause always meets the request running.
    in_engine(engine, engine_hooks.slow, "slow", 0.02)
    running, ran = _send(http, {**COMPLETION, "prompt": "slow", "max_tokens": 100})
    _until(lambda: _gauge(http, "num_requests_running") == 1, "it never ran")
    assert http.post("/pause", params=params).json() == {"status": "paused"}
    running.join(timeout=60)
    assert ran[0].json()["choices"][0]["finish_reason"] == finish_reason
    assert http.get("/is_paused").json() == {"is_paused": True}
    late, answered = _send(http, COMPLETION)
    _until(lambda: _gauge(http, "num_requests_waiting") == 1, "never held in the engine")
    time.sleep(0.2)
    assert late.is_alive() and _gauge(http, "num_requests_running") == 0  # held, not run
    assert http.post("/resume").json() == {"status": "resumed"}
    late.join(timeout=60)
    assert answered[0].status_code == 200, answered[0].text
    assert answered[0].json()["choices"][0]["text"] == expected
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_a_request_sent_while_a_pause_drains_waits_for_the_resume(
        http: httpx.Client, engine: AsyncLLM) -> None:
    """Unlike a sleep's drain, which refuses it at once (503), a pause's (mode wait) takes a
    request sent meanwhile: it runs after the resume, with its text."""
    expected = http.post("/v1/completions", json=COMPLETION).json()["choices"][0]["text"]
    in_engine(engine, engine_hooks.slow, "slow", 0.05)  # 100 steps: 5 s of drain
    running, ran = _send(http, {**COMPLETION, "prompt": "slow", "max_tokens": 100})
    _until(lambda: _gauge(http, "num_requests_running") == 1, "it never ran")
    paused: list[httpx.Response] = []
    pauser = threading.Thread(target=lambda: paused.append(
        http.post("/pause", params={"mode": "wait"})))
    pauser.start()
    time.sleep(0.5)  # the pause reaches the engine before the request
    late, answered = _send(http, COMPLETION)
    _until(lambda: engine.num_requests == 2, "the request never reached the front end")
    sent_while_draining = pauser.is_alive()
    pauser.join(timeout=60)
    running.join(timeout=60)
    assert sent_while_draining, "the drain ended before the request was sent"
    assert paused[0].json() == {"status": "paused"}
    assert ran[0].json()["choices"][0]["finish_reason"] == "length"
    time.sleep(0.2)
    assert late.is_alive()  # held
    assert http.post("/resume").status_code == 200
    late.join(timeout=60)
    assert answered[0].status_code == 200, answered[0].text
    assert answered[0].json()["choices"][0]["text"] == expected


def test_clear_cache_false_keeps_the_prefix_cache(http: httpx.Client, engine: AsyncLLM) -> None:
    long = {**COMPLETION, "prompt": list(range(5, 70))}  # full blocks, which the cache keeps
    assert http.post("/v1/completions", json=long).status_code == 200
    assert http.post("/pause", params={"clear_cache": "false"}).status_code == 200
    assert in_engine(engine, engine_hooks.prefix_cache_blocks) > 0
    assert http.post("/pause").status_code == 200  # again: clear_cache=true by default
    assert in_engine(engine, engine_hooks.prefix_cache_blocks) == 0


def test_a_mode_other_than_abort_or_wait_is_400_naming_mode(http: httpx.Client) -> None:
    response = http.post("/pause", params={"mode": "keep"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "mode" and "'abort'" in error["message"], error
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_the_routes_need_the_development_flag(start_server: Callable[..., ServerThread],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with httpx.Client(base_url=start_server().url, timeout=60) as plain:
        assert plain.post("/pause").status_code == 404
        assert plain.post("/resume").status_code == 404
        assert plain.get("/is_paused").status_code == 404
    root = argparse.ArgumentParser(prog="kvfit")
    serve.add_serve_parser(root.add_subparsers(dest="command", required=True))
    args = root.parse_args(["serve", "m"])  # no sleep mode needed
    monkeypatch.delenv(serve.DEV_MODE_ENV, raising=False)
    assert not serve._serve_config(args, EngineArgs(model="m")).enable_pause_endpoints
    monkeypatch.setenv(serve.DEV_MODE_ENV, "1")
    assert serve._serve_config(args, EngineArgs(model="m")).enable_pause_endpoints


def test_a_pause_from_one_front_end_holds_the_other_ones_requests(model_path: Path) -> None:
    """Two API processes' front ends on one engine process: the pause is the engine's."""
    args = EngineArgs(**engine_kwargs(model_path))
    first = AsyncLLM(args, client=functools.partial(EngineProcess, num_api_servers=2))
    (conn,) = first.engine_client.api_server_conns
    first.engine_client.api_server_conns = []
    second = AsyncLLM(args, client=lambda _, on_outputs, on_dead: AttachedEngine(
        conn, on_outputs, on_dead, first.engine_pid))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def text(engine: AsyncLLM) -> str:
        output = None
        async for output in engine.generate({"prompt_token_ids": [5, 6, 7]}, params):  # noqa: B007
            pass
        return output.outputs[0].text

    async def run() -> tuple[str, bool, bool, bool, str]:
        expected = await text(second)
        await first.pause_generation()
        held = asyncio.ensure_future(text(second))
        paused = await second.is_paused()
        seen = second.paused  # the pause's message reached this front end too
        deadline = time.monotonic() + 30
        while second.stats().num_waiting != 1:  # in the engine, waiting
            assert time.monotonic() < deadline, "never held in the engine"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        was_held = not held.done() and second.stats().num_running == 0
        await first.resume_generation()
        return expected, paused, seen, was_held, await asyncio.wait_for(held, 30)

    try:
        expected, paused, seen, was_held, after = asyncio.run(run())
        assert paused and seen and was_held
        assert after == expected
        assert not asyncio.run(second.is_paused())
    finally:
        second.shutdown()
        first.shutdown()
