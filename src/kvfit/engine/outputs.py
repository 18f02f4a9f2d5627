"""Request results, shaped like vLLM's so code written against it reads them unchanged."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from kvfit.engine.sequence import Logprob, Logprobs, Sequence

__all__ = ["CompletionOutput", "Logprob", "RequestOutput"]


@dataclass
class CompletionOutput:
    """One generated completion of a request.

    `logprobs` (one {token id: `Logprob`} per token) and `cumulative_logprob` are None unless
    the request asked for logprobs. `stop_reason` is the stop string or stop token id that ended
    generation, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[Logprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's prompt and its `n` completions; `prompt_logprobs` starts with None.

    `num_cached_tokens`: the prompt tokens whose K/V came from the prefix cache or the KV
    connector when the request was first scheduled (0 before), as vLLM's field.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[Logprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0

    @classmethod
    def from_seqs(cls, seqs: SequenceOf[Sequence]) -> RequestOutput:
        """The current state of a request's sequences (its `n` completions, in order) as a
        result (final once all are finished)."""
        first = seqs[0]
        prompt_logprobs = None
        if first.sampling_params.prompt_logprobs is not None:
            prompt_logprobs = list(first.prompt_logprobs)
        return cls(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=[_completion(seq) for seq in seqs],
            finished=all(seq.is_finished for seq in seqs),
            num_cached_tokens=max(first.num_cached_tokens, 0),
        )

    @classmethod
    def from_seq(cls, seq: Sequence) -> RequestOutput:
        """`from_seqs` of a request with one completion."""
        return cls.from_seqs([seq])


def _completion(seq: Sequence) -> CompletionOutput:
    token_ids = seq.output_token_ids
    logprobs = cumulative = None
    if seq.sampling_params.logprobs is not None:
        logprobs = list(seq.logprobs)
        cumulative = sum(lp[t].logprob for t, lp in zip(token_ids, logprobs, strict=False))
    return CompletionOutput(
        index=seq.sibling_index,
        text=seq.output_text,
        token_ids=token_ids,
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
    )
