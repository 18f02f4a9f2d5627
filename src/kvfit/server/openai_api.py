"""The OpenAI-compatible HTTP API over an `AsyncLLM`: `build_app(engine, ServeConfig)` puts
`serving.OpenAIServing`'s routes behind the server's error handling (every error an OpenAI error
body, an unknown route answered with the routes there are), its API key and its body limit."""

from __future__ import annotations

import logging
import re
import string
import urllib.parse
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import kvfit
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.body_limit import BodyLimit
from kvfit.server.metrics import ServerMetrics
from kvfit.server.protocol import UNSUPPORTED_FIELDS, APIError
from kvfit.server.serving import REQUEST_ID_STATE, OpenAIServing, ServeConfig
from kvfit.server.streaming import DirectSendApp

__all__ = ["ServeConfig", "build_app"]
logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, config: ServeConfig) -> FastAPI:
    """A FastAPI app serving `engine` (which it does not own: shut it down after the app)."""
    docs = {"openapi_url": None, "docs_url": None, "redoc_url": None} \
        if config.disable_fastapi_docs else {}
    app = DirectSendApp(title="kvfit", version=kvfit.__version__, **docs)
    app.served_root_path = config.root_path
    metrics = ServerMetrics(engine, config.served_model_names[0],
                            multiprocess=config.multiprocess_metrics)
    serving = OpenAIServing(engine, config, metrics)
    app.state.engine, app.state.metrics, app.state.config = engine, metrics, config
    app.state.serving = serving  # the server stops its requests (`api_servers.uvicorn_server`)

    def error(e: APIError, headers: Mapping[str, str] | None = None) -> JSONResponse:
        metrics.failure(e.status_code)
        return JSONResponse(e.body(), status_code=e.status_code, headers=headers)

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
        if isinstance(e.__cause__, ClientDisconnect):
            # FastAPI's 400 for a body it could not read, here because the client left while
            # sending it: no invalid request (nobody reads the answer), a client that left.
            return error(APIError("the client disconnected while sending the request body",
                                  499, "client_disconnected"))
        if e.status_code == 400 and message == _UNPARSED_BODY and e.__cause__ is not None:
            # FastAPI's words for a body its JSON parser raised on other than with a
            # JSONDecodeError; the cause says what is wrong (bytes that are not UTF-8, nesting
            # too deep for the parser).
            message = f"the request body could not be read as JSON: {e.__cause__}"
        if e.status_code in (404, 405) and message in ("Not Found", "Method Not Allowed"):
            # No route matched: say which there are (an OpenAI client calling
            # /v1/embeddings or /v1/responses learns this server does not serve them).
            routes = [f"{method} {route.path}" for route in (*app.routes, *api.routes)
                      if isinstance(route, APIRoute)
                      for method in sorted(route.methods - {"HEAD"})]
            message = (f"{request.method} {request.url.path} is not served here; this server "
                       f"serves {', '.join(routes)}")
        # A 405's `Allow` (the route's methods), which HTTP requires of one.
        return error(APIError(message, status_code=e.status_code, type=kind), e.headers)

    def internal(e: Exception) -> JSONResponse:
        logger.exception("request failed", exc_info=e)
        return error(APIError(f"internal error: {e}", 500, "internal_server_error"))

    def get(router: FastAPI | APIRouter, path: str, route: Callable[..., Any],
            *methods: str) -> None:
        # HEAD too, as HTTP asks of every GET resource (RFC 9110 9.1): a monitor probing
        # /health with HEAD gets GET's status and headers (no body), not a 405.
        router.api_route(path, methods=["GET", "HEAD", *methods])(route)

    get(app, "/health", serving.health)
    # vLLM's /ping (SageMaker's health check, by GET or POST): /health's answer, no key needed.
    get(app, "/ping", serving.health, "POST")
    api = APIRouter(dependencies=[Depends(serving.check_api_key)])
    get(api, "/version", serving.version)
    get(api, "/metrics", serving.metrics_route)
    get(api, "/v1/models", serving.models)
    get(api, "/v1/models/{name:path}", serving.model)
    api.post("/tokenize")(serving.tokenize)
    api.post("/detokenize")(serving.detokenize)
    if config.enable_sleep_endpoints:
        api.post("/sleep")(serving.sleep)
        api.post("/wake_up")(serving.wake_up)
        get(api, "/is_sleeping", serving.is_sleeping)
    if config.enable_pause_endpoints:
        api.post("/pause")(serving.pause)
        api.post("/resume")(serving.resume)
        get(api, "/is_paused", serving.is_paused)
    if config.enable_kv_cache_endpoints:
        get(api, "/kv_cache", serving.kv_cache)
        api.post("/kv_cache/resize")(serving.resize_kv_cache)
        api.post("/reset_prefix_cache")(serving.reset_prefix_cache)
    api.post("/v1/completions")(serving.completions)
    api.post("/v1/chat/completions")(serving.chat_completions)
    api.post("/invocations")(serving.invocations)  # SageMaker's, beside /ping
    app.include_router(api)
    app.add_middleware(_InternalErrors, answer=internal)
    if config.max_request_body_bytes is not None:
        app.add_middleware(BodyLimit, limit=config.max_request_body_bytes)
    # Outermost (added last): a preflight is answered before the API key is asked for, and
    # the errors of the layers below (413, 500, 401) carry the headers too, so a browser's
    # script can read them. A streamed answer's start goes through it (`EventStream`).
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                       allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers,
                       allow_credentials=config.allow_credentials)
    if config.enable_request_id_headers:
        app.add_middleware(_RequestIdHeader)
    return app


_UNPARSED_BODY = "There was an error parsing the body"
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
        if errors[0].get("type") == "extra_forbidden" and len(loc) == 1 and (
                loc[0] in UNSUPPORTED_FIELDS):
            # A field of vLLM's or OpenAI's API this route does not take: why.
            message = f"{param}: {UNSUPPORTED_FIELDS[loc[0]]}"
        elif errors[0].get("type") == "extra_forbidden":
            message = (f"{param}: unknown field (this server refuses fields it does not know "
                       "rather than ignoring them)")
        elif not loc and errors[0].get("type") == "missing":
            message = "the request body is empty: send a JSON object"
        elif not loc and errors[0].get("type") in ("model_attributes_type", "dict_type",
                                                   "model_type"):
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


_HEADER_SAFE = "".join(sorted(set(string.printable) - set(string.whitespace) - {"%"})) + " "


class _RequestIdHeader:
    """ASGI middleware (`--enable-request-id-headers`): every answer carries `X-Request-Id`,
    the id its body is named by (`cmpl-<id>`), else the client's header, else a new one, as
    vLLM's. Outermost, so errors of the layers below carry it too."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # The route names the answer in this dict (`serving._response_id`); one the routing's
        # copies of the scope share.
        state = scope.setdefault("state", {})

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer_id = state.get(REQUEST_ID_STATE) or next(
                    (value.decode("latin-1") for name, value in scope["headers"]
                     if name == b"x-request-id" and value), None) or uuid.uuid4().hex
                # A body's request_id may hold what a header may not (a line break, non-ASCII
                # text): percent-encoded there, never a broken answer.
                value = urllib.parse.quote(answer_id, safe=_HEADER_SAFE).encode()
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", value)]
            await send(message)

        await self.app(scope, receive, send_with_id)
