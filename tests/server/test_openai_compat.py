"""What OpenAI and vLLM clients send that the server must take as they do: explicit nulls,
prompt scoring (echo with max_tokens 0), assistant prefill, per the official `openai` client
and raw httpx against a real uvicorn server."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import engine_hooks
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfit.server.async_llm import AsyncLLM

from .conftest import MAX_MODEL_LEN, MODEL_NAME, ServerThread, in_engine

MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": None, "echo": None,
                         "stream": None, "logprobs": None, "stream_options": None,
                         "best_of": None, "suffix": None, "ignore_eos": None}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "n": None,
                              "logprobs": None, "stream": None, "top_logprobs": None,
                              "add_generation_prompt": None, "min_tokens": None}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stream": True,
                              "stream_options": {"include_usage": None}}),
])
def test_null_means_the_default(http: httpx.Client, path: str, body: dict) -> None:
    """OpenAI's API has these parameters nullable; the Python client sends `null` for one a
    caller passed as None (`n=None`), and vLLM takes it as unset."""
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]")
        return
    (choice,) = r.json()["choices"]
    assert choice["logprobs"] is None and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("logprobs", "top_logprobs", "status"), [
    (None, 0, 200), (False, 0, 200), (False, 2, 400), (None, -1, 400), (True, 0, 200),
])  # fmt: skip
def test_top_logprobs_0_without_logprobs_asks_for_nothing(
        http: httpx.Client, logprobs: bool | None, top_logprobs: int, status: int) -> None:
    """As vLLM: only a top_logprobs that asks for entries (> 0, or -1) needs logprobs=true."""
    body = {"messages": MESSAGES, "max_tokens": 2, "top_logprobs": top_logprobs}
    if logprobs is not None:
        body["logprobs"] = logprobs
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["param"] == "top_logprobs"
    else:
        content = (r.json()["choices"][0]["logprobs"] or {}).get("content")
        assert (content is not None) == bool(logprobs)


def test_null_max_tokens_is_the_rest_of_the_context_as_vllm_takes_it(
        http: httpx.Client) -> None:
    # docs/architecture.md said every null meant the field's default (16 for a completion).
    body = {"prompt": "Hi", "temperature": 0, "ignore_eos": True}
    usage = http.post("/v1/completions", json={**body, "max_tokens": None}).json()["usage"]
    assert usage["total_tokens"] == MAX_MODEL_LEN
    assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 16


def test_null_for_a_required_field_is_still_an_error(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_the_client_passing_none_is_served(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       n=None, logprobs=None, stream=None)
    assert len(r.choices) == 1 and r.usage.completion_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt(client: openai.OpenAI, stream: bool) -> None:
    """Prompt scoring (evaluation harnesses send it): the prompt, its logprobs, no completion."""
    prompt = "The capital of France is Paris"
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3,
                                      temperature=0, echo=True, logprobs=2)
    kwargs = dict(model=MODEL_NAME, prompt=[prompt, "Hi"], max_tokens=0, echo=True, logprobs=2,
                  n=2, temperature=1.0)
    if stream:
        chunks = list(client.completions.create(**kwargs, stream=True,
                                                stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        choices: dict[int, list] = {}
        for chunk in chunks:
            for c in chunk.choices:
                choices.setdefault(c.index, []).append(c)
        texts = {i: "".join(c.text for c in cs) for i, cs in choices.items()}
        tokens = {i: [t for c in cs for t in c.logprobs.tokens] for i, cs in choices.items()}
        finish = {i: cs[-1].finish_reason for i, cs in choices.items()}
    else:
        r = client.completions.create(**kwargs)
        usage = r.usage
        texts = {c.index: c.text for c in r.choices}
        tokens = {c.index: c.logprobs.tokens for c in r.choices}
        finish = {c.index: c.finish_reason for c in r.choices}
        lp = r.choices[0].logprobs
        n_prompt = len(lp.tokens)
        assert lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx(
            whole.choices[0].logprobs.token_logprobs[1:n_prompt], abs=1e-4)
    assert texts == {0: prompt, 1: prompt, 2: "Hi", 3: "Hi"}
    assert tokens[0] == whole.choices[0].logprobs.tokens[:len(tokens[0])]
    assert "".join(tokens[0]) == prompt and "".join(tokens[2]) == "Hi"
    assert set(finish.values()) == {"length"}
    assert usage.completion_tokens == 0
    assert usage.prompt_tokens == whole.usage.prompt_tokens + len(tokens[2])


def test_max_tokens_0_without_echo_is_still_refused(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


PREFILL = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, I"}]


def test_continue_final_message_continues_the_assistant_prefill(client: openai.OpenAI,
                                                                  http: httpx.Client) -> None:
    rendered = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello, I"
    ref = client.completions.create(model=MODEL_NAME, prompt=rendered, max_tokens=6,
                                    temperature=0)
    for flags in ({"continue_final_message": True, "add_generation_prompt": False},
                  {"continue_final_message": True}):  # add_generation_prompt left unset
        r = client.chat.completions.create(model=MODEL_NAME, messages=PREFILL, max_tokens=6,
                                           temperature=0, extra_body=flags)
        assert r.choices[0].message.content == ref.choices[0].text
        assert r.usage.prompt_tokens == ref.usage.prompt_tokens
        tokens = http.post("/tokenize", json={"messages": PREFILL, **flags}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == rendered
    # Without it the final message is closed and a new turn follows, as before.
    closed = http.post("/tokenize", json={"messages": PREFILL, "add_generation_prompt": False})
    assert http.post("/detokenize", json={"tokens": closed.json()["tokens"]}).json()[
        "prompt"] == rendered + "<|im_end|>\n"


def test_continue_final_message_with_add_generation_prompt_is_a_400(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={
        "messages": PREFILL, "continue_final_message": True, "add_generation_prompt": True})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "add_generation_prompt"
    assert "continue_final_message" in r.json()["error"]["message"]


@pytest.mark.parametrize(("part", "kind"), [
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "image_url"),
    ({"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
     "input_audio"),
])
def test_an_image_or_audio_part_is_a_400_that_names_it(http: httpx.Client, part: dict,
                                                       kind: str) -> None:
    content = [{"type": "text", "text": "What is this?"}, part]
    for path in ("/v1/chat/completions", "/tokenize"):
        r = http.post(path, json={"messages": [{"role": "user", "content": content}]})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "messages.0.content"
        assert f"part 1 is of type '{kind}'" in error["message"]
        assert "text only" in error["message"] and "fits none" not in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_bytes_of_a_split_character_join_into_it(client: openai.OpenAI,
                                                               http: httpx.Client,
                                                               stream: bool) -> None:
    """kvfit-tiny spells '日' as three one-byte tokens; each one's `bytes` is its byte (not
    U+FFFD's), so a client joining the bytes gets the character back."""
    byte_tokens = http.post("/tokenize", json={"prompt": "日"}).json()["tokens"]
    (whole,) = http.post("/tokenize", json={"prompt": "llo"}).json()["tokens"]
    assert len(byte_tokens) == 3
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, logprobs=True,
                  top_logprobs=4, temperature=1.0, seed=3,
                  extra_body={"allowed_token_ids": [*byte_tokens, whole]})
    if stream:
        entries = [e for chunk in client.chat.completions.create(**kwargs, stream=True)
                   if chunk.choices and chunk.choices[0].logprobs
                   for e in chunk.choices[0].logprobs.content]
    else:
        entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    by_token = {bytes([b]) for b in "日".encode()} | {b"llo"}
    assert len(entries) == 6
    assert {bytes(e.bytes) for e in entries} <= by_token
    for e in [*entries, *(top for x in entries for top in x.top_logprobs)]:
        if "\ufffd" in e.token:  # part of a character: raw bytes, none of them U+FFFD's
            assert e.bytes and "\ufffd".encode() not in bytes(e.bytes)
        else:
            assert bytes(e.bytes).decode() == e.token


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_rendering_many_messages_leaves_the_event_loop_free(
        server: ServerThread, http: httpx.Client, engine: AsyncLLM,
        monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """The chat template is Python: seconds for a body of megabytes of messages. While it
    renders (held here until /health has answered), the server answers others."""
    rendering, release = threading.Event(), threading.Event()
    render = engine.tokenizer.apply_chat_template

    def held(*args: Any, **kwargs: Any) -> Any:
        rendering.set()
        release.wait(timeout=60)
        return render(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", held)
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi there"}] * 400}
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{server.url}{path}", json=body, timeout=120)
        try:
            assert rendering.wait(timeout=60)
            # On the event loop, the render would hold /health until the timeout.
            assert http.get("/health", timeout=20).status_code == 200
        finally:
            release.set()
        r = big.result()
    if path == "/tokenize":
        assert r.status_code == 200 and r.json()["count"] > 400 * 3, r.text
    else:  # far beyond max_model_len
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}")


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, http: httpx.Client,
                                                 engine: AsyncLLM,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3's `enable_thinking: false`, as vLLM users send it."""
    monkeypatch.setattr(engine.tokenizer, "chat_template", THINKING_TEMPLATE)
    rendered = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    tokens = http.post("/tokenize", json={"messages": MESSAGES, **kwargs}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == (
        rendered + "<think></think>")
    thinking = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": thinking}).json()["prompt"] == rendered
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       extra_body=kwargs)
    assert r.usage.prompt_tokens == len(tokens)


@pytest.mark.parametrize("name", ["tokenize", "add_generation_prompt", "messages"])
def test_chat_template_kwargs_may_not_set_the_call_s_own_arguments(http: httpx.Client,
                                                                    name: str) -> None:
    r = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {name: True}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"chat_template_kwargs.{name}"


@pytest.mark.parametrize(("body", "says"), [
    ({"prompt": [[1], [5] * MAX_MODEL_LEN]},
     "the prompt at index 1 is 128 tokens; shorten it to at most 127 tokens"),
    ({"prompt": [5] * MAX_MODEL_LEN}, "the prompt is 128 tokens; shorten it"),
    ({"messages": [{"role": "user", "content": "w " * MAX_MODEL_LEN}]},
     "the messages render to 14"),
    ({"prompt": [[1], [5, 6]], "max_tokens": MAX_MODEL_LEN - 1},
     "(2 in the prompt at index 1, 127 in the completion): lower max_tokens to at most 126"),
    ({"messages": MESSAGES, "max_completion_tokens": MAX_MODEL_LEN},
     "in the messages, 128 in the completion): lower max_completion_tokens to at most"),
])
def test_a_prompt_beyond_max_model_len_is_a_400_that_says_by_how_much(
        http: httpx.Client, body: dict, says: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert says in error["message"], error["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_words_are_never_generated(http: httpx.Client, path: str) -> None:
    """vLLM's `bad_words`: of the two tokens allowed, the banned word's never comes."""
    (llo,) = http.post("/tokenize", json={"prompt": "llo"}).json()["tokens"]
    (run,) = http.post("/tokenize", json={"prompt": " run"}).json()["tokens"]
    body = {"max_tokens": 4, "temperature": 1.0, "seed": 0, "ignore_eos": True,
            "allowed_token_ids": [llo, run], "bad_words": ["llo"],
            **({"prompt": "Hi"} if path == "/v1/completions" else {"messages": MESSAGES})}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice.get("text", (choice.get("message") or {}).get("content")) == " run" * 4
    r = http.post(path, json={**body, "bad_words": "llo"})  # a list, as vLLM's
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


def _failures(http: httpx.Client) -> dict[str, float]:
    """kvfit:request_failure_total by reason (prometheus_client's parser)."""
    return {s.labels["reason"]: s.value
            for family in text_string_to_metric_families(http.get("/metrics").text)
            for s in family.samples if s.name == "kvfit:request_failure_total"}


def test_failure_metrics_tell_client_errors_from_server_errors(
        server: ServerThread, http: httpx.Client, engine: AsyncLLM, tmp_path: Any) -> None:
    """`reason="error"` is what dashboards alert on: a client that gives up on a running
    request, or a wrong method, is no server error."""
    before = _failures(http)
    assert http.get("/v1/completions").status_code == 405
    release = tmp_path / "release"
    in_engine(engine, engine_hooks.stall, "slow", str(release))
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", timeout=0.5,
                       json={"prompt": "slow", "max_tokens": 50, "ignore_eos": True})
        deadline = time.monotonic() + 10
        while _failures(http).get("client_disconnected", 0) == before.get(
                "client_disconnected", 0):
            assert time.monotonic() < deadline, f"not counted apart: {_failures(http)}"
            time.sleep(0.02)
    finally:
        release.touch()
        in_engine(engine, engine_hooks.clear)
    after = _failures(http)
    assert after.get("error", 0) == before.get("error", 0), after
    assert after["invalid"] == before.get("invalid", 0) + 1  # the 405


def test_a_client_that_leaves_while_sending_its_body_is_no_invalid_request(
        server: ServerThread, http: httpx.Client) -> None:
    # Found by the hunt: FastAPI's 400 for a body it could not read counted a client that
    # left mid-upload as reason="invalid", a client error nobody made.
    before = _failures(http)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"a")
        time.sleep(0.2)  # the server waits on the rest of the body
    deadline = time.monotonic() + 10
    while _failures(http).get("client_disconnected", 0) == before.get("client_disconnected", 0):
        assert time.monotonic() < deadline, f"not counted as a client that left: {_failures(http)}"
        time.sleep(0.02)
    assert _failures(http).get("invalid", 0) == before.get("invalid", 0)


def test_text_parts_are_joined_a_line_apart(client: openai.OpenAI, http: httpx.Client) -> None:
    parts = [{"type": "text", "text": "Describe"}, {"type": "text", "text": "this code:"}]
    messages = [{"role": "user", "content": parts}]
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": tokens}).json()["prompt"] == (
        "<|im_start|>user\nDescribe\nthis code:<|im_end|>\n<|im_start|>assistant\n")
    as_string = [{"role": "user", "content": "Describe\nthis code:"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                       temperature=0)
    ref = client.chat.completions.create(model=MODEL_NAME, messages=as_string, max_tokens=4,
                                         temperature=0)
    assert r.choices[0].message.content == ref.choices[0].message.content
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens == len(tokens)


def test_continuous_usage_is_on_every_chat_chunk(client: openai.OpenAI) -> None:
    """vLLM's continuous_usage_stats: the role chunk too, so a client reading each chunk's
    usage never meets a null."""
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=3, n=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is not None for c in chunks)
    prompt = chunks[-1].usage.prompt_tokens
    assert chunks[0].usage.completion_tokens == 0 and chunks[0].usage.prompt_tokens == prompt
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", {"messages": MESSAGES})])
def test_continuous_usage_alone_asks_for_the_usage(http: httpx.Client, path: str,
                                                   body: dict) -> None:
    """As vLLM takes it (its include_usage defaults to true): continuous_usage_stats without
    include_usage puts the usage in every chunk; with include_usage false it is a 400, not
    an option that does nothing."""
    r = http.post(path, json={**body, "max_tokens": 3, "stream": True,
                              "stream_options": {"continuous_usage_stats": True}})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert chunks and all(c["usage"] is not None for c in chunks), r.text
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    r = http.post(path, json={**body, "max_tokens": 3, "stream": True, "stream_options": {
        "include_usage": False, "continuous_usage_stats": True}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "stream_options.continuous_usage_stats"
    # Neither: no usage, as OpenAI's stream_options without include_usage.
    r = http.post(path, json={**body, "max_tokens": 3, "stream": True, "stream_options": {}})
    assert "usage" not in r.text


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_an_empty_body_is_a_400_that_says_so(http: httpx.Client, path: str) -> None:
    r = http.post(path, content=b"", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "the request body is empty: send a JSON object"


# As Qwen3's template: roles it does not know are left out.
KNOWN_ROLES_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] in ('system', 'user', 'assistant') %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _rendered(http: httpx.Client, messages: list[dict]) -> str:
    tokens = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    return http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_a_developer_message_is_the_system_message_for_a_template_without_it(
        client: openai.OpenAI, http: httpx.Client, engine: AsyncLLM,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "chat_template", KNOWN_ROLES_TEMPLATE)
    developer = [{"role": "developer", "content": "Answer in French."}, *MESSAGES]
    system = [{"role": "system", "content": "Answer in French."}, *MESSAGES]
    assert "Answer in French." in _rendered(http, developer)
    assert _rendered(http, developer) == _rendered(http, system)
    r = client.chat.completions.create(model=MODEL_NAME, messages=developer, max_tokens=2)
    ref = client.chat.completions.create(model=MODEL_NAME, messages=system, max_tokens=2)
    assert r.usage.prompt_tokens == ref.usage.prompt_tokens
    # A template that knows the role gets it as sent.
    monkeypatch.setattr(engine.tokenizer, "chat_template",
                        KNOWN_ROLES_TEMPLATE.replace("'assistant')", "'assistant', 'developer')"))
    assert "<|im_start|>developer\nAnswer in French." in _rendered(http, developer)


# As Llama 3.1's template writes a call: its arguments with `tojson`.
TOOL_CALL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.tool_calls %}"
    "{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _with_call(arguments: Any) -> list[dict]:
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": arguments}}
    return [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def test_tool_call_arguments_reach_the_template_as_an_object(
        client: openai.OpenAI, http: httpx.Client, engine: AsyncLLM,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenAI's API sends a call's arguments as JSON text; vLLM parses them for the template,
    which writes them with `tojson`: the text itself would be written as a quoted string."""
    monkeypatch.setattr(engine.tokenizer, "chat_template", TOOL_CALL_TEMPLATE)
    rendered = _rendered(http, _with_call('{"city": "Paris"}'))
    assert '<|im_start|>assistant\nweather{"city": "Paris"}<|im_end|>' in rendered, rendered
    assert _rendered(http, _with_call("")) == _rendered(http, _with_call("{}"))
    r = client.chat.completions.create(model=MODEL_NAME, messages=_with_call('{"city": "Paris"}'),
                                       max_tokens=2)
    assert r.usage.prompt_tokens == len(http.post("/tokenize", json={
        "messages": _with_call('{"city": "Paris"}')}).json()["tokens"])
    # No calls: the template's plain assistant path, with the message's text.
    plain = [*MESSAGES, {"role": "assistant", "content": "Hello", "tool_calls": []}]
    assert "<|im_start|>assistant\nHello<|im_end|>" in _rendered(http, plain)
    r = http.post("/v1/chat/completions", json={"messages": _with_call("{city"),
                                                 "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages.1.tool_calls"
    assert "function.arguments is not JSON" in r.json()["error"]["message"]


@pytest.mark.parametrize(("path", "field", "value", "why"), [
    ("/v1/chat/completions", "guided_json", {"type": "object"}, "structured output"),
    ("/v1/completions", "guided_choice", ["a", "b"], "structured output"),
    ("/v1/chat/completions", "use_beam_search", True, "beam search"),
    ("/v1/chat/completions", "chat_template", "{{ messages }}", "--chat-template"),
    ("/v1/chat/completions", "echo", True, "chat echo"),
    ("/v1/chat/completions", "reasoning_effort", "low", "enable_thinking"),
    ("/v1/completions", "max_completion_tokens", 4, "takes max_tokens"),
    ("/v1/completions", "response_format", {"type": "json_object"}, "chat completions field"),
    ("/v1/chat/completions", "cache_salt", "s3cret", "salt"),
    # vLLM's completions field: it was "unknown field", as if misspelt.
    ("/v1/completions", "prompt_embeds", "AAAA", "prompt embeddings"),
])
def test_a_vllm_or_openai_field_not_taken_is_refused_with_why(
        http: httpx.Client, path: str, field: str, value: Any, why: str) -> None:
    """A field of vLLM's or OpenAI's API the route does not take is a 400 that says why, not
    'unknown field', which reads as a misspelling of a field the server takes."""
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    r = http.post(path, json={**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and why in error["message"], error
    assert "unknown field" not in error["message"]


def test_vllm_fields_at_values_that_ask_for_nothing_are_taken(http: httpx.Client) -> None:
    """As OpenAI's tool fields at their no-op values: a client sending vLLM's defaults (or
    null for a field it leaves unset) is served; a nested unknown field is still unknown."""
    body = {"messages": MESSAGES, "max_tokens": 2, "priority": 0, "use_beam_search": False,
            "echo": False, "guided_json": None, "cache_salt": None}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    # vLLM's defaults of length_penalty and include_reasoning (a client dumping every field
    # of vLLM's request sends them) were refused as beam search and reasoning asked for.
    for extra in ({"length_penalty": 1.0}, {"length_penalty": 1}, {"include_reasoning": True}):
        r = http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 200, r.text
    for extra in ({"length_penalty": 0.5}, {"length_penalty": True},
                  {"include_reasoning": False}, {"include_reasoning": 1}, {"echo": 0}):
        r = http.post("/v1/chat/completions", json={**body, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra))
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "priority": 0,
                                           "guided_regex": None})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**body, "stream": True,
                                                "stream_options": {"priority": 0}})
    assert r.status_code == 400 and "unknown field" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_spaces_between_special_tokens_is_taken(http: httpx.Client, path: str) -> None:
    """vLLM's `spaces_between_special_tokens` (default true) was a 400 even at true; it is a
    sampling setting now (kvfit-tiny's byte-level decoder puts no spaces between special
    tokens, so the text is the same either way)."""
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    body = {**body, "max_tokens": 4, "temperature": 0, "skip_special_tokens": False}
    texts = []
    for value in (True, False):
        r = http.post(path, json={**body, "spaces_between_special_tokens": value})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        texts.append(choice["text"] if "text" in choice else choice["message"]["content"])
    assert texts[0] == texts[1]
    r = http.post(path, json={**body, "spaces_between_special_tokens": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "spaces_between_special_tokens"


DOCUMENTS_TEMPLATE = (
    "{% for d in documents or [] %}[{{ d.title }}] {{ d.text }}\n{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_documents_reach_the_template(client: openai.OpenAI, http: httpx.Client,
                                      engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's `documents` (retrieval-augmented generation): the template's `documents`, which
    chat_template_kwargs may not set (an argument of the template call)."""
    monkeypatch.setattr(engine.tokenizer, "chat_template", DOCUMENTS_TEMPLATE)
    documents = [{"title": "Paris", "text": "The capital of France."}]
    r = http.post("/tokenize", json={"messages": MESSAGES, "documents": documents})
    tokens = r.json()["tokens"]
    rendered = http.post("/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert rendered.startswith("[Paris] The capital of France.\n<|im_start|>user"), rendered
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       extra_body={"documents": documents})
    assert r.usage.prompt_tokens == len(tokens)
    r = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "chat_template_kwargs": {"documents": documents}})
    assert r.status_code == 400 and "the request's own field" in r.json()["error"]["message"]


def test_return_tokens_as_token_ids_gives_each_token_s_id(client: openai.OpenAI,
                                                          http: httpx.Client) -> None:
    """vLLM's return_tokens_as_token_ids: every token of logprobs as `token_id:N` (a token
    that is part of a character has no text of its own), streamed or not, echo too."""
    kwargs = dict(model=MODEL_NAME, prompt="Hi there", max_tokens=4, temperature=0, logprobs=2,
                  echo=True, extra_body={"return_tokens_as_token_ids": True})
    whole = client.completions.create(**kwargs).choices[0]
    lp = whole.logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens), lp.tokens
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == whole.text
    assert all(k.startswith("token_id:") for top in lp.top_logprobs[1:] for k in top)
    assert all(top[t] == p for t, p, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                lp.top_logprobs[1:], strict=True))
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset
    for stream in (False, True):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
            top_logprobs=2, stream=stream, extra_body={"return_tokens_as_token_ids": True})
        content = ([e for c in r for e in (c.choices[0].logprobs.content if c.choices and
                                           c.choices[0].logprobs else [])]
                   if stream else r.choices[0].logprobs.content)
        assert len(content) == 3
        for entry in [*content, *(top for e in content for top in e.top_logprobs)]:
            assert entry.token.startswith("token_id:") and entry.bytes == list(
                entry.token.encode())


def _final_usage(r: httpx.Response) -> dict:
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert chunks[-1]["choices"] == [], r.text
    return chunks[-1]["usage"]


def test_prompt_tokens_details_reports_the_cached_prompt_tokens(
        start_server: Any, http: httpx.Client) -> None:
    """vLLM's --enable-prompt-tokens-details: the usage's prompt_tokens_details.cached_tokens
    counts the prompt tokens the prefix cache served (whole blocks of 16), summed over the
    prompts, streamed or not; off (the default), the usage has no such field."""
    prompt = list(range(100, 140))  # 40 tokens: 2 whole blocks can come from the cache
    messages = [{"role": "user", "content": "tell me a story about a cat " * 6}]
    with httpx.Client(base_url=start_server(enable_prompt_tokens_details=True).url,
                      timeout=60) as details:
        first = details.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        # Nothing cached yet: left out, as vLLM leaves a 0 out.
        assert "prompt_tokens_details" not in first.json()["usage"]
        usage = details.post("/v1/completions", json={
            "prompt": [prompt, prompt], "max_tokens": 2, "n": 2}).json()["usage"]
        assert usage["prompt_tokens"] == 80
        assert usage["prompt_tokens_details"] == {"cached_tokens": 64}
        stream = {"max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
        for body, cached in (({"prompt": prompt}, 32), ({"prompt": [prompt, prompt]}, 64),
                             ({"prompt": prompt, "n": 2}, 32)):
            r = details.post("/v1/completions", json={**body, **stream})
            assert _final_usage(r)["prompt_tokens_details"] == {"cached_tokens": cached}
        details.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        usage = details.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 2}).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 16
        r = details.post("/v1/chat/completions", json={"messages": messages, **stream})
        assert _final_usage(r)["prompt_tokens_details"] == usage["prompt_tokens_details"]
    usage = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).json()
    assert "prompt_tokens_details" not in usage["usage"]
    r = http.post("/v1/chat/completions", json={"messages": messages, **stream})
    assert "prompt_tokens_details" not in _final_usage(r)


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1}),
    ("/tokenize", {"prompt": "Hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_an_empty_model_name_asks_for_the_served_model(http: httpx.Client, path: str,
                                                        body: dict) -> None:
    """As vLLM takes it: clients and UIs with the model left blank send `"model": ""` (it
    was a 404, "the model '' does not exist")."""
    r = http.post(path, json={**body, "model": ""})
    assert r.status_code == 200, r.text
    if path.startswith("/v1"):
        assert r.json()["model"] == MODEL_NAME


def test_ping_answers_as_health_without_a_key(start_server: Any) -> None:
    """vLLM's /ping (SageMaker's health check, by GET or POST) was a 404: a load balancer or
    SageMaker probing it took a healthy server for a dead one."""
    server = start_server(api_key="sekret")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for method in ("GET", "POST"):
            r = http.request(method, "/ping")
            assert r.status_code == 200 and r.content == b"", r.text
        assert http.get("/version").status_code == 401  # the key is still needed elsewhere


@pytest.mark.parametrize("path", ["/health", "/ping", "/version", "/v1/models", "/metrics"])
def test_head_on_a_get_route_answers_as_get_does(http: httpx.Client, path: str) -> None:
    """HTTP asks every GET resource to take HEAD (RFC 9110 9.1): it was a 405, so a monitor
    probing /health with HEAD took the server for broken."""
    r = http.head(path)
    assert r.status_code == 200 and r.content == b""
    assert r.headers.get("content-type") == http.get(path).headers.get("content-type")


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("DELETE", "/v1/completions", {"POST"}), ("GET", "/v1/chat/completions", {"POST"}),
    ("POST", "/health", {"GET", "HEAD"}), ("PUT", "/ping", {"GET", "HEAD", "POST"}),
])
def test_a_405_names_the_allowed_methods(http: httpx.Client, method: str, path: str,
                                         allow: set[str]) -> None:
    """HTTP requires an Allow header on a 405; the server's error body had replaced the one
    the router gave with none."""
    r = http.request(method, path)
    assert r.status_code == 405 and r.json()["error"]["message"].startswith(f"{method} {path}")
    assert set(r.headers["allow"].split(", ")) == allow


def test_invocations_serves_chat_and_completions_as_vllm(client: openai.OpenAI,
                                                         http: httpx.Client) -> None:
    """SageMaker's inference route, beside /ping (it was a 404): as vLLM routes it, a body
    with messages is a chat completion, any other a completion; a bad body is the 400 the
    route's own would get."""
    chat = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    r = http.post("/invocations", json=chat)
    assert r.status_code == 200, r.text
    ref = client.chat.completions.create(model=MODEL_NAME, **chat)
    assert r.json()["object"] == "chat.completion"
    assert r.json()["choices"][0]["message"]["content"] == ref.choices[0].message.content
    completion = {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
    r = http.post("/invocations", json={**completion, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
                   if line.startswith("data: {"))
    assert text == client.completions.create(model=MODEL_NAME, **completion).choices[0].text
    for body, param in (({"max_tokens": 2}, "prompt"), ({"messages": [], "n": 1}, "messages"),
                        ({"prompt": "x", "top_kk": 1}, "top_kk")):
        r = http.post("/invocations", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for content in (b"{", b"[1]", b"\xff"):
        r = http.post("/invocations", content=content,
                      headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json(), r.text


def test_long_token_lists_are_decoded_off_the_event_loop(
        http: httpx.Client, engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """/detokenize (and /tokenize's token_strs) of many ids ran on the event loop: a million
    ids held it most of a second, every stream and /health waiting. Now on the tokenizer's
    thread, as long prompts are encoded; a short list stays inline (a thread costs more)."""
    threads: list[str] = []
    for name in ("decode", "convert_ids_to_tokens"):
        method = getattr(engine.tokenizer, name)

        def recording(*args: Any, method: Any = method, **kwargs: Any) -> Any:
            threads.append(threading.current_thread().name)
            return method(*args, **kwargs)

        monkeypatch.setattr(engine.tokenizer, name, recording)
    ids = engine.tokenizer.encode("hello world " * 5000)
    assert len(ids) > 8192
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == "hello world " * 5000
    r = http.post("/tokenize", json={"prompt": "hello world " * 5000, "return_token_strs": True})
    assert r.status_code == 200 and len(r.json()["token_strs"]) == len(ids)
    assert len(threads) == 2 and all(t.startswith("kvfit-tokenize") for t in threads), threads
    threads.clear()
    assert http.post("/detokenize", json={"tokens": ids[:8]}).status_code == 200
    assert len(threads) == 1 and not threads[0].startswith("kvfit-tokenize"), threads
    # An id out of range is still a 400 naming the field, from the thread too.
    r = http.post("/detokenize", json={"tokens": [*ids, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def _chunks(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("extra", [
    {}, {"n": 2, "prompt": ["Hi there", "Once upon"]}, {"prompt": [5, 6]},
    {"echo": True, "logprobs": 1},
])
def test_return_token_ids_gives_the_prompt_and_completion_ids(
        http: httpx.Client, engine: AsyncLLM, extra: dict) -> None:
    """vLLM's return_token_ids (RL and evaluation clients send it) was a 400, "unknown field":
    each choice carries its prompt's ids and its own, streamed as vLLM streams them (the
    prompt's once, in a choice's first chunk; each chunk's new ids)."""
    body = {"prompt": "Hi there", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}
    given = body["prompt"]
    prompts = ([given] if isinstance(given, str) or isinstance(given[0], int) else given)
    prompts = [p if isinstance(p, list) else engine.tokenizer.encode(p) for p in prompts]
    n = body.get("n", 1)
    whole = http.post("/v1/completions", json=body).json()
    assert len(whole["choices"]) == len(prompts) * n
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompts[choice["index"] // n]
        assert len(choice["token_ids"]) == 6
    streamed: dict[int, list[int]] = {}
    for chunk in _chunks(http.post("/v1/completions", json={**body, "stream": True})):
        for choice in chunk["choices"]:
            i = choice["index"]
            assert ("prompt_token_ids" in choice) == (i not in streamed), chunk
            if i not in streamed:
                assert choice["prompt_token_ids"] == prompts[i // n]
            streamed.setdefault(i, []).extend(choice["token_ids"])
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}
    plain = http.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0]


def test_return_token_ids_in_a_chat(http: httpx.Client) -> None:
    """vLLM's shape: the prompt's ids beside the choices (streamed: with the role chunk), each
    choice's ids in it (streamed: each chunk's new ones)."""
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "n": 2, "return_token_ids": True}
    prompt = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    whole = http.post("/v1/chat/completions", json=body).json()
    assert whole["prompt_token_ids"] == prompt
    assert [len(c["token_ids"]) for c in whole["choices"]] == [5, 5]
    chunks = _chunks(http.post("/v1/chat/completions", json={**body, "stream": True}))
    assert chunks[0]["prompt_token_ids"] == prompt
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in chunks[1:]:
        for choice in chunk["choices"]:
            streamed[choice["index"]].extend(choice["token_ids"])
    assert streamed == {c["index"]: c["token_ids"] for c in whole["choices"]}


def test_responses_text_parts_and_refusals_are_text(http: httpx.Client) -> None:
    """vLLM takes the Responses API's input_text and output_text parts in a chat, and an
    assistant's refusal part as its words: each was a 400 saying the model "takes text
    only"."""
    def rendered(messages: list[dict]) -> list[int]:
        r = http.post("/tokenize", json={"messages": messages})
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    plain = [{"role": "user", "content": "Describe\nthis"},
             {"role": "assistant", "content": "I can't"}, {"role": "user", "content": "Why"}]
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Describe"},
                                          {"type": "text", "text": "this"}]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"}]},
             {"role": "user", "content": [{"type": "output_text", "text": "Why"}]}]
    assert rendered(parts) == rendered(plain)
    r = http.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 2})
    assert r.status_code == 200, r.text
    for bad in ({"type": "refusal", "text": "x"}, {"type": "input_text", "refusal": "x"}):
        r = http.post("/tokenize", json={"messages": [{"role": "user", "content": [bad]}]})
        assert r.status_code == 400 and "takes its words as" in r.json()["error"]["message"]
