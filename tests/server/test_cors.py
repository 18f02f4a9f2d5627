"""CORS as vLLM's server does it: `--allowed-origins`, `--allowed-methods`, `--allowed-headers`
(default every one) and `--allow-credentials` (default off); browsers' preflight requests are
answered, and the headers are on every answer, streamed (SSE) ones and errors included."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.server import serve

from .conftest import MODEL_NAME, ServerThread

GOOD, EVIL = "http://app.example", "http://evil.example"
COMPLETION = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}


def _preflight(url: str, origin: str, method: str = "POST",
               headers: str = "authorization, content-type") -> httpx.Response:
    return httpx.options(f"{url}/v1/completions", headers={
        "origin": origin, "access-control-request-method": method,
        "access-control-request-headers": headers})


def _stream(url: str, origin: str, api_key: str | None = None) -> tuple[httpx.Headers, str]:
    headers = {"origin": origin}
    if api_key is not None:
        headers["authorization"] = f"Bearer {api_key}"
    with httpx.stream("POST", f"{url}/v1/completions", headers=headers, timeout=60,
                      json={**COMPLETION, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        return response.headers, response.read().decode()


def test_by_default_any_origin_is_allowed_preflight_streamed_and_errors(
    start_server: Callable[..., ServerThread],
) -> None:
    url = start_server(api_key="sekret").url
    # The preflight carries no key (browsers never send one): answered, not a 401 or 405.
    pre = _preflight(url, EVIL)
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "*"
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    assert "access-control-allow-credentials" not in pre.headers
    headers, body = _stream(url, EVIL, api_key="sekret")
    assert headers["access-control-allow-origin"] == "*"
    assert headers["content-type"].startswith("text/event-stream")
    assert body.rstrip().endswith("data: [DONE]")
    plain = httpx.post(f"{url}/v1/completions", json=COMPLETION, timeout=60,
                       headers={"origin": EVIL, "authorization": "Bearer sekret"})
    assert plain.status_code == 200 and plain.headers["access-control-allow-origin"] == "*"
    # An error a browser's script must be able to read: the missing key.
    refused = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers={"origin": EVIL})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_and_credentials(start_server: Callable[..., ServerThread]) -> None:
    url = start_server(allowed_origins=[GOOD], allowed_methods=["GET", "POST"],
                       allowed_headers=["Content-Type"], allow_credentials=True).url
    pre = _preflight(url, GOOD, headers="content-type")
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == GOOD
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert _preflight(url, EVIL, headers="content-type").status_code == 400
    assert _preflight(url, GOOD, method="DELETE", headers="content-type").status_code == 400
    assert _preflight(url, GOOD, headers="x-secret").status_code == 400
    headers, body = _stream(url, GOOD)
    assert headers["access-control-allow-origin"] == GOOD
    assert headers["access-control-allow-credentials"] == "true"
    assert "data: [DONE]" in body
    headers, _ = _stream(url, EVIL)  # served (the browser refuses it), with no allow header
    assert "access-control-allow-origin" not in headers


def _parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="kvfit")
    serve.add_serve_parser(root.add_subparsers(dest="command", required=True))
    return root


def test_serve_takes_vllms_cors_flags_and_defaults() -> None:
    config = serve._serve_config(_parser().parse_args(["serve", "m"]), EngineArgs(model="m"))
    assert (config.allowed_origins, config.allowed_methods, config.allowed_headers,
            config.allow_credentials) == (["*"], ["*"], ["*"], False)
    args = _parser().parse_args([
        "serve", "m", "--allowed-origins", f'["{GOOD}"]', "--allowed-methods", '["POST"]',
        "--allowed-headers", '["Authorization"]', "--allow-credentials"])
    config = serve._serve_config(args, EngineArgs(model="m"))
    assert (config.allowed_origins, config.allowed_methods, config.allowed_headers,
            config.allow_credentials) == ([GOOD], ["POST"], ["Authorization"], True)


@pytest.mark.parametrize("value", [GOOD, '"*"', "[1]", "[http://a]"])
def test_a_cors_flag_that_is_no_json_list_of_strings_is_a_usage_error(
    value: str, capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(["serve", "m", "--allowed-origins", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--allowed-origins" in err and "JSON list of strings" in err and repr(value) in err
