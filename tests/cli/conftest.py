"""Fixtures of the CLI tests: small engine flags, one torch thread, and a fake
OpenAI-compatible server with scripted timing and failures."""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest


@pytest.fixture
def engine_flags() -> list[str]:
    """kvfit-tiny on the CPU with a small profiling step and a cache capped at 4 x 128 tokens
    (measured sizing, the default): an engine starts in well under a second."""
    return ["--device", "cpu", "--max-num-batched-tokens", "128", "--max-num-seqs", "4",
            "--max-model-len", "128"]


class FakeOpenAIServer(ThreadingHTTPServer):
    """`/v1/models`, `/v1/completions` and `/v1/chat/completions`, streamed as SSE over
    chunked HTTP/1.1. Request i behaves as `behaviors[i % len(behaviors)]`:

    - `ok`: an empty-text chunk at once, the first content chunk after `ttft` seconds, one more
      every `itl` seconds up to `max_tokens`, a usage chunk, `[DONE]`;
    - `500`: an HTTP 500 with an error body;
    - `drop`: the first content chunk, then the connection closes mid-body;
    - `error`: an `{"error": ...}` event after the first content chunk;
    - `held`: like `ok`, but every chunk's text is empty (tokens that are parts of one
      character, which a server holds back) while its continuous usage counts the tokens.

    With `api_key` set, a request without `Authorization: Bearer <api_key>` gets HTTP 401.
    `most_in_flight` is the most completions it was answering at once.
    """

    daemon_threads = True

    def __init__(self, behaviors: tuple[str, ...], ttft: float, itl: float,
                 api_key: str | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.behaviors, self.ttft, self.itl, self.api_key = behaviors, ttft, itl, api_key
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self._counter = itertools.count()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def next_behavior(self, body: dict[str, Any]) -> str:
        with self._lock:
            self.bodies.append(body)
            return self.behaviors[next(self._counter) % len(self.behaviors)]

    def count_in_flight(self, change: int) -> None:
        with self._lock:
            self.in_flight += change
            self.most_in_flight = max(self.most_in_flight, self.in_flight)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FakeOpenAIServer

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event(self, obj: Any) -> None:
        data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
        self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")

    def _refused(self) -> bool:
        """Whether the request lacks the server's key (answered with a 401 here)."""
        key = self.server.api_key
        if key is None or self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self._json(401, {"error": {"message": "a valid API key is needed",
                                   "type": "authentication_error"}})
        return True

    def do_GET(self) -> None:
        if self._refused():
            return
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        self.server.count_in_flight(1)
        try:
            self._post()
        finally:
            self.server.count_in_flight(-1)

    def _post(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self._refused():
            return
        behavior = self.server.next_behavior(body)
        if behavior == "500":
            self._json(500, {"error": {"message": "boom"}})
            return
        chat = self.path.endswith("/chat/completions")
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def chunk(text: str, tokens: int | None = None) -> dict[str, Any]:
            choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0,
                                                                             "text": text}
            event = {"id": "x", "model": body["model"], "choices": [choice]}
            if tokens is not None:
                event["usage"] = {"prompt_tokens": 7, "completion_tokens": tokens}
            return event

        # A chunk before any content (a role delta, as servers send): TTFT must skip it.
        self._event(chunk(""))
        time.sleep(self.server.ttft)
        # A chat reply counts the messages, so a test can see the history that was sent.
        n = body.get("max_tokens") or 4
        pieces = [f"seen {len(body['messages'])}"] if chat else [f" t{k}" for k in range(n)]
        for k, piece in enumerate(pieces):
            if k:
                time.sleep(self.server.itl)
            self._event(chunk("", k + 1) if behavior == "held" else chunk(piece))
            if behavior == "drop":
                self.close_connection = True  # no final chunk: the body is cut short
                return
            if behavior == "error":
                self._event({"error": {"message": "engine died"}})
                self._event("[DONE]")
                self.wfile.write(b"0\r\n\r\n")
                return
        self._event({"id": "x", "choices": [], "usage": {"prompt_tokens": 7,
                                                        "completion_tokens": len(pieces)}})
        self._event("[DONE]")
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeOpenAIServer]]:
    """Factory: `fake_server(behaviors=("ok",), ttft=0.0, itl=0.0, api_key=None)` starts a
    server on a free port of 127.0.0.1 (its `.url`, its `.bodies` received); all are stopped
    at teardown."""
    servers: list[FakeOpenAIServer] = []

    def start(behaviors: tuple[str, ...] = ("ok",), ttft: float = 0.0,
              itl: float = 0.0, api_key: str | None = None) -> FakeOpenAIServer:
        server = FakeOpenAIServer(behaviors, ttft, itl, api_key)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
