"""`kvfit serve` stopped (SIGINT, SIGTERM) with requests in flight: `--shutdown-timeout` gives
them time to finish, then they are aborted, and the process exits even while clients hold
connections open."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from .conftest import ServeProcess, ServerThread
from .test_serve import parser


def _events(lines: Any) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_shutdown_timeout_is_a_number_of_seconds(capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["serve", "m"]).shutdown_timeout == 0  # vLLM's default
    assert parser().parse_args(["serve", "m", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    for bad in ("-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "m", "--shutdown-timeout", bad])
        assert repr(bad) in capsys.readouterr().err


def test_a_stopped_server_aborts_its_requests_and_exits_though_a_client_stalls() -> None:
    """Without a timeout, in-flight requests are aborted at once (as vLLM's default). A client
    that sent half a request and went quiet no longer keeps the process alive (uvicorn waits
    for every connection to close)."""
    server = ServeProcess("--max-model-len", "2048", "--num-gpu-blocks-override", "160")
    stalled = socket.create_connection(("127.0.0.1", server.port))
    try:
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                        b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        body = {"prompt": "a", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
            server.proc.send_signal(signal.SIGINT)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        events = _events(rest)
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        server.proc.wait(timeout=60)  # no second signal: that one would force the exit
    finally:
        stalled.close()
        output = server.stop()
    assert server.proc.returncode == 0, output
    assert "Traceback" not in output, output


def test_a_shutdown_timeout_lets_requests_in_flight_finish() -> None:
    server = ServeProcess("--shutdown-timeout", "120")
    try:
        body = {"prompt": "a", "max_tokens": 30, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            server.proc.send_signal(signal.SIGINT)
            events = _events([first, *lines])
        server.proc.wait(timeout=60)
    finally:
        output = server.stop()
    assert server.proc.returncode == 0, output
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 30


def test_a_stopping_app_refuses_new_generation_requests(
        start_server: Callable[..., ServerThread]) -> None:
    """Once its server stops, the app answers a request that still reaches it (one read on a
    connection open before) with 503, not a generation the drain would wait for."""
    server = start_server()
    server.server.config.app.state.serving.stop_admitting()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_sigterm_shuts_the_engine_down_and_exits_0() -> None:
    """uvicorn re-raises the SIGTERM it stopped on: its default action killed the process
    (status -15) before it shut its engine down, where --api-server-count exits 0."""
    server = ServeProcess()
    try:
        (engine,) = server.engine_processes()
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=60)
    finally:
        output = server.stop()
    assert server.proc.returncode == 0, output
    engine.wait(timeout=10)
