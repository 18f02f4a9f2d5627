"""`generate`'s arguments in vLLM's forms, checked for their types before anything else: a
prompt is a string, `{"prompt": "text"}` or `{"prompt_token_ids": [...]}` (both keys: the ids
are used, the text kept), `sampling_params` one `SamplingParams` or one per prompt. A wrong
argument is named with what was given instead."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvfit.engine.sampling_params import SamplingParams, is_int

Prompt = str | dict[str, Any]
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


def batch_args(prompts: Any, sampling_params: Any) -> tuple[list[Prompt], list[SamplingParams]]:
    """One list of prompts and one of params (of any length; the caller compares them)."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string, a prompt dict or a list of them; got "
                        f"{describe(prompts)}")
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    if isinstance(sampling_params, dict | str) or not isinstance(sampling_params, Sequence) \
            or not all(isinstance(sp, SamplingParams) for sp in sampling_params):
        hint = " (build one: SamplingParams(**params))" if isinstance(sampling_params, dict) else ""
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them; got "
                        f"{describe(sampling_params)}{hint}")
    return list(prompts), list(sampling_params)


def parse_prompt(where: str, prompt: Prompt, tokenizer: Any | None) -> tuple[str | None, list]:
    """`(text or None, token ids)` of one prompt; errors start with `where`."""
    if isinstance(prompt, dict) and _PROMPT_KEYS & set(prompt) and (
            other := sorted(map(str, set(prompt) - _PROMPT_KEYS))):
        # vLLM's other keys (multi_modal_data, cache_salt, ...) ask for what a text-only
        # engine does not do: ignored, the request would run without them. (A dict of neither
        # key is no prompt, said below.)
        raise ValueError(f"{where}: prompt key {', '.join(map(repr, other))} is not supported; "
                         f"a prompt dict holds 'prompt' (text) and/or 'prompt_token_ids'")
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
        if hasattr(ids, "tolist") and not isinstance(ids, Sequence):
            ids = ids.tolist()  # a numpy array or torch tensor (a tokenizer's tensors)
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise ValueError(f"{where}: prompt_token_ids is a list of ints, got "
                             f"{type(ids).__name__}")
        return prompt.get("prompt"), list(ids)
    text = prompt.get("prompt") if isinstance(prompt, dict) else prompt
    if not isinstance(text, str):
        raise ValueError(f"{where}: a prompt is a string, {{'prompt': 'text'}} or "
                         f"{{'prompt_token_ids': [...]}}; got {describe(prompt)}")
    if tokenizer is None:
        raise ValueError(f"{where}: the model has no tokenizer; pass "
                         f"{{'prompt_token_ids': [...]}} instead of text")
    return text, tokenizer.encode(text)


def check_token_ids(where: str, token_ids: list, vocab_size: int) -> None:
    """Every id an int (numpy's too, made a Python int in place; not a bool) in
    `[0, vocab_size)`; the first that is not is named."""
    # Every request's prompt passes here: plain ints in range (the common case) are told in C
    # (a bool's type is not int); anything else is looked at id by id.
    if token_ids and set(map(type, token_ids)) == {int} and (
            min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return
    for position, t in enumerate(token_ids):
        if isinstance(t, np.integer):
            t = token_ids[position] = int(t)
        if not isinstance(t, int) or isinstance(t, bool):
            raise ValueError(f"{where}: prompt_token_ids[{position}] is {t!r}, not an int")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{where}: prompt_token_ids[{position}] = {t} is outside the "
                             f"model's vocabulary of {vocab_size} ids [0, {vocab_size})")


def describe(value: Any) -> str:
    """A value's type and a short repr, for errors about wrong argument types."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def priorities(priority: Any, num_prompts: int) -> list[int]:
    """vLLM's `priority` argument of `generate`: None (every request at 0) or one int per
    prompt."""
    if priority is None:
        return [0] * num_prompts
    if isinstance(priority, str) or not isinstance(priority, Sequence):
        raise TypeError(f"priority must be a list of ints, one per prompt; got "
                        f"{describe(priority)}")
    if len(priority) != num_prompts:
        raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts; pass "
                         f"one per prompt (or None)")
    return [check_priority(value) for value in priority]


def check_priority(value: Any) -> int:
    """One request's priority, an int (lower runs first under scheduling_policy='priority')."""
    if not is_int(value):
        raise TypeError(f"priority must be an int; got {describe(value)}")
    return int(value)


def check_vllm_request_args(call: str, lora_request: Any = None,
                            tokenization_kwargs: dict[str, Any] | None = None) -> None:
    """vLLM's per-request keywords of `generate` and `chat`: taken where they ask for nothing
    (`lora_request=None`, no `tokenization_kwargs`), else ValueError naming the argument."""
    if lora_request is not None and not (isinstance(lora_request, Sequence)
                                         and all(r is None for r in lora_request)):
        raise ValueError(f"{call}(lora_request=...): LoRA adapters are not supported; pass "
                         f"lora_request=None (serve a merged model instead)")
    if tokenization_kwargs:
        raise ValueError(f"{call}(tokenization_kwargs={tokenization_kwargs!r}) is not "
                         f"supported: tokenize the prompt yourself and pass "
                         f"{{'prompt_token_ids': [...]}}")


def template_call_args(apply_chat_template: Callable[..., Any]) -> set[str]:
    """The names a tokenizer's `apply_chat_template` (bound, or the class's) takes as its own
    arguments (tokenize, documents, return_tensors, ...), and the conversation's (`messages`,
    as the template reads it): `chat_template_kwargs` that set one would change the call, not
    be a variable of the template, and are refused."""
    return {"conversation", "messages", *(
        name for name, p in inspect.signature(apply_chat_template).parameters.items()
        if p.kind is not inspect.Parameter.VAR_KEYWORD and name != "self")}
