"""What OpenAI and vLLM clients send that the server must take as they do: explicit nulls,
prompt scoring (echo with max_tokens 0), assistant prefill, per the official `openai` client
and raw httpx against a real uvicorn server."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from .conftest import MODEL_NAME, ServerThread

MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


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


def test_null_for_a_required_field_is_still_an_error(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_the_client_passing_none_is_served(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2,
                                       n=None, logprobs=None, stream=None)
    assert len(r.choices) == 1 and r.usage.completion_tokens == 2
