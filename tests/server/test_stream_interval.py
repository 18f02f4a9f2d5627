"""`--stream-interval N`: a streamed request's reader is woken once N new tokens are queued
(the first token, a completion's end and errors at once), and what it streams joins to the
same text, tokens and logprobs as N=1 and as the whole response."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.server.async_llm import AsyncLLM, _Item, _Stream
from kvfit.server.openai_api import ServeConfig, build_app

from .conftest import MODEL_NAME, ServerThread, engine_kwargs

INTERVAL = 4
PROMPT = "The number 5 is followed by"


# --- The per-request stream, fed by hand -------------------------------------------------


def _plain(token: int) -> _Item:
    return ("r", [token])


def _step(tokens: list[list[int]], finish: list[str | None], finished: bool = False) -> _Item:
    """A `RequestDelta`: completion i gained `tokens[i]` (and ended if `finish[i]`)."""
    return ("r", [(i, t, None, f, None, None) for i, (t, f) in enumerate(
        zip(tokens, finish, strict=True))], finished, None, 0)


def _batches(interval: int, items: list[_Item]) -> list[list[_Item]]:
    """What a reader's `take`s return while `items` are pushed one per loop turn (the reader
    runs as soon as it is woken), until it takes a finished delta or an error."""
    async def run() -> list[list[_Item]]:
        stream = _Stream("r", "r", interval)
        batches: list[list[_Item]] = []

        async def reader() -> None:
            while True:
                batches.append(await stream.take())
                if any(isinstance(i, BaseException) or (len(i) > 2 and i[2])
                       for i in batches[-1]):
                    return

        task = asyncio.ensure_future(reader())
        for item in items:
            for _ in range(3):
                await asyncio.sleep(0)
            stream.push(item)
        await asyncio.wait_for(task, 5)
        return batches

    return asyncio.run(run())


def test_the_reader_wakes_at_the_first_token_then_every_n_then_at_the_end() -> None:
    items = [_plain(t) for t in range(10)] + [_step([[10]], ["length"], finished=True)]
    sizes = [len(b) for b in _batches(INTERVAL, items)]
    assert sizes == [1, 4, 4, 2]  # 11 tokens: the first alone, groups of 4, the rest at the end
    assert len(sizes) == 1 + math.ceil((11 - 1) / INTERVAL)
    assert [len(b) for b in _batches(1, items)] == [1] * 11  # N=1: every step wakes it


def test_siblings_count_once_per_step_and_one_ending_wakes_the_reader() -> None:
    steps = [_step([[t], [t]], [None, None]) for t in range(4)]  # n=2: 4 steps of both
    steps.append(_step([[4], []], [None, "stop"]))  # sibling 1 ends with nothing new
    steps.append(_step([[5]], ["length"], finished=True))
    assert [len(b) for b in _batches(3, steps)] == [1, 3, 1, 1]


def test_an_error_wakes_the_reader_at_once() -> None:
    error = RuntimeError("failed")
    batches = _batches(INTERVAL, [_plain(0), _plain(1), error])
    assert batches == [[_plain(0)], [_plain(1), error]]


def test_a_stream_interval_below_one_is_refused_before_the_engine_starts() -> None:
    with pytest.raises(ValueError, match="--stream-interval"):
        AsyncLLM(EngineArgs(model="no-such-model"), stream_interval=0)


# --- The server, N=4 against N=1 and the whole response ----------------------------------


@pytest.fixture(scope="module")
def server_n(model_path: Path) -> Iterator[ServerThread]:
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path)), stream_interval=INTERVAL)
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME])))
    yield server
    server.stop()
    engine.shutdown()


def _events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert all("error" not in e for e in events), events
    return events


def _joined(events: list[dict[str, Any]], index: int, key: str = "text") -> str:
    return "".join(c[key] for e in events for c in e["choices"] if c["index"] == index)


def _logprob_tokens(events: list[dict[str, Any]], index: int) -> list[str]:
    return [t for e in events for c in e["choices"] if c["index"] == index
            for t in c["logprobs"]["tokens"]]


USAGE = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def test_a_plain_stream_comes_in_groups_of_n_with_the_same_text(
        server_n: ServerThread, server: ServerThread) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    with httpx.Client(base_url=server_n.url, timeout=60) as http, \
            httpx.Client(base_url=server.url, timeout=60) as http1:
        whole = http.post("/v1/completions", json=body).json()
        assert whole == {**http1.post("/v1/completions", json=body).json(),
                         "id": whole["id"], "created": whole["created"]}
        events = _events(http, "/v1/completions", {**body, **USAGE})
        events1 = _events(http1, "/v1/completions", {**body, **USAGE})
    text = whole["choices"][0]["text"]
    assert _joined(events, 0) == _joined(events1, 0) == text
    content = [e for e in events if e["choices"]]
    counts = [e["usage"]["completion_tokens"] for e in content]
    sizes = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert sum(sizes) == 24
    # The reader wakes at 4 new tokens (a slow one may find more), the end at once: between the
    # first chunk and the last every chunk carries at least 4, so at most 1 + ceil(23 / 4).
    assert all(size >= INTERVAL for size in sizes[1:-1]), sizes
    assert 2 <= len(content) <= 1 + math.ceil((24 - 1) / INTERVAL)
    # The final chunk: finish_reason with the last tokens, then usage as a whole response's.
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["finish_reason"] is None for e in content[:-1] for c in e["choices"])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]


def test_n_logprobs_and_stop_strings_join_to_the_same_text(
        server_n: ServerThread, server: ServerThread) -> None:
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "n": 2, "logprobs": 1}
    with httpx.Client(base_url=server_n.url, timeout=60) as http, \
            httpx.Client(base_url=server.url, timeout=60) as http1:
        text = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
        stop = text[len(text) // 2:][:3]  # late in the text: several chunks come before it
        body["stop"] = [stop]
        whole = http.post("/v1/completions", json=body).json()
        events = _events(http, "/v1/completions", {**body, "stream_options": {
            "include_usage": True}})
        events1 = _events(http1, "/v1/completions", body)
    for want in whole["choices"]:
        i = want["index"]
        assert want["finish_reason"] == "stop" and stop not in want["text"]
        assert _joined(events, i) == _joined(events1, i) == want["text"]
        assert _logprob_tokens(events, i) == _logprob_tokens(events1, i) \
            == want["logprobs"]["tokens"]
        last = [c for e in events for c in e["choices"] if c["index"] == i][-1]
        assert last["finish_reason"] == "stop"
    assert events[-1]["usage"] == whole["usage"]


def test_a_chat_stream_joins_to_the_whole_reply(server_n: ServerThread) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count on"}],
            "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server_n.url, timeout=60) as http:
        whole = http.post("/v1/chat/completions", json=body).json()
        events = _events(http, "/v1/chat/completions", body)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == \
        whole["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len(events) <= 1 + 1 + math.ceil((16 - 1) / INTERVAL)  # the role chunk, then content
