"""The plain completion stream's lines, built from encoded parts, are the bytes the general
path encodes from its dicts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from kvfit.engine.outputs import CompletionOutput, RequestOutput
from kvfit.server.protocol import CompletionRequest
from kvfit.server.streaming import stream_completion, stream_plain_completion

STEPS = [("", [], None, None), ('He said "hi"', [5, 6], None, None),
         ('He said "hi"', [5, 6], None, None),  # nothing new: no event
         ('He said "hi"\n\tcafé ✓', [5, 6, 7], None, None),
         ('He said "hi"\n\tcafé ✓ \\', [5, 6, 7, 8], None, None)]
ENDS = [("length", None), ("stop", "\n}"), ("stop", 7)]


async def _outputs(end: tuple[str, Any]) -> AsyncIterator[RequestOutput]:
    steps = [*STEPS, (STEPS[-1][0] + " end", [*STEPS[-1][1], 9], *end)]
    for text, token_ids, finish_reason, stop_reason in steps:
        yield RequestOutput("r", None, [1, 2, 3], None, [CompletionOutput(
            0, text, list(token_ids), None, None, finish_reason, stop_reason)],
            finish_reason is not None)


def _lines(events: list[Any]) -> bytes:
    return b"".join(e if isinstance(e, bytes) else b"data: " + orjson.dumps(e) + b"\n\n"
                    for e in events)


async def _collect(events: AsyncIterator[Any]) -> list[Any]:
    return [e async for e in events]


@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("include_usage", [False, True])
def test_plain_completion_lines_are_the_general_paths_bytes(end: tuple[str, Any],
                                                            include_usage: bool) -> None:
    body = CompletionRequest(prompt=[1, 2, 3], stream=True,
                             stream_options={"include_usage": include_usage})
    args = (body, "cmpl-x", 123, "m/é")
    plain = asyncio.run(_collect(stream_plain_completion(_outputs(end), *args, None)))
    general = asyncio.run(_collect(stream_completion([_outputs(end)], *args, None, None, None)))
    assert len(general) == (5 if include_usage else 4)
    assert _lines(plain) == _lines(general)


def test_each_event_stream_starts_with_a_message_of_its_own() -> None:
    """A middleware may add headers to a response's start message in place (Starlette's
    `MutableHeaders(scope=message)` does): one response's additions must not reach the next."""
    from kvfit.server.streaming import EventStream

    async def events() -> AsyncIterator[Any]:
        yield {"x": 1}

    async def receive() -> dict[str, Any]:
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    starts: list[list[tuple[bytes, bytes]]] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            starts.append(list(message["headers"]))
            message["headers"].append((b"x-added", b"1"))  # as a middleware's wrapper may

    async def respond_twice() -> None:
        for _ in range(2):
            await EventStream(events(), lambda: None)({"type": "http"}, receive, send)

    asyncio.run(respond_twice())
    assert starts[0] == starts[1] == [(b"content-type", b"text/event-stream; charset=utf-8")]
