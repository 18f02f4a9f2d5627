"""Per-request sampling settings, with vLLM's names and semantics."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cached_property

import numpy as np

logger = logging.getLogger(__name__)

MIN_TEMPERATURE = 0.01
"""Temperatures in (0, 0.01) are raised to this, with a warning, as vLLM does (its `_MAX_TEMP`):
a logit divided by a smaller one overflows, or all but overflows, and sampling at one is the
argmax's anyway; 0 is greedy."""

MAX_TOKEN_LIST = 1024
"""Most entries of `logit_bias`, of `stop_token_ids`, of `allowed_token_ids` and of `bad_words`
(token sequences) one request may carry. Warmup samples every row with this many of each, so
the step that holds the most of them is one that was measured before the KV cache was sized."""

MAX_N = 16384
"""Most completions (`n`) one request may ask for, vLLM's default bound
(`VLLM_MAX_N_SEQUENCES`). Each is a sequence built as the request is queued, so an unbounded
`n` (a 30-byte request asking for 10**20) would fill the front end's memory before any check
on the engine's side ran."""


class RequestOutputKind(IntEnum):
    """What each output of a streamed request (`AsyncLLM.generate`) holds, vLLM's values:
    everything so far (`CUMULATIVE`), only what is new since the last output (`DELTA`), or
    one output at the end (`FINAL_ONLY`). `LLM.generate` returns final outputs whatever it
    says, as vLLM's."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request.

    `temperature=0` is greedy; one in (0, 0.01) is raised to 0.01 with a warning, as vLLM's
    is (`MIN_TEMPERATURE`). `top_k` of 0 or -1, `top_p=1` and `min_p=0` disable those
    filters, which act on the tempered distribution in vLLM's order: min-p, top-k, then top-p
    over what is left. Penalties act on the logits before them, after `logit_bias` (vLLM's
    order): `repetition_penalty` (> 1 discourages) on every token of the prompt and output,
    `presence_penalty` and `frequency_penalty` on output tokens (once, and per occurrence);
    `logit_bias` adds to given token ids; `allowed_token_ids` (when set) are the only tokens
    that may be sampled.
    `bad_words` are never generated: a one-token word is banned outright, a longer
    one when the output ends with all but its last token (`bad_words_token_ids` holds them
    tokenized; the `LLM` front end fills it).

    `seed` makes the request's samples depend on it alone (not on the engine's generator, its
    batch or its position); -1 means no seed, as in vLLM and OpenAI's API (clients send it for
    "random"), so `seed` reads None.

    `max_tokens=None` generates until the context is full (`max_model_len`) or a stop.
    `n` completions share the prompt (and, with prefix caching, its KV blocks). `stop` strings
    end generation and are cut from the text unless `include_stop_str_in_output`; so is the
    text of the token that ends it (`stop_token_ids`, EOS), which `token_ids` always hold.
    `logprobs=n` returns the top-n log-probabilities of every generated token plus the sampled
    one; `prompt_logprobs=n` the same for every prompt token after the first; -1 asks for the
    whole vocabulary (within the engine's `max_logprobs`, as vLLM's). They hold what the
    engine's `logprobs_mode` says: by default (vLLM's) the log-softmax of the raw logits,
    before penalties, temperature and filters; prompt logprobs always so.
    `spaces_between_special_tokens=False` (with `skip_special_tokens=False`) gives an added
    token that follows another as its bare text, without the space a decoder (WordPiece's, or
    none) puts before it, as vLLM's does.
    `detokenize=False` leaves `output_text` empty unless stop strings need the text (a front
    end that decodes text itself keeps that work off the engine's step).
    `output_kind` (`RequestOutputKind`): what each output of a streamed request holds.
    `structured_outputs` and `guided_decoding` (vLLM's) are taken at None only.
    `truncate_prompt_tokens=k` keeps only the prompt's last k tokens (-1: the last
    `max_model_len`), as vLLM's does; `RequestOutput.prompt` stays the text given.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM's structured output (and its older name): taken at None only, so that a vLLM
    # script passing them is told why rather than given a TypeError.
    structured_outputs: object | None = None
    guided_decoding: object | None = None

    def __post_init__(self) -> None:
        for name in ("structured_outputs", "guided_decoding"):
            _check(getattr(self, name) is None, name, "is not supported: kvfit has no "
                   "structured output (JSON schema, regex, grammar, choice); leave it None",
                   getattr(self, name))
        for name in ("stop", "bad_words"):
            value = getattr(self, name)
            setattr(self, name, [value] if isinstance(value, str) else _as_list(name, value))
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _as_list("allowed_token_ids", self.allowed_token_ids)
        self.bad_words_token_ids = [_as_list("bad_words_token_ids", ids)
                                    for ids in _as_list("bad_words_token_ids",
                                                        self.bad_words_token_ids)]
        if self.logit_bias is not None:
            # JSON object keys arrive as strings. A key or value that is no number is named
            # here, not left to int()'s error, which says neither field nor entry.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError):
                _check(False, "logit_bias", "must map token ids to numbers", self.logit_bias)
        # vLLM's enum, or its value; anything else would stream as CUMULATIVE, unasked.
        _check(is_int(self.output_kind) and self.output_kind in tuple(RequestOutputKind),
               "output_kind", "must be a RequestOutputKind", self.output_kind)
        self.output_kind = RequestOutputKind(self.output_kind)
        self._validate()
        if 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("SamplingParams.temperature %s is below %s, where logits / "
                           "temperature overflow: raised to %s, as vLLM does (0 is greedy)",
                           self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if self.allowed_token_ids is not None:
            # Each entry is device memory at every step (an index and the value it keeps),
            # and warmup measures distinct ids, at most the vocabulary: a small vocabulary's
            # request naming ids twice would hold more. The same set of tokens, first order.
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))
        if self.seed == -1:
            # vLLM's (and OpenAI's) "no seed": a client sending -1 for "random" would otherwise
            # get the same completion at every try.
            self.seed = None

    def _validate(self) -> None:
        # Types first: a NaN passes no range check by failing, an inf passes some, a float
        # max_tokens or a bool seed would run with a meaning nobody asked for.
        for name in _INT_FIELDS:
            value = getattr(self, name)
            _check(value is None and name in _OPTIONAL_FIELDS or is_int(value), name,
                   "must be an integer", value)
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _check(_is_real(value) and math.isfinite(value), name, "must be a finite number",
                   value)
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or ()
            _check(all(is_int(t) for t in ids), name, "must hold integers", ids)
        _check(all(is_int(t) for ids in self.bad_words_token_ids for t in ids),
               "bad_words_token_ids", "must hold lists of integers", self.bad_words_token_ids)
        # Stop strings are first read by the detokenizer inside a step, where an int or bytes
        # would fail the step and with it every request of the batch.
        for name in ("stop", "bad_words"):
            words = getattr(self, name)
            _check(all(isinstance(w, str) for w in words), name, "must hold strings", words)
        _check(self.allowed_token_ids != [], "allowed_token_ids",
               "must name at least one token (None: every token)", self.allowed_token_ids)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= -1, "top_k", "must be -1 (off), 0 (off) or >= 1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        for name in ("presence_penalty", "frequency_penalty"):
            _check(-2 <= getattr(self, name) <= 2, name, "must be in [-2, 2]", getattr(self, name))
        _check(self.repetition_penalty > 0, "repetition_penalty", "must be > 0 (1 = off)",
               self.repetition_penalty)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               "must be >= 1", self.max_tokens)  # or None: up to max_model_len
        _check(0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens",
               f"must be in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        _check(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens == -1
               or self.truncate_prompt_tokens >= 1, "truncate_prompt_tokens",
               "must be >= 1, -1 (the last max_model_len) or None", self.truncate_prompt_tokens)
        _check(all(self.stop), "stop", "must not contain an empty string", self.stop)
        _check(all(w.strip() for w in self.bad_words), "bad_words",
               "must not contain an empty word (it would ban nothing)", self.bad_words)
        # They are tokenized as the request is queued, and a tokenizer raises a TypeError on a
        # lone UTF-16 surrogate (JSON's "\ud800" escapes carry them), not a ValueError.
        _check(all(_is_unicode(w) for w in self.bad_words), "bad_words",
               "must be valid Unicode text (no lone UTF-16 surrogates)", self.bad_words)
        _check(all(self.bad_words_token_ids), "bad_words_token_ids",
               "must not contain an empty token list", self.bad_words_token_ids)
        if self.logit_bias is not None:
            _check(all(math.isfinite(v) for v in self.logit_bias.values()), "logit_bias",
                   "values must be finite", self.logit_bias)
        self.check_limits()

    def check_limits(self) -> None:
        """Raise ValueError naming the field if `n`, `logprobs`, `prompt_logprobs` or a token
        list is past the bound warmup measured (`MAX_N`, -1, `MAX_TOKEN_LIST`).

        Construction checks them, but a caller may change a params object afterwards and pass
        it again: a front end that does not copy it through the constructor (the async engine
        takes a shallow copy) calls this as it queues the request, a few `len`s, so that no
        step can hold more entries than warmup's worst case.
        """
        _check(is_int(self.n) and 1 <= self.n <= MAX_N, "n", f"must be in [1, {MAX_N}]",
               self.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or is_int(value) and value >= -1, name,
                   "must be >= 0, -1 (the whole vocabulary) or None", value)
        for name in ("logit_bias", "stop_token_ids", "allowed_token_ids", "bad_words",
                     "bad_words_token_ids"):
            size = len(getattr(self, name) or ())
            _check(size <= MAX_TOKEN_LIST, name,
                   f"holds at most {MAX_TOKEN_LIST} entries (warmup measures that many)",
                   f"{size} entries")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError if a token id this request names is outside `[0, vocab_size)`."""
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("stop_token_ids", self.stop_token_ids),
                          ("allowed_token_ids", self.allowed_token_ids or ()),
                          ("bad_words_token_ids", [t for w in self.bad_words_token_ids
                                                   for t in w])):  # fmt: skip
            bad = [t for t in ids if not 0 <= t < vocab_size]
            _check(not bad, name, f"token ids must be in [0, {vocab_size})", bad[:8])

    @cached_property
    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """`logit_bias` as `(token ids int64, biases float32)`, built once per params object
        (requests of one batch share it; steps read it every time)."""
        bias = self.logit_bias or {}
        return (np.fromiter(bias.keys(), np.int64, len(bias)),
                np.fromiter(bias.values(), np.float32, len(bias)))

    @cached_property
    def single_token_bad_words(self) -> frozenset[int]:
        """Bad words of one token: banned at every step."""
        return frozenset(w[0] for w in self.bad_words_token_ids if len(w) == 1)

    @cached_property
    def multi_token_bad_words(self) -> tuple[list[int], ...]:
        """Bad words of several tokens: their last token is banned after the others."""
        return tuple(w for w in self.bad_words_token_ids if len(w) > 1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling the next token reads earlier output tokens on the host (penalties,
        multi-token bad words): such a row cannot be scheduled while its last token is still
        on the device."""
        return self.has_penalties or bool(self.multi_token_bad_words)


_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
               "truncate_prompt_tokens")
_OPTIONAL_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


def is_int(value: object) -> bool:
    """An integer, numpy's included; not a bool (True is no token id or count)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool | np.bool_)


def truncate_prompt(token_ids: list[int], truncate_prompt_tokens: int | None,
                    max_model_len: int) -> list[int]:
    """`token_ids` cut to their last `truncate_prompt_tokens` (-1: the last `max_model_len`;
    None: all), vLLM's `truncate_prompt_tokens`, for the engine and the server alike."""
    k = truncate_prompt_tokens
    return token_ids if k is None else token_ids[-(max_model_len if k == -1 else k):]


def _as_list(name: str, value: object) -> list:
    """`value` (a list, tuple or other iterable; None: empty) as a new list. A lone number
    is refused naming the field, not left to list()'s error, which names neither."""
    try:
        return list(value or [])
    except TypeError:
        raise ValueError(f"SamplingParams.{name} must be a list, got {value!r}") from None


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {rule}, got {value!r}")
