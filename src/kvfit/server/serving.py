"""The OpenAI-compatible routes' work over an `AsyncLLM`: `OpenAIServing`, one per app, whose
methods `openai_api.build_app` serves."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

import kvfit
from kvfit.engine.kv_resize import KVCacheResizeError
from kvfit.engine.outputs import CompletionOutput, RequestOutput
from kvfit.engine.prompts import template_call_args
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sleep import WakeUpOutOfMemoryError
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.errors import ENGINE_ERRORS, UNAVAILABLE, engine_error
from kvfit.server.metrics import ServerMetrics
from kvfit.server.protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
    _SamplingFields,
)
from kvfit.server.request_log import RequestLog
from kvfit.server.responses import (
    chat_logprobs,
    completion_logprobs,
    most,
    prompt_logprobs,
    usage_of,
)
from kvfit.server.streaming import EventStream, completion_events, stream_chat

T = TypeVar("T")
# Characters of a request's texts tokenized on the event loop (a few ms); more go to a thread.
_INLINE_TOKENIZE_CHARS = 1 << 14
# Token ids decoded (or looked up) on the event loop, a few ms; more go to the same thread.
_INLINE_DETOKENIZE_TOKENS = 1 << 12


@dataclass
class ServeConfig:
    """Server settings (the engine's are `EngineArgs`).

    `served_model_names`: the names clients may ask for (the first is reported); `api_key`
    (one, or a list of which clients send any): when set, every route but `/health` and
    `/ping` needs `Authorization: Bearer <key>`;
    `max_concurrent_requests`: generation requests in progress at once, beyond which new ones
    get 503 (None: unbounded). `max_request_body_bytes`: larger request bodies get 413 before
    they are read whole (None: unbounded). `enable_sleep_endpoints`: serve `/sleep`, `/wake_up` and
    `/is_sleeping` (an engine with sleep mode, behind the development flag: they let any
    client take the model away from every other). `enable_kv_cache_endpoints`: serve
    `GET /kv_cache`, `POST /kv_cache/resize?num_blocks=N` and vLLM's `POST
    /reset_prefix_cache` (behind the development flag too). `enable_pause_endpoints`: serve
    vLLM's `POST /pause`, `POST /resume` and `GET /is_paused` (the development flag as well).
    `multiprocess_metrics`: `/metrics` sums the request figures of every API server process
    (`--api-server-count` > 1; prometheus_client's multiprocess mode, `PROMETHEUS_MULTIPROC_DIR`).
    `chat_template`: a Jinja chat template used instead of the tokenizer's own (None: the
    tokenizer's). `shutdown_timeout`: seconds a stopping server (SIGINT, SIGTERM) gives the
    generation requests in progress to finish before it aborts them (0: at once, as vLLM's
    `--shutdown-timeout` default); new ones get 503 meanwhile.
    `enable_prompt_tokens_details`: the usage carries `prompt_tokens_details.cached_tokens`
    (vLLM's `--enable-prompt-tokens-details`, off by default as there).
    `allowed_origins`, `allowed_methods`, `allowed_headers`, `allow_credentials`: the CORS
    policy (vLLM's flags and defaults: every origin, method and header, no credentials); the
    server answers browsers' preflight requests and puts the headers on every answer, streamed
    ones included.
    `root_path`: the path prefix a proxy serves the app under (FastAPI's `root_path`, vLLM's
    `--root-path`). `response_role`: a chat answer's role where the request asks for a new
    turn (`add_generation_prompt`; else the last message's role, as vLLM answers).
    `disable_fastapi_docs`: no `/docs`, `/redoc` nor `/openapi.json`. `enable_request_id_headers`:
    every answer carries an `X-Request-Id` header, the id its body is named by.
    `disable_uvicorn_access_log`: uvicorn logs no line per request;
    `disable_access_log_for_endpoints`: none for requests to these paths.
    `return_tokens_as_token_ids`: the default of the requests' field of that name (vLLM's
    `--return-tokens-as-token-ids`). `enable_force_include_usage`: every streamed answer ends
    with the usage, as though it asked for it (vLLM's `--enable-force-include-usage`).
    `default_chat_template_kwargs`: chat template variables under each request's own
    `chat_template_kwargs` (vLLM's `--default-chat-template-kwargs`).
    `enable_log_requests`: log each generation request on the `kvfit` logger at INFO as it is
    queued and as it ends (`request_log`; vLLM's `--enable-log-requests`), its prompt cut to
    `max_log_len` characters (None: whole; vLLM's `--max-log-len`). `enable_log_outputs`:
    with `enable_log_requests`, also each completion's generated text and token ids as the
    request ends, cut alike (vLLM's `--enable-log-outputs`; alone it logs nothing).
    `admission_counts`: with several API server processes (`--api-server-count`), each one's
    generation requests in progress, in shared memory (a `RawArray`, one entry a process,
    this one's at `api_server_index`), so that `max_concurrent_requests` bounds the server's
    total rather than each process's.
    """

    served_model_names: list[str]
    api_key: str | list[str] | None = None
    max_concurrent_requests: int | None = 1024
    root: str | None = None  # the model folder, shown by /v1/models
    enable_sleep_endpoints: bool = False
    enable_kv_cache_endpoints: bool = False
    enable_pause_endpoints: bool = False
    max_request_body_bytes: int | None = 64 << 20
    multiprocess_metrics: bool = False
    chat_template: str | None = None
    shutdown_timeout: float = 0.0
    enable_prompt_tokens_details: bool = False
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    root_path: str = ""
    response_role: str = "assistant"
    disable_fastapi_docs: bool = False
    enable_request_id_headers: bool = False
    disable_uvicorn_access_log: bool = False
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    disable_access_log_for_endpoints: list[str] = field(default_factory=list)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    enable_log_requests: bool = False
    max_log_len: int | None = None
    enable_log_outputs: bool = False
    admission_counts: Any = None
    api_server_index: int = 0
    created: int = field(default_factory=lambda: int(time.time()))


class _Slots:
    """The generation requests in progress, counted against the bound (one event loop: no
    lock); none is taken once the server is stopping. With `counts` (one entry per API server
    process in shared memory, this one's at `index`) the bound is on their sum: each process
    writes only its own entry, and takes a slot first and checks the sum after, so two
    processes taking the last slot at once both see the other and both refuse (a retry gets
    it) rather than both pass."""

    def __init__(self, limit: int | None, counts: Any = None, index: int = 0) -> None:
        self.limit = limit
        self.held: set[_Admission] = set()
        self.stopping = False
        self._counts, self._index = counts, index

    def take(self, admission: _Admission) -> None:
        if self.stopping:
            raise APIError("the server is shutting down; send the request to another",
                           status_code=503, type="service_unavailable")
        self.held.add(admission)
        if self.limit is None:
            return
        self._publish()
        if (len(self.held) if self._counts is None else sum(self._counts)) > self.limit:
            self.give(admission)
            raise APIError(f"the server has {self.limit} generation requests in progress, its "
                           f"limit (--max-concurrent-requests); retry later",
                           status_code=503, type="service_unavailable")

    def give(self, admission: _Admission) -> None:
        self.held.discard(admission)
        self._publish()

    def _publish(self) -> None:
        if self._counts is not None:
            self._counts[self._index] = len(self.held)


@dataclass(eq=False)  # held in a set, by identity
class _Admission:
    """A generation request's slot and engine requests, released once however the HTTP
    request ends: the slot given back and every engine request aborted (a no-op for those
    that finished), so nothing outlives its client."""

    slots: _Slots
    engine: AsyncLLM
    request_ids: list[str] = field(default_factory=list)
    released: bool = False

    def abort(self) -> None:
        for request_id in self.request_ids:
            self.engine.abort(request_id)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.slots.give(self)
            self.abort()


class OpenAIServing:
    """The routes of one app over `engine` (which it does not own), and what they share: the
    served names, the API key, the slots of `max_concurrent_requests`, the tokenizer's
    thread and the request metrics."""

    def __init__(self, engine: AsyncLLM, config: ServeConfig, metrics: ServerMetrics) -> None:
        self.engine, self.config, self.metrics = engine, config, metrics
        self.slots = _Slots(config.max_concurrent_requests, config.admission_counts,
                            config.api_server_index)
        self.model_name = config.served_model_names[0]
        # One thread: requests' large texts are tokenized one at a time, off the event loop.
        self.tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="kvfit-tokenize")
        self.request_log = RequestLog(config.max_log_len, config.enable_log_outputs) \
            if config.enable_log_requests else None

    # -- checks ------------------------------------------------------------------------------

    async def check_api_key(self, request: Request) -> None:
        """The dependency of every route but /health and /ping when the server has an API key."""
        if self.config.api_key is None:
            return
        keys = [self.config.api_key] if isinstance(self.config.api_key, str) \
            else self.config.api_key
        # The scheme is case-insensitive (RFC 9110); the key is compared in constant time, so
        # response times do not tell a guesser how much of it is right (and with every key,
        # nor which).
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        sent = key.strip().encode()
        matches = [hmac.compare_digest(sent, k.encode()) for k in keys]
        if scheme.lower() != "bearer" or not any(matches):
            raise APIError("a valid API key is needed: send 'Authorization: Bearer <key>'",
                           status_code=401, type="authentication_error", code="invalid_api_key")

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """generation_config.json's sampling defaults (`--generation-config`)."""
        return self.engine.config.model_config.sampling_defaults

    def server_defaults(self, body: _SamplingFields) -> None:
        """The server's defaults of a generation request's fields it leaves unset."""
        if self.config.return_tokens_as_token_ids and (
                "return_tokens_as_token_ids" not in body.model_fields_set):
            body.return_tokens_as_token_ids = True
        if self.config.enable_force_include_usage and body.stream:
            # vLLM's: the usage comes whatever the request's include_usage says.
            options = body.stream_options or StreamOptions()
            options.include_usage = True
            body.stream_options = options

    def check_model(self, name: str | None) -> None:
        # No name, or an empty one, asks for the served model, as vLLM takes it: clients and
        # UIs that leave the model blank send `"model": ""`.
        if name and name not in self.config.served_model_names:
            # 404, as OpenAI and vLLM answer (the openai client raises NotFoundError).
            raise APIError(f"the model {name!r} does not exist; this server serves "
                           f"{', '.join(self.config.served_model_names)}", status_code=404,
                           type="not_found_error", param="model", code="model_not_found")

    def check_length(self, num_prompt: int, max_tokens: int | None, where: str,
                     max_field: str, which: str = "") -> int:
        """The request's max_tokens (unset: the rest of the context) after checking that
        prompt and completion fit in max_model_len, at most generation_config.json's
        `max_new_tokens` where it sets one (as vLLM caps). `which` tells one prompt of several."""
        limit = self.engine.max_model_len
        subject = f"the {where}{which}"
        if num_prompt == 0:
            empty = "render to no tokens" if where == "messages" else "is empty"
            raise APIError(f"{subject} {empty}", param=where)
        if num_prompt >= limit:
            size = f"{'render to' if where == 'messages' else 'is'} {num_prompt} tokens"
            raise APIError(f"this model's maximum context length is {limit} tokens and "
                           f"{subject} {size}; shorten it to at most {limit - 1} tokens "
                           f"(one is needed for the completion)",
                           param=where, code="context_length_exceeded")
        cap = self.sampling_defaults.get("max_tokens")
        if max_tokens is None:
            return min(limit - num_prompt, cap or limit)
        if max_tokens >= 1 and num_prompt + max_tokens > limit:
            raise APIError(f"this model's maximum context length is {limit} tokens; you asked "
                           f"for {num_prompt + max_tokens} ({num_prompt} in {subject}, "
                           f"{max_tokens} in the completion): lower {max_field} to at most "
                           f"{limit - num_prompt}", param=max_field,
                           code="context_length_exceeded")
        return max_tokens if cap is None or max_tokens < 1 else min(max_tokens, cap)

    def check_logprobs(self, n: int | None, param: str, whole_vocab: bool = True) -> int | None:
        """`n` checked against the server's max_logprobs; -1 (vLLM's "the whole vocabulary",
        where `whole_vocab`: prompt_logprobs and chat's top_logprobs, not completions'
        logprobs) as the vocabulary's size, the count the answer's entries are cut to."""
        asked = n
        if n == -1 and whole_vocab:
            n = self.engine.config.model_config.hf_config.vocab_size
            asked = f"-1 (the whole vocabulary, {n})"
        if n is not None and n < 0:
            raise APIError(f"{param} must be >= 0{', or -1' if whole_vocab else ''}, got {n}",
                           param=param)
        if n is not None and n > self.engine.max_logprobs:
            raise APIError(f"{param}={asked} is above the server's max_logprobs="
                           f"{self.engine.max_logprobs} (--max-logprobs)", param=param)
        return n

    # -- text --------------------------------------------------------------------------------

    def tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise APIError("the model has no tokenizer: send token ids")
        return self.engine.tokenizer

    def encode_now(self, texts: list[str], param: str,
                   add_special_tokens: bool) -> list[list[int]]:
        """Each text's token ids. JSON's `\\ud800` escapes can carry lone UTF-16 surrogates,
        which are no Unicode text: the tokenizer raises a TypeError on them, so they are a 400."""
        for text in texts:
            try:
                text.encode()
            except UnicodeEncodeError as e:
                raise APIError(f"{param} holds a lone UTF-16 surrogate "
                               f"({e.object[e.start:e.end]!r}): send valid Unicode text",
                               param=param) from None
        return [self.tokenizer().encode(t, add_special_tokens=add_special_tokens) for t in texts]

    async def encode(self, texts: list[str], param: str,
                     add_special_tokens: bool = True) -> list[list[int]]:
        """`encode_now`, on the tokenizer's thread when the texts are long: a prompt of
        megabytes takes seconds to tokenize, during which the event loop would serve no one
        (no stream's tokens, not /health). The tokenizer lets go of the GIL as it works."""
        if sum(map(len, texts)) <= _INLINE_TOKENIZE_CHARS:
            return self.encode_now(texts, param, add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenize_pool, self.encode_now, texts, param, add_special_tokens)

    async def token_work(self, num_tokens: int, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)`, tokenizer work over `num_tokens` token ids: on the tokenizer's
        thread when they are many, as `encode` does (a million ids decode in most of a second,
        which on the event loop would stall every stream and /health)."""
        if num_tokens <= _INLINE_DETOKENIZE_TOKENS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work,
                                                                 *args)

    def decode_now(self, tokens: list[int]) -> str:
        vocab = len(self.tokenizer())
        if any(not 0 <= t < vocab for t in tokens):
            raise APIError(f"tokens must be ids in [0, {vocab})", param="tokens")
        return self.tokenizer().decode(tokens)

    def render_chat_now(self, messages: list[ChatMessage], flags: dict[str, Any]) -> str:
        dicts = [m.template_dict() for m in messages]
        # OpenAI's `developer` role is its `system` role renamed. A template that never names
        # it renders it as an unknown role or drops it (Qwen3's keeps only the roles it
        # knows): there it is the system message it stands for.
        chat_template = self.config.chat_template
        template = chat_template or getattr(self.tokenizer(), "chat_template", None)
        if "developer" not in str(template or ""):
            for message in dicts:
                if message["role"] == "developer":
                    message["role"] = "system"
        try:
            return self.tokenizer().apply_chat_template(dicts, tokenize=False,
                                                        chat_template=chat_template, **flags)
        except APIError:
            raise
        except Exception as e:  # a template error is the messages' fault (or no template)
            raise APIError(f"the chat template could not render the messages: {e}",
                           param="messages") from None

    async def render_chat(self, body: ChatCompletionRequest | TokenizeRequest) -> str:
        """The messages rendered with the chat template; on the tokenizer's thread when they
        are long or many: the template is Python (jinja), seconds for a body of megabytes,
        and on a thread the event loop keeps its turns at the GIL (streams go on)."""
        # The server's defaults under the request's own variables (vLLM's order).
        flags = {**self.config.default_chat_template_kwargs, **body.template_flags()}
        # chat_template_kwargs are the template's variables; the call's own arguments
        # (tokenize, return_tensors, ...) are not for a client to set. The signature is read
        # only for a request that sends some, not for every chat request.
        if body.chat_template_kwargs:
            call_args = template_call_args(self.tokenizer().apply_chat_template)
            if clash := sorted(call_args & set(body.chat_template_kwargs)):
                # Those the request has a field of its own for (documents, ...): say so.
                own = " (send it as the request's own field)" if clash[0] in type(
                    body).model_fields else ""
                raise APIError(f"chat_template_kwargs may not set {', '.join(clash)}: an "
                               "argument of the template call, not a variable of the "
                               f"template{own}", param=f"chat_template_kwargs.{clash[0]}")
        size = sum(map(_chat_message_size, body.messages)) + sum(
            len(key) + len(value) for doc in body.documents or () for key, value in doc.items())
        if size <= _INLINE_TOKENIZE_CHARS:
            return self.render_chat_now(body.messages, flags)
        return await asyncio.get_running_loop().run_in_executor(
            self.tokenize_pool, self.render_chat_now, body.messages, flags)

    def truncated(self, body: _SamplingFields, prompt: dict[str, Any]) -> dict[str, Any]:
        """`prompt` with its ids cut as `truncate_prompt_tokens` asks; a text it no longer
        matches is dropped (an echo then decodes the ids kept)."""
        ids = body.truncate(prompt["prompt_token_ids"], self.engine.max_model_len)
        if len(ids) == len(prompt["prompt_token_ids"]):
            return prompt
        return {"prompt_token_ids": ids, "prompt": None}

    def prompt_text(self, prompt: dict[str, Any]) -> str:
        """The text of a prompt as the engine got it (an echo's): its own, or its ids'."""
        if prompt["prompt"] is not None:
            return prompt["prompt"]
        return "" if self.engine.tokenizer is None else self.engine.tokenizer.decode(
            prompt["prompt_token_ids"])

    # -- generation --------------------------------------------------------------------------

    def start(self, body: _SamplingFields, prompts: list[dict[str, Any]],
              params: list[SamplingParams], answer_id: str
              ) -> tuple[list[AsyncIterator[RequestOutput]], _Admission]:
        """Take a slot and queue every prompt of a request (answered as `answer_id`): all or
        none."""
        admission = _Admission(self.slots, self.engine)
        self.slots.take(admission)
        streams: list[AsyncIterator[RequestOutput]] = []
        request_id = uuid.uuid4().hex
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
                stream = self.engine.add_request(prompt, sp, f"{request_id}-{i}",
                                                 body.priority)
                admission.request_ids.append(stream.request_id)
                self.metrics.track(stream, len(prompt["prompt_token_ids"]), sp.max_tokens)
                if self.request_log is not None:
                    self.request_log.received(stream.request_id, answer_id, prompt, sp)
                    self.request_log.watch(stream)
                streams.append(aiter(stream))
        except BaseException as e:
            admission.release()
            if isinstance(e, ValueError):
                raise body.value_error(e) from None
            if isinstance(e, UNAVAILABLE):
                raise engine_error(e) from None
            raise
        return streams, admission

    def stop_admitting(self) -> None:
        """The server is stopping: generation requests from now on get 503."""
        self.slots.stopping = True

    def abort_all(self) -> None:
        """Abort every generation request in progress (a stopping server's drain is over):
        streams end with finish_reason "abort", unstreamed requests answer with it."""
        for admission in list(self.slots.held):
            admission.abort()

    def stream_error(self, e: Exception) -> APIError:
        """An engine error met after a stream's headers went out: sent as an event."""
        api_error = engine_error(e)
        self.metrics.failure(api_error.status_code)
        return api_error

    # -- routes ------------------------------------------------------------------------------

    async def health(self) -> Response:
        # 503 too while a failed resize left the KV cache released: no request runs until
        # the engine backs it again, so a load balancer must route elsewhere meanwhile.
        healthy = self.engine.is_alive and not self.engine.kv_cache_released
        return Response(status_code=200 if healthy else 503)

    async def version(self) -> dict[str, str]:
        return {"version": kvfit.__version__}

    async def metrics_route(self) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.config.created,
                "owned_by": "kvfit", "root": self.config.root,
                "max_model_len": self.engine.max_model_len}

    async def models(self) -> dict[str, Any]:
        return {"object": "list",
                "data": [self.model_card(n) for n in self.config.served_model_names]}

    async def model(self, name: str) -> dict[str, Any]:
        # `client.models.retrieve`; a path, as served names hold slashes ("Qwen/Qwen3-0.6B").
        self.check_model(name)
        return self.model_card(name)

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError("send one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = await self.render_chat(body)
            # As a chat completion tokenizes them (and vLLM's /tokenize): the template writes
            # its own special tokens, so the tokenizer's are off unless the request asks.
            add = body.add_special_tokens and "add_special_tokens" in body.model_fields_set
            (tokens,) = await self.encode([text], "messages", add_special_tokens=add)
        else:
            (tokens,) = await self.encode([body.prompt], "prompt", body.add_special_tokens)
        # vLLM's answer has token_strs always, null unless asked for.
        token_strs = (await self.token_work(len(tokens),
                                            self.tokenizer().convert_ids_to_tokens, tokens)
                      if body.return_token_strs else None)
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len,
                "tokens": tokens, "token_strs": token_strs}

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.check_model(body.model)
        return {"prompt": await self.token_work(len(body.tokens), self.decode_now,
                                                body.tokens)}

    async def completions(self, body: CompletionRequest, request: Request) -> Any:
        engine = self.engine
        self.check_model(body.model)
        self.server_defaults(body)
        body.check()
        # vLLM's completions take no -1 for logprobs (their answers list each entry by text).
        self.check_logprobs(body.logprobs, "logprobs", whole_vocab=False)
        body.prompt_logprobs = self.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        given = body.prompts()
        texts = [p for p in given if isinstance(p, str)]
        encoded = iter(await self.encode(texts, "prompt", body.add_special_tokens)
                       if texts else ())
        prompts = [{"prompt_token_ids": next(encoded), "prompt": p} if isinstance(p, str)
                   else {"prompt_token_ids": p, "prompt": None} for p in given]
        prompts = [self.truncated(body, p) for p in prompts]
        # The engine computes the prompt's logprobs once, for the echo and the field both.
        num_prompt_logprobs = most(body.logprobs if body.echo else None, body.prompt_logprobs)
        # Prompt scoring (echo with max_tokens 0, as OpenAI's legacy API and vLLM take it, and
        # evaluation harnesses send): the engine generates one token, left out of the answer.
        scoring = body.echo and body.max_tokens == 0
        if scoring and body.min_tokens:
            raise APIError("min_tokens must be 0 with max_tokens 0 (prompt scoring)",
                           param="min_tokens")
        params = [body.sampling_params(
            self.check_length(len(p["prompt_token_ids"]), 1 if scoring else body.max_tokens,
                              "prompt", "max_tokens",
                              f" at index {i}" if len(prompts) > 1 else ""),
            body.logprobs, num_prompt_logprobs, self.sampling_defaults)
            for i, p in enumerate(prompts)]
        ids = f"cmpl-{_response_id(request, body.request_id)}"
        streams, admission = self.start(body, prompts, params, ids)
        if scoring:
            streams = [_prompt_only(s) for s in streams]
        created = int(time.time())
        streaming = False
        try:
            echo = [self.prompt_text(p) for p in prompts] if body.echo else None
            if body.stream:
                response = EventStream(completion_events(
                    streams, body, ids, created, self.model_name, engine, echo,
                    self.stream_error, self.config.enable_prompt_tokens_details),
                    admission.release)
                streaming = True
                return response
            outputs = await _run_all(request, streams)
        finally:
            if not streaming:
                admission.release()
        choices = []
        for i, out in enumerate(outputs):
            for c in out.outputs:
                text = c.text if echo is None else echo[i] + c.text
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(engine, c, body.logprobs, out, bool(echo),
                                                   as_ids=body.return_tokens_as_token_ids)
                choice = {"index": i * body.n + c.index, "text": text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if body.return_token_ids:
                    choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    choice["token_ids"] = list(c.token_ids)
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs(engine, out,
                                                                body.prompt_logprobs)
                choices.append(choice)
        return {"id": ids, "object": "text_completion", "created": created,
                "model": self.model_name, "choices": choices,
                "usage": usage_of(outputs, self.config.enable_prompt_tokens_details)}

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Any:
        engine = self.engine
        self.check_model(body.model)
        self.server_defaults(body)
        body.check()
        num_logprobs = self.check_logprobs(body.num_logprobs(), "top_logprobs")
        body.prompt_logprobs = self.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
        text = await self.render_chat(body)
        (token_ids,) = await self.encode([text], "messages", body.add_special_tokens)
        prompt = self.truncated(body, {"prompt_token_ids": token_ids, "prompt": text})
        token_ids = prompt["prompt_token_ids"]
        if not token_ids:
            raise APIError("the messages render to an empty prompt", param="messages")
        max_tokens, max_field = body.requested_max_tokens()
        max_tokens = self.check_length(len(token_ids), max_tokens, "messages", max_field)
        body._renamed = {"max_tokens": max_field, "logprobs": "top_logprobs"}
        params = body.sampling_params(max_tokens, num_logprobs, body.prompt_logprobs,
                                      self.sampling_defaults)
        ids = f"chatcmpl-{_response_id(request, body.request_id)}"
        streams, admission = self.start(body, [prompt], [params], ids)
        created = int(time.time())
        # vLLM's: the configured role answers a new turn; a continued message keeps its own.
        role = (self.config.response_role if body.template_flags()["add_generation_prompt"]
                else body.messages[-1].role)
        if body.stream:
            try:
                return EventStream(stream_chat(streams[0], body, ids, created, self.model_name,
                                               engine, num_logprobs, self.stream_error,
                                               len(token_ids),
                                               self.config.enable_prompt_tokens_details,
                                               token_ids if body.return_token_ids else None,
                                               role),
                                   admission.release)
            except BaseException:
                admission.release()
                raise
        try:
            (out,) = await _run_all(request, streams)
        finally:
            admission.release()
        choices = [{"index": c.index,
                    "message": {"role": role, "content": c.text},
                    "logprobs": (None if num_logprobs is None
                                 else {"content": chat_logprobs(
                                     engine, c, 0, num_logprobs,
                                     body.return_tokens_as_token_ids)}),
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    **({"token_ids": list(c.token_ids)} if body.return_token_ids else {})}
                   for c in out.outputs]
        answer = {"id": ids, "object": "chat.completion", "created": created,
                  "model": self.model_name, "choices": choices,
                  "usage": usage_of([out], self.config.enable_prompt_tokens_details)}
        if body.return_token_ids:  # vLLM's place for them: beside the choices
            answer["prompt_token_ids"] = list(out.prompt_token_ids)
        if body.prompt_logprobs is not None:  # vLLM's place for them: beside the choices
            answer["prompt_logprobs"] = prompt_logprobs(engine, out, body.prompt_logprobs)
        return answer

    async def invocations(self, request: Request) -> Any:
        """SageMaker's inference route, as vLLM serves it: a body with `messages` is a chat
        completion, any other a completion (whose errors then name what it lacks)."""
        try:
            body = await request.json()
        except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested too deep
            raise APIError(f"the request body is not valid JSON ({e})") from None
        chat = isinstance(body, dict) and "messages" in body
        kind = ChatCompletionRequest if chat else CompletionRequest
        try:
            parsed = kind.model_validate(body)
        except ValidationError as e:  # answered as the other routes answer a bad body
            raise RequestValidationError(e.errors(include_url=False)) from None
        if chat:
            return await self.chat_completions(parsed, request)
        return await self.completions(parsed, request)

    # -- development routes (`enable_sleep_endpoints`, `enable_pause_endpoints`, ...) ---------

    async def sleep(self, level: int = 1, mode: str = "wait") -> dict[str, Any]:
        """Release the KV cache and weights (`LLM.sleep`); what went and what stays."""
        # The engine's own error names LLM calls, not routes; a sleep still draining counts.
        if self.engine.sleeping or self.engine.is_going_to_sleep:
            raise APIError("the engine is asleep already: POST /wake_up first")
        try:
            report = await self.engine.sleep(level, mode)
        except (ValueError, RuntimeError) as e:
            param = next((p for p in ("level", "mode") if f"{p}=" in str(e)), None)
            raise APIError(str(e), param=param) from None
        return {"level": report.level, "released": report.released, "kept": report.kept,
                "host_bytes": report.host_bytes}

    async def wake_up(self, tags: Annotated[list[str] | None, Query()] = None
                      ) -> dict[str, Any]:
        """Restore `tags` (`weights`, `kv_cache`; none: everything asleep): 503 when the
        device has no memory for them (they stay asleep: retry once it has)."""
        # Not the tags' fault: nothing is asleep. A sleep still draining is: the engine takes
        # this wake after it (refused here, the engine would end up asleep), as vLLM orders them.
        # Named tags go to the engine awake too: a KV cache the sleep kept (a fixed size) wakes
        # as a no-op after the weights (vLLM's order), which left nothing asleep.
        not_asleep = APIError("the engine is not asleep: POST /sleep first")
        if not (self.engine.sleeping or self.engine.is_going_to_sleep or tags):
            raise not_asleep
        try:
            await self.engine.wake_up(tags)
        except (KVCacheResizeError, WakeUpOutOfMemoryError) as e:
            raise APIError(str(e), status_code=503, type="service_unavailable") from None
        except (ValueError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and not self.engine.sleeping:
                raise not_asleep from None  # the engine's own words name LLM calls
            raise APIError(str(e), param="tags") from None
        return {"is_sleeping": self.engine.sleeping}

    async def is_sleeping(self) -> dict[str, bool]:
        return {"is_sleeping": self.engine.sleeping}

    async def pause(self, mode: str = "abort", wait_for_inflight_requests: bool = False,
                    clear_cache: bool = True) -> dict[str, str]:
        """vLLM's `POST /pause` (`AsyncLLM.pause_generation`): answered once the requests in
        flight are aborted or, with `mode=wait`, finished; generation requests sent while
        paused wait for `POST /resume` (they are not refused)."""
        try:
            await self.engine.pause_generation(
                mode=mode, wait_for_inflight_requests=wait_for_inflight_requests,
                clear_cache=clear_cache)
        except UNAVAILABLE as e:
            raise engine_error(e) from None
        except (ValueError, RuntimeError) as e:
            raise APIError(str(e), param="mode" if "mode=" in str(e) else None) from None
        return {"status": "paused"}

    async def resume(self) -> dict[str, str]:
        """vLLM's `POST /resume`: the requests sent while paused run."""
        try:
            await self.engine.resume_generation()
        except UNAVAILABLE as e:
            raise engine_error(e) from None
        return {"status": "resumed"}

    async def is_paused(self) -> dict[str, bool]:
        try:
            return {"is_paused": await self.engine.is_paused()}
        except UNAVAILABLE as e:
            raise engine_error(e) from None

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_external: bool = False) -> dict[str, Any]:
        """Forget every cached prefix (vLLM's development route and query parameters), and
        with `reset_external` what the KV connector's store holds (`reset_connector`);
        `reset` false, with why, while requests hold blocks and `reset_running_requests` is
        not set, or where `reset_external` finds no connector (vLLM answers 200 then too, and
        only logs it)."""
        try:
            reset = await self.engine.reset_prefix_cache(reset_running_requests, reset_external)
        except UNAVAILABLE as e:
            raise engine_error(e) from None
        if reset:
            return {"reset": True}
        if reset_external and self.engine.config.kv_connector_config is None:
            return {"reset": False, "message": "no KV connector is configured "
                    "(--kv-connector-path, --kv-offloading-size), so reset_external reset "
                    "nothing beyond the prefix cache, which was reset"}
        return {"reset": False, "message": "requests hold KV cache blocks; nothing was reset: "
                "retry once they finish, or pass reset_running_requests=true to preempt them "
                "(they are recomputed)"}

    async def kv_cache(self) -> dict[str, Any]:
        """The KV cache's size, bounds, resize counts and latest resizes."""
        try:
            return await self.engine.kv_cache_state()
        except UNAVAILABLE as e:
            raise engine_error(e) from None

    async def resize_kv_cache(self, num_blocks: int) -> dict[str, Any]:
        """Grow or shrink the committed KV cache to `num_blocks` (`LLM.resize_kv_cache`):
        400 out of bounds or for a cache that cannot resize, 503 when a grow finds no
        memory (the cache stays as it was), while a failed resize left the cache
        released (the engine backs it again by itself) or while the engine is asleep
        (wake it first), as generation is then."""
        try:
            event = await self.engine.resize_kv_cache(num_blocks)
        except KVCacheResizeError as e:
            raise APIError(str(e), status_code=503, type="service_unavailable") from None
        except (ValueError, RuntimeError) as e:
            if isinstance(e, UNAVAILABLE):
                raise engine_error(e) from None
            raise APIError(str(e), param="num_blocks") from None
        return dataclasses.asdict(event)


REQUEST_ID_STATE = "kvfit_request_id"
"""Where an answer's id is left in the request's scope state, for `--enable-request-id-headers`
to send back as the `X-Request-Id` header."""


def _response_id(request: Request, body_id: str | None = None) -> str:
    """An answer's id (after its `cmpl-` or `chatcmpl-`): the client's `X-Request-Id` header
    where it sends one, else the body's `request_id`, as vLLM's, so that a gateway's logs and
    the answers tie up; else a new one. Only a label: the engine's requests are named apart,
    so clients that send the same id never clash. Left in the request's state for the
    response's header."""
    answer_id = request.headers.get("x-request-id") or body_id or uuid.uuid4().hex
    setattr(request.state, REQUEST_ID_STATE, answer_id)
    return answer_id


def _chat_message_size(message: ChatMessage) -> int:
    """About how many characters `message` adds to a rendered chat: its text and a header."""
    content = message.content
    if isinstance(content, list):
        return 64 + sum(len(part.words) for part in content)
    return 64 + len(content or "")


async def _final(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    output = None
    async with aclosing(stream):
        async for output in stream:  # noqa: B007 (the last one is the result)
            pass
    return output


async def _all_final(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    # A task group: when one prompt's request fails, the others are aborted.
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_final(s)) for s in streams]
    except ExceptionGroup as e:
        raise e.exceptions[0] from None
    return [task.result() for task in tasks]


async def _run_all(request: Request, streams: list[AsyncIterator[RequestOutput]]
                   ) -> list[RequestOutput]:
    """Every stream's final output, unless the client leaves first or the engine fails."""
    try:
        return await _unless_disconnected(request, _all_final(streams))
    except ENGINE_ERRORS as e:
        raise engine_error(e) from None


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
