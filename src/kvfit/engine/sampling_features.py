"""Every sampling option as warmup sees it: the fields it reads and its worst case.

Measured sizing is only as safe as warmup is complete, so each option of `SamplingParams` belongs
to one `SamplingFeature`, which names the request that makes the option's device memory largest.
Warmup samples `max_num_seqs` rows with `worst_case_params()` (every feature at once), and a test
fails when a field belongs to no feature, so a new option cannot be forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from kvfit.engine.sampling_params import MAX_TOKEN_LIST, SamplingParams


@dataclass(frozen=True)
class WarmupLimits:
    """The engine limits a worst case is built from."""

    vocab_size: int
    max_model_len: int
    max_logprobs: int
    eos_token_ids: tuple[int, ...] = ()  # banned below min_tokens besides the stop ids


class SamplingFeature:
    """A sampling option: the `SamplingParams` fields it reads, whether a request uses it, and
    the settings at which it allocates the most device memory."""

    fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        raise NotImplementedError

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        raise NotImplementedError


class Temperature(SamplingFeature):
    """Random sampling (Gumbel-max with a per-row seed) instead of the argmax."""

    fields = ("temperature",)

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return not params.greedy

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"temperature": 0.8}


class Filters(SamplingFeature):
    """top-k, top-p and min-p: one threshold per row (`kvfit.ops.filter_thresholds`)."""

    fields = ("top_k", "top_p", "min_p")

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.top_k > 0 or params.top_p < 1.0 or params.min_p > 0.0

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"top_k": max(1, limits.vocab_size // 2), "top_p": 0.9, "min_p": 0.01}


class Seed(SamplingFeature):
    """Per-request seeds: each token's noise drawn from the request's own seed."""

    fields = ("seed",)

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.seed is not None

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"seed": 0}


class Siblings(SamplingFeature):
    """`n` completions of one prompt: more rows (bounded by max_num_seqs) and per-sibling
    seeds; warmup's rows are sibling pairs."""

    fields = ("n",)

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.n > 1

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"n": 2}


class Logprobs(SamplingFeature):
    """Logprobs of sampled tokens: top-n, rank and log-sum-exp over row blocks."""

    fields = ("logprobs",)

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.logprobs is not None

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"logprobs": limits.max_logprobs}


class PromptLogprobs(SamplingFeature):
    """Prompt logprobs: logits of whole prompt chunks (warmed up in the mixed step, where a
    chunk's logits meet a prefill's activations)."""

    fields = ("prompt_logprobs",)

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.prompt_logprobs is not None

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"prompt_logprobs": limits.max_logprobs}


class Penalties(SamplingFeature):
    """Repetition, presence and frequency penalties, applied in place over each row's distinct
    context tokens (warmup's contexts are `max_model_len` distinct tokens)."""

    fields = ("presence_penalty", "frequency_penalty", "repetition_penalty")

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.has_penalties

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}


class LogitBias(SamplingFeature):
    """`logit_bias`: added in place at the given token ids."""

    fields = ("logit_bias",)

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return bool(params.logit_bias)

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        return {"logit_bias": {t: 1.0 for t in range(_list_size(limits))}}


class AllowedTokens(SamplingFeature):
    """`allowed_token_ids`: every other token -inf; the undo copies the row whole."""

    fields = ("allowed_token_ids",)

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        # The last ids: the last one is never banned below, so no row is left without a token.
        return {"allowed_token_ids": list(range(limits.vocab_size - _list_size(limits),
                                                limits.vocab_size))}


class BannedTokens(SamplingFeature):
    """Tokens set to -inf in place: stop and EOS ids below `min_tokens`, and bad words."""

    fields = ("min_tokens", "stop_token_ids", "ignore_eos", "bad_words", "bad_words_token_ids")

    @classmethod
    def active(cls, params: SamplingParams) -> bool:
        return params.min_tokens > 0 or bool(params.bad_words_token_ids)

    @classmethod
    def worst_case(cls, limits: WarmupLimits) -> dict[str, Any]:
        # Disjoint lists, so every ban is an entry of its own, and none an EOS id, which
        # `min_tokens` bans besides them (a request whose lists miss EOS bans that many more),
        # up to every id but the last that is no EOS (allowed above, so no row is left without
        # a token: one entry short of a request that bans the whole vocabulary: its index and
        # value, about 16 bytes a row).
        eos = set(limits.eos_token_ids)
        ids = [t for t in range(limits.vocab_size) if t not in eos][:-1]
        size = min(MAX_TOKEN_LIST, len(ids))
        return {"min_tokens": limits.max_model_len, "stop_token_ids": ids[:size],
                "bad_words_token_ids": [[t] for t in ids[size : 2 * size]]}


def _list_size(limits: WarmupLimits) -> int:
    """The most ids a request's list may hold: `MAX_TOKEN_LIST`, or every id of a smaller
    vocabulary (each id is an entry of device memory, so a quarter would not do)."""
    return min(MAX_TOKEN_LIST, limits.vocab_size)


SAMPLING_FEATURES: tuple[type[SamplingFeature], ...] = (
    Temperature, Filters, Seed, Siblings, Logprobs, PromptLogprobs, Penalties, LogitBias,
    AllowedTokens, BannedTokens,
)

HOST_ONLY_FIELDS = frozenset({"max_tokens", "stop", "include_stop_str_in_output",
                              "skip_special_tokens", "spaces_between_special_tokens",
                              "detokenize", "truncate_prompt_tokens", "output_kind",
                              "structured_outputs", "guided_decoding"})
"""Fields that never reach the device: they only decide when a request stops and its text,
(`truncate_prompt_tokens`) cut the prompt before it is queued, within max_model_len,
(`output_kind`) shape a stream's outputs, or (`structured_outputs`, `guided_decoding`) are
vLLM's, taken at None only."""


def worst_case_params(limits: WarmupLimits) -> SamplingParams:
    """One request with every feature at its worst case: what warmup samples every row with."""
    kwargs: dict[str, Any] = {"max_tokens": limits.max_model_len}
    for feature in SAMPLING_FEATURES:
        kwargs.update(feature.worst_case(limits))
    return SamplingParams(**kwargs)
