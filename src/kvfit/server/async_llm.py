"""`AsyncLLM`: the engine behind asyncio. The engine core loop runs in a process of its own
(or, asked, on a thread); requests from any number of coroutines join the same steps, and each
request gets its own stream of outputs, decoded to text here, in the front end."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from kvfit.engine.config import EngineArgs, EngineConfig, ModelConfig
from kvfit.engine.detokenizer import Detokenizer
from kvfit.engine.engine_core import EngineStats
from kvfit.engine.input_processor import InputProcessor, Prompt
from kvfit.engine.kv_resize import KVCacheResize
from kvfit.engine.outputs import CompletionOutput, RequestOutput
from kvfit.engine.prompts import check_priority, check_vllm_request_args, describe
from kvfit.engine.sampling_params import RequestOutputKind, SamplingParams
from kvfit.engine.sequence import Sequence
from kvfit.engine.sleep import SleepReport
from kvfit.kv.report import KVCacheReport
from kvfit.models.loader import load_tokenizer
from kvfit.server.engine_client import (
    AttachedEngine,
    EngineProcess,
    InThreadEngine,
    OnDead,
    OnOutputs,
)
from kvfit.server.engine_messages import (
    ASLEEP,
    EngineDeadError,
    EngineOutputs,
    EngineSleepingError,
    PhaseTimes,
    PlainDelta,
    RequestDelta,
    RequestFailedError,
)
from kvfit.server.stats_logger import stats_line

if TYPE_CHECKING:
    from kvfit.engine.llm import LLM

logger = logging.getLogger(__name__)
EngineClientFactory = Callable[[EngineArgs, OnOutputs, OnDead],
                               "EngineProcess | InThreadEngine | AttachedEngine"]
_Item = RequestDelta | PlainDelta | BaseException  # what a stream carries
_NO_PROFILER = ("AsyncLLM.{call}: kvfit's engine has no profiler to start or stop; profile it "
                "in your process: AsyncLLM(engine_args, engine_process=False) under "
                "torch.profiler.profile(), or LLM.generate with "
                "kvfit.benchmarks.profiling.profile_run(run, llm, device)")


class _Stream:
    """Carries one request's deltas from the engine's thread to its event loop.

    Items land in a plain list on the loop's thread (`_deliver`) and the reader takes all of
    them at once, so a reader that fell behind catches up in one go: its deltas are merged
    into one output (one SSE event) instead of one per step. With `interval` N > 1 the reader
    is woken only once N new tokens are queued (the first token at once, so time to first
    token is unchanged), or a completion finished, or an error came: each wake-up costs the
    event loop a task switch, an SSE event and its JSON, per request.
    """

    def __init__(self, request_id: str, engine_id: str, interval: int = 1) -> None:
        self.loop = asyncio.get_running_loop()
        self.request_id = request_id  # the caller's
        self.engine_id = engine_id  # the engine's: another after an aborted one of the same id
        self.items: list[_Item] = []
        self.interval = interval
        self._waiter: asyncio.Future[None] | None = None
        self._ready = False  # whether `take` returns now
        self._buffered = 0  # tokens queued since the last `take`
        self._threshold = 1  # tokens that make the queue ready: 1 until the first `take`

    def push(self, item: _Item) -> None:
        """Append on the loop's thread; wake the reader once the queue is ready."""
        self.items.append(item)
        if not self._ready and self._completes(item):
            self._ready = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    def _completes(self, item: _Item) -> bool:
        """Whether `item` makes the queue ready (counting its tokens)."""
        if self.interval == 1 or isinstance(item, BaseException):
            return True
        if len(item) == 2:  # PlainDelta (request_id, token_ids)
            self._buffered += len(item[1])
        else:  # RequestDelta (request_id, seqs, finished, ...), seqs of SeqDelta
            _, seqs, finished = item[:3]
            # A finished completion goes out at once (its finish_reason, stop, usage).
            if finished or any(seq[3] is not None for seq in seqs):  # seq[3]: finish_reason
                return True
            # Siblings (n > 1) advance together: a step's tokens are the most any one gained.
            self._buffered += max((len(seq[1]) for seq in seqs), default=0)
        return self._buffered >= self._threshold

    def unread(self, items: list[_Item]) -> None:
        """Put `items` back in front, for the next `take` to return at once."""
        self.items[:0] = items
        self._ready = True

    async def take(self) -> list[_Item]:
        """Every item queued so far (at least one), oldest first, once the queue is ready."""
        while not self._ready:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        self._ready, self._buffered, self._threshold = False, 0, self.interval
        return items


def _deliver(batch: list[tuple[_Stream, _Item]]) -> None:
    for stream, item in batch:
        stream.push(item)


def _deliver_threadsafe(loop: asyncio.AbstractEventLoop,
                        batch: list[tuple[_Stream, _Item]]) -> None:
    """One wake-up of `loop` for the whole batch (a wake-up costs a syscall and a GIL hand-off:
    per step, not per request)."""
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
        loop.call_soon_threadsafe(_deliver, batch)


class StreamObserver(Protocol):
    """What a `RequestStream` tells its `observer`: each output as it is yielded, then the
    end (`failed`: the stream raised; else it finished, or its reader left early)."""

    def output(self, output: RequestOutput) -> None: ...

    def end(self, failed: bool) -> None: ...


class RequestStream:
    """One request's outputs, as an async iterator of cumulative `RequestOutput`s (the last
    one has `finished=True`).

    Each output's lists (`token_ids`, `logprobs`) grow in place as later outputs arrive:
    copy them to keep a snapshot. Text is decoded here, on the caller's event loop, not on the
    engine's step; requests with stop strings take the engine's text (it must look for them),
    held back by the longest stop string less one character until finished, so streamed text
    is never taken back. A reader that falls behind the engine gets one output for all the
    steps it missed (never a timer: what is ready is yielded at once). With the engine's
    `stream_interval` N > 1 an output comes once N new tokens are ready (the first token and
    the end at once). Closing the iterator before the end aborts the request.

    `SamplingParams.output_kind` as vLLM's: `DELTA` yields new `RequestOutput`s holding only
    what each completion added since the last (completions that added nothing left out;
    `cumulative_logprob` still the whole completion's; the prompt's logprobs in the first),
    `FINAL_ONLY` the last output alone.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, seqs: list[Sequence],
                 params: SamplingParams) -> None:
        self.request_id = request_id
        self._engine = engine
        # The engine's name for it is `seqs`' (`AsyncLLM._engine_id`).
        self._stream = _Stream(request_id, seqs[0].request_id, engine.stream_interval)
        first = seqs[0]
        self.prompt_token_ids = first.prompt_token_ids
        self.output = RequestOutput(
            request_id=request_id, prompt=first.prompt, prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=None, finished=False,
            outputs=[CompletionOutput(index=seq.sibling_index, text="", token_ids=[],
                                      cumulative_logprob=None if params.logprobs is None else 0.0,
                                      logprobs=None if params.logprobs is None else [])
                     for seq in seqs],
        )
        # Mirrors of the engine's sequences for this side's detokenizer.
        self._mirrors = [Sequence(first.prompt_token_ids, params, request_id=request_id)
                         for _ in seqs]
        self._hold_back = max(map(len, params.stop), default=1) - 1
        # `detokenize=False` leaves the text empty, as `LLM.generate` does (only stop strings
        # make the engine decode, and then its text comes as it does there).
        self._decode = params.detokenize
        self._kind = params.output_kind
        # DELTA: per completion, the characters and tokens already yielded, and whether its end
        # was; whether the prompt's logprobs were.
        self._yielded = [(0, 0, False)] * len(seqs)
        self._prompt_logprobs_yielded = False
        self._closed = False
        # Told of every output and of the end (the server's request metrics): a call here
        # rather than a generator around the stream, which would cost two more switches a
        # token.
        self.observer: StreamObserver | None = None
        # Each ended completion's queue, prefill, decode and inference times (the engine's
        # clock), by index.
        self.phase_times: dict[int, PhaseTimes] = {}

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        observer, failed = self.observer, False
        try:
            while not self.output.finished:
                items = await self._stream.take()
                deltas: list[RequestDelta | PlainDelta] = []
                for i, item in enumerate(items):
                    if isinstance(item, BaseException):
                        if not deltas:
                            raise item
                        self._stream.unread(items[i:])  # raised once the rest is out
                        break
                    deltas.append(item)
                self._apply(deltas)
                if observer is not None:
                    observer.output(self.output)
                if self._kind is RequestOutputKind.CUMULATIVE:
                    yield self.output
                elif self._kind is RequestOutputKind.DELTA:
                    if (delta := self._delta()) is not None:
                        yield delta
                elif self.output.finished:
                    yield self.output
        except Exception:
            failed = True
            raise
        finally:
            self._close()
            if observer is not None:
                observer.end(failed)

    def _delta(self) -> RequestOutput | None:
        """What the output added since the last `_delta` (None: nothing)."""
        out, outputs = self.output, []
        for c in out.outputs:
            chars, tokens, ended = self._yielded[c.index]
            if ended or (len(c.text) == chars and len(c.token_ids) == tokens
                         and c.finish_reason is None):
                continue
            outputs.append(CompletionOutput(
                index=c.index, text=c.text[chars:], token_ids=c.token_ids[tokens:],
                cumulative_logprob=c.cumulative_logprob,
                logprobs=None if c.logprobs is None else c.logprobs[tokens:],
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
            self._yielded[c.index] = (len(c.text), len(c.token_ids), c.finish_reason is not None)
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not self._prompt_logprobs_yielded:
            prompt_logprobs, self._prompt_logprobs_yielded = out.prompt_logprobs, True
        if not outputs and prompt_logprobs is None and not out.finished:
            return None
        return RequestOutput(
            request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
            prompt_logprobs=prompt_logprobs, outputs=outputs, finished=out.finished,
            num_cached_tokens=out.num_cached_tokens)

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.output.finished:
                self._engine._abort_stream(self._stream)
            for mirror in self._mirrors:
                self._engine._detokenizer.free(mirror)

    def _apply(self, deltas: list[RequestDelta | PlainDelta]) -> None:
        """Fold every delta taken into the output; text is decoded once per completion."""
        if len(deltas) == 1 and len(deltas[0]) == 2:
            # One step of a plain request, most wake-ups at every step: its tokens and text,
            # nothing else (a plain delta never ends its request: its last is a RequestDelta).
            tokens, out, mirror = deltas[0][1], self.output.outputs[0], self._mirrors[0]
            out.token_ids.extend(tokens)
            if self._decode:
                mirror.token_ids.extend(tokens)
                self._engine._detokenizer.step(mirror, check_stop=False)
                out.text = mirror.output_text
            return
        decode: set[int] = set()
        for delta in deltas:
            if len(delta) == 2:  # a plain request's new tokens
                self.output.outputs[0].token_ids.extend(delta[1])
                if self._decode:
                    self._mirrors[0].token_ids.extend(delta[1])
                    decode.add(0)
                continue
            _, seqs, _, prompt_logprobs, num_cached_tokens = delta
            self.output.num_cached_tokens = max(num_cached_tokens, 0)
            for index, token_ids, logprobs, finish_reason, stop_reason, text, times in seqs:
                if times is not None:
                    self.phase_times[index] = times
                out = self.output.outputs[index]
                out.token_ids.extend(token_ids)
                if out.logprobs is not None:
                    out.logprobs.extend(logprobs)
                    out.cumulative_logprob += sum(lp[t].logprob for t, lp in
                                                  zip(token_ids, logprobs, strict=True))
                out.finish_reason, out.stop_reason = finish_reason, stop_reason
                if text is None:
                    if not self._decode:
                        continue
                    mirror = self._mirrors[index]
                    if (finish_reason == "stop" and token_ids
                            and not mirror.sampling_params.include_stop_str_in_output):
                        # Ended by a stop token or EOS (a stop string comes with the engine's
                        # text): its text stays out, as in vLLM and the engine's own text.
                        token_ids = token_ids[:-1]
                    mirror.token_ids.extend(token_ids)
                    decode.add(index)
                elif finish_reason is not None:
                    out.text = text
                else:
                    out.text = text[: max(len(out.text), len(text) - self._hold_back)]
            if prompt_logprobs is not None:
                self.output.prompt_logprobs = prompt_logprobs
        for index in decode:
            mirror = self._mirrors[index]
            self._engine._detokenizer.step(mirror, check_stop=False)
            self.output.outputs[index].text = mirror.output_text
        self.output.finished = all(o.finish_reason is not None for o in self.output.outputs)


class AsyncLLM:
    """The engine for asyncio front ends (the HTTP server), with its core loop in a process of
    its own (`engine_process=True`, the default) or on a thread of this one.

    `add_request` validates and tokenizes here, on the caller's thread, and raises ValueError
    naming the setting; the engine admits the request at its next step, so requests of many
    clients share steps, and sends back, per step, one message with the new tokens of every
    request that advanced. Text is decoded here, off the engine's step. `abort(request_id)`
    ends a request and frees its KV blocks. An error raised by a step fails
    (`RequestFailedError`) only the requests that step held; an engine that stops (its
    process killed or crashed) fails every request it held and every later one with
    `EngineDeadError`, and `is_alive` turns False.

    `client` overrides `engine_process`: a factory `client(engine_args, on_outputs, on_dead)`
    of the engine client (as `EngineProcess(..., num_api_servers=N)` for the first of several
    API server processes, `AttachedEngine` over a pipe for the others; `engine_client`).

    `stream_interval` (`--stream-interval`): how many new tokens a request's stream gathers
    before its reader is woken (its first token, its end and its errors go at once); above 1 it
    trades smoother streams for less event-loop work per token.
    """

    def __init__(self, engine_args: EngineArgs, engine_process: bool = True,
                 stream_interval: int = 1, client: EngineClientFactory | None = None) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval (--stream-interval) must be >= 1, "
                             f"got {stream_interval}")
        self.engine_args = engine_args
        self.stream_interval = stream_interval
        self._streams: dict[str, _Stream] = {}  # by the engine's id, until the request's end
        # The caller's id -> the engine's, of each request neither ended nor aborted: an id
        # whose abort is sent is free at once, while its last output is still on its way.
        # Under `_ids_lock`: changed from the engine's thread too, as requests end.
        self._engine_ids: dict[str, str] = {}
        self._ids_lock = threading.Lock()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._dead: BaseException | None = None
        self._dead_callbacks: list[Callable[[BaseException], None]] = []
        # What stopped the engine other than `shutdown`; with the callbacks under one lock, so
        # that each callback is called once whether it came before the death or after.
        self._died_of: BaseException | None = None
        self._dead_lock = threading.Lock()
        if client is None:
            client = EngineProcess if engine_process else InThreadEngine
        self._client = client(engine_args, self._on_outputs, self._on_dead)
        ready = self._client.ready
        self.config: EngineConfig = ready.config
        self._stats, self._is_sleeping = ready.stats, ready.is_sleeping
        self._sleeps_underway = 0  # `sleep` calls sent and not answered yet
        self._kv_cache_report = ready.kv_cache_report
        # `--tokenizer` as the engine reads it: prompts tokenized here, text decoded here.
        self.tokenizer: Any | None = load_tokenizer(engine_args.tokenizer or engine_args.model)
        self._input_processor = InputProcessor(self.config, self.tokenizer)
        self._detokenizer = Detokenizer(self.tokenizer)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True,
                         usage_context: Any = None, stat_loggers: list[Any] | None = None,
                         *, engine_process: bool = True, stream_interval: int = 1) -> AsyncLLM:
        """vLLM's constructor, `AsyncLLM.from_engine_args(engine_args)` (kvfit's `EngineArgs`
        are its `AsyncEngineArgs`). `start_engine_loop` and `usage_context` ask for nothing
        here (the engine starts here; nothing is reported anywhere, as vLLM's v1 engine starts
        regardless too); custom `stat_loggers` are refused."""
        if stat_loggers:
            raise ValueError("AsyncLLM.from_engine_args(stat_loggers=...): custom stat loggers "
                             "are not supported; read AsyncLLM.stats() or the server's "
                             "/metrics instead")
        return cls(engine_args, engine_process=engine_process, stream_interval=stream_interval)

    @property
    def vllm_config(self) -> EngineConfig:
        """vLLM's name for the engine's configuration (`config`; the same sub-configs:
        `model_config`, `cache_config`, `scheduler_config`, `parallel_config`)."""
        return self.config

    @property
    def model_config(self) -> ModelConfig:
        """vLLM's: the model's configuration (`max_model_len`, `hf_config`, `dtype`, ...)."""
        return self.config.model_config

    async def get_vllm_config(self) -> EngineConfig:
        """vLLM's older coroutine for `vllm_config`."""
        return self.config

    async def get_model_config(self) -> ModelConfig:
        """vLLM's older coroutine for `model_config`."""
        return self.config.model_config

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what the engine serves, text generation alone."""
        return ("generate",)

    async def do_log_stats(self) -> None:
        """vLLM's: log the engine's figures now (INFO), one line as `kvfit serve` prints:
        queues, KV cache use, prefix cache hit rate, preemptions."""
        logger.info(stats_line(self._stats, source="AsyncLLM"))

    async def is_tracing_enabled(self) -> bool:
        """vLLM's: False, there is no OpenTelemetry tracing here."""
        return False

    def get_tokenizer(self) -> Any | None:
        """vLLM's: the tokenizer prompts are tokenized and text decoded with (`--tokenizer`,
        else the model's), or None for a model folder without one (token-id prompts only),
        as `LLM.get_tokenizer`."""
        return self.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self.config.model_config.max_logprobs

    @property
    def kv_cache_report(self) -> KVCacheReport:
        """How the KV cache was sized (`oom_guard_shrinks` counts the guard's shrinks since)."""
        return self._kv_cache_report

    @property
    def engine_client(self) -> EngineProcess | InThreadEngine | AttachedEngine:
        """The client that carries commands and outputs to and from the engine."""
        return self._client

    @property
    def engine_pid(self) -> int | None:
        """The engine process's id (None when the engine runs on a thread)."""
        return self._client.pid

    @property
    def num_requests(self) -> int:
        """Requests added and not yet ended, as this front end sees them."""
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._client.is_alive()

    # vLLM's names for the engine's state (its server and frameworks built on it read them).
    @property
    def is_running(self) -> bool:
        """vLLM's: whether the engine runs (`is_alive`)."""
        return self.is_alive

    @property
    def errored(self) -> bool:
        """vLLM's: whether the engine has stopped (died or shut down); requests then fail with
        `dead_error`."""
        return not self.is_alive

    @property
    def is_stopped(self) -> bool:
        """vLLM's: `errored`."""
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        """vLLM's: what a stopped engine raises, caused by what stopped it (where known)."""
        error = EngineDeadError("the engine is not running")
        error.__cause__ = self._dead
        return error

    async def check_health(self) -> None:
        """vLLM's: raise `dead_error` once the engine has stopped; return while it runs."""
        if self.errored:
            raise self.dead_error

    @property
    def kv_cache_released(self) -> bool:
        """Whether a failed resize left the engine's KV cache released (as of its latest
        message): requests wait until the engine backs it again, and `/health` answers 503 so
        a load balancer sends them elsewhere meanwhile."""
        return self._stats.kv_cache_released

    @property
    def sleeping(self) -> bool:
        """Whether `sleep` released the weights or the KV cache (as of the engine's latest
        message; read from any thread, without waiting). `await is_sleeping()` is vLLM's."""
        return self._is_sleeping

    async def is_sleeping(self) -> bool:
        """vLLM's coroutine: whether the engine is asleep, asked of the engine after the
        commands sent before (a `sleep` still draining answers True once it is done, as in
        vLLM); `sleeping` is the latest message's answer at once."""
        return await self._call(_is_sleeping)

    @property
    def is_going_to_sleep(self) -> bool:
        """Whether a `sleep` was sent and not answered yet (it may be draining requests): the
        engine takes commands in order, so a `wake_up` sent now runs after it."""
        return self._sleeps_underway > 0

    def add_dead_callback(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(error)` (from an engine thread) if the engine stops other than by
        `shutdown`: a server exits on it. Called at once (here) if it has stopped already:
        the engine may die between its start and this call."""
        with self._dead_lock:
            self._dead_callbacks.append(callback)
            died_of = self._died_of
        if died_of is not None:
            callback(died_of)

    async def sleep(self, level: int = 1, mode: str = "wait") -> SleepReport:
        """`LLM.sleep` in the engine, between two steps: requests queued before it are run to
        the end (`mode="wait"`) or aborted (`"abort"`) and their streams end; any sent later
        get `EngineSleepingError` until `wake_up`, from the moment it is sent: the engine
        takes no command while it drains (mode="wait", as long as the longest request), and a
        request queued behind the sleep would wait that long only to be refused."""
        self._sleeps_underway += 1
        try:
            return await self._call("sleep", level, mode)
        finally:
            self._sleeps_underway -= 1

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """`LLM.wake_up(tags)` in the engine (weights reloaded after level 2)."""
        await self._call("wake_up", tags)

    async def pause_generation(self, *, mode: str = "abort",
                               wait_for_inflight_requests: bool = False,
                               clear_cache: bool = True) -> None:
        """vLLM's: stop scheduling requests until `resume_generation`, e.g. while a trainer
        replaces the weights (`collective_rpc`). In the one engine, between two steps, so a
        pause sent from any API server process pauses them all: the requests it holds are
        aborted (`mode="abort"`, the default: their streams end with finish_reason "abort")
        or run to their end (`"wait"`, or vLLM's older `wait_for_inflight_requests=True`),
        then the prefix cache is reset (`clear_cache`); it returns once that is done and
        those streams have ended. Requests added while paused are taken, not refused, and
        wait: the engine runs them after `resume_generation`. ValueError for another mode
        (vLLM's "keep" is not supported)."""
        if wait_for_inflight_requests:  # vLLM's older spelling of mode="wait"
            mode = "wait"
        await self._call(_pause, mode, clear_cache)

    async def resume_generation(self) -> None:
        """vLLM's: schedule again after `pause_generation`; the requests added meanwhile run,
        in the order they came (a no-op when not paused)."""
        await self._call(_resume)

    async def is_paused(self) -> bool:
        """vLLM's: whether generation is paused, asked of the engine after the commands sent
        before it; `paused` is the latest message's answer at once."""
        return await self._call(_is_paused)

    @property
    def paused(self) -> bool:
        """Whether `pause_generation` paused the engine (as of its latest message; read from any
        thread, without waiting)."""
        return self._stats.paused

    async def resize_kv_cache(self, num_blocks: int) -> KVCacheResize:
        """`LLM.resize_kv_cache` in the engine, between two steps; `EngineSleepingError`
        while it sleeps (a state to leave, not a bad `num_blocks`)."""
        return await self._call(_resize_kv_cache, num_blocks)

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        """`LLM.reset_prefix_cache` in the engine, between two steps: False while requests
        hold blocks, unless `reset_running_requests` (they are preempted and recomputed).
        `reset_connector` also has a KV connector's store serve nothing it holds now (after
        weights changed through `collective_rpc`); without a connector it is False, as
        vLLM's."""
        return await self._call("reset_prefix_cache", reset_running_requests, reset_connector)

    async def kv_cache_state(self) -> dict[str, Any]:
        """The KV cache's size, bounds and resize counts, read in the engine."""
        return await self._call(_kv_cache_state)

    async def collective_rpc(self, method: str | Callable[..., Any],
                             timeout: float | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: `LLM.collective_rpc` in the engine, between two steps: a `Worker` method by
        name, or `method(worker, *args, **kwargs)`, on every worker; answers in rank order.
        In an engine process a callable (a module-level function), its arguments and the
        answers must pickle. `timeout` is refused (ValueError): a call runs to its end."""
        return await self._call("collective_rpc", method, timeout, tuple(args), kwargs)

    async def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: refused (NotImplementedError): the engine has no profiler of its own."""
        raise NotImplementedError(_NO_PROFILER.format(call="start_profile()"))

    async def stop_profile(self) -> None:
        """vLLM's: refused, as `start_profile`."""
        raise NotImplementedError(_NO_PROFILER.format(call="stop_profile()"))

    async def call_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(llm, *args)` in the engine between two steps and return its result (its
        error is raised here). In an engine process `fn` (a module-level function), its
        arguments and its result must pickle. For tests and diagnostics."""
        return await self._call(fn, *args)

    async def _call(self, fn: str | Callable[..., Any], *args: Any) -> Any:
        future = asyncio.get_running_loop().create_future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        try:
            self._check_alive()
            self._client.send(("call", call_id, fn, args))
        except BaseException:
            self._calls.pop(call_id, None)
            raise
        return await future

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError("the engine is not running") from self._dead

    def stats(self) -> EngineStats:
        """The engine's figures after its latest step (a snapshot; safe from any thread)."""
        return self._stats

    def decode_token(self, token_id: int) -> str | None:
        """One token's text on its own (None without a tokenizer)."""
        return self._detokenizer.decode_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's raw bytes (`Detokenizer.token_bytes`)."""
        return self._detokenizer.token_bytes(token_id)

    def add_request(self, prompt: Prompt, params: SamplingParams,
                    request_id: str | None = None, priority: int = 0) -> RequestStream:
        """Queue one request (call from a running event loop); iterate the returned stream
        for its outputs. Raises ValueError for a request the engine would refuse; `priority`
        (vLLM's; lower runs first) needs the engine's `scheduling_policy="priority"` unless
        it is 0."""
        if not isinstance(params, SamplingParams):  # else an AttributeError deep inside
            hint = " (build one: SamplingParams(**params))" if isinstance(params, dict) else ""
            if isinstance(request_id, SamplingParams):
                hint = (" (the arguments are in vLLM's add_request(request_id, prompt, params) "
                        "order: here it is add_request(prompt, sampling_params, request_id))")
            raise TypeError(f"sampling_params must be a SamplingParams; got "
                            f"{describe(params)}{hint}")
        priority = check_priority(priority)
        self._check_alive()
        if self._is_sleeping or self._sleeps_underway:
            raise EngineSleepingError(ASLEEP)
        request_id = request_id or uuid.uuid4().hex
        # The engine decodes text only where stop strings need it; the stream decodes the rest.
        # A shallow copy, not `dataclasses.replace`, which validates every field again (15 us
        # a request on the API process's one core); the engine never changes the lists.
        engine_params = copy.copy(params)
        engine_params.detokenize = False
        seqs = self._input_processor.make_request(prompt, engine_params, request_id, priority)
        with self._ids_lock:
            if request_id in self._engine_ids:
                raise ValueError(f"request_id {request_id!r} is already running; use another, "
                                 f"or abort it first")
            engine_id = self._engine_id(request_id)
            for seq in seqs:
                seq.request_id = engine_id
            stream = RequestStream(self, request_id, seqs, params)
            self._engine_ids[request_id] = engine_id
            self._streams[engine_id] = stream._stream
        first = seqs[0]
        try:
            self._check_alive()  # `_on_dead` may have run since: it failed the streams it saw
            self._client.send(("add", engine_id, first.prompt_token_ids, first.prompt,
                               first.sampling_params, priority))
        except BaseException:
            with self._ids_lock:
                self._streams.pop(engine_id, None)
                if self._engine_ids.get(request_id) == engine_id:
                    del self._engine_ids[request_id]
            raise
        return stream

    def _engine_id(self, request_id: str) -> str:
        """The engine's name for a new request `request_id` (under `_ids_lock`): the same,
        unless an aborted request of that id has not ended in the engine yet; then the id and
        a random suffix (as vLLM names every request), so that the old request's last output
        never reaches the new one's stream."""
        engine_id = request_id
        while engine_id in self._streams:
            engine_id = f"{request_id}-{uuid.uuid4().hex[:8]}"
        return engine_id

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams,
                       request_id: str | None = None, priority: int = 0, *,
                       lora_request: Any = None, tokenization_kwargs: dict[str, Any] | None = None,
                       trace_headers: Any = None, data_parallel_rank: int | None = None,
                       ) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate its stream; leaving early aborts the request. The
        arguments are named as vLLM's (`generate(prompt=..., sampling_params=...,
        request_id=...)`, as its examples call it). Of vLLM's other keywords, those that ask
        for nothing are taken (`lora_request=None`, `tokenization_kwargs` None or empty,
        `data_parallel_rank` None or 0, `trace_headers`: there is no tracing to carry them
        to); a LoRA adapter, tokenizer arguments or another rank are refused (ValueError)."""
        check_vllm_request_args("generate", lora_request, tokenization_kwargs)
        if data_parallel_rank not in (None, 0):
            raise ValueError(f"generate(data_parallel_rank={data_parallel_rank!r}): there is one "
                             f"engine (no data parallelism); pass None or 0")
        async for output in self.add_request(prompt, sampling_params, request_id, priority):
            yield output

    def abort(self, request_id: str | Iterable[str]) -> _Done:
        """End requests now (finish_reason "abort") and free their blocks: one id or, as vLLM's
        `abort` takes them, several; unknown and ended ids are ignored (nothing is sent for
        them). An aborted id may name a new request at once: the old stream still gets its
        last output (finish_reason "abort"), and the new one only its own. Thread-safe.
        Called plainly, or awaited as vLLM's (a coroutine there): the abort is sent by the
        time it returns either way."""
        # A str is iterable too (by character): only another iterable is several ids.
        ids = (request_id,) if isinstance(request_id, str) or not isinstance(
            request_id, Iterable) else request_id
        for one in ids:
            with self._ids_lock:
                engine_id = self._engine_ids.pop(one, None)
                if engine_id is not None:
                    self._send_abort(engine_id)
        return _DONE

    def _abort_stream(self, stream: _Stream) -> None:
        """Abort `stream`'s request unless it has ended or its abort was sent already (its
        reader left early)."""
        with self._ids_lock:
            # Its id may name a newer request by now: that one runs on.
            if (self._streams.get(stream.engine_id) is stream
                    and self._engine_ids.get(stream.request_id) == stream.engine_id):
                del self._engine_ids[stream.request_id]
                self._send_abort(stream.engine_id)

    def _send_abort(self, engine_id: str) -> None:
        # Under `_ids_lock`, so that the abort reaches the engine before any request that
        # takes the id once the lock is free (sending only queues it).
        if self._dead is None:
            with contextlib.suppress(EngineDeadError):
                self._client.send(("abort", engine_id))

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine and free the model and KV cache (in-flight requests fail with
        `EngineDeadError`). `timeout` (vLLM's): how long an engine process may take to stop
        before it is terminated (None: the client's own bound, 60 s); an engine on a thread
        stops between two steps regardless."""
        if timeout is None:
            self._client.shutdown()  # a client from a `client` factory may take no timeout
        else:
            self._client.shutdown(timeout)

    # --- Called from the engine's thread (in-thread) or the output reader (process) ---

    def _on_outputs(self, message: EngineOutputs) -> None:
        """Hand each output to its stream: one batch, one wake-up per event loop; then settle
        calls (after the outputs, so a finished sleep's streams end first)."""
        self._stats, self._is_sleeping = message.stats, message.is_sleeping
        if message.kv_cache_report is not None:
            self._kv_cache_report = message.kv_cache_report
        batches: dict[asyncio.AbstractEventLoop,
                      list[tuple[_Stream, _Item]]] = {}
        streams, ended = self._streams, []
        for delta in message.tokens:
            if (stream := streams.get(delta[0])) is not None:
                batches.setdefault(stream.loop, []).append((stream, delta))
        for delta in message.outputs:
            if delta[2]:  # the request's last output
                if (stream := streams.pop(delta[0], None)) is not None:
                    ended.append(stream)
            else:
                stream = streams.get(delta[0])
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, delta))
        for request_id, error in message.errors:
            if (stream := streams.pop(request_id, None)) is not None:
                ended.append(stream)
                batches.setdefault(stream.loop, []).append((stream, error))
        if ended:
            self._free_ids(ended)
        for loop, batch in batches.items():
            _deliver_threadsafe(loop, batch)
        for call_id, result, error in message.results:
            future = self._calls.pop(call_id, None)
            if future is not None:
                _settle_threadsafe(future, result, error)

    def _free_ids(self, ended: list[_Stream]) -> None:
        """The callers' ids of ended requests are free (those not aborted before)."""
        with self._ids_lock:
            for stream in ended:
                if self._engine_ids.get(stream.request_id) == stream.engine_id:
                    del self._engine_ids[stream.request_id]

    def _on_dead(self, error: BaseException | None) -> None:
        """The engine stopped: fail every stream and call it held (set `_dead` first, so a
        request added meanwhile sees it)."""
        self._dead = error or EngineDeadError("the engine was shut down")
        dead = EngineDeadError(f"the engine stopped: {self._dead}")
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, BaseException]]] = {}
        with self._ids_lock:
            self._engine_ids.clear()
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream, dead))
        for loop, batch in batches.items():
            _deliver_threadsafe(loop, batch)
        for call_id in list(self._calls):
            future = self._calls.pop(call_id, None)
            if future is not None:
                _settle_threadsafe(future, None, dead)
        if error is not None:
            with self._dead_lock:
                self._died_of = error
                callbacks = list(self._dead_callbacks)
            for callback in callbacks:
                callback(error)


class _Done:
    """An awaitable with nothing to wait for: what a plain method returns so that code
    written for vLLM's coroutine of the same name (`await engine.abort(id)`) runs too."""

    __slots__ = ()

    def __await__(self) -> Iterator[None]:
        return iter(())


_DONE = _Done()


def _settle_threadsafe(future: asyncio.Future[Any], result: Any,
                       error: BaseException | None) -> None:
    def settle() -> None:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
        future.get_loop().call_soon_threadsafe(settle)


__all__ = ["AsyncLLM", "EngineDeadError", "EngineSleepingError", "RequestFailedError",
           "RequestStream"]


def _resize_kv_cache(llm: LLM, num_blocks: int) -> KVCacheResize:
    if llm.engine.is_sleeping:  # checked in the engine: the front end's view may be stale
        raise EngineSleepingError("resize_kv_cache() while the engine is asleep (its KV cache "
                                  "or weights released): wake it up first (POST /wake_up)")
    return llm.resize_kv_cache(num_blocks)


def _is_sleeping(llm: LLM) -> bool:
    return llm.is_sleeping


def _pause(llm: LLM, mode: str, clear_cache: bool) -> None:
    # The engine's, not `LLM`'s: a paused `generate` would wait for a resume from elsewhere.
    llm.engine.pause(mode, clear_cache)


def _resume(llm: LLM) -> None:
    llm.engine.resume()


def _is_paused(llm: LLM) -> bool:
    return llm.engine.is_paused


def _kv_cache_state(llm: LLM) -> dict[str, Any]:
    # Module level, so that it pickles to an engine process by name.
    return llm.engine.kv_cache_state()
