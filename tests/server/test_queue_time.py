"""`kvfit:request_queue_time_seconds`: vLLM's time a request waited before it was first
scheduled, here with `max_num_seqs=1` so a second request waits for the first to finish."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfit.engine.config import EngineArgs
from kvfit.server.async_llm import AsyncLLM

from . import engine_hooks
from .conftest import MODEL_NAME, ServerThread, engine_kwargs, in_engine

STEP_S = 0.25


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(**{**engine_kwargs(model_path), "max_num_seqs": 1}))
    yield engine
    engine.shutdown()


def _queue_time(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name.removeprefix("kvfit:request_queue_time_seconds") + s.labels.get("le", ""):
            s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("kvfit:request_queue_time_seconds")}


def test_a_request_behind_a_full_batch_reports_its_wait(
        start_server: object, engine: AsyncLLM) -> None:
    server: ServerThread = start_server()  # type: ignore[operator]
    in_engine(engine, engine_hooks.slow, "slow", STEP_S)  # each step of "slow" takes 0.25 s
    before = _queue_time(server.url)
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

    async def run() -> None:
        first = await client.completions.create(model=MODEL_NAME, prompt="slow", max_tokens=6,
                                                stream=True, extra_body={"ignore_eos": True})
        chunks = aiter(first)
        await anext(chunks)  # "slow" runs: the one sequence the engine takes
        second = asyncio.create_task(client.completions.create(
            model=MODEL_NAME, prompt="fast", max_tokens=2))
        async for _ in chunks:
            pass
        await second

    try:
        asyncio.run(run())
    finally:
        in_engine(engine, engine_hooks.clear)
    after = _queue_time(server.url)
    assert after["_count"] - before["_count"] == 2
    # "fast" waited for the rest of "slow" (its last steps of 0.25 s); "slow" hardly waited.
    assert after["_sum"] - before["_sum"] >= 2 * STEP_S
    assert after["_bucket0.3"] - before["_bucket0.3"] == 1
