"""Streamed answers: server-sent events as an ASGI response (`EventStream`), and the events of
a streamed completion or chat completion, built from the engine's outputs as they come."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response

from kvfit.engine.outputs import RequestOutput
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.errors import ENGINE_ERRORS
from kvfit.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, usage
from kvfit.server.responses import chat_logprobs, completion_logprobs, usage_of

_SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")
_SSE_DONE = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}


_SERVER_SEND = "kvfit.server_send"


class DirectSendApp(FastAPI):
    """The app, which puts the server's own `send` in each request's scope: a streamed
    response's events go straight to it, not through a send wrapper per middleware (five:
    Starlette's error and exception middlewares, CORS, `_InternalErrors`, the route's), each an
    await an event at one event per token per stream. Those wrappers only note that the
    response started, which its start, sent through them, tells them (CORS adds its headers
    to the start, so streamed answers carry them); a middleware that changed response bodies
    would have to go without this.

    `served_root_path` (`--root-path`): the prefix a proxy serves the app under, put in each
    request's scope as FastAPI's deprecated `root_path` argument did: the docs' URLs carry
    it, and requests are routed with the prefix or without it."""

    served_root_path = ""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope[_SERVER_SEND] = send
        if self.served_root_path:
            scope["root_path"] = self.served_root_path
        await super().__call__(scope, receive, send)


class EventStream(Response):
    """Server-sent events (dicts, or their `data:` lines already encoded), then `[DONE]`:
    an ASGI response. `release` runs however the response ends, even one whose client left
    before it started; a client that leaves (seen at once, by a listener for its
    disconnect, even while no event comes) cancels the iteration, which aborts its requests
    too.

    Not Starlette's StreamingResponse, which costs every event another generator switch
    and a dict, and the end two writes (`[DONE]`, then the empty last chunk): here an event
    is one `send` and the end, `[DONE]` with the last chunk, one more. A Response only so
    that FastAPI passes it through (it sets `background`)."""

    def __init__(self, events: AsyncIterator[dict[str, Any] | bytes],
                 release: Callable[[], None]) -> None:
        self._events, self._release = events, release
        self.background = None

    async def _stream(self, send: Callable[[dict[str, Any]], Awaitable[None]],
                      send_body: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        # A new start message each response: a middleware may add headers to it in place.
        await send({"type": "http.response.start", "status": 200,
                    "headers": [_SSE_CONTENT_TYPE]})
        # orjson: an event costs ~0.4 us to encode where json.dumps took ~3.9 us, at one
        # event per token per stream on the API process's one core.
        dumps = orjson.dumps
        async with aclosing(self._events):
            async for event in self._events:
                line = event if type(event) is bytes else b"data: " + dumps(event) + b"\n\n"
                await send_body({"type": "http.response.body", "body": line, "more_body": True})
        await send_body(_SSE_DONE)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        # The start goes through the middlewares (they note that the response started), the
        # body straight to the server (see `DirectSendApp`).
        streaming = asyncio.ensure_future(self._stream(send, scope.get(_SERVER_SEND, send)))

        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait((streaming, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not streaming.done():  # the client left (or the server stops): abort
                streaming.cancel()
                with suppress(asyncio.CancelledError):
                    await streaming
            self._release()
        if not streaming.cancelled():
            streaming.result()  # its error, if any: uvicorn closes the connection
        if self.background is not None:
            await self.background()


async def merged(streams: list[AsyncIterator[RequestOutput]]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """`(prompt index, output)` of several streams as they arrive."""
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out))
            queue.put_nowait(None)
        except Exception as e:
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


async def stream_completion(streams: list[AsyncIterator[RequestOutput]],
                             body: CompletionRequest, ids: str, created: int, model: str,
                             engine: AsyncLLM, echo: list[str] | None,
                             engine_error: Callable[[Exception], APIError],
                             prompt_details: bool = False) -> AsyncIterator[dict[str, Any]]:
    """A streamed completion's chunks, any number of prompts, choices and logprobs: each
    chunk carries what every choice added since the last, an engine error ends the stream as
    an error event."""
    sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, index) -> (chars, tokens)
    # (prompt, index) -> the text offset of its next token: the sum of its tokens' texts so
    # far, as the whole answer counts them. Not the text sent: a stop string's possible start
    # or a character's first bytes are held back while their tokens' logprobs go out.
    next_offset: dict[tuple[int, int], int] = {}
    done: set[tuple[int, int]] = set()
    outputs: dict[int, RequestOutput] = {}
    base = {"id": ids, "object": "text_completion", "created": created, "model": model}
    extra = {"usage": None} if body.include_usage else {}
    # Read once: the loop runs for every token of every stream.
    num_logprobs, n, continuous_usage = body.logprobs, body.n, body.continuous_usage
    as_ids, return_ids = body.return_tokens_as_token_ids, body.return_token_ids
    # One prompt (the common request) is read directly: a pass-through generator between
    # the stream and this one would cost every token two more generator switches.
    single = len(streams) == 1
    source = streams[0] if single else merged(streams)
    try:
        async with aclosing(source):
            async for item in source:
                i, out = (0, item) if single else item
                outputs[i] = out
                choices = []
                for c in out.outputs:
                    key = (i, c.index)
                    chars, tokens = sent.get(key, (0, 0))
                    if key in done or (len(c.text) == chars and len(c.token_ids) == tokens
                                       and c.finish_reason is None):
                        continue
                    text = c.text[chars:]
                    first = key not in sent
                    first_echo = echo is not None and first
                    if first_echo:
                        text = echo[i] + text
                    logprobs = None
                    if num_logprobs is not None:
                        # As unstreamed: the echoed prompt's tokens lead, and offsets count its
                        # tokens' text.
                        logprobs = completion_logprobs(engine, c, num_logprobs, out,
                                                        first_echo, tokens,
                                                        next_offset.get(key, 0), as_ids)
                        if logprobs["tokens"]:
                            next_offset[key] = (logprobs["text_offset"][-1]
                                                + len(logprobs["tokens"][-1]))
                    sent[key] = (len(c.text), len(c.token_ids))
                    if c.finish_reason is not None:
                        done.add(key)
                    choice = {"index": i * n + c.index, "text": text, "logprobs": logprobs,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if return_ids:  # as vLLM: the prompt's ids in a choice's first chunk
                        if first:
                            choice["prompt_token_ids"] = list(out.prompt_token_ids)
                        choice["token_ids"] = list(c.token_ids[tokens:])
                    choices.append(choice)
                if choices:
                    if continuous_usage:
                        extra = {"usage": usage_of(list(outputs.values()))}
                    yield {**base, "choices": choices, **extra}
    except ENGINE_ERRORS as e:
        yield engine_error(e).body()
        return
    if body.include_usage:
        yield {**base, "choices": [],
               "usage": usage_of(list(outputs.values()), prompt_details)}


def completion_events(streams: list[AsyncIterator[RequestOutput]], body: CompletionRequest,
                       ids: str, created: int, model: str, engine: AsyncLLM,
                       echo: list[str] | None, engine_error: Callable[[Exception], APIError],
                       prompt_details: bool = False) -> AsyncIterator[dict[str, Any] | bytes]:
    """A streamed completion's events: `stream_plain_completion` for the common request,
    else `stream_completion`."""
    if len(streams) == 1 and body.n == 1 and body.logprobs is None and echo is None and (
            not body.continuous_usage and not body.return_token_ids):
        return stream_plain_completion(streams[0], body, ids, created, model, engine_error,
                                       prompt_details)
    return stream_completion(streams, body, ids, created, model, engine, echo, engine_error,
                             prompt_details)


async def stream_plain_completion(stream: AsyncIterator[RequestOutput],
                                   body: CompletionRequest, ids: str, created: int, model: str,
                                   engine_error: Callable[[Exception], APIError],
                                   prompt_details: bool = False
                                   ) -> AsyncIterator[dict[str, Any] | bytes]:
    """`stream_completion` of the common request (one prompt, one completion, no logprobs,
    no echo, no usage in every chunk, no token ids), its events' lines the same bytes, built
    from parts encoded once: the request's fields and those of a chunk that does not end it.
    A chunk is then its text's JSON and two joins, not three dicts, a list and their
    encoding, at one chunk per token per stream."""
    base = {"id": ids, "object": "text_completion", "created": created, "model": model}
    usage_field = b',"usage":null' if body.include_usage else b""
    # orjson writes keys in insertion order, without spaces: the parts of the dict below.
    head = b"data: " + orjson.dumps(base)[:-1] + b',"choices":[{"index":0,"text":'
    going_on = b',"logprobs":null,"finish_reason":null,"stop_reason":null}]' + usage_field + \
        b"}\n\n"
    dumps = orjson.dumps
    chars = tokens = 0
    done = False
    out = None
    try:
        async with aclosing(stream):
            async for out in stream:
                c = out.outputs[0]
                text, finish_reason = c.text, c.finish_reason
                if done or (finish_reason is None and len(text) == chars
                            and len(c.token_ids) == tokens):
                    continue
                if finish_reason is None:
                    yield head + dumps(text[chars:]) + going_on
                else:
                    done = True
                    end = dumps({"logprobs": None, "finish_reason": finish_reason,
                                 "stop_reason": c.stop_reason})
                    yield (head + dumps(text[chars:]) + b"," + end[1:-1] + b"}]" + usage_field
                           + b"}\n\n")
                chars, tokens = len(text), len(c.token_ids)
    except ENGINE_ERRORS as e:
        yield engine_error(e).body()
        return
    if body.include_usage and out is not None:
        yield {**base, "choices": [], "usage": usage_of([out], prompt_details)}


async def stream_chat(stream: AsyncIterator[RequestOutput], body: ChatCompletionRequest,
                       ids: str, created: int, model: str, engine: AsyncLLM,
                       num_logprobs: int | None, engine_error: Callable[[Exception], APIError],
                       num_prompt_tokens: int, prompt_details: bool = False,
                       prompt_token_ids: list[int] | None = None, role: str = "assistant"
                       ) -> AsyncIterator[dict[str, Any]]:
    """A streamed chat completion's chunks: the `role` for every choice first, then
    each choice's new text (and logprobs), an engine error ending the stream as an error
    event. `prompt_token_ids` (vLLM's return_token_ids): sent with the role, and each
    chunk's new token ids with its text."""
    base = {"id": ids, "object": "chat.completion.chunk", "created": created, "model": model}
    extra = {"usage": None} if body.include_usage else {}
    # With continuous usage every chunk carries it, the role chunk too (nothing generated yet).
    first = {"usage": usage(num_prompt_tokens, 0)} if body.continuous_usage else extra
    if prompt_token_ids is not None:
        first = {**first, "prompt_token_ids": prompt_token_ids}
    yield {**base, "choices": [{"index": j, "delta": {"role": role, "content": ""},
                                "logprobs": None, "finish_reason": None}
                               for j in range(body.n)], **first}
    sent = [(0, 0, False)] * body.n  # chars, tokens, finished
    out = None
    try:
        async with aclosing(stream):
            async for out in stream:
                choices = []
                for c in out.outputs:
                    chars, tokens, done = sent[c.index]
                    if done or (len(c.text) == chars and len(c.token_ids) == tokens
                                and c.finish_reason is None):
                        continue
                    logprobs = None
                    if num_logprobs is not None:
                        logprobs = {"content": chat_logprobs(engine, c, tokens, num_logprobs,
                                                         body.return_tokens_as_token_ids)}
                    choice = {"index": c.index, "delta": {"content": c.text[chars:]},
                              "logprobs": logprobs, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if prompt_token_ids is not None:
                        choice["token_ids"] = list(c.token_ids[tokens:])
                    choices.append(choice)
                    sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
                if choices:
                    if body.continuous_usage:
                        extra = {"usage": usage_of([out])}
                    yield {**base, "choices": choices, **extra}
    except ENGINE_ERRORS as e:
        yield engine_error(e).body()
        return
    if body.include_usage and out is not None:
        yield {**base, "choices": [], "usage": usage_of([out], prompt_details)}
