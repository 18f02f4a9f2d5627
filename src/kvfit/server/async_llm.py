"""`AsyncLLM`: the engine behind asyncio. One thread steps the engine; requests from any number
of coroutines join the same steps, and each request gets its own stream of outputs."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvfit.engine.config import EngineArgs
from kvfit.engine.detokenizer import Detokenizer
from kvfit.engine.engine_core import EngineCore, EngineStats
from kvfit.engine.kv_resize import KVCacheResize
from kvfit.engine.llm import LLM, Prompt
from kvfit.engine.outputs import CompletionOutput, RequestOutput
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import Logprobs, Sequence
from kvfit.engine.sleep import SleepReport
from kvfit.kv.report import KVCacheReport

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or an error outside any one step)."""


class EngineSleepingError(RuntimeError):
    """A request sent while the engine sleeps (`AsyncLLM.sleep`): wake it up first."""


class RequestFailedError(RuntimeError):
    """A step holding this request raised; the request was aborted, the engine goes on."""


@dataclass
class _SeqDelta:
    """What one completion gained in one step (built on the engine thread)."""

    index: int
    token_ids: list[int]
    logprobs: list[Logprobs]
    finish_reason: str | None
    stop_reason: int | str | None
    text: str | None  # the engine's text where it detokenizes (stop strings), else None


@dataclass
class _Delta:
    seqs: list[_SeqDelta]
    prompt_logprobs: list[Logprobs | None] | None = None  # with the last delta


class _Stream:
    """Carries one request's deltas from the engine thread to its event loop.

    Items land in a plain list on the loop's thread (`_deliver`) and the reader takes all of
    them at once, so a reader that fell behind catches up in one go: its deltas are merged
    into one output (one SSE event) instead of one per step.
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.items: list[_Delta | BaseException] = []
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _Delta | BaseException) -> None:
        """Send one item from any thread."""
        _deliver_threadsafe(self.loop, [(self, item)])

    def push(self, item: _Delta | BaseException) -> None:
        """Append on the loop's thread and wake the reader."""
        self.items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[_Delta | BaseException]:
        """Every item queued so far (at least one), oldest first."""
        while not self.items:
            self._waiter = self.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self.items = self.items, []
        return items


def _deliver(batch: list[tuple[_Stream, _Delta | BaseException]]) -> None:
    for stream, item in batch:
        stream.push(item)


def _deliver_threadsafe(loop: asyncio.AbstractEventLoop,
                        batch: list[tuple[_Stream, _Delta | BaseException]]) -> None:
    """One wake-up of `loop` for the whole batch (a wake-up costs a syscall and a GIL hand-off:
    per step, not per request)."""
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens any more
        loop.call_soon_threadsafe(_deliver, batch)


@dataclass
class _Tracked:
    """Engine-thread bookkeeping of one request: what its stream has been sent so far."""

    seqs: list[Sequence]
    stream: _Stream
    sent: list[int]
    reported: list[bool]

    def delta(self) -> _Delta | None:
        parts = []
        for i, seq in enumerate(self.seqs):
            num_ready = seq.num_output_tokens - seq.has_pending_token
            if num_ready == self.sent[i] and (self.reported[i] or not seq.is_finished):
                continue
            start, params = self.sent[i], seq.sampling_params
            first = seq.num_prompt_tokens + start
            parts.append(_SeqDelta(
                index=seq.sibling_index,
                token_ids=seq.token_ids[first : first + num_ready - start],
                logprobs=seq.logprobs[start:num_ready] if params.logprobs is not None else [],
                finish_reason=seq.finish_reason if seq.is_finished else None,
                stop_reason=seq.stop_reason,
                text=seq.output_text if params.stop else None,
            ))
            self.sent[i], self.reported[i] = num_ready, seq.is_finished
        if not parts:
            return None
        delta = _Delta(parts)
        parent = self.seqs[0]
        if self.finished and parent.sampling_params.prompt_logprobs is not None:
            delta.prompt_logprobs = list(parent.prompt_logprobs)
        return delta

    @property
    def finished(self) -> bool:
        return all(self.reported)


class RequestStream:
    """One request's outputs, as an async iterator of cumulative `RequestOutput`s (the last
    one has `finished=True`).

    Each output's lists (`token_ids`, `logprobs`) grow in place as later outputs arrive:
    copy them to keep a snapshot. Text is decoded here, on the caller's event loop, not on the
    engine's step; requests with stop strings take the engine's text (it must look for them),
    held back by the longest stop string less one character until finished, so streamed text
    is never taken back. A reader that falls behind the engine gets one output for all the
    steps it missed (never a timer: what is ready is yielded at once). Closing the iterator
    before the end aborts the request.
    """

    def __init__(self, engine: AsyncLLM, request_id: str, seqs: list[Sequence],
                 params: SamplingParams) -> None:
        self.request_id = request_id
        self._engine = engine
        self._stream = _Stream()
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
        self._closed = False

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.output.finished:
                items = await self._stream.take()
                deltas: list[_Delta] = []
                for i, item in enumerate(items):
                    if isinstance(item, BaseException):
                        if not deltas:
                            raise item
                        self._stream.items[:0] = items[i:]  # raised once the rest is out
                        break
                    deltas.append(item)
                self._apply(deltas)
                yield self.output
        finally:
            self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.output.finished:
                self._engine.abort(self.request_id)
            for mirror in self._mirrors:
                self._engine._detokenizer.free(mirror)

    def _apply(self, deltas: list[_Delta]) -> None:
        """Fold every delta taken into the output; text is decoded once per completion."""
        decode: set[int] = set()
        for delta in deltas:
            for part in delta.seqs:
                out = self.output.outputs[part.index]
                out.token_ids.extend(part.token_ids)
                if out.logprobs is not None:
                    out.logprobs.extend(part.logprobs)
                    out.cumulative_logprob += sum(lp[t].logprob for t, lp in
                                                  zip(part.token_ids, part.logprobs, strict=True))
                out.finish_reason, out.stop_reason = part.finish_reason, part.stop_reason
                if part.text is None:
                    self._mirrors[part.index].token_ids.extend(part.token_ids)
                    decode.add(part.index)
                elif part.finish_reason is not None:
                    out.text = part.text
                else:
                    out.text = part.text[: max(len(out.text), len(part.text) - self._hold_back)]
            if delta.prompt_logprobs is not None:
                self.output.prompt_logprobs = delta.prompt_logprobs
        for index in decode:
            mirror = self._mirrors[index]
            self._engine._detokenizer.step(mirror, check_stop=False)
            self.output.outputs[index].text = mirror.output_text
        self.output.finished = all(o.finish_reason is not None for o in self.output.outputs)


class AsyncLLM:
    """The engine run by a thread of its own, for asyncio front ends (the HTTP server).

    `add_request` validates and tokenizes on the caller's thread and raises ValueError naming
    the setting; the engine thread admits the request at its next step, so requests of many
    clients share steps. `abort(request_id)` ends a request and frees its KV blocks. An error
    raised by a step fails (`RequestFailedError`) only the requests that step held; the
    engine keeps serving the others.
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        self.engine_args = engine_args
        self._llm = LLM(**dataclasses.asdict(engine_args))
        self.tokenizer: Any | None = self._llm.get_tokenizer()
        self._detokenizer = Detokenizer(self.tokenizer)
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._stats = self._core.stats()
        governor = self._core.kv_cache_governor
        self._idle_poll_s = None if governor is None else governor.config.poll_interval_s
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvfit-engine", daemon=True)
        self._thread.start()

    @property
    def _core(self) -> EngineCore:
        return self._llm.engine

    @property
    def max_model_len(self) -> int:
        return self._llm.config.model_config.max_model_len

    @property
    def max_logprobs(self) -> int:
        return self._llm.config.model_config.max_logprobs

    @property
    def kv_cache_report(self) -> KVCacheReport:
        """How the KV cache was sized (`oom_guard_shrinks` counts the guard's shrinks since)."""
        return self._core.kv_cache_report

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def is_sleeping(self) -> bool:
        """Whether `sleep` released the weights or the KV cache (read from any thread)."""
        return self._core.is_sleeping

    async def sleep(self, level: int = 1, mode: str = "wait") -> SleepReport:
        """`LLM.sleep` on the engine thread, between two steps: requests queued before it
        are run to the end (`mode="wait"`) or aborted (`"abort"`) and their streams end; any
        sent later get `EngineSleepingError` until `wake_up`."""
        return await self._call(self._llm.sleep, level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """`LLM.wake_up(tags)` on the engine thread (weights reloaded after level 2)."""
        await self._call(self._llm.wake_up, tags)

    async def resize_kv_cache(self, num_blocks: int) -> KVCacheResize:
        """`LLM.resize_kv_cache` on the engine thread, between two steps."""
        return await self._call(self._llm.resize_kv_cache, num_blocks)

    async def kv_cache_state(self) -> dict[str, Any]:
        """The KV cache's size, bounds and resize counts, read on the engine thread."""
        return await self._call(self._core.kv_cache_state)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run `fn(*args)` on the engine thread between steps; its result or error here."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self._dead
        future = asyncio.get_running_loop().create_future()
        self._submit("call", fn, args, future)
        return await future

    def stats(self) -> EngineStats:
        """The engine's figures after its latest step (a snapshot; safe from any thread)."""
        return self._stats

    def decode_token(self, token_id: int) -> str | None:
        """One token's text on its own (None without a tokenizer)."""
        return self._detokenizer.decode_token(token_id)

    def add_request(self, prompt: Prompt, params: SamplingParams,
                    request_id: str | None = None) -> RequestStream:
        """Queue one request (call from a running event loop); iterate the returned stream
        for its outputs. Raises ValueError for a request the engine would refuse."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running") from self._dead
        if self.is_sleeping:
            raise EngineSleepingError("the engine is asleep: wake it up first (POST /wake_up)")
        request_id = request_id or uuid.uuid4().hex
        # The engine decodes text only where stop strings need it; the stream decodes the rest.
        engine_params = dataclasses.replace(params, detokenize=False)
        seqs = self._llm.make_request(prompt, engine_params, request_id)
        stream = RequestStream(self, request_id, seqs, params)
        self._submit("add", request_id, seqs, stream._stream)
        return stream

    async def generate(self, prompt: Prompt, params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate its stream; leaving early aborts the request."""
        async for output in self.add_request(prompt, params, request_id):
            yield output

    def abort(self, request_id: str) -> None:
        """End a request now (finish_reason "abort") and free its blocks; unknown ids are
        ignored. Thread-safe."""
        self._submit("abort", request_id)

    def shutdown(self) -> None:
        """Stop the engine thread and free the model and KV cache."""
        if self._thread.is_alive():
            self._submit("stop")
            self._thread.join()
        self._llm.shutdown()

    def _submit(self, *command: Any) -> None:
        self._commands.put(command)
        self._wake.set()

    # --- Engine thread ---

    def _run(self) -> None:
        try:
            while self._drain_commands():
                if not self._core.has_unfinished():
                    # Idle, the elastic cache's governor still watches memory on its poll.
                    if not self._wake.wait(self._idle_poll_s):
                        self._core.step()
                        self._stats = self._core.stats()
                    self._wake.clear()
                    continue
                try:
                    self._core.step()
                except Exception as error:
                    logger.exception("engine step failed; aborting the requests it held")
                    failed = RequestFailedError(f"the engine failed on this request: {error}")
                    for request_id in self._core.fail_step():
                        tracked = self._tracked.pop(request_id, None)
                        if tracked is not None:
                            tracked.stream.put(failed)
                self._publish()
                self._stats = self._core.stats()
        except BaseException as error:
            logger.exception("the engine thread stopped")
            self._dead = error
        finally:
            dead = EngineDeadError("the engine stopped")
            for tracked in self._tracked.values():
                tracked.stream.put(dead)
            self._tracked.clear()

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts; False once asked to stop."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            kind, args = command[0], command[1:]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*args)
            elif kind == "call":
                self._run_call(*args)
            elif kind == "abort":
                self._core.abort_request(args[0])
                tracked = self._tracked.pop(args[0], None)
                if tracked is not None and (delta := tracked.delta()) is not None:
                    tracked.stream.put(delta)
                self._stats = self._core.stats()

    def _run_call(self, fn: Callable[..., Any], args: tuple[Any, ...],
                  future: asyncio.Future[Any]) -> None:
        try:
            result, error = fn(*args), None
        except Exception as e:  # the caller's to handle; the engine serves on
            result, error = None, e
        self._publish()  # what a sleep finished or aborted ends its streams
        self._stats = self._core.stats()

        def settle() -> None:
            if not future.done():
                if error is None:
                    future.set_result(result)
                else:
                    future.set_exception(error)

        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
            future.get_loop().call_soon_threadsafe(settle)

    def _add(self, request_id: str, seqs: list[Sequence], stream: _Stream) -> None:
        try:
            for seq in seqs:
                self._core.add_request(seq)
        except (ValueError, RuntimeError) as error:
            # A RuntimeError: a sleep queued before this request ran first.
            self._core.abort_request(request_id)
            if isinstance(error, RuntimeError) and self._core.is_sleeping:
                error = EngineSleepingError(f"the engine is asleep: {error}")
            stream.put(error)
            return
        self._tracked[request_id] = _Tracked(seqs, stream, [0] * len(seqs), [False] * len(seqs))

    def _publish(self) -> None:
        """Send this step's deltas: one batch, one wake-up per event loop."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, _Delta | BaseException]]] = {}
        finished = []
        for request_id, tracked in self._tracked.items():
            delta = tracked.delta()
            if delta is not None:
                batches.setdefault(tracked.stream.loop, []).append((tracked.stream, delta))
            if tracked.finished:
                finished.append(request_id)
        for request_id in finished:
            del self._tracked[request_id]
        for loop, batch in batches.items():
            _deliver_threadsafe(loop, batch)


__all__ = ["AsyncLLM", "EngineDeadError", "EngineSleepingError", "RequestFailedError",
           "RequestStream"]
