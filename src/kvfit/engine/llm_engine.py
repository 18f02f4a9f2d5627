"""`LLMEngine`: vLLM's `LLM.llm_engine`, the API of scripts that add requests and step the
engine themselves (`add_request`, `step`, `has_unfinished_requests`, `abort_request`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvfit.engine.config import EngineConfig, ModelConfig
from kvfit.engine.outputs import RequestOutput
from kvfit.engine.prompts import Prompt, check_priority, check_vllm_request_args, describe
from kvfit.engine.sampling_params import RequestOutputKind, SamplingParams
from kvfit.engine.sequence import PENDING_TOKEN, Sequence

if TYPE_CHECKING:
    from kvfit.engine.llm import LLM

ENGINE_ID_PREFIX = "llm_engine-"
"""Before a caller's id in the engine: `generate` names its requests by a counter ("0", "1",
...), and an id of the caller's ("0") would otherwise abort or report one of them."""


@dataclasses.dataclass
class _Request:
    request_id: str  # the caller's
    seqs: list[Sequence]
    final_only: bool
    num_reported: int = -1  # output tokens in the last output returned (-1: none yet)


class LLMEngine:
    """What `LLM.llm_engine` returns: vLLM's stepping loop over the same engine `generate`
    runs, `while engine.has_unfinished_requests(): outputs = engine.step()`.

    `step` runs one engine step and returns a `RequestOutput` for each request added here
    that gained tokens or finished, cumulative as vLLM's default output kind (`FINAL_ONLY`:
    its final output alone); a finished request's last output equals `generate`'s for it. The
    engine is pipelined (a step's tokens are read at the next), so a request's first output
    comes one step later than vLLM's. Requests of `generate` calls on other threads share the
    steps but are reported only to their call, and theirs advance this loop's requests too
    (which `step` reports all the same). Aborted requests are dropped with no output, as in
    vLLM. Thread-safe through `LLM`'s lock, a step at a time.
    """

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self._requests: dict[str, _Request] = {}  # by the caller's id, until reported finished
        self._seen_steps = llm._num_steps  # the count after this object's last step

    @property
    def vllm_config(self) -> EngineConfig:
        """The engine's configuration, under vLLM's name (`LLM.config`)."""
        return self._llm.config

    @property
    def model_config(self) -> ModelConfig:
        return self._llm.config.model_config

    def get_tokenizer(self) -> Any | None:
        """The tokenizer prompts are tokenized with (`LLM.get_tokenizer`)."""
        return self._llm.tokenizer

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams,
                    arrival_time: float | None = None, lora_request: Any = None,
                    tokenization_kwargs: dict[str, Any] | None = None,
                    trace_headers: Any = None, priority: int = 0) -> None:
        """Queue a request for the next `step`, in vLLM's argument order; `prompt` as
        `generate` takes one. Raises ValueError for a request `generate` would refuse, or
        for `request_id` of a request added here and not yet reported finished or aborted.
        vLLM's `arrival_time`, `lora_request` and `tokenization_kwargs` are taken where they
        ask for nothing (None), else refused; `trace_headers` has nowhere to go."""
        check_vllm_request_args("add_request", lora_request, tokenization_kwargs)
        if arrival_time is not None:
            raise ValueError(f"add_request(arrival_time={arrival_time!r}): a request's queue "
                             f"time starts when it is added here; leave arrival_time None")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str; got {describe(request_id)}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams (pooling is not supported); got "
                            f"{describe(params)}")
        if params.output_kind is RequestOutputKind.DELTA:
            raise ValueError("SamplingParams(output_kind=DELTA) is not supported by "
                             "llm_engine.step(); take CUMULATIVE (the default) and slice off "
                             "what an output added, or use AsyncLLM, which streams deltas")
        llm = self._llm
        # The request's own copy, as `generate` takes one (the sampler caches on it).
        seqs = llm.make_request(prompt, dataclasses.replace(params),
                                ENGINE_ID_PREFIX + request_id, check_priority(priority))
        with llm._lock:
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already running; use another, "
                                 f"or abort_request it first")
            try:
                for seq in seqs:
                    llm.engine.add_request(seq)
            except ValueError:
                llm.engine.abort_request(seqs[0].request_id)
                raise
            self._requests[request_id] = _Request(
                request_id, seqs, params.output_kind is RequestOutputKind.FINAL_ONLY)

    def step(self) -> list[RequestOutput]:
        """One engine step (none while only other threads' requests or none run); the
        outputs of this object's requests that gained tokens or finished since the last."""
        llm = self._llm
        with llm._lock:
            stepped_elsewhere = llm._num_steps != self._seen_steps
            finished: list[Sequence] = []
            if llm.engine.has_unfinished() and self._requests:
                try:
                    finished = llm._step()
                except BaseException:
                    # As `generate`'s: the requests the step held are aborted (their state is
                    # unknown), and the next `step` looks at every request for them.
                    llm.engine.fail_step()
                    self._seen_steps = -1
                    raise
            self._seen_steps = llm._num_steps
            if stepped_elsewhere:  # another caller's steps advanced ours unseen: look at all
                candidates = list(self._requests.values())
            else:
                candidates = self._stepped(finished)
            outputs = [out for request in candidates if (out := self._output(request))]
            if not self._requests and llm._num_runs == 0 and llm.engine.has_unfinished():
                # The last step launched may still be in flight: apply it, so the engine is
                # left idle as `generate` leaves it.
                llm._step()
                self._seen_steps = llm._num_steps
        return outputs

    def _stepped(self, finished: list[Sequence]) -> list[_Request]:
        """This object's requests among those the last step applied or finished."""
        requests, found = self._requests, {}
        for seq in (*self._llm.engine.updated_seqs, *finished):
            if seq.request_id.startswith(ENGINE_ID_PREFIX):
                request = requests.get(seq.request_id[len(ENGINE_ID_PREFIX):])
                if request is not None:
                    found[request.request_id] = request
        return list(found.values())

    def _output(self, request: _Request) -> RequestOutput | None:
        """`request`'s output if it gained tokens or finished since the last (dropped from
        `_requests` once finished); else None."""
        done = all(seq.is_finished for seq in request.seqs)
        num_tokens = sum(seq.num_output_tokens - seq.has_pending_token for seq in request.seqs)
        if not done and (request.final_only or num_tokens == request.num_reported):
            return None
        request.num_reported = num_tokens
        output = RequestOutput.from_seqs(request.seqs)
        output.request_id = request.request_id
        if done:
            del self._requests[request.request_id]
        else:
            for completion in output.outputs:  # a token the step in flight samples: not yet
                if completion.token_ids and completion.token_ids[-1] == PENDING_TOKEN:
                    completion.token_ids.pop()
        return output

    def has_unfinished_requests(self) -> bool:
        """Whether a request added here has not been reported finished (nor aborted)."""
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        """How many requests added here have not been reported finished (nor aborted)."""
        return len(self._requests)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """End requests added here now and free their blocks: one id or several, as vLLM's;
        they are dropped (no output). Unknown and finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._llm._lock:
            for request_id in ids:
                if self._requests.pop(request_id, None) is not None:
                    self._llm.engine.abort_request(ENGINE_ID_PREFIX + request_id)

