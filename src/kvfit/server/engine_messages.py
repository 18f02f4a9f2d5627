"""What crosses between `AsyncLLM` (the front end) and its engine core loop, in a thread or
in a process of its own: plain tuples and small dataclasses, so a message pickles compactly.

Front end -> engine, commands (tuples, applied in order between two steps):
  `("add", request_id, prompt_token_ids, prompt_text, params, priority)`, `("abort", request_id)`,
  `("call", call_id, fn, args)` (`fn`: an `LLM` method name, or a function run as
  `fn(llm, *args)`), `("stop",)`; with several API server processes (`ChannelRouter`) also
  `("attach",)`, answered with `EngineReady`, from each process but the first.
Engine -> front end: one `EngineReady` (or `EngineStartFailed`), then `EngineOutputs`, at most
one per step: the new tokens of every request that advanced, coalesced into one message.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from kvfit.engine.config import EngineConfig
from kvfit.engine.engine_core import EngineStats
from kvfit.engine.sequence import Logprobs
from kvfit.kv.report import KVCacheReport


class EngineDeadError(RuntimeError):
    """The engine has stopped (shut down, its process died, or an error outside any step)."""


class EngineSleepingError(RuntimeError):
    """A request sent while the engine sleeps (`AsyncLLM.sleep`): wake it up first."""


ASLEEP = "the engine is asleep: wake it up first (POST /wake_up)"
"""What a request sent to a sleeping engine is told (an HTTP client: the route to call)."""


class RequestFailedError(RuntimeError):
    """A step holding this request raised; the request was aborted, the engine goes on."""


# Outputs are plain tuples: pickle builds and reads a tuple in C, a class instance (even a
# NamedTuple) through Python calls, 20 times slower per object at hundreds per step.
PhaseTimes = tuple[float, float, float, float]
"""`(queue, prefill, decode, inference)` seconds of one completion, vLLM's intervals on the
engine's clock: queued -> first scheduled -> first token -> finished (inference: first
scheduled -> finished)."""

SeqDelta = tuple[int, list[int], "list[Logprobs] | None", "str | None", "int | str | None",
                 "str | None", "PhaseTimes | None"]
"""`(index, token_ids, logprobs, finish_reason, stop_reason, text, times)`: what completion
`index` gained since its last delta; `logprobs` None unless asked for; `finish_reason` None
until it ends; `text` is the engine's (None unless it detokenizes: stop strings); `times`,
with its end, its `PhaseTimes` (None otherwise, and for one never scheduled)."""

RequestDelta = tuple[str, list[SeqDelta], bool, "list[Logprobs | None] | None", int]
"""`(request_id, seqs, finished, prompt_logprobs, num_cached_tokens)`: what one request gained;
`finished` once every completion has ended; the prompt logprobs, where asked, with the first;
`num_cached_tokens` as `RequestOutput`'s (-1 while the request waits to start)."""

PlainDelta = tuple[str, list[int]]
"""`(request_id, token_ids)`: the new tokens of a plain request (one completion, no logprobs,
no stop strings) that goes on; its last delta is a `RequestDelta`."""


@dataclass
class EngineReady:
    """Sent once the engine has started: what the front end needs to check requests."""

    config: EngineConfig
    kv_cache_report: KVCacheReport
    stats: EngineStats
    is_sleeping: bool


@dataclass
class EngineStartFailed:
    """Sent instead of `EngineReady` when the engine could not start, and as its last message
    when its core loop fails (as when its tensor-parallel workers die)."""

    error: BaseException
    traceback: str


@dataclass
class EngineOutputs:
    """One step's (or one round of commands') results: one delta per request that advanced,
    in `tokens` (plain requests going on) or `outputs` (the others, and every last delta);
    `errors`, `(request_id, error)` of requests that ended with that error;
    `kv_cache_report` only when it changed (the out-of-memory guard shrank the cache);
    `results`, `(call_id, result, error)` settling `call`s."""

    tokens: list[PlainDelta]
    outputs: list[RequestDelta]
    errors: list[tuple[str, BaseException]]
    stats: EngineStats
    is_sleeping: bool
    kv_cache_report: KVCacheReport | None = None
    results: list[tuple[int, Any, BaseException | None]] = field(default_factory=list)


def portable(error: BaseException) -> BaseException:
    """`error` if it survives pickling (to cross to the front end's process), else a
    RuntimeError carrying its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
