"""`EngineCoreLoop`: the engine side of `AsyncLLM`. It owns the `LLM`, applies the front end's
commands between steps, steps while anything is unfinished and sends one `EngineOutputs` per
step with the new tokens of every request that advanced (never one message per token).

The same loop runs on a thread of the front end's process or as the main loop of an engine
process (`engine_client`); only `send` differs.
"""

from __future__ import annotations

import itertools
import logging
import math
import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvfit.engine.kv_resize import KVCacheReleasedError
from kvfit.engine.llm import LLM
from kvfit.engine.sequence import PENDING_TOKEN, Sequence
from kvfit.kv.report import KVCacheReport
from kvfit.server.engine_messages import (
    ASLEEP,
    EngineOutputs,
    EngineReady,
    EngineSleepingError,
    PhaseTimes,
    PlainDelta,
    RequestDelta,
    RequestFailedError,
    SeqDelta,
    portable,
)

logger = logging.getLogger(__name__)

WORKER_CHECK_S = 1.0
"""How often an idle loop looks for a dead worker process (a sentinel read each: no call)."""


class _Tracked:
    """One request's sequences and how many of each one's tokens were sent so far. `delta`
    runs for every running request at every step: it reads each setting once, up front."""

    __slots__ = ("request_id", "seqs", "sent", "reported", "logprobs", "text",
                 "prompt_logprobs", "plain")

    def __init__(self, request_id: str, seqs: list[Sequence]) -> None:
        self.request_id, self.seqs = request_id, seqs
        self.sent = [0] * len(seqs)
        self.reported = [False] * len(seqs)
        params = seqs[0].sampling_params
        self.logprobs = params.logprobs is not None
        self.text = bool(params.stop)  # the engine decodes text only for stop strings
        self.prompt_logprobs = params.prompt_logprobs is not None  # and not sent yet
        self.plain = len(seqs) == 1 and not (self.logprobs or self.text or self.prompt_logprobs)

    def delta(self) -> RequestDelta | PlainDelta | None:
        """What the request gained since the last call (None: nothing); a `PlainDelta` for a
        plain request that goes on (a quarter of the work: the common case at every step)."""
        if self.plain and not (seq := self.seqs[0]).is_finished:
            tokens = seq.token_ids
            end = len(tokens) - (tokens[-1] == PENDING_TOKEN)  # a pending token is not ready
            first = seq.num_prompt_tokens + self.sent[0]
            if end == first:
                return None
            self.sent[0] = end - seq.num_prompt_tokens
            return self.request_id, tokens[first:end]
        parts: list[SeqDelta] = []
        sent, reported = self.sent, self.reported
        for i, seq in enumerate(self.seqs):
            tokens = seq.token_ids
            end = len(tokens) - (tokens[-1] == PENDING_TOKEN)  # a pending token is not ready
            first = seq.num_prompt_tokens + sent[i]
            done = seq.is_finished
            if end == first and (reported[i] or not done):
                continue
            start, num_ready = sent[i], end - seq.num_prompt_tokens
            parts.append((seq.sibling_index, tokens[first:end],
                          seq.logprobs[start:num_ready] if self.logprobs else None,
                          seq.finish_reason if done else None, seq.stop_reason,
                          seq.output_text if self.text else None,
                          _phase_times(seq) if done else None))
            sent[i], reported[i] = num_ready, done
        if not parts:
            return None
        finished = all(reported)
        prompt_logprobs = None
        # With the first output, not the last: the prompt is whole once a token follows it,
        # and a stream that echoes its prompt sends the prompt's logprobs first.
        if self.prompt_logprobs:
            self.prompt_logprobs = False
            prompt_logprobs = list(self.seqs[0].prompt_logprobs)
        return self.request_id, parts, finished, prompt_logprobs, self.seqs[0].num_cached_tokens


def _phase_times(seq: Sequence) -> PhaseTimes | None:
    """A finished sequence's queue, prefill, decode and inference times, as vLLM's intervals
    (first scheduled -> first token -> finish); None for one never scheduled."""
    if not seq.scheduled_time:
        return None
    end = seq.finished_time or time.monotonic()
    first_token = seq.first_token_time or end  # ended with no token: all of it was prefill
    return (seq.scheduled_time - seq.queued_time, first_token - seq.scheduled_time,
            end - first_token, end - seq.scheduled_time)


class EngineCoreLoop:
    """Steps `llm`'s engine for a front end; `send` receives every `EngineOutputs`.

    Commands (`engine_messages`) go through `submit`, from any thread; `run` applies them
    between steps, so requests of many clients share steps. A step that raises fails
    (`RequestFailedError`) only the requests it held; the loop serves on.
    """

    def __init__(self, llm: LLM, send: Callable[[EngineOutputs], None]) -> None:
        self.llm, self.core = llm, llm.engine
        self._send = send
        self._commands: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._added: list[str] = []  # request ids since the last publish: in no step yet
        # What commands and failed steps produced: deltas of aborted requests, errors.
        self._pending: list[RequestDelta] = []
        self._errors: list[tuple[str, BaseException]] = []
        self._results: list[tuple[int, Any, BaseException | None]] = []
        self._stats = self.core.stats()
        self._report: KVCacheReport = self.core.kv_cache_report
        self._sleeping = self.core.is_sleeping
        governor = self.core.kv_cache_governor
        self._idle_poll_s = None if governor is None else governor.config.poll_interval_s

    def ready(self) -> EngineReady:
        """The message that tells the front end the engine is up."""
        return EngineReady(self.llm.config, self._report, self._stats, self._sleeping)

    def submit(self, command: tuple[Any, ...]) -> None:
        """Queue a command for the next pause between steps (thread-safe)."""
        self._commands.put(command)
        self._wake.set()

    def run(self) -> None:
        """Serve commands and step until a `("stop",)` command."""
        while self._apply_commands():
            if not self.core.has_unfinished():
                # Idle, the elastic cache's governor still watches memory on its poll, and a
                # KV cache a failed resize released is retried (so /health recovers with no
                # traffic: a load balancer sends none while it answers 503).
                if not self._wait_idle():
                    self.core.step()
                    self._publish(scan=[])
                self._wake.clear()
                continue
            self._step()
            self._publish(scan=self._stepped())

    def _wait_idle(self) -> bool:
        """Wait for a command (True) or for `_idle_wait_s` to pass (False: time to step).
        Meanwhile every `WORKER_CHECK_S` a dead worker process raises `ExecutorFailedError`:
        the engine stops with its cause at once, and /health turns 503, rather than at the
        next request."""
        timeout = self._idle_wait_s()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = math.inf if deadline is None else max(0.0, deadline - time.monotonic())
            if self._wake.wait(min(left, WORKER_CHECK_S)):
                return True
            self.core.executor.check_workers()
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _idle_wait_s(self) -> float | None:
        """How long an idle loop waits for a command before stepping anyway (None: forever)."""
        if not self.core.kv_cache_released:
            return self._idle_poll_s
        return min(self._idle_poll_s or math.inf, self.core.released_retry_s)

    def _step(self) -> None:
        try:
            self.core.step()
        except Exception as error:
            failed: Exception
            if self.core.is_sleeping:  # refused for a user's sleep: no engine fault
                logger.error("engine step refused (%s); failing the requests it held", error)
                # Not the engine's words, which name LLM calls (as `_add`): requests a resume
                # queued while asleep are told the route to call.
                failed = EngineSleepingError(ASLEEP)
            elif isinstance(error, KVCacheReleasedError):  # no fault either: memory is short
                logger.error("%s", error)
                failed = error
            else:
                logger.exception("engine step failed; aborting the requests it held")
                failed = RequestFailedError(f"the engine failed on this request: {error}")
            for request_id in self.core.fail_step():
                if self._tracked.pop(request_id, None) is not None:
                    self._errors.append((request_id, failed))

    def _apply_commands(self) -> bool:
        """Apply queued commands and send what they produced; False once asked to stop."""
        called = added = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                self._add(*command[1:])
                added = True
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "call":
                self._call(*command[1:])
                called = True
        # A call (a sleep) may have stepped every request to its end: look at them all. Adds
        # alone send nothing: the next step's message carries the stats they changed, unless
        # no step follows (generation paused: the front ends see them waiting).
        if (called or self._pending or self._errors
                or (added and not self.core.has_unfinished())):
            self._publish(scan=list(self._tracked.values()) if called else [])
        return True

    def _add(self, request_id: str, prompt_token_ids: list[int], prompt: str | None,
             params: Any, priority: int) -> None:
        try:
            seqs = self.llm.make_request({"prompt_token_ids": prompt_token_ids,
                                          "prompt": prompt}, params, request_id, priority)
            for seq in seqs:
                self.core.add_request(seq)
        except (ValueError, RuntimeError) as error:
            # A RuntimeError: a sleep queued before this request ran first.
            self.core.abort_request(request_id)
            if isinstance(error, RuntimeError) and self.core.is_sleeping:
                # Not the engine's words, which name LLM calls: the client is told the
                # route, as one refused before its request reached the engine.
                error = EngineSleepingError(ASLEEP)
            self._errors.append((request_id, portable(error)))
            return
        self._tracked[request_id] = _Tracked(request_id, seqs)
        self._added.append(request_id)

    def _abort(self, request_id: str) -> None:
        self.core.abort_request(request_id)
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None and (delta := tracked.delta()) is not None:
            self._pending.append(delta)

    def _call(self, call_id: int, fn: str | Callable[..., Any], args: tuple[Any, ...]) -> None:
        """`llm.<fn>(*args)` or `fn(llm, *args)`; its result (or error) goes back by id."""
        try:
            result = getattr(self.llm, fn)(*args) if isinstance(fn, str) else fn(self.llm, *args)
            pickle.dumps(result)  # it must be able to reach a front end in another process
            self._results.append((call_id, result, None))
        except Exception as error:  # the caller's to handle; the engine serves on
            self._results.append((call_id, None, portable(error)))

    def _stepped(self) -> list[_Tracked]:
        """The requests a step can have changed: those whose sequences it applied (the core's
        `updated_seqs`, at most two batches) and those added since the last publish. Visiting
        these, not every request held, keeps a queue of waiting requests off every step's
        cost (the delta of a request visited twice is None the second time)."""
        tracked, added, self._added = self._tracked, self._added, []
        # A request failed or aborted since it was added is no longer tracked: its end is sent.
        return [t for request_id in itertools.chain(
            added, (seq.request_id for seq in self.core.updated_seqs))
            if (t := tracked.get(request_id)) is not None]

    def _publish(self, scan: list[_Tracked]) -> None:
        """Send what is pending plus the deltas of the requests in `scan`, in one message;
        nothing when nothing changed."""
        outputs, self._pending = self._pending, []
        tokens: list[PlainDelta] = []
        finished = []
        for tracked in scan:
            delta = tracked.delta()
            if delta is None:
                continue
            if len(delta) == 2:
                tokens.append(delta)
                continue
            outputs.append(delta)
            if delta[2]:
                finished.append(tracked.request_id)
        for request_id in finished:
            self._tracked.pop(request_id, None)
        core = self.core
        stats, report, sleeping = core.stats(), core.kv_cache_report, core.is_sleeping
        changed_report = report if report is not self._report else None
        if not (tokens or outputs or self._errors or self._results or changed_report is not None
                or stats != self._stats or sleeping != self._sleeping):
            return
        self._stats, self._report, self._sleeping = stats, report, sleeping
        errors, self._errors = self._errors, []
        results, self._results = self._results, []
        self._send(EngineOutputs(tokens, outputs, errors, stats, sleeping, changed_report,
                                 results))
