"""The pieces of OpenAI's response bodies that streamed and whole answers share: usage and
the three shapes of logprobs (completions', chat's, and vLLM's prompt_logprobs)."""

from __future__ import annotations

from typing import Any

from kvfit.engine.outputs import CompletionOutput, RequestOutput
from kvfit.engine.sequence import Logprobs
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.protocol import usage


def usage_of(outputs: list[RequestOutput], prompt_details: bool = False) -> dict[str, Any]:
    """The usage of a request's outputs: every prompt's tokens and every completion's. With
    `prompt_details` (`--enable-prompt-tokens-details`), also `prompt_tokens_details`'s
    `cached_tokens`: the prompt tokens served from the prefix cache or the KV connector,
    summed over the prompts as `prompt_tokens` is (vLLM reports one prompt's), and left out
    at 0 as vLLM does."""
    answer: dict[str, Any] = usage(sum(len(o.prompt_token_ids) for o in outputs),
                                   sum(len(c.token_ids) for o in outputs for c in o.outputs))
    cached = sum(o.num_cached_tokens for o in outputs) if prompt_details else 0
    if cached:
        answer["prompt_tokens_details"] = {"cached_tokens": cached}
    return answer


# What a -inf logprob (a token the processed logprobs modes filtered out) is sent as: JSON has
# no infinity, and this is vLLM's (and OpenAI's) stand-in.
MIN_JSON_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """`value`, at least `MIN_JSON_LOGPROB`."""
    return max(value, MIN_JSON_LOGPROB)


def top_entries(entries: Logprobs, num: int) -> list[tuple[int, Any]]:
    """The `num` most likely entries, most likely first."""
    ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
    return ranked[:num]


def most(*nums: int | None) -> int | None:
    """The largest of the logprob counts given, None where none is."""
    given = [n for n in nums if n is not None]
    return max(given) if given else None


def prompt_logprobs(engine: AsyncLLM, out: RequestOutput, num: int
                     ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs` of an answer: None at the first prompt token (nothing comes
    before it), then at each position its own token and the `num` most likely, keyed by token
    id, each with its logprob, rank (1 = most likely) and text."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entries in zip(out.prompt_token_ids, out.prompt_logprobs or (), strict=False):
        if entries is None:
            result.append(None)
            continue
        own = [(token_id, entries[token_id])] if token_id in entries else []
        result.append({str(t): {"logprob": json_logprob(e.logprob), "rank": e.rank,
                                "decoded_token": (e.decoded_token if e.decoded_token is not None
                                                  else engine.decode_token(t))}
                       for t, e in [*own, *top_entries(entries, num)]})
    return result


def as_token_id(token_id: int) -> str:
    """vLLM's `return_tokens_as_token_ids` form of a token in logprobs: one a client can map
    back to its id, where a token's text may be part of a character (U+FFFD) or ambiguous."""
    return f"token_id:{token_id}"


def completion_logprobs(engine: AsyncLLM, c: CompletionOutput, num: int, out: RequestOutput,
                         echo: bool, start: int = 0, text_offset: int = 0,
                         as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's completions logprobs of tokens `start:` of `c` (with the prompt's first when
    `echo`): token texts, their logprobs, each one's top `num` and itself, and text offsets.
    `as_ids`: tokens as `token_id:N`, their offsets counted as vLLM counts them (each
    token's string as given)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    pairs: list[tuple[int, Logprobs | None]] = []
    if echo and out.prompt_logprobs is not None:
        pairs += list(zip(out.prompt_token_ids, out.prompt_logprobs, strict=False))
    pairs += list(zip(c.token_ids[start:], c.logprobs[start:], strict=False))
    def key(token_id: int, e: Any) -> str:  # a top_logprobs entry's key
        return as_token_id(token_id) if as_ids else e.decoded_token or ""

    offsets, offset = [], text_offset
    for token_id, entries in pairs:
        text = as_token_id(token_id) if as_ids else engine.decode_token(token_id) or ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entries is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        chosen = entries.get(token_id)
        token_logprobs.append(None if chosen is None else json_logprob(chosen.logprob))
        # As vLLM and OpenAI's completions: the sampled token first, then the `num` most
        # likely (up to num + 1 entries; logprobs=0 gives the sampled token alone).
        top = {} if chosen is None else {key(token_id, chosen): json_logprob(chosen.logprob)}
        top.update({key(t, e): json_logprob(e.logprob) for t, e in top_entries(entries, num)})
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(engine: AsyncLLM, c: CompletionOutput, start: int, num: int,
                  as_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI's chat logprobs `content` entries of tokens `start:` of `c`. `bytes` are each
    token's own (a token holding part of a character has the part's bytes, not those of its
    text, U+FFFD), so a client can join them into the characters. `as_ids`: each token as
    `token_id:N`, its bytes that string's (as vLLM gives them)."""
    def entry(token_id: int, e: Any) -> dict[str, Any]:
        if as_ids:
            token = as_token_id(token_id)
            return {"token": token, "logprob": json_logprob(e.logprob),
                    "bytes": list(token.encode())}
        return {"token": e.decoded_token or "", "logprob": json_logprob(e.logprob),
                "bytes": list(engine.token_bytes(token_id))}

    content = []
    for token_id, entries in zip(c.token_ids[start:], c.logprobs[start:], strict=False):
        item = entry(token_id, entries[token_id])
        item["top_logprobs"] = [entry(t, e) for t, e in top_entries(entries, num)]
        content.append(item)
    return content
