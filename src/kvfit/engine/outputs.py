"""Request results, shaped like vLLM's so code written against it reads them unchanged."""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.engine.sequence import Sequence


@dataclass
class CompletionOutput:
    """One generated completion of a request.

    `logprobs` and `cumulative_logprob` are None unless the request asked for logprobs.
    `stop_reason` is the stop string or stop token id that ended generation, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its completions; `prompt_logprobs` starts with None."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool

    @classmethod
    def from_seq(cls, seq: Sequence) -> RequestOutput:
        """The current state of `seq` as a result (final once `seq` is finished)."""
        params = seq.sampling_params
        token_ids = seq.output_token_ids
        logprobs = cumulative = None
        if params.logprobs is not None:
            logprobs = list(seq.logprobs)
            cumulative = sum(lp[t] for t, lp in zip(token_ids, logprobs, strict=False))
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=token_ids,
            cumulative_logprob=cumulative,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = list(seq.prompt_logprobs)
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[completion],
            finished=seq.is_finished,
        )
