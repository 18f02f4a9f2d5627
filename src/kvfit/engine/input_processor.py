"""`InputProcessor`: prompts and sampling params checked and tokenized into the engine's
`Sequence`s, with nothing but the engine's config and tokenizer (vLLM's name for the piece).

`LLM` uses it before queueing; a front end whose engine runs in another process uses its own
copy, so a request the engine would refuse is refused where it arrives, naming the setting.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from kvfit.engine.config import EngineConfig
from kvfit.engine.prompts import Prompt, check_token_ids, parse_prompt
from kvfit.engine.sampling_params import MAX_TOKEN_LIST, SamplingParams, truncate_prompt
from kvfit.engine.sequence import Sequence

__all__ = ["InputProcessor", "Prompt"]


class InputProcessor:
    """Validates and tokenizes requests against one engine's `config`; `tokenizer` may be
    None (token-id prompts only)."""

    def __init__(self, config: EngineConfig, tokenizer: Any | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._request_counter = itertools.count()

    def make_request(self, prompt: Prompt, params: SamplingParams,
                     request_id: str, priority: int = 0) -> list[Sequence]:
        """Tokenize and validate one request without queueing it: its `n` sequences, named
        `request_id` (front ends that queue requests themselves, e.g. the async engine).
        Raises ValueError naming the setting, like `LLM.generate`."""
        try:
            seqs = self.make_sequences(0, prompt, self.resolve_bad_words(params), priority)
        except ValueError as e:
            raise ValueError(str(e).removeprefix("request 0: ")) from None
        for seq in seqs:
            seq.request_id = request_id
        return seqs

    def resolve_bad_words(self, params: SamplingParams) -> SamplingParams:
        """`params` with its `bad_words` tokenized into `bad_words_token_ids`: each word as
        written and after a space (a word inside text is usually another token). Raises
        ValueError naming bad_words where the sequences, with `bad_words_token_ids`, come to
        more than `MAX_TOKEN_LIST` (the most warmup bans): a word can give two, so words within
        `SamplingParams`' own bound on their number can come to more."""
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("SamplingParams.bad_words needs a tokenizer and the model has none; "
                             "use bad_words_token_ids instead")
        ids = list(params.bad_words_token_ids)
        for word in params.bad_words:
            for text in (word.lstrip(), " " + word.lstrip()):
                tokens = self.tokenizer.encode(text, add_special_tokens=False)
                if tokens and tokens not in ids:
                    ids.append(tokens)
        if len(ids) > MAX_TOKEN_LIST:
            # Each token sequence is what warmup bounds (MAX_TOKEN_LIST of them): named here,
            # as the words the caller gave, not as bad_words_token_ids, which they never set.
            given = len(params.bad_words_token_ids)
            with_given = f" ({len(ids)} with bad_words_token_ids)" if given else ""
            raise ValueError(
                f"SamplingParams.bad_words: its {len(params.bad_words)} words tokenize to "
                f"{len(ids) - given} token sequences (each as written and after a space)"
                f"{with_given}; at most {MAX_TOKEN_LIST} may be banned (warmup measures that "
                f"many): give fewer words")
        return dataclasses.replace(params, bad_words=[], bad_words_token_ids=ids)

    def make_sequences(self, index: int, prompt: Prompt, params: SamplingParams,
                       priority: int = 0) -> list[Sequence]:
        """Tokenize and validate request number `index`; its `n` sequences, the first the
        parent of the rest. Errors name the request and the setting."""
        where = f"request {index}"
        if priority and self.config.scheduler_config.scheduling_policy != "priority":
            # As vLLM refuses it: taken, it would promise an order that never happens.
            raise ValueError(f"{where}: priority={priority} needs the priority scheduling "
                             f"policy (--scheduling-policy priority); under 'fcfs' requests "
                             f"run in arrival order and take priority 0")
        try:
            # Checked at construction, but a caller may have changed the object since (the
            # async engine passes a shallow copy): no step may hold more than warmup measured.
            params.check_limits()
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        allowed = params.allowed_token_ids
        if allowed is not None and len(set(allowed)) < len(allowed):
            # Made distinct at construction (each entry is device memory at every step), but
            # not where the list was changed since: the constructor makes it so again.
            params = dataclasses.replace(params, allowed_token_ids=allowed)
        text, token_ids = parse_prompt(where, prompt, self.tokenizer)
        mc = self.config.model_config
        token_ids = truncate_prompt(token_ids, params.truncate_prompt_tokens, mc.max_model_len)
        vocab_size = mc.hf_config.vocab_size
        if not token_ids:
            raise ValueError(f"{where}: the prompt is empty")
        check_token_ids(where, token_ids, vocab_size)
        if len(token_ids) >= mc.max_model_len:
            raise ValueError(
                f"{where}: the prompt has {len(token_ids)} tokens, max_model_len is "
                f"{mc.max_model_len} (one more is needed to generate); shorten the prompt or "
                f"raise max_model_len"
            )
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n == -1:  # vLLM's: every token of the vocabulary
                params = dataclasses.replace(params, **{name: vocab_size})
            asked = f"-1 (the whole vocabulary, {vocab_size})" if n == -1 else n
            if n is not None and getattr(params, name) > mc.max_logprobs:
                raise ValueError(f"{where}: SamplingParams.{name}={asked} is above max_logprobs="
                                 f"{mc.max_logprobs}; lower it or raise max_logprobs (-1: the "
                                 f"whole vocabulary)")
        try:
            params.check_token_ids(vocab_size)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{where}: SamplingParams.stop needs a tokenizer; use "
                             f"stop_token_ids instead")
        if params.max_tokens is None:  # the rest of the context, as vLLM resolves it
            room = mc.max_model_len - len(token_ids)
            # A min_tokens beyond the room bans stops to the end of the context either way
            # (like an explicit max_tokens past it); unclamped it would fail validation.
            params = dataclasses.replace(params, max_tokens=room,
                                         min_tokens=min(params.min_tokens, room))
        request_id = str(next(self._request_counter))
        parent = Sequence(token_ids, params, request_id=request_id, prompt=text,
                          priority=priority)
        siblings = [Sequence(token_ids, params, request_id=request_id, prompt=text,
                             sibling_index=i, parent=parent, priority=priority)
                    for i in range(1, params.n)]
        return [parent, *siblings]
