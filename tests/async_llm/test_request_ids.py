"""`AsyncLLM`'s request ids: an id whose abort was sent names a new request at once (the old
request's last output, still on its way, reaches only the old stream), and an id of a request
still running is refused. On the CPU, the engine on a thread (no server packages needed)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvfit import SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.server.async_llm import AsyncLLM

OLD = {"prompt_token_ids": list(range(3, 30))}
NEW = {"prompt_token_ids": list(range(40, 52))}
LONG = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_model: Callable[[str], Path]) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(model=str(tiny_model("qwen3")), device="cpu",
                                 max_model_len=128, num_gpu_blocks_override=64),
                      engine_process=False)
    yield engine
    engine.shutdown()


async def _final(stream: Any) -> Any:
    output = None
    async for output in stream:  # noqa: B007 (the last one is the result)
        pass
    return output


@pytest.fixture(scope="module")
def reference(engine: AsyncLLM) -> dict[str, list[int]]:
    async def run() -> dict[str, list[int]]:
        old = await _final(engine.generate(OLD, LONG))
        new = await _final(engine.generate(NEW, SHORT))
        return {"old": old.outputs[0].token_ids, "new": new.outputs[0].token_ids}

    return asyncio.run(run())


def _hold(llm: Any, seconds: float) -> None:
    """Keeps the engine's loop busy, so that the commands sent meanwhile wait."""
    time.sleep(seconds)


@pytest.mark.parametrize("how", ["abort", "close"])
def test_an_aborted_id_names_a_new_request_at_once(engine: AsyncLLM,
                                                   reference: dict[str, list[int]],
                                                   how: str) -> None:
    # Was refused ("already running") until the old request's last output arrived; reused
    # under the same engine id, that output (finish_reason "abort") would end the new stream.
    async def run() -> tuple[Any, Any, Any]:
        old = aiter(engine.add_request(OLD, LONG, "x"))
        assert not (await anext(old)).finished
        # The engine takes no command until this call ends: no abort sent meanwhile can have
        # ended its request there when the id is used again.
        held = asyncio.ensure_future(engine.call_engine(_hold, 0.3))
        await asyncio.sleep(0.05)
        if how == "abort":
            await engine.abort("x")
        else:  # the reader leaves: its stream aborts the request
            await old.aclose()
        never_run = engine.add_request(NEW, SHORT, "x")  # aborted before the engine sees it
        await engine.abort("x")
        new = engine.add_request(NEW, SHORT, "x")
        # A request of the id that still runs keeps its error.
        with pytest.raises(ValueError, match="'x' is already running"):
            engine.add_request(NEW, SHORT, "x")
        assert engine.num_requests == 3  # each ends only once the engine says so
        await held
        last = await _final(new)
        old_last = await _final(old) if how == "abort" else None
        return old_last, await _final(never_run), last

    # Bounded: a stream that another request's output ended leaves its own reader waiting.
    old, never_run, new = asyncio.run(asyncio.wait_for(run(), 120))
    assert new.request_id == "x" and new.finished
    assert new.outputs[0].token_ids == reference["new"]
    assert new.outputs[0].finish_reason == "length"
    assert never_run.request_id == "x" and never_run.outputs[0].finish_reason == "abort"
    assert never_run.outputs[0].token_ids == []
    if old is not None:
        out = old.outputs[0]
        assert old.request_id == "x" and out.finish_reason == "abort"
        assert 0 < len(out.token_ids) < LONG.max_tokens
        assert out.token_ids == reference["old"][:len(out.token_ids)]
    assert engine.num_requests == 0


def test_a_running_id_is_refused_and_freed_by_its_end(engine: AsyncLLM) -> None:
    async def run() -> None:
        stream = engine.generate(NEW, SHORT, "y")
        first = await anext(stream)
        with pytest.raises(ValueError, match="'y' is already running; use another, or abort"):
            engine.add_request(OLD, SHORT, "y")
        assert not first.finished
        await _final(stream)
        assert (await _final(engine.generate(NEW, SHORT, "y"))).outputs[0].token_ids

    asyncio.run(run())
    assert engine.num_requests == 0
