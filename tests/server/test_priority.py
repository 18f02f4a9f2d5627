"""vLLM's priority scheduling through the async engine and the server: `priority` reaches the
scheduler under `--scheduling-policy priority`, and is a clear error under fcfs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.engine.sampling_params import SamplingParams
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.openai_api import ServeConfig, build_app

from .conftest import MODEL_NAME, ServerThread, engine_kwargs


@pytest.fixture(scope="module")
def priority_engine(model_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path), scheduling_policy="priority"))
    yield engine
    engine.shutdown()


def test_async_requests_keep_their_output_at_any_priority(priority_engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)

    async def run(priority: int) -> list[int]:
        outs = [o async for o in priority_engine.generate("Hello there", params,
                                                          priority=priority)]
        return outs[-1].outputs[0].token_ids

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(run(0), run(-3), run(7)))

    first, *others = asyncio.run(both())
    assert len(first) == 4 and all(o == first for o in others)


def test_the_server_takes_priority_under_the_priority_policy(
        priority_engine: AsyncLLM, engine: AsyncLLM) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "priority": 5}
    server = ServerThread(build_app(priority_engine, ServeConfig(served_model_names=[MODEL_NAME])))
    fcfs = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME])))
    try:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2, "priority": -1}
        assert httpx.post(f"{server.url}/v1/chat/completions", json=chat,
                          timeout=60).status_code == 200
        r = httpx.post(f"{fcfs.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 400
        error = r.json()["error"]
        assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]
    finally:
        server.stop()
        fcfs.stop()
