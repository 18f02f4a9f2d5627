"""The OpenAI-compatible server end to end: a real uvicorn server on 127.0.0.1 queried with the
official `openai` client (and httpx where a client would refuse to send what is tested)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import engine_hooks
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfit import LLM, SamplingParams
from kvfit.engine.outputs import RequestOutput
from kvfit.server.async_llm import AsyncLLM

from .conftest import MAX_MODEL_LEN, MODEL_NAME, ServerThread, engine_kwargs, in_engine

PROMPTS = [f"The number {i} is followed by" for i in range(32)]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[LLM]:
    """The offline engine on the same weights and settings: the reference outputs."""
    llm = LLM(**engine_kwargs(model_path))
    yield llm
    llm.shutdown()


def greedy(max_tokens: int = 8, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def metrics(http: httpx.Client) -> dict[str, float]:
    """Every sample of /metrics by name (labels joined into the name, but `model_name`, which
    every one carries), parsed by prometheus_client's parser."""
    r = http.get("/metrics")
    assert r.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL_NAME, s
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def test_completion_matches_llm_generate(client: openai.OpenAI, llm: LLM) -> None:
    (ref,) = llm.generate(PROMPTS[0], greedy(), use_tqdm=False)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=8,
                                  temperature=0)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI, llm: LLM) -> None:
    (ref,) = llm.generate(PROMPTS[1], greedy(12), use_tqdm=False)
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert len(chunks) > 2  # streamed as it was generated, not in one piece
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    plain = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4,
                                           temperature=0, stream=True))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)


def test_chat_matches_llm_chat_streaming_and_not(client: openai.OpenAI, llm: LLM) -> None:
    (ref,) = llm.chat(MESSAGES, greedy(10), use_tqdm=False)
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                       max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_n_completions(client: openai.OpenAI, llm: LLM) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, n=3,
                                  temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 18
    # Seeded: the same request gives the same three completions.
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6, n=3,
                                      temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                          n=3, temperature=0)
    assert len({c.message.content for c in chat.choices}) == 1  # greedy: all the same
    assert chat.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=6,
                                            n=3, temperature=1.0, seed=7, stream=True))
    texts = ["", "", ""]
    for chunk in chunks:  # one chunk carries every choice that advanced in a step
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in r.choices]


def test_n_above_max_num_seqs_streams_every_choice(client: openai.OpenAI) -> None:
    # 70 completions on an engine of 64 sequences: the last wait for a slot, as vLLM's would.
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=2,
                                            n=70, temperature=0, stream=True))
    finished = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices
                if c.finish_reason}
    assert sorted(finished) == list(range(70))


def test_several_prompts_in_one_request(client: openai.OpenAI, llm: LLM) -> None:
    refs = llm.generate(PROMPTS[8:10], greedy(4), use_tqdm=False)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[8:10], max_tokens=4,
                                  temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [o.outputs[0].text for o in refs for _ in range(2)]
    ids = client.completions.create(model=MODEL_NAME, prompt=[refs[0].prompt_token_ids],
                                    max_tokens=4, temperature=0)
    assert ids.choices[0].text == refs[0].outputs[0].text


def test_stop_strings(client: openai.OpenAI, llm: LLM) -> None:
    (ref,) = llm.generate(PROMPTS[3], greedy(16), use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[5:8]
    expected = text[: text.index(stop)]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16,
                                  temperature=0, stop=[stop, "never appears"])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_min_tokens_keeps_a_stop_string_from_ending_the_first_tokens(client: openai.OpenAI,
                                                                     llm: LLM) -> None:
    # As vLLM: stop strings count only in the text of tokens past the first min_tokens. The
    # first token's own text as the stop string ended the output at once, empty, even with
    # min_tokens=1.
    (ref,) = llm.generate(PROMPTS[3], greedy(16), use_tqdm=False)
    (first,) = llm.generate(PROMPTS[3], greedy(1), use_tqdm=False)
    text, stop = ref.outputs[0].text, first.outputs[0].text
    assert stop and text.startswith(stop)
    again = text.find(stop, 1)  # the first match that ends past the first token's text
    expected = text if again == -1 else text[:again]
    for min_tokens, want in ((0, ""), (1, expected)):
        r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16,
                                      temperature=0, stop=[stop],
                                      extra_body={"min_tokens": min_tokens})
        assert r.choices[0].text == want, min_tokens
        streamed = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[3],
                                             max_tokens=16, temperature=0, stop=[stop],
                                             extra_body={"min_tokens": min_tokens},
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed) == want, min_tokens


def test_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    (ref,) = llm.generate(PROMPTS[4], greedy(5, logprobs=3), use_tqdm=False)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[4], max_tokens=5,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    ref_lp = [entries[t].logprob for t, entries in
              zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs, strict=True)]
    assert lp.token_logprobs == pytest.approx(ref_lp, abs=1e-5)
    assert all(len(top) == 3 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(max(top.values()) == pytest.approx(chosen, abs=1e-6)
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs, strict=True))
    assert "".join(lp.tokens) == r.choices[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_completion_top_logprobs_hold_the_sampled_token(client: openai.OpenAI) -> None:
    """As vLLM (and OpenAI's completions): `top_logprobs` has the sampled token and the
    `logprobs` most likely, up to logprobs + 1 entries; logprobs=0 gives the sampled alone."""
    def check(lp: Any, num: int, first: int = 0) -> None:
        for token, chosen, top in zip(lp.tokens[first:], lp.token_logprobs[first:],
                                      lp.top_logprobs[first:], strict=True):
            assert top[token] == pytest.approx(chosen), (token, top)
            assert (len(top) == 1) if num == 0 else (num <= len(top) <= num + 1), top

    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[13], max_tokens=4, temperature=0)
    whole = client.completions.create(**kwargs, logprobs=0, echo=True).choices[0].logprobs
    assert whole.top_logprobs[0] is None  # the prompt's first token has none
    check(whole, 0, first=1)
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        **kwargs, logprobs=0, stream=True) if c.choices]
    for lp in streamed:
        check(lp, 0)
    # A token outside the top 2 (allowed_token_ids forces it) is there too: 3 entries.
    forced = client.completions.create(**kwargs, logprobs=2, extra_body={
        "allowed_token_ids": [10], "ignore_eos": True}).choices[0].logprobs
    check(forced, 2)
    assert any(len(top) == 3 for top in forced.top_logprobs)


def test_allowed_token_ids(client: openai.OpenAI, llm: LLM) -> None:
    """vLLM's extra field, on both routes: only the listed tokens are sampled."""
    allowed = [10, 11, 12]
    params = greedy(6, ignore_eos=True, allowed_token_ids=allowed)
    (ref,) = llm.generate(PROMPTS[7], params, use_tqdm=False)
    assert set(ref.outputs[0].token_ids) <= set(allowed)
    extra = {"allowed_token_ids": allowed, "ignore_eos": True}
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[7], max_tokens=6,
                                  temperature=0, extra_body=extra)
    assert r.choices[0].text == ref.outputs[0].text
    (chat_ref,) = llm.chat(MESSAGES, params, use_tqdm=False)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6,
                                          temperature=0, extra_body=extra)
    assert chat.choices[0].message.content == chat_ref.outputs[0].text


@pytest.mark.parametrize(("path", "ids", "says"), [
    ("/v1/completions", [], "at least one token"),
    ("/v1/completions", [99999], "token ids must be in [0,"),
    ("/v1/chat/completions", [-1], "token ids must be in [0,"),
    ("/v1/chat/completions", list(range(1025)), "at most 1024"),
])
def test_invalid_allowed_token_ids_are_a_400_naming_the_field(
        http: httpx.Client, path: str, ids: list[int], says: str) -> None:
    body = {"max_tokens": 2, "allowed_token_ids": ids,
            **({"prompt": "x"} if path == "/v1/completions" else {"messages": MESSAGES})}
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "allowed_token_ids" and says in error["message"], error


def test_echo(client: openai.OpenAI, llm: LLM) -> None:
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[5], max_tokens=4,
                                  temperature=0, echo=True, logprobs=1)
    (ref,) = llm.generate(PROMPTS[5], greedy(4), use_tqdm=False)
    assert r.choices[0].text == PROMPTS[5] + ref.outputs[0].text
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ref.prompt_token_ids) + 4
    assert lp.token_logprobs[0] is None and None not in lp.token_logprobs[1:]


def test_prompt_logprobs_are_the_engines_in_vllms_shape(client: openai.OpenAI,
                                                         llm: LLM) -> None:
    """vLLM's `prompt_logprobs` field: per prompt position after the first, the prompt's own
    token and the n most likely, keyed by token id, with the offline engine's values; on
    completions in each choice, on chat beside the choices."""
    (ref,) = llm.generate(PROMPTS[7], greedy(2, prompt_logprobs=2), use_tqdm=False)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[7], max_tokens=2,
                                  temperature=0, extra_body={"prompt_logprobs": 2})
    got = r.choices[0].model_extra["prompt_logprobs"]
    assert r.choices[0].logprobs is None  # the sampled tokens' were not asked for
    assert len(got) == len(ref.prompt_token_ids)
    assert got[0] is None and ref.prompt_logprobs[0] is None
    for token_id, entries, want in zip(ref.prompt_token_ids[1:], got[1:], ref.prompt_logprobs[1:],
                                       strict=True):
        assert str(token_id) in entries and 2 <= len(entries) <= 3
        assert sorted(e["rank"] for t, e in entries.items() if t != str(token_id))[:2] == [1, 2]
        for t, e in entries.items():
            assert e["logprob"] == pytest.approx(want[int(t)].logprob, abs=1e-5)
            assert e["rank"] == want[int(t)].rank and isinstance(e["decoded_token"], str)

    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    own = chat.model_extra["prompt_logprobs"]
    assert own[0] is None and len(own) == chat.usage.prompt_tokens
    assert all(len(entries) == 1 for entries in own[1:])  # the prompt's own tokens alone


def test_prompt_logprobs_beside_echo_keep_their_own_counts(client: openai.OpenAI) -> None:
    """echo with logprobs=1 and prompt_logprobs=3: one engine computation, each field cut to
    its own count."""
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[8], max_tokens=2,
                                  temperature=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 3})
    choice = r.choices[0]
    prompt = choice.model_extra["prompt_logprobs"]
    assert all(3 <= len(entries) <= 4 for entries in prompt[1:])
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])
    assert len(choice.logprobs.tokens) == len(prompt) + 2


@pytest.mark.parametrize(("extra", "message"), [
    (dict(prompt_logprobs=3, stream=True), "not available with stream=true"),
    (dict(prompt_logprobs=10_000), "above the server's max_logprobs"),
    (dict(prompt_logprobs=-1), "-1 (the whole vocabulary, 512) is above"),
    (dict(prompt_logprobs=-2), "must be >= 0, or -1"),
])  # fmt: skip
def test_prompt_logprobs_the_server_cannot_give_are_refused(http: httpx.Client, extra: dict,
                                                            message: str) -> None:
    for path, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        r = http.post(path, json={"model": MODEL_NAME, "max_tokens": 2, **body, **extra})
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == "prompt_logprobs", error
    assert http.get("/health").status_code == 200


def test_whole_vocabulary_logprobs_as_vllm_takes_them(model_path: Path, llm: LLM) -> None:
    """vLLM's -1 for prompt_logprobs (both endpoints) and chat's top_logprobs: every token of
    the vocabulary, where --max-logprobs -1 allows it; completions' logprobs takes no -1."""
    from kvfit.engine.config import EngineArgs
    from kvfit.server.openai_api import ServeConfig, build_app

    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path), max_logprobs=-1),
                      engine_process=False)
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME])))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            (ref,) = llm.generate(PROMPTS[3], greedy(2), use_tqdm=False)
            r = http.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": PROMPTS[3], "max_tokens": 2, "temperature": 0,
                "prompt_logprobs": -1})
            assert r.status_code == 200, r.text
            prompt = r.json()["choices"][0]["prompt_logprobs"]
            assert prompt[0] is None and len(prompt) == len(ref.prompt_token_ids)
            assert all(len(entries) == 512 for entries in prompt[1:])
            r = http.post("/v1/chat/completions", json={
                "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 2, "temperature": 0,
                "logprobs": True, "top_logprobs": -1, "prompt_logprobs": -1})
            assert r.status_code == 200, r.text
            content = r.json()["choices"][0]["logprobs"]["content"]
            assert [len(item["top_logprobs"]) for item in content] == [512, 512]
            assert all(len(entries) == 512 for entries in r.json()["prompt_logprobs"][1:])
            r = http.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": PROMPTS[3], "max_tokens": 2, "logprobs": -1})
            assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    finally:
        server.stop()
        engine.shutdown()


def test_add_special_tokens_reaches_the_tokenizer(client: openai.OpenAI, http: httpx.Client,
                                                   engine: AsyncLLM,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `add_special_tokens`: on by default for a completion's text prompt, off for a
    rendered chat (its template writes its own), either way when the request says."""
    seen: list[bool] = []
    encode = engine.tokenizer.encode

    def spy(text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        seen.append(add_special_tokens)
        return encode(text, add_special_tokens=add_special_tokens, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    for extra in ({}, {"add_special_tokens": False}):
        client.completions.create(model=MODEL_NAME, prompt=PROMPTS[2], max_tokens=1,
                                  extra_body=extra)
    for extra in ({}, {"add_special_tokens": True}):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1,
                                       extra_body=extra)
    # /tokenize tokenizes as those routes do, the same flag honoured for messages too.
    for extra in ({}, {"add_special_tokens": False}):
        http.post("/tokenize", json={"prompt": PROMPTS[2], **extra}).raise_for_status()
    for extra in ({}, {"add_special_tokens": True}):
        http.post("/tokenize", json={"messages": MESSAGES, **extra}).raise_for_status()
    assert seen == [True, False, False, True] * 2


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(client: openai.OpenAI,
                                                               http: httpx.Client,
                                                               llm: LLM) -> None:
    """vLLM's `truncate_prompt_tokens=k`: the answer is the offline engine's on the prompt's
    last k tokens, which an echo returns; -1 keeps the last max_model_len (so a longer prompt
    still leaves no room for the completion); 0 or below -1 is a 400 naming the field."""
    (full,) = llm.generate(PROMPTS[9], greedy(4), use_tqdm=False)
    kept = full.prompt_token_ids[-3:]
    (ref,) = llm.generate({"prompt_token_ids": kept}, greedy(4), use_tqdm=False)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[9], max_tokens=4,
                                  temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert r.usage.prompt_tokens == 3
    assert r.choices[0].text == llm.get_tokenizer().decode(kept) + ref.outputs[0].text
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage.prompt_tokens == 5
    long_prompt = {"model": MODEL_NAME, "prompt": list(range(3, 3 + MAX_MODEL_LEN + 20)),
                   "max_tokens": 1, "truncate_prompt_tokens": -1}
    r = http.post("/v1/completions", json=long_prompt)
    assert r.status_code == 400 and f"is {MAX_MODEL_LEN} tokens" in r.json()["error"]["message"]
    for k in (0, -2):
        r = http.post("/v1/completions", json={**long_prompt, "truncate_prompt_tokens": k})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_streamed_echo_has_the_logprobs_of_the_unstreamed_one(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[12], max_tokens=5, temperature=0, echo=True,
                  logprobs=1)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)
              if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    for field in ("tokens", "text_offset"):
        assert [x for c in chunks for x in getattr(c.logprobs, field)] == getattr(
            whole.logprobs, field), field
    streamed = [x for c in chunks for x in c.logprobs.token_logprobs]
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_text_offsets_past_held_back_text_are_the_unstreamed_ones(
        client: openai.OpenAI, llm: LLM, echo: bool) -> None:
    """A stop string that never matches makes the stream hold back text that might start it
    while the tokens' logprobs go out: each token's text_offset is still where its text
    starts in the whole answer (it was the length of the text sent so far, so it lagged)."""
    (ref,) = llm.generate(PROMPTS[3], greedy(16), use_tqdm=False)
    text = ref.outputs[0].text
    stop = text[-6:] + "\x00"  # each prefix of the answer's last characters held back
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=16, temperature=0,
                  logprobs=1, echo=echo, stop=[stop, text[2:5] + "\x00"])
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True)
              if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    offsets = [x for c in chunks if c.logprobs for x in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    # (A token holding part of a character is U+FFFD alone, not in the text.)
    assert all(whole.text.startswith(t, o) for o, t in zip(
        offsets, whole.logprobs.tokens, strict=True) if "\ufffd" not in t)


async def _concurrent(url: str, prompts: list[str]) -> list[str]:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused",
                                  max_retries=0) as aclient:
        async def one(prompt: str) -> str:
            r = await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8,
                                                 temperature=0)
            return r.choices[0].text

        return await asyncio.gather(*(one(p) for p in prompts))


def test_32_concurrent_clients_get_their_own_greedy_answer(
        server: ServerThread, llm: LLM, engine: AsyncLLM) -> None:
    refs = [o.outputs[0].text for o in llm.generate(PROMPTS, greedy(), use_tqdm=False)]
    assert len(set(refs)) > 1  # the prompts' answers differ, so a mix-up would show
    in_engine(engine, engine_hooks.record_batches)
    assert asyncio.run(_concurrent(server.url, PROMPTS)) == refs
    assert max(in_engine(engine, engine_hooks.batch_sizes)) > 1  # clients shared steps


def test_abort_frees_the_blocks(http: httpx.Client, engine: AsyncLLM) -> None:
    body = {"prompt": PROMPTS[6], "max_tokens": 100, "temperature": 0, "stream": True,
            "ignore_eos": True}
    before = metrics(http)
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert engine.stats().num_free_blocks < engine.stats().num_blocks  # it holds blocks
    deadline = time.monotonic() + 10
    while (m := metrics(http))["kvfit:kv_cache_blocks_in_use"] or m["kvfit:num_requests_running"]:
        assert time.monotonic() < deadline, "the aborted request kept its blocks"
        time.sleep(0.05)
    key = "kvfit:request_success_total{finished_reason=abort}"
    assert m[key] == before.get(key, 0) + 1
    assert m["kvfit:generation_tokens_total"] < before["kvfit:generation_tokens_total"] + 100


def _assert_leaving_client_aborts(http: httpx.Client, engine: AsyncLLM, tmp_path: Path,
                                  leave: Callable[[], None]) -> None:
    """`leave()` sends a request for the stalled prompt "slow" and gives up on it: the server
    notices, aborts it once in the engine and frees its blocks."""
    release = tmp_path / "release"
    # The request is still running when its client gives up.
    in_engine(engine, engine_hooks.stall, "slow", str(release))
    key = "kvfit:request_success_total{finished_reason=abort}"
    try:
        before = metrics(http)
        leave()
        deadline = time.monotonic() + 10
        # Counted as the request's stream closes, after it sent the engine its abort.
        while metrics(http).get(key, 0) == before.get(key, 0):
            assert time.monotonic() < deadline, "the server did not notice the client leave"
            time.sleep(0.01)
        release.touch()
        # Commands apply in order: by this call the engine has applied the abort.
        assert in_engine(engine, engine_hooks.num_unfinished) == 0
    finally:
        release.touch()
        in_engine(engine, engine_hooks.clear)
    deadline = time.monotonic() + 10
    while (m := metrics(http))["kvfit:kv_cache_blocks_in_use"]:
        assert time.monotonic() < deadline, "the abandoned request kept its blocks"
        time.sleep(0.05)
    assert m[key] == before.get(key, 0) + 1
    assert m["kvfit:generation_tokens_total"] < before["kvfit:generation_tokens_total"] + 100


def test_a_client_that_leaves_a_plain_request_aborts_it(server: ServerThread, http: httpx.Client,
                                                       engine: AsyncLLM, tmp_path: Path) -> None:
    def leave() -> None:
        body = {"prompt": "slow", "max_tokens": 100, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)

    _assert_leaving_client_aborts(http, engine, tmp_path, leave)


def test_a_client_that_leaves_a_stream_before_its_first_event_aborts_it(
        server: ServerThread, http: httpx.Client, engine: AsyncLLM, tmp_path: Path) -> None:
    """No event comes to fail on a write: the response itself notices the client leave."""
    def leave() -> None:
        body = {"prompt": "slow", "max_tokens": 100, "ignore_eos": True, "stream": True}
        with pytest.raises(httpx.ReadTimeout), httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, timeout=0.5) as r:
            assert r.status_code == 200
            for _ in r.iter_bytes():
                pass

    _assert_leaving_client_aborts(http, engine, tmp_path, leave)


def test_async_llm_abort_by_id(engine: AsyncLLM) -> None:
    async def run() -> RequestOutput:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        output = None
        async for output in engine.generate({"prompt_token_ids": [5, 6, 7]}, params, "mine"):
            if output.outputs[0].token_ids:
                engine.abort("mine")
        return output

    output = asyncio.run(run())
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert len(output.outputs[0].token_ids) < 100


def test_x_request_id_names_the_answer_and_clients_sending_the_same_one_never_clash(
        server: ServerThread, http: httpx.Client) -> None:
    # Found by the hunt: vLLM's answer ids are cmpl-/chatcmpl-<X-Request-Id>; the header was
    # ignored here. Several clients sending the same one at once must each get their own answer.
    headers = {"X-Request-Id": "trace-7"}
    paths = {"/v1/completions": ({"prompt": PROMPTS[3]}, "cmpl-trace-7"),
             "/v1/chat/completions": ({"messages": MESSAGES}, "chatcmpl-trace-7")}

    async def send(path: str, stream: bool, n: int) -> tuple[str, int]:
        body = {**paths[path][0], "max_tokens": 20, "ignore_eos": True, "stream": stream,
                "n": n}
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            if not stream:
                r = await client.post(path, json=body, headers=headers)
                assert r.status_code == 200, r.text
                return r.json()["id"], sum(c["index"] >= 0 for c in r.json()["choices"])
            ids, ended = set(), 0
            async with client.stream("POST", path, json=body, headers=headers) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        ids.add(chunk["id"])
                        ended += sum(c["finish_reason"] == "length" for c in chunk["choices"])
            (only,) = ids
            return only, ended

    async def run() -> list[tuple[str, int]]:
        return await asyncio.gather(*(send(path, stream, n) for path in paths
                                      for stream in (False, True) for n in (1, 2, 1)))

    answers = asyncio.run(run())
    assert answers == [(paths[path][1], n) for path in paths for _ in (False, True)
                       for n in (1, 2, 1)]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert r.json()["id"].startswith("cmpl-") and r.json()["id"] != "cmpl-trace-7"


def test_async_llm_abort_takes_several_ids_as_vllms(engine: AsyncLLM) -> None:
    # Found by the hunt: vLLM's AsyncLLM.abort takes a str or an iterable of them; a list was
    # a TypeError (unhashable type) here, and aborted nothing. It is a coroutine there:
    # `await engine.abort(id)` was a TypeError too (None is not awaitable).
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def run() -> list[RequestOutput]:
        streams = [aiter(engine.add_request({"prompt_token_ids": [5, 6, 7]}, params, rid))
                   for rid in ("several-0", "several-1", "several-2")]
        for stream in streams:  # each one is running
            while not (await anext(stream)).outputs[0].token_ids:
                pass
        engine.abort(["several-0", "unknown"])
        await engine.abort("several-2")  # vLLM's abort is a coroutine: code awaits it
        return [[out async for out in stream][-1] for stream in streams]

    outputs = asyncio.run(run())
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort", "length", "abort"]
    deadline = time.monotonic() + 10
    while engine.stats().num_free_blocks < engine.stats().num_blocks:
        assert time.monotonic() < deadline, "the aborted requests kept their blocks"
        time.sleep(0.05)


BAD_REQUESTS = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    # Unbounded, this n had the server build 10**20 sequences (memory without end, no answer).
    ("/v1/completions", {"prompt": "x", "n": 10**20}, 400, "n"),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 16385}, 400, "n"),
    # So are a request's prompts times n: each completion of each prompt is a sequence.
    ("/v1/completions", {"prompt": [[1]] * 16385}, 400, "prompt"),
    ("/v1/completions", {"prompt": ["a", ""]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "a", "echo": True, "max_tokens": 0, "min_tokens": 3}, 400,
     "min_tokens"),
    ("/v1/completions", {"prompt": ["x"] * 2049, "n": 8}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"word": 1}}, 400, "logit_bias.word.[key]"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "temprature": 0}, 400, "temprature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, -5]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1.5]}, 400, "prompt"),  # fits no member of the union
    ("/v1/completions", {"prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "word " * MAX_MODEL_LEN}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 25, "logprobs": True},
     400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w " * MAX_MODEL_LEN}]},
     400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400,
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream": True, "model": "other"}, 404,
     "model"),
    ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]}, 400, "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_object"}},
     400, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "functions": [{"name": "f"}]}, 400,
     "functions"),
    ("/v1/chat/completions", {"messages": MESSAGES, "modalities": ["text", "audio"]}, 400,
     "modalities"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/detokenize", {"tokens": [100000]}, 400, "tokens"),
    ("/tokenize", {}, 400, "prompt"),
    ("/v1/nothing-here", {}, 404, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS,
                         ids=[f"{p}-{'-'.join(map(str, b)) or 'empty'}"[:60]
                              for p, b, _, _ in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(http: httpx.Client, path: str, body: dict,
                                        status: int, param: str | None) -> None:
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"]
    assert error["param"] == param
    assert http.get("/health").status_code == 200


def test_an_empty_prompt_of_several_is_named_by_its_index(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": ["a", ""], "max_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the prompt at index 1 is empty"


def test_tool_and_format_fields_that_ask_for_nothing_are_taken(client: openai.OpenAI,
                                                               http: httpx.Client) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       tools=[], tool_choice="none", parallel_tool_calls=False,
                                       response_format={"type": "text"})
    assert r.usage.completion_tokens == 2
    # OpenAI's bookkeeping fields change nothing here; a client written for OpenAI sends them.
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       store=False, metadata={"run": "1"}, user="u",
                                       service_tier="auto", prompt_cache_key="k",
                                       safety_identifier="s", modalities=["text"],
                                       functions=[], function_call="none")
    assert r.usage.completion_tokens == 2
    error = http.post("/v1/completions", json={"prompt": "x", "temprature": 0}).json()["error"]
    assert "unknown field" in error["message"] and error["param"] == "temprature"


def test_a_body_that_is_not_a_json_object_says_so(http: httpx.Client) -> None:
    # curl -d without -H 'Content-Type: application/json' sends a form's content type.
    r = http.post("/v1/completions", content=b'{"prompt": "x"}',
                  headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert "Content-Type: application/json" in r.json()["error"]["message"]


def test_invalid_json_is_a_400_and_the_server_survives(http: httpx.Client,
                                                       client: openai.OpenAI) -> None:
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe", b"", b'{"prompt": "x", "top_p": NaN}',
                    b'{"prompt": "x", "temperature": Infinity}'):
        r = http.post("/v1/completions", content=content,
                      headers={"content-type": "application/json"})
        assert r.status_code == 400, content
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.completions.create(model=MODEL_NAME, prompt="still here", max_tokens=2)
    assert r.usage.completion_tokens == 2


@pytest.mark.parametrize(("content", "says"), [
    (b'{"prompt": "caf\xe9"}', "can't decode byte 0xe9"),  # Latin-1, not UTF-8
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "recursion"),
])
def test_a_body_the_json_parser_cannot_read_says_why(http: httpx.Client, content: bytes,
                                                     says: str) -> None:
    # FastAPI answers these with "There was an error parsing the body", naming no cause.
    r = http.post("/v1/completions", content=content,
                  headers={"content-type": "application/json"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("the request body could not be read as JSON") and says in message


LONE_SURROGATES = [  # JSON escapes that decode to no Unicode text
    ("/v1/completions", b'{"prompt": "\\ud800 x", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", b'{"prompt": "x", "logit_bias": {"\\ud800": 1}}', "logit_bias"),
    # Tokenized as the request is queued: the tokenizer's TypeError was a 500.
    ("/v1/completions", b'{"prompt": "x", "bad_words": ["ok", "\\ud800"]}', "bad_words"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "bad_words": ["\\udfff"]}', "bad_words"),
]


@pytest.mark.parametrize(("path", "content", "param"), LONE_SURROGATES)
def test_lone_surrogates_are_a_400(http: httpx.Client, path: str, content: bytes,
                                   param: str) -> None:
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param)
    assert http.get("/health").status_code == 200


def test_a_huge_prompt_does_not_stall_the_server(server: ServerThread,
                                                 http: httpx.Client) -> None:
    # Seconds of tokenizing (and then a 400: far beyond max_model_len).
    body = {"prompt": "hello world " * 400_000, "max_tokens": 2}
    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=120)
        time.sleep(0.5)  # sent and being tokenized
        latencies = []
        while not huge.done():
            start = time.perf_counter()
            assert http.get("/health").status_code == 200
            latencies.append(time.perf_counter() - start)
            time.sleep(0.05)
        r = huge.result()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert latencies and max(latencies) < 1.0, latencies


def test_an_internal_error_is_a_500_on_a_connection_that_stays_usable(
        http: httpx.Client, engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a tokenizer bug")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 500, r.text
    assert r.json()["error"]["type"] == "internal_server_error"
    monkeypatch.undo()
    # The same keep-alive connection: uvicorn closed it after a re-raised error.
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_a_failing_step_fails_only_its_request(http: httpx.Client, engine: AsyncLLM) -> None:
    # An engine bug that only this prompt's requests hit.
    in_engine(engine, engine_hooks.fail, "poison")
    try:
        r = http.post("/v1/completions", json={"prompt": "poison", "max_tokens": 4})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "internal_server_error"
        with http.stream("POST", "/v1/completions",
                         json={"prompt": "poison", "max_tokens": 4, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data:")]
        assert "internal_server_error" in events[0] and events[-1] == "data: [DONE]"
    finally:
        in_engine(engine, engine_hooks.clear)
    r = http.post("/v1/completions", json={"prompt": "healthy", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert http.get("/health").status_code == 200
    assert engine.stats().num_free_blocks == engine.stats().num_blocks


def test_metrics(http: httpx.Client, engine: AsyncLLM) -> None:
    http.post("/v1/completions", json={"prompt": PROMPTS[7], "max_tokens": 3})
    assert http.post("/v1/completions",
                     json={"prompt": PROMPTS[7], "max_tokens": -1}).status_code == 400
    m = metrics(http)
    report = engine.kv_cache_report
    assert m["kvfit:kv_cache_blocks_total"] == 256
    assert m["kvfit:kv_cache_blocks_in_use"] == 0 and m["kvfit:num_requests_waiting"] == 0
    assert m["kvfit:kv_cache_usage_perc"] == 0
    assert m[f"kvfit:kv_cache_sizing_info{{method={report.method}}}"] == 1
    assert m["kvfit:kv_cache_committed_bytes"] == report.committed_bytes > 0
    assert m["kvfit:kv_cache_reserved_bytes"] >= m["kvfit:kv_cache_committed_bytes"]
    assert m["kvfit:kv_cache_sizing_transient_bytes"] == report.transient
    assert m["kvfit:oom_guard_events_total"] == 0
    assert m["kvfit:prompt_tokens_total"] > 0 and m["kvfit:generation_tokens_total"] >= 3
    assert m["kvfit:time_to_first_token_seconds_count"] >= 1
    assert m["kvfit:inter_token_latency_seconds_count"] >= 2
    assert m["kvfit:e2e_request_latency_seconds_count"] >= 1
    assert m["kvfit:request_success_total{finished_reason=length}"] >= 1
    assert m["kvfit:request_failure_total{reason=invalid}"] >= 1
    assert m["kvfit:prefix_cache_queries_total"] > 0
    # The same prompt again: its full blocks are prefix-cache hits.
    hits = m["kvfit:prefix_cache_hits_total"]
    http.post("/v1/completions", json={"prompt": "word " * 40, "max_tokens": 2})
    http.post("/v1/completions", json={"prompt": "word " * 40, "max_tokens": 2})
    m = metrics(http)
    assert m["kvfit:prefix_cache_hits_total"] >= hits + 32
    assert 0 < m["kvfit:prefix_cache_hit_rate"] <= 1


def test_metrics_count_n_completions_as_vllm_and_agree_with_the_usage(
        http: httpx.Client, client: openai.OpenAI) -> None:
    """A request with n=3 is three requests to the request figures (vLLM's child requests),
    and the token histograms add up to the response's usage."""
    before = metrics(http)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=4, n=3,
                                  temperature=1.0, seed=1)
    m = metrics(http)
    grew = {k: m[k] - before.get(k, 0) for k in m}
    assert grew["kvfit:request_success_total{finished_reason=length}"] == 3
    for key in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                "request_prompt_tokens", "request_generation_tokens"):
        assert grew[f"kvfit:{key}_count"] == 3, key
    assert grew["kvfit:request_generation_tokens_sum"] == r.usage.completion_tokens == 12
    assert grew["kvfit:generation_tokens_total"] == r.usage.completion_tokens
    assert grew["kvfit:request_prompt_tokens_sum"] == 3 * r.usage.prompt_tokens
    assert grew["kvfit:prompt_tokens_total"] == r.usage.prompt_tokens
    assert grew["kvfit:inter_token_latency_seconds_count"] == 3 * 3


def test_every_metric_carries_the_model_name(http: httpx.Client) -> None:
    """vLLM labels every series with `model_name` (its dashboards select by it), and its
    request_success has each finish reason from the start, so a rate() of one is 0, not absent."""
    text = http.get("/metrics").text
    families = list(text_string_to_metric_families(text))
    assert len(families) > 20
    for family in families:
        for s in family.samples:
            assert s.labels.get("model_name") == MODEL_NAME, s
    success = {s.labels["finished_reason"] for f in families for s in f.samples
               if s.name == "kvfit:request_success_total"}
    assert {"stop", "length", "abort"} <= success


def test_models_tokenize_detokenize_version(http: httpx.Client, client: openai.OpenAI,
                                            engine: AsyncLLM) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).model_dump() == models.data[0].model_dump()
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    tokens = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tokens["tokens"] == engine.tokenizer.encode("Hello world")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_MODEL_LEN
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "Hello world"
    # vLLM's return_token_strs (refused as an unknown field before): each token's string.
    assert tokens["token_strs"] is None
    strs = http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True})
    assert strs.json()["token_strs"] == engine.tokenizer.convert_ids_to_tokens(tokens["tokens"])
    assert strs.json()["tokens"] == tokens["tokens"]
    assert len(http.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True})
               .json()["token_strs"]) == http.post("/tokenize", json={
                   "messages": MESSAGES}).json()["count"]
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == r.usage.prompt_tokens
    import kvfit

    assert http.get("/version").json() == {"version": kvfit.__version__}


def test_api_key_and_queue_bound(start_server, engine: AsyncLLM, tmp_path: Path) -> None:
    server = start_server(api_key="sekret", max_concurrent_requests=1)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200  # no key needed
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekret"}):
            for path in ("/v1/models", "/metrics", "/version"):
                r = http.get(path, headers=headers)
                assert r.status_code == 401
                assert r.json()["error"]["type"] == "authentication_error"
            r = http.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong",
                          max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0)
        assert client.completions.create(model=MODEL_NAME, prompt="x",
                                         max_tokens=2).usage.completion_tokens == 2
        auth = {"authorization": "Bearer sekret"}
        assert http.get("/v1/models", headers={"authorization": "bearer sekret"}
                        ).status_code == 200  # the scheme is case-insensitive
        # The engine stalls on the held request's step, so its slot stays taken.
        release = tmp_path / "release"
        in_engine(engine, engine_hooks.stall, "hold", str(release))
        body = {"prompt": "hold", "max_tokens": 4, "stream": True}
        try:
            with http.stream("POST", "/v1/completions", json=body, headers=auth) as held:
                assert held.status_code == 200
                r = http.post("/v1/completions", json={"prompt": "x"}, headers=auth)
                assert r.status_code == 503
                assert r.json()["error"]["type"] == "service_unavailable"
                assert "(--max-concurrent-requests)" in r.json()["error"]["message"]
                release.touch()
                assert "data: [DONE]" in list(held.iter_lines())
        finally:
            release.touch()
            in_engine(engine, engine_hooks.clear)
        deadline = time.monotonic() + 10
        while (r := http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1},
                              headers=auth)).status_code == 503:
            assert time.monotonic() < deadline, "the slot was never given back"
            time.sleep(0.05)
        assert r.status_code == 200


def test_load_run(server: ServerThread, http: httpx.Client) -> None:
    """500 requests, 16 at a time: every one answered; latencies printed, not asserted."""
    num_requests, concurrency = 500, 16

    async def run() -> tuple[list[float], list[str]]:
        latencies: list[float] = []
        errors: list[str] = []
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as aclient:
            async def one(i: int) -> None:
                body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4, "temperature": 0,
                        "stream": i % 4 == 0}
                async with gate:
                    start = time.perf_counter()
                    r = await aclient.post("/v1/completions", json=body)
                    latencies.append(time.perf_counter() - start)
                    if r.status_code != 200:
                        errors.append(f"{r.status_code}: {r.text[:200]}")
                    elif body["stream"]:
                        events = [e for e in r.text.split("\n\n") if e.startswith("data:")]
                        if events[-1] != "data: [DONE]":
                            errors.append("stream without [DONE]")
                    elif json.loads(r.text)["usage"]["completion_tokens"] != 4:
                        errors.append(f"short answer: {r.text[:200]}")

            await asyncio.gather(*(one(i) for i in range(num_requests)))
        return latencies, errors

    start = time.perf_counter()
    latencies, errors = asyncio.run(run())
    elapsed = time.perf_counter() - start
    latencies.sort()
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(f"\nload run: {num_requests} requests, {concurrency} concurrent, {elapsed:.1f} s, "
          f"errors {len(errors)}, p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms")
    assert not errors, errors[:5]
    assert http.get("/health").status_code == 200


def test_a_stopped_engine_answers_503(model_path: Path) -> None:
    from kvfit.engine.config import EngineArgs
    from kvfit.server.openai_api import ServeConfig, build_app

    dead = AsyncLLM(EngineArgs(**engine_kwargs(model_path)))
    dead.shutdown()
    server = ServerThread(build_app(dead, ServeConfig([MODEL_NAME])))
    try:
        with httpx.Client(base_url=server.url) as http:
            assert http.get("/health").status_code == 503
            # vLLM's /ping answers as /health (a load balancer probing it routes elsewhere).
            assert http.get("/ping").status_code == http.post("/ping").status_code == 503
            r = http.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
            assert http.get("/metrics").status_code == 200
    finally:
        server.stop()


def test_text_is_decoded_off_the_engine_step(engine: AsyncLLM, llm: LLM) -> None:
    in_engine(engine, engine_hooks.count_detokenized)

    async def text(params: SamplingParams, request_id: str) -> str:
        output = None
        async for output in engine.generate(PROMPTS[11], params, request_id):  # noqa: B007
            pass
        return output.outputs[0].text

    (ref,) = llm.generate(PROMPTS[11], greedy(10), use_tqdm=False)
    assert asyncio.run(text(greedy(10), "plain")) == ref.outputs[0].text
    assert "plain" not in in_engine(engine, engine_hooks.detokenized)  # the engine decoded none
    asyncio.run(text(greedy(10, stop=["never"]), "with-stop"))
    assert "with-stop" in in_engine(engine, engine_hooks.detokenized)  # stop strings need it


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/embeddings", 404), ("POST", "/v1/responses", 404),
    ("GET", "/v1/nothing", 404), ("GET", "/tokenize", 405),
])
def test_a_route_not_served_says_which_are(http: httpx.Client, method: str, path: str,
                                           status: int) -> None:
    """An OpenAI client calling an API this server lacks (embeddings, responses) or a route
    with the wrong method gets an OpenAI error naming the request and the routes there are,
    not a bare 'Not Found'."""
    response = http.request(method, path, json={"model": MODEL_NAME, "input": "x"})
    assert response.status_code == status
    message = response.json()["error"]["message"]
    assert f"{method} {path} is not served here" in message
    assert "POST /v1/completions" in message and "POST /tokenize" in message


def test_the_official_client_gets_not_found_for_embeddings(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="/v1/embeddings is not served here"):
        client.embeddings.create(model=MODEL_NAME, input="x")


def test_the_body_request_id_names_the_answer(start_server: Callable[..., ServerThread]) -> None:
    # vLLM's request_id field names the answer where no X-Request-Id header does; it was
    # refused here ("the server names each request itself").
    url = start_server(enable_request_id_headers=True).url
    for path, body, prefix in (("/v1/completions", {"prompt": "x"}, "cmpl-"),
                               ("/v1/chat/completions", {"messages": MESSAGES}, "chatcmpl-")):
        for stream in (False, True):
            request = {**body, "max_tokens": 2, "stream": stream, "request_id": "job 7\n"}
            r = httpx.post(url + path, json=request, timeout=60)
            assert r.status_code == 200, r.text
            first = json.loads(r.text.split("\n")[0][6:]) if stream else r.json()
            assert first["id"] == f"{prefix}job 7\n"
            # Sent back as a header may carry it: percent-encoded where it may not.
            assert r.headers["x-request-id"] == "job 7%0A"
            # The header, where both come, names it, as vLLM's.
            r = httpx.post(url + path, json={**request, "stream": False}, timeout=60,
                           headers={"X-Request-Id": "hdr"})
            assert r.json()["id"] == f"{prefix}hdr"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "request_id": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id"
