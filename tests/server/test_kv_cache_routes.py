"""`GET /kv_cache` and `POST /kv_cache/resize?num_blocks=N`: served only behind the development
flag; a resize changes the size the engine serves with and not its greedy text; errors name
the setting; the metrics count resizes; an idle elastic engine still follows free memory."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfit.elastic.demand import DEFAULT_DEMAND_DIR
from kvfit.engine.config import EngineArgs
from kvfit.kv.monitor import HostMemoryMonitor
from kvfit.server import serve
from kvfit.server.async_llm import AsyncLLM

from .conftest import MAX_MODEL_LEN, MODEL_NAME, ServerThread, engine_kwargs, in_engine
from .test_openai_api import metrics

MiB = 1 << 20
LOW, HIGH = 4 * MiB, 10 * MiB
COMPLETION = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8, 9], "max_tokens": 8,
              "temperature": 0, "ignore_eos": True}


class ScriptedMemory(HostMemoryMonitor):
    """Device free memory as the test sets it (`free`)."""

    def __init__(self) -> None:
        super().__init__(1 << 30, "cpu_kv_cache_space_bytes")
        self.free = (LOW + HIGH) // 2

    def free_and_total(self) -> tuple[int, int]:
        return self.free, self.budget_bytes


def _use_monitor(llm: Any, monitor: HostMemoryMonitor) -> None:
    llm.engine.executor.workers[0].monitor = monitor


@pytest.fixture(scope="module")
def memory() -> ScriptedMemory:
    return ScriptedMemory()


@pytest.fixture(scope="module")
def engine(model_path: Path, memory: ScriptedMemory) -> Iterator[AsyncLLM]:
    kwargs = engine_kwargs(model_path)
    del kwargs["num_gpu_blocks_override"]  # a fixed-size cache cannot resize
    # On a thread of this process: the test scripts the free memory the governor reads.
    engine = AsyncLLM(EngineArgs(**kwargs, elastic_kv_cache=True, elastic_low_watermark="4MiB",
                                 elastic_high_watermark="10MiB", elastic_min_interval=0.2,
                                 elastic_idle_s=0),  # free memory alone
                      engine_process=False)
    in_engine(engine, _use_monitor, memory)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def http(start_server: Callable[..., ServerThread]) -> Iterator[httpx.Client]:
    server = start_server(enable_kv_cache_endpoints=True)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


@pytest.fixture(autouse=True)
def full_size(http: httpx.Client, memory: ScriptedMemory) -> Iterator[dict[str, Any]]:
    """Each test starts and ends at the largest size, free memory in the governor's band."""
    memory.free = (LOW + HIGH) // 2
    state = http.get("/kv_cache").json()
    assert http.post("/kv_cache/resize", params={"num_blocks": state["max_blocks"]}
                     ).status_code == 200
    yield http.get("/kv_cache").json()
    memory.free = (LOW + HIGH) // 2
    assert http.post("/kv_cache/resize", params={"num_blocks": state["max_blocks"]}
                     ).status_code == 200


def _text(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_get_reports_the_size_its_bounds_and_the_governor(full_size: dict[str, Any]) -> None:
    state = full_size
    assert state["num_blocks"] == state["max_blocks"] == state["num_free_blocks"]
    assert state["min_blocks"] == MAX_MODEL_LEN // state["block_size"]
    assert state["min_blocks"] < state["num_blocks"] <= state["capacity_blocks"]
    assert state["committed_bytes"] > 0 and state["reserved_bytes"] >= state["committed_bytes"]
    assert state["elastic"] == {"low_watermark": "4.00 MiB", "high_watermark": "10.00 MiB",
                                "min_interval_s": 0.2, "idle_s": 0.0,
                                "demand_dir": DEFAULT_DEMAND_DIR}


def test_resize_changes_the_size_not_the_text_and_is_counted(
        http: httpx.Client, full_size: dict[str, Any]) -> None:
    before, largest = _text(http), full_size["num_blocks"]
    shrinks = metrics(http)["kvfit:kv_cache_resizes_total{direction=shrink}"]
    response = http.post("/kv_cache/resize", params={"num_blocks": 20})
    assert response.status_code == 200, response.text
    event = response.json()
    assert (event["cause"], event["num_blocks_before"], event["num_blocks_after"]) == (
        "api", largest, 20)
    assert event["delta_bytes"] < 0
    state = http.get("/kv_cache").json()
    assert state["num_blocks"] == 20 and state["latest_resizes"][-1] == event
    assert _text(http) == before
    m = metrics(http)
    assert m["kvfit:kv_cache_blocks_total"] == 20
    assert m["kvfit:kv_cache_resizes_total{direction=shrink}"] == shrinks + 1


@pytest.mark.parametrize(("num_blocks", "status", "message"), [
    (1, 400, "max_model_len"),
    (10**9, 400, "address space"),
    ("many", 400, "num_blocks"),
])
def test_bad_resizes_are_refused_naming_the_setting(http: httpx.Client, num_blocks: Any,
                                                    status: int, message: str) -> None:
    response = http.post("/kv_cache/resize", params={"num_blocks": num_blocks})
    assert response.status_code == status, response.text
    assert message in response.text
    assert response.json()["error"]["param"] == "num_blocks"


def test_an_idle_elastic_engine_shrinks_when_memory_runs_short(
        http: httpx.Client, memory: ScriptedMemory, full_size: dict[str, Any]) -> None:
    memory.free = 0  # another process took it all; no request arrives
    deadline = time.monotonic() + 30
    while (state := http.get("/kv_cache").json())["num_blocks"] > state["min_blocks"]:
        assert time.monotonic() < deadline, "the idle engine never shrank"
        time.sleep(0.05)
    assert state["latest_resizes"][-1]["cause"] == "governor"
    assert state["num_shrinks"] > full_size["num_shrinks"]


def test_the_routes_need_the_development_flag(
        monkeypatch: pytest.MonkeyPatch, start_server: Callable[..., ServerThread]) -> None:
    with httpx.Client(base_url=start_server().url, timeout=60) as plain:
        assert plain.get("/kv_cache").status_code == 404
        assert plain.post("/kv_cache/resize", params={"num_blocks": 20}).status_code == 404
    monkeypatch.delenv(serve.DEV_MODE_ENV, raising=False)
    assert not serve.dev_mode()
    monkeypatch.setenv(serve.DEV_MODE_ENV, "1")
    assert serve.dev_mode()


def test_concurrent_resizes_under_load_change_no_text(
        http: httpx.Client, full_size: dict[str, Any]) -> None:
    """Resizes sent at once with completions (`n` of 2, prompts up to most of max_model_len)
    are applied one by one between steps: each answers 200, every text is the one the
    unresized cache gives, and the cache ends consistent with every block free."""
    import concurrent.futures

    bodies = [{**COMPLETION, "prompt": list(range(5, 5 + n)), "max_tokens": 30, "n": 2}
              for n in (3, 50, 90, 7)]
    expected = []
    for body in bodies:
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        expected.append(response.json()["choices"])
    low, high = full_size["min_blocks"], full_size["max_blocks"]
    sizes = [low, high, 40, 17, high, low + 1, 100, low] * 2
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        completions = [pool.submit(http.post, "/v1/completions", json=body)
                       for body in bodies * 2]
        resizes = [pool.submit(http.post, "/kv_cache/resize", params={"num_blocks": n})
                   for n in sizes]
        resized = [future.result() for future in resizes]
        answers = [future.result() for future in completions]
    assert [r.status_code for r in resized] == [200] * len(sizes), [r.text for r in resized]
    for i, answer in enumerate(answers):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"] == expected[i % len(bodies)]
    state = http.get("/kv_cache").json()  # (a short cache's governor may have grown it)
    assert state["num_free_blocks"] == state["num_blocks"]
    assert low <= state["num_blocks"] <= high and state["committed_bytes"] > 0
