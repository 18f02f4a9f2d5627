"""The OpenAI-compatible HTTP API over an `AsyncLLM`: `build_app(engine, ServeConfig)`."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import inspect
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvfit
from kvfit.engine.kv_resize import KVCacheReleasedError, KVCacheResizeError
from kvfit.engine.outputs import CompletionOutput, RequestOutput
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import Logprobs
from kvfit.engine.sleep import WakeUpOutOfMemoryError
from kvfit.server.async_llm import (
    AsyncLLM,
    EngineDeadError,
    EngineSleepingError,
    RequestFailedError,
)
from kvfit.server.body_limit import BodyLimit
from kvfit.server.metrics import ServerMetrics
from kvfit.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    _SamplingFields,
    usage,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
# Engine errors a request can meet: 503 for an engine that cannot serve now, 400 for a refused
# request, 500 for a step that failed on it (`engine_error`).
_UNAVAILABLE = (EngineDeadError, EngineSleepingError, KVCacheReleasedError)
_ENGINE_ERRORS = (ValueError, RequestFailedError, *_UNAVAILABLE)
# Characters of a request's texts tokenized on the event loop (a few ms); more go to a thread.
_INLINE_TOKENIZE_CHARS = 1 << 14


@dataclass
class ServeConfig:
    """Server settings (the engine's are `EngineArgs`).

    `served_model_names`: the names clients may ask for (the first is reported); `api_key`:
    when set, every route but `/health` needs `Authorization: Bearer <key>`;
    `max_concurrent_requests`: generation requests in progress at once, beyond which new ones
    get 503 (None: unbounded). `max_request_body_bytes`: larger request bodies get 413 before
    they are read whole (None: unbounded). `enable_sleep_endpoints`: serve `/sleep`, `/wake_up` and
    `/is_sleeping` (an engine with sleep mode, behind the development flag: they let any
    client take the model away from every other). `enable_kv_cache_endpoints`: serve
    `GET /kv_cache` and `POST /kv_cache/resize?num_blocks=N` (behind the development flag too).
    `multiprocess_metrics`: `/metrics` sums the request figures of every API server process
    (`--api-server-count` > 1; prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`).
    `chat_template`: a Jinja chat template used instead of the tokenizer's own (None: the
    tokenizer's).
    """

    served_model_names: list[str]
    api_key: str | None = None
    max_concurrent_requests: int | None = 1024
    root: str | None = None  # the model folder, shown by /v1/models
    enable_sleep_endpoints: bool = False
    enable_kv_cache_endpoints: bool = False
    max_request_body_bytes: int | None = 64 << 20
    multiprocess_metrics: bool = False
    chat_template: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))


class _Slots:
    """Counts generation requests in progress against the bound (one event loop: no lock)."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.in_use = limit, 0

    def take(self) -> None:
        if self.limit is not None and self.in_use >= self.limit:
            raise APIError(f"the server has {self.limit} generation requests in progress, its "
                           f"limit (--max-concurrent-requests); retry later",
                           status_code=503, type="service_unavailable")
        self.in_use += 1

    def give(self) -> None:
        self.in_use -= 1


@dataclass
class _Admission:
    """A generation request's slot and engine requests, released once however the HTTP
    request ends: the slot given back and every engine request aborted (a no-op for those
    that finished), so nothing outlives its client."""

    slots: _Slots
    engine: AsyncLLM
    request_ids: list[str] = field(default_factory=list)
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slots.give()
            for request_id in self.request_ids:
                self.engine.abort(request_id)


def build_app(engine: AsyncLLM, config: ServeConfig) -> FastAPI:
    """A FastAPI app serving `engine` (which it does not own: shut it down after the app)."""
    app = _App(title="kvfit", version=kvfit.__version__)
    metrics = ServerMetrics(engine, multiprocess=config.multiprocess_metrics)
    slots = _Slots(config.max_concurrent_requests)
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, config
    model_name = config.served_model_names[0]

    def error(e: APIError) -> JSONResponse:
        metrics.failure(e.status_code)
        return JSONResponse(e.body(), status_code=e.status_code)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return error(APIError(f"the request body is not valid JSON ({reason})"))
        return error(_validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        message = str(e.detail)
        if e.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            # No route matched: say which there are (an OpenAI client calling
            # /v1/embeddings or /v1/responses learns this server does not serve them).
            routes = [f"{method} {route.path}" for route in (*app.routes, *api.routes)
                      if isinstance(route, APIRoute) for method in sorted(route.methods)]
            message = (f"{request.method} {request.url.path} is not served here; this server "
                       f"serves {', '.join(routes)}")
        return error(APIError(message, status_code=e.status_code, type=kind))

    def internal(e: Exception) -> JSONResponse:
        logger.exception("request failed", exc_info=e)
        return error(APIError(f"internal error: {e}", 500, "internal_server_error"))

    async def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        # The scheme is case-insensitive (RFC 9110); the key is compared in constant time, so
        # response times do not tell a guesser how much of it is right.
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                key.strip().encode(), config.api_key.encode()):
            raise APIError("a valid API key is needed: send 'Authorization: Bearer <key>'",
                           status_code=401, type="authentication_error", code="invalid_api_key")

    @app.get("/health")
    async def health() -> Response:
        # 503 too while a failed resize left the KV cache released: no request runs until
        # the engine backs it again, so a load balancer must route elsewhere meanwhile.
        healthy = engine.is_alive and not engine.kv_cache_released
        return Response(status_code=200 if healthy else 503)

    api = APIRouter(dependencies=[Depends(check_api_key)])

    @api.get("/version")
    async def version() -> dict[str, str]:
        return {"version": kvfit.__version__}

    @api.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": config.created, "owned_by": "kvfit",
                "root": config.root, "max_model_len": engine.max_model_len}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(n) for n in config.served_model_names]}

    @api.get("/v1/models/{name:path}")
    async def model(name: str) -> dict[str, Any]:
        # `client.models.retrieve`; a path, as served names hold slashes ("Qwen/Qwen3-0.6B").
        check_model(name)
        return model_card(name)

    def check_model(name: str | None) -> None:
        if name is not None and name not in config.served_model_names:
            # 404, as OpenAI and vLLM answer (the openai client raises NotFoundError).
            raise APIError(f"the model {name!r} does not exist; this server serves "
                           f"{', '.join(config.served_model_names)}", status_code=404,
                           type="not_found_error", param="model", code="model_not_found")

    def tokenizer() -> Any:
        if engine.tokenizer is None:
            raise APIError("the model has no tokenizer: send token ids")
        return engine.tokenizer

    # One thread: requests' large texts are tokenized one at a time, off the event loop.
    tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfit-tokenize")

    def encode_now(texts: list[str], param: str, add_special_tokens: bool) -> list[list[int]]:
        """Each text's token ids. JSON's `\\ud800` escapes can carry lone UTF-16 surrogates,
        which are no Unicode text: the tokenizer raises a TypeError on them, so they are a 400."""
        for text in texts:
            try:
                text.encode()
            except UnicodeEncodeError as e:
                raise APIError(f"{param} holds a lone UTF-16 surrogate "
                               f"({e.object[e.start:e.end]!r}): send valid Unicode text",
                               param=param) from None
        return [tokenizer().encode(t, add_special_tokens=add_special_tokens) for t in texts]

    async def encode(texts: list[str], param: str,
                     add_special_tokens: bool = True) -> list[list[int]]:
        """`encode_now`, on the tokenizer's thread when the texts are long: a prompt of
        megabytes takes seconds to tokenize, during which the event loop would serve no one
        (no stream's tokens, not /health). The tokenizer lets go of the GIL as it works."""
        if sum(map(len, texts)) <= _INLINE_TOKENIZE_CHARS:
            return encode_now(texts, param, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            tokenize_pool, encode_now, texts, param, add_special_tokens)

    def render_chat_now(messages: list[ChatMessage], flags: dict[str, Any]) -> str:
        dicts = [m.template_dict() for m in messages]
        # OpenAI's `developer` role is its `system` role renamed. A template that never names
        # it renders it as an unknown role or drops it (Qwen3's keeps only the roles it
        # knows): there it is the system message it stands for.
        template = config.chat_template or getattr(tokenizer(), "chat_template", None)
        if "developer" not in str(template or ""):
            for message in dicts:
                if message["role"] == "developer":
                    message["role"] = "system"
        try:
            return tokenizer().apply_chat_template(dicts, tokenize=False,
                                                   chat_template=config.chat_template, **flags)
        except APIError:
            raise
        except Exception as e:  # a template error is the messages' fault (or no template)
            raise APIError(f"the chat template could not render the messages: {e}",
                           param="messages") from None

    async def render_chat(body: ChatCompletionRequest | TokenizeRequest) -> str:
        """The messages rendered with the chat template; on the tokenizer's thread when they
        are long or many: the template is Python (jinja), seconds for a body of megabytes,
        and on a thread the event loop keeps its turns at the GIL (streams go on)."""
        flags = body.template_flags()
        # chat_template_kwargs are the template's variables; the call's own arguments
        # (tokenize, return_tensors, ...) are not for a client to set. The signature is read
        # only for a request that sends some, not for every chat request.
        if body.chat_template_kwargs:
            call_args = {"messages", *(
                name for name, p in inspect.signature(tokenizer().apply_chat_template)
                .parameters.items() if p.kind is not inspect.Parameter.VAR_KEYWORD)}
            if clash := sorted(call_args & set(body.chat_template_kwargs)):
                raise APIError(f"chat_template_kwargs may not set {', '.join(clash)}: an "
                               "argument of the template call, not a variable of the template",
                               param=f"chat_template_kwargs.{clash[0]}")
        if sum(map(_chat_message_size, body.messages)) <= _INLINE_TOKENIZE_CHARS:
            return render_chat_now(body.messages, flags)
        return await asyncio.get_running_loop().run_in_executor(
            tokenize_pool, render_chat_now, body.messages, flags)

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("send one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = await render_chat(body)
            (tokens,) = await encode([text], "messages", add_special_tokens=False)
        else:
            (tokens,) = await encode([body.prompt], "prompt", body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    @api.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model)
        vocab = len(tokenizer())
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(f"tokens must be ids in [0, {vocab})", param="tokens")
        return {"prompt": tokenizer().decode(body.tokens)}

    def check_length(num_prompt: int, max_tokens: int | None, where: str,
                     max_field: str, which: str = "") -> int:
        """The request's max_tokens (unset: the rest of the context) after checking that
        prompt and completion fit in max_model_len. `which` tells one prompt of several."""
        limit = engine.max_model_len
        subject = f"the {where}{which}"
        if num_prompt >= limit:
            size = f"{'render to' if where == 'messages' else 'is'} {num_prompt} tokens"
            raise APIError(f"this model's maximum context length is {limit} tokens and "
                           f"{subject} {size}; shorten it to at most {limit - 1} tokens "
                           f"(one is needed for the completion)",
                           param=where, code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt
        if max_tokens >= 1 and num_prompt + max_tokens > limit:
            raise APIError(f"this model's maximum context length is {limit} tokens; you asked "
                           f"for {num_prompt + max_tokens} ({num_prompt} in {subject}, "
                           f"{max_tokens} in the completion): lower {max_field} to at most "
                           f"{limit - num_prompt}", param=max_field,
                           code="context_length_exceeded")
        return max_tokens

    def check_logprobs(n: int | None, param: str) -> None:
        if n is not None and n > engine.max_logprobs:
            raise APIError(f"{param}={n} is above the server's max_logprobs="
                           f"{engine.max_logprobs}", param=param)

    def start(body: _SamplingFields, prompts: list[dict[str, Any]], params: list[SamplingParams]
              ) -> tuple[list[AsyncIterator[RequestOutput]], _Admission]:
        """Take a slot and queue every prompt of a request: all or none."""
        slots.take()
        admission = _Admission(slots, engine)
        streams: list[AsyncIterator[RequestOutput]] = []
        request_id = uuid.uuid4().hex
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                stream = engine.add_request(prompt, sp, f"{request_id}-{i}")
                admission.request_ids.append(stream.request_id)
                streams.append(metrics.track(stream, len(prompt["prompt_token_ids"])))
        except BaseException as e:
            admission.release()
            if isinstance(e, ValueError):
                raise body.value_error(e) from None
            if isinstance(e, _UNAVAILABLE):
                raise engine_error(e) from None
            raise
        return streams, admission

    def engine_error(e: Exception) -> APIError:
        if isinstance(e, ValueError):
            return APIError(str(e))
        if isinstance(e, _UNAVAILABLE):
            return APIError(str(e), 503, "service_unavailable")
        return APIError(str(e), 500, "internal_server_error")

    async def final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        output = None
        async with aclosing(stream):
            async for output in stream:  # noqa: B007 (the last one is the result)
                pass
        return output

    async def all_final(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        # A task group: when one prompt's request fails, the others are aborted.
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(final(s)) for s in streams]
        except ExceptionGroup as e:
            raise e.exceptions[0] from None
        return [task.result() for task in tasks]

    async def run_all(request: Request, streams: list[AsyncIterator[RequestOutput]]
                      ) -> list[RequestOutput]:
        try:
            return await _unless_disconnected(request, all_final(streams))
        except _ENGINE_ERRORS as e:
            raise engine_error(e) from None

    def stream_error(e: Exception) -> APIError:
        """An engine error met after a stream's headers went out: sent as an event."""
        api_error = engine_error(e)
        metrics.failure(api_error.status_code)
        return api_error

    if config.enable_sleep_endpoints:

        @api.post("/sleep")
        async def sleep(level: int = 1, mode: str = "wait") -> dict[str, Any]:
            """Release the KV cache and weights (`LLM.sleep`); what went and what stays."""
            if engine.is_sleeping:  # the engine's own error names LLM calls, not routes
                raise APIError("the engine is asleep already: POST /wake_up first")
            try:
                report = await engine.sleep(level, mode)
            except (ValueError, RuntimeError) as e:
                param = next((p for p in ("level", "mode") if f"{p}=" in str(e)), None)
                raise APIError(str(e), param=param) from None
            return {"level": report.level, "released": report.released, "kept": report.kept,
                    "host_bytes": report.host_bytes}

        @api.post("/wake_up")
        async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> dict[str, Any]:
            """Restore `tags` (`weights`, `kv_cache`; none: everything asleep): 503 when the
            device has no memory for them (they stay asleep: retry once it has)."""
            if not engine.is_sleeping:  # not the tags' fault: nothing is asleep
                raise APIError("the engine is not asleep: POST /sleep first")
            try:
                await engine.wake_up(tags)
            except (KVCacheResizeError, WakeUpOutOfMemoryError) as e:
                raise APIError(str(e), status_code=503, type="service_unavailable") from None
            except (ValueError, RuntimeError) as e:
                raise APIError(str(e), param="tags") from None
            return {"is_sleeping": engine.is_sleeping}

        @api.get("/is_sleeping")
        async def is_sleeping() -> dict[str, bool]:
            return {"is_sleeping": engine.is_sleeping}

    if config.enable_kv_cache_endpoints:

        @api.get("/kv_cache")
        async def kv_cache() -> dict[str, Any]:
            """The KV cache's size, bounds, resize counts and latest resizes."""
            try:
                return await engine.kv_cache_state()
            except _UNAVAILABLE as e:
                raise engine_error(e) from None

        @api.post("/kv_cache/resize")
        async def resize_kv_cache(num_blocks: int) -> dict[str, Any]:
            """Grow or shrink the committed KV cache to `num_blocks` (`LLM.resize_kv_cache`):
            400 out of bounds or for a cache that cannot resize, 503 when a grow finds no
            memory (the cache stays as it was), while a failed resize left the cache
            released (the engine backs it again by itself) or while the engine is asleep
            (wake it first), as generation is then."""
            try:
                event = await engine.resize_kv_cache(num_blocks)
            except KVCacheResizeError as e:
                raise APIError(str(e), status_code=503, type="service_unavailable") from None
            except (ValueError, RuntimeError) as e:
                if isinstance(e, _UNAVAILABLE):
                    raise engine_error(e) from None
                raise APIError(str(e), param="num_blocks") from None
            return dataclasses.asdict(event)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(body.model)
        body.check()
        check_logprobs(body.logprobs, "logprobs")
        check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        given = body.prompts()
        texts = [p for p in given if isinstance(p, str)]
        encoded = iter(await encode(texts, "prompt", body.add_special_tokens) if texts else ())
        prompts = [{"prompt_token_ids": next(encoded), "prompt": p} if isinstance(p, str)
                   else {"prompt_token_ids": p, "prompt": None} for p in given]
        prompts = [truncated(body, p) for p in prompts]
        # The engine computes the prompt's logprobs once, for the echo and the field both.
        prompt_logprobs = _most(body.logprobs if body.echo else None, body.prompt_logprobs)
        # Prompt scoring (echo with max_tokens 0, as OpenAI's legacy API and vLLM take it, and
        # evaluation harnesses send): the engine generates one token, left out of the answer.
        scoring = body.echo and body.max_tokens == 0
        params = [body.sampling_params(
            check_length(len(p["prompt_token_ids"]), 1 if scoring else body.max_tokens,
                         "prompt", "max_tokens", f" at index {i}" if len(prompts) > 1 else ""),
            body.logprobs, prompt_logprobs) for i, p in enumerate(prompts)]
        streams, admission = start(body, prompts, params)
        if scoring:
            streams = [_prompt_only(s) for s in streams]
        ids = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streaming = False
        try:
            echo = [engine_prompt_text(p) for p in prompts] if body.echo else None
            if body.stream:
                response = _EventStream(_completion_events(
                    streams, body, ids, created, model_name, engine, echo, stream_error),
                    admission.release)
                streaming = True
                return response
            outputs = await run_all(request, streams)
        finally:
            if not streaming:
                admission.release()
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text = c.text if echo is None else echo[i] + c.text
                logprobs = None
                if body.logprobs is not None:
                    logprobs = _completion_logprobs(engine, c, body.logprobs, out, bool(echo))
                choice = {"index": i * body.n + c.index, "text": text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(engine, out,
                                                                 body.prompt_logprobs)
                choices.append(choice)
        return {"id": ids, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": _usage(outputs)}

    def truncated(body: _SamplingFields, prompt: dict[str, Any]) -> dict[str, Any]:
        """`prompt` with its ids cut as `truncate_prompt_tokens` asks; a text it no longer
        matches is dropped (an echo then decodes the ids kept)."""
        ids = body.truncate(prompt["prompt_token_ids"], engine.max_model_len)
        if len(ids) == len(prompt["prompt_token_ids"]):
            return prompt
        return {"prompt_token_ids": ids, "prompt": None}

    def engine_prompt_text(prompt: dict[str, Any]) -> str:
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        return "" if engine.tokenizer is None else engine.tokenizer.decode(
            prompt["prompt_token_ids"])

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(body.model)
        body.check()
        num_logprobs = body.num_logprobs()
        check_logprobs(num_logprobs, "top_logprobs")
        check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        text = await render_chat(body)
        (token_ids,) = await encode([text], "messages", body.add_special_tokens)
        prompt = truncated(body, {"prompt_token_ids": token_ids, "prompt": text})
        token_ids = prompt["prompt_token_ids"]
        if not token_ids:
            raise APIError("the messages render to an empty prompt", param="messages")
        max_tokens, max_field = body.requested_max_tokens()
        max_tokens = check_length(len(token_ids), max_tokens, "messages", max_field)
        body._renamed = {"max_tokens": max_field, "logprobs": "top_logprobs"}
        params = body.sampling_params(max_tokens, num_logprobs, body.prompt_logprobs)
        streams, admission = start(body, [prompt], [params])
        ids = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        if body.stream:
            try:
                return _EventStream(_stream_chat(streams[0], body, ids, created, model_name,
                                                 engine, num_logprobs, stream_error,
                                                 len(token_ids)),
                                    admission.release)
            except BaseException:
                admission.release()
                raise
        try:
            (out,) = await run_all(request, streams)
        finally:
            admission.release()
        choices = [{"index": c.index,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": (None if num_logprobs is None
                                 else {"content": _chat_logprobs(engine, c, 0, num_logprobs)}),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                   for c in out.outputs]
        answer = {"id": ids, "object": "chat.completion", "created": created,
                  "model": model_name, "choices": choices, "usage": _usage([out])}
        if body.prompt_logprobs is not None:  # vLLM's place for them: beside the choices
            answer["prompt_logprobs"] = _prompt_logprobs(engine, out, body.prompt_logprobs)
        return answer

    app.include_router(api)
    app.add_middleware(_InternalErrors, answer=internal)
    if config.max_request_body_bytes is not None:
        app.add_middleware(BodyLimit, limit=config.max_request_body_bytes)
    return app


def _chat_message_size(message: ChatMessage) -> int:
    """About how many characters `message` adds to a rendered chat: its text and a header."""
    content = message.content
    if isinstance(content, list):
        return 64 + sum(len(part.text) for part in content)
    return 64 + len(content or "")


# What pydantic puts in an error's `loc` for the member of a union that failed
# (`str | list[str]` ...): not a field, so not part of the `param` named.
_UNION_MEMBER = re.compile(r"(str|int|float|bool|(list|dict)\[.*\]|[A-Z]\w*)")
_LOC_SOURCES = ("body", "query", "path", "header", "cookie")


def _validation_error(errors: Sequence[dict[str, Any]]) -> APIError:
    """A 400 for pydantic's `errors`, its `param` the field path of the first (`messages.0.role`,
    `num_blocks`). A value that fits no member of a union gets what each member found wrong."""
    loc = list(errors[0].get("loc", ()))
    if loc and loc[0] in _LOC_SOURCES:
        loc = loc[1:]
    tag = next((i for i, part in enumerate(loc)
                if isinstance(part, str) and _UNION_MEMBER.fullmatch(part)), None)
    if tag is None:
        param = ".".join(map(str, loc)) or None
        message = f"{param or 'the request body'}: {errors[0].get('msg', 'invalid')}"
        if errors[0].get("type") == "extra_forbidden":
            message = (f"{param}: unknown field (this server refuses fields it does not know "
                       "rather than ignoring them)")
        elif not loc and errors[0].get("type") == "missing":
            message = "the request body is empty: send a JSON object"
        elif not loc and errors[0].get("type") in ("model_attributes_type", "dict_type"):
            # No JSON object: often a body sent without `Content-Type: application/json`.
            message = ("the request body must be a JSON object, sent with "
                       "'Content-Type: application/json'")
        return APIError(message, param=param)
    param = ".".join(map(str, loc[:tag])) or None
    reasons = []
    for error in errors:  # every member's error, in the order pydantic tried them
        other = list(error.get("loc", ()))
        if other and other[0] in _LOC_SOURCES:
            other = other[1:]
        if len(other) > tag and other[:tag] == loc[:tag]:
            where = ".".join(map(str, other[tag + 1:]))
            reasons.append(f"as {other[tag]}{f' (at {where})' if where else ''}: "
                           f"{error.get('msg', 'invalid')}")
    return APIError(f"{param or 'the request body'} fits none of its types: "
                    f"{'; '.join(reasons)}", param=param)


class _InternalErrors:
    """ASGI middleware: an unexpected exception of a route is answered with a 500 OpenAI error
    body. Not `exception_handler(Exception)`: Starlette's ServerErrorMiddleware, which runs
    those, re-raises after answering, and uvicorn then closes the connection, so the client's
    next request on it (keep-alive) fails too."""

    def __init__(self, app: Any, answer: Callable[[Exception], Response]) -> None:
        self.app, self.answer = app, answer

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            if started:  # too late for an error body: the connection has to go
                raise
            await self.answer(e)(scope, receive, send)


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (which aborts its requests) if the client goes away."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with suppress(asyncio.CancelledError):
            await task
        raise APIError("the client disconnected", 499, "client_disconnected")
    return task.result()


async def _prompt_only(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A prompt-scoring request's one output, once it is finished: its prompt (and prompt
    logprobs) with empty completions, the token generated to get them left out."""
    async with aclosing(stream):
        async for out in stream:  # noqa: B007 (the last one is the result)
            pass
    out.outputs = [CompletionOutput(
        index=c.index, text="", token_ids=[],
        cumulative_logprob=None if c.logprobs is None else 0.0,
        logprobs=None if c.logprobs is None else [], finish_reason="length")
        for c in out.outputs]
    yield out


def _usage(outputs: list[RequestOutput]) -> dict[str, int]:
    return usage(sum(len(o.prompt_token_ids) for o in outputs),
                 sum(len(c.token_ids) for o in outputs for c in o.outputs))


def _top(entries: Logprobs, num: int) -> list[tuple[int, Any]]:
    """The `num` most likely entries, most likely first."""
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
    return ranked[:num]


def _most(*nums: int | None) -> int | None:
    """The largest of the logprob counts given, None where none is."""
    given = [n for n in nums if n is not None]
    return max(given) if given else None


def _prompt_logprobs(engine: AsyncLLM, out: RequestOutput, num: int
                     ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of an answer: None at the first prompt token (nothing comes
    before it), then at each position its own token and the `num` most likely, keyed by token
    id, each with its logprob, rank (1 = most likely) and text."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entries in zip(out.prompt_token_ids, out.prompt_logprobs or (), strict=False):
        if entries is None:
            result.append(None)
            continue
        own = [(token_id, entries[token_id])] if token_id in entries else []
        result.append({str(t): {"logprob": e.logprob, "rank": e.rank,
                                "decoded_token": (e.decoded_token if e.decoded_token is not None
                                                  else engine.decode_token(t))}
                       for t, e in [*own, *_top(entries, num)]})
    return result


def _completion_logprobs(engine: AsyncLLM, c: CompletionOutput, num: int, out: RequestOutput,
                         echo: bool, start: int = 0, text_offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions logprobs of tokens `start:` of `c` (with the prompt's first when
    `echo`): token texts, their logprobs, each one's top `num` and itself, and text offsets."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    pairs: list[tuple[int, Logprobs | None]] = []
    if echo and out.prompt_logprobs is not None:
        pairs += list(zip(out.prompt_token_ids, out.prompt_logprobs, strict=False))
    pairs += list(zip(c.token_ids[start:], c.logprobs[start:], strict=False))
    offsets, offset = [], text_offset
    for token_id, entries in pairs:
        text = engine.decode_token(token_id) or ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entries is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        chosen = entries.get(token_id)
        token_logprobs.append(None if chosen is None else chosen.logprob)
        # As vLLM and OpenAI's completions: the sampled token first, then the `num` most
        # likely (up to num + 1 entries; logprobs=0 gives the sampled token alone).
        top = {} if chosen is None else {(chosen.decoded_token or ""): chosen.logprob}
        top.update({(e.decoded_token or ""): e.logprob for _, e in _top(entries, num)})
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _chat_logprobs(engine: AsyncLLM, c: CompletionOutput, start: int, num: int
                   ) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs `content` entries of tokens `start:` of `c`. `bytes` are each
    token's own (a token holding part of a character has the part's bytes, not those of its
    text, U+FFFD), so a client can join them into the characters."""
    def entry(token_id: int, e: Any) -> dict[str, Any]:
        return {"token": e.decoded_token or "", "logprob": e.logprob,
                "bytes": list(engine.token_bytes(token_id))}

    content = []
    for token_id, entries in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
        item = entry(token_id, entries[token_id])
        item["top_logprobs"] = [entry(t, e) for t, e in _top(entries, num)]
        content.append(item)
    return content


_SSE_CONTENT_TYPE = (b"content-type", b"text/event-stream; charset=utf-8")
_SSE_DONE = {"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False}


_SERVER_SEND = "kvfit.server_send"


class _App(FastAPI):
    """The app, which puts the server's own `send` in each request's scope: a streamed
    response's events go straight to it, not through a send wrapper per middleware (four:
    Starlette's error and exception middlewares, `_InternalErrors`, the route's), each an
    await an event at one event per token per stream. Those wrappers only note that the
    response started, which its start, sent through them, tells them; a middleware that
    changed response bodies would have to go without this."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope[_SERVER_SEND] = send
        await super().__call__(scope, receive, send)


class _EventStream(Response):
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
        # body straight to the server (see `_App`).
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


async def _merged(streams: list[AsyncIterator[RequestOutput]]
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


async def _stream_completion(streams: list[AsyncIterator[RequestOutput]],
                             body: CompletionRequest, ids: str, created: int, model: str,
                             engine: AsyncLLM, echo: list[str] | None,
                             engine_error: Callable[[Exception], APIError]
                             ) -> AsyncIterator[dict[str, Any]]:
    sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, index) -> (chars, tokens)
    done: set[tuple[int, int]] = set()
    outputs: dict[int, RequestOutput] = {}
    base = {"id": ids, "object": "text_completion", "created": created, "model": model}
    extra = {"usage": None} if body.include_usage else {}
    # Read once: the loop runs for every token of every stream.
    num_logprobs, n, continuous_usage = body.logprobs, body.n, body.continuous_usage
    # One prompt (the common request) is read directly: a pass-through generator between
    # the stream and this one would cost every token two more generator switches.
    single = len(streams) == 1
    source = streams[0] if single else _merged(streams)
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
                    first_echo = echo is not None and key not in sent
                    if first_echo:
                        text = echo[i] + text
                    logprobs = None
                    if num_logprobs is not None:
                        # As unstreamed: the echoed prompt's tokens lead, and offsets count its
                        # text.
                        offset = 0 if first_echo else chars + (len(echo[i]) if echo else 0)
                        logprobs = _completion_logprobs(engine, c, num_logprobs, out,
                                                        first_echo, tokens, offset)
                    sent[key] = (len(c.text), len(c.token_ids))
                    if c.finish_reason is not None:
                        done.add(key)
                    choices.append({"index": i * n + c.index, "text": text,
                                    "logprobs": logprobs, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
                if choices:
                    if continuous_usage:
                        extra = {"usage": _usage(list(outputs.values()))}
                    yield {**base, "choices": choices, **extra}
    except _ENGINE_ERRORS as e:
        yield engine_error(e).body()
        return
    if body.include_usage:
        yield {**base, "choices": [], "usage": _usage(list(outputs.values()))}


def _completion_events(streams: list[AsyncIterator[RequestOutput]], body: CompletionRequest,
                       ids: str, created: int, model: str, engine: AsyncLLM,
                       echo: list[str] | None, engine_error: Callable[[Exception], APIError]
                       ) -> AsyncIterator[dict[str, Any] | bytes]:
    """A streamed completion's events: `_stream_plain_completion` for the common request,
    else `_stream_completion`."""
    if len(streams) == 1 and body.n == 1 and body.logprobs is None and echo is None and (
            not body.continuous_usage):
        return _stream_plain_completion(streams[0], body, ids, created, model, engine_error)
    return _stream_completion(streams, body, ids, created, model, engine, echo, engine_error)


async def _stream_plain_completion(stream: AsyncIterator[RequestOutput],
                                   body: CompletionRequest, ids: str, created: int, model: str,
                                   engine_error: Callable[[Exception], APIError]
                                   ) -> AsyncIterator[dict[str, Any] | bytes]:
    """`_stream_completion` of the common request (one prompt, one completion, no logprobs,
    no echo, no usage in every chunk), its events' lines the same bytes, built from parts
    encoded once: the request's fields and those of a chunk that does not end it. A chunk is
    then its text's JSON and two joins, not three dicts, a list and their encoding, at one
    chunk per token per stream."""
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
    except _ENGINE_ERRORS as e:
        yield engine_error(e).body()
        return
    if body.include_usage and out is not None:
        yield {**base, "choices": [], "usage": _usage([out])}


async def _stream_chat(stream: AsyncIterator[RequestOutput], body: ChatCompletionRequest,
                       ids: str, created: int, model: str, engine: AsyncLLM,
                       num_logprobs: int | None, engine_error: Callable[[Exception], APIError],
                       num_prompt_tokens: int) -> AsyncIterator[dict[str, Any]]:
    base = {"id": ids, "object": "chat.completion.chunk", "created": created, "model": model}
    extra = {"usage": None} if body.include_usage else {}
    # With continuous usage every chunk carries it, the role chunk too (nothing generated yet).
    first = {"usage": usage(num_prompt_tokens, 0)} if body.continuous_usage else extra
    yield {**base, "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
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
                        logprobs = {"content": _chat_logprobs(engine, c, tokens, num_logprobs)}
                    choices.append({"index": c.index, "delta": {"content": c.text[chars:]},
                                    "logprobs": logprobs, "finish_reason": c.finish_reason,
                                    "stop_reason": c.stop_reason})
                    sent[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
                if choices:
                    if body.continuous_usage:
                        extra = {"usage": _usage([out])}
                    yield {**base, "choices": choices, **extra}
    except _ENGINE_ERRORS as e:
        yield engine_error(e).body()
        return
    if body.include_usage and out is not None:
        yield {**base, "choices": [], "usage": _usage([out])}
