"""Request bodies over `max_request_body_bytes` get 413 (declared or chunked), with an OpenAI
error body naming the flag; bodies under it are served, and the server stays healthy."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from .conftest import MODEL_NAME, ServerThread

LIMIT = 4096
COMPLETION = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def http(start_server: Callable[..., ServerThread]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=start_server(max_request_body_bytes=LIMIT).url,
                      timeout=60) as http:
        yield http


def _chunked(body: bytes, size: int = 1000) -> Iterator[bytes]:
    # A generator body: httpx sends it chunked, with no content-length.
    for start in range(0, len(body), size):
        yield body[start : start + size]


def _assert_too_large(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert "--max-request-body-bytes" in error["message"]
    assert error["type"] == "invalid_request_error"


def test_bodies_over_the_limit_get_413_declared_or_chunked(http: httpx.Client) -> None:
    big = json.dumps({**COMPLETION, "prompt": [1] * LIMIT}).encode()
    headers = {"content-type": "application/json"}
    _assert_too_large(http.post("/v1/completions", content=big, headers=headers))
    _assert_too_large(http.post("/v1/completions", content=_chunked(big), headers=headers))
    assert http.get("/health").status_code == 200


def test_bodies_under_the_limit_are_served_declared_or_chunked(http: httpx.Client) -> None:
    body = json.dumps(COMPLETION).encode()
    headers = {"content-type": "application/json"}
    declared = http.post("/v1/completions", content=body, headers=headers)
    chunked = http.post("/v1/completions", content=_chunked(body, 7), headers=headers)
    assert declared.status_code == chunked.status_code == 200, (declared.text, chunked.text)
    assert declared.json()["choices"][0]["text"] == chunked.json()["choices"][0]["text"]
