"""vLLM's frontend flags of `vllm serve` that were argparse's 'unrecognized arguments' here:
`--root-path`, `--response-role`, `--disable-fastapi-docs`, `--enable-request-id-headers`,
`--disable-uvicorn-access-log` and `-asc`, each doing what vLLM's does."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.server import serve
from kvfit.server.api_servers import uvicorn_server

from .conftest import ServerThread

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}


def _args(*flags: str) -> argparse.Namespace:
    root = argparse.ArgumentParser(prog="kvfit")
    serve.add_serve_parser(root.add_subparsers(dest="command", required=True))
    return root.parse_args(["serve", "m", *flags])


def test_the_flags_reach_the_serve_config() -> None:
    config = serve._serve_config(_args(), EngineArgs(model="m"))
    assert (config.root_path, config.response_role, config.disable_fastapi_docs,
            config.enable_request_id_headers, config.disable_uvicorn_access_log) == (
        "", "assistant", False, False, False)
    args = _args("--root-path", "/llm/", "--response-role", "bot", "--disable-fastapi-docs",
                 "--enable-request-id-headers", "--disable-uvicorn-access-log", "-asc", "3")
    config = serve._serve_config(args, EngineArgs(model="m"))
    assert (config.root_path, config.response_role, config.disable_fastapi_docs,
            config.enable_request_id_headers, config.disable_uvicorn_access_log) == (
        "/llm", "bot", True, True, True)
    assert args.api_server_count == 3


def test_a_root_path_without_its_slash_is_a_usage_error(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("--root-path", "llm")
    assert "--root-path" in capsys.readouterr().err


def test_root_path_serves_under_the_prefix_and_the_docs_carry_it(
        start_server: Callable[..., ServerThread]) -> None:
    url = start_server(root_path="/llm").url
    # A proxy that strips the prefix, and one that passes it on: both answered.
    for path in ("/v1/models", "/llm/v1/models"):
        assert httpx.get(url + path).status_code == 200, path
    spec = httpx.get(f"{url}/openapi.json").json()
    assert spec["servers"] == [{"url": "/llm"}]


def test_disable_fastapi_docs(start_server: Callable[..., ServerThread]) -> None:
    url = start_server().url
    assert httpx.get(f"{url}/docs").status_code == 200
    url = start_server(disable_fastapi_docs=True).url
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(url + path).status_code == 404, path
    assert httpx.get(f"{url}/health").status_code == 200


def test_response_role_names_the_chat_answers_role(
        start_server: Callable[..., ServerThread]) -> None:
    url = start_server(response_role="bot").url
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "bot"
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True},
                      timeout=60) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data:"))[6:])
    assert first["choices"][0]["delta"]["role"] == "bot"
    # A continued final message keeps its own role, as vLLM answers it.
    body = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "Well"}],
            "continue_final_message": True, "add_generation_prompt": False}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_request_id_headers_name_the_answer(start_server: Callable[..., ServerThread]) -> None:
    plain = start_server().url
    r = httpx.post(f"{plain}/v1/chat/completions", json=CHAT, timeout=60)
    assert "x-request-id" not in r.headers  # off by default, as in vLLM
    url = start_server(enable_request_id_headers=True).url
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.json()["id"] == f"chatcmpl-{r.headers['x-request-id']}"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                   headers={"X-Request-Id": "trace-9"}, timeout=60)
    assert (r.headers["x-request-id"], r.json()["id"]) == ("trace-9", "cmpl-trace-9")
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": "x", "max_tokens": 2, "stream": True}) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data:"))[6:])
        assert first["id"] == f"cmpl-{r.headers['x-request-id']}"
    # Errors and other routes carry one too.
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": -5},
                   headers={"X-Request-Id": "bad-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "bad-1"
    assert httpx.get(f"{url}/health").headers["x-request-id"]


@pytest.mark.parametrize("off", [False, True])
def test_disable_uvicorn_access_log(start_server: Callable[..., ServerThread],
                                    off: bool) -> None:
    app = start_server(disable_uvicorn_access_log=off).server.config.app
    assert uvicorn_server(app, "info").config.access_log is not off


def test_return_tokens_as_token_ids_is_the_requests_default(
        start_server: Callable[..., ServerThread]) -> None:
    # vLLM's --return-tokens-as-token-ids was unrecognized.
    assert serve._serve_config(_args("--return-tokens-as-token-ids"),
                               EngineArgs(model="m")).return_tokens_as_token_ids
    url = start_server(return_tokens_as_token_ids=True).url
    body = {"prompt": "x", "max_tokens": 2, "logprobs": 1}
    tokens = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()[
        "choices"][0]["logprobs"]["tokens"]
    assert all(t.startswith("token_id:") for t in tokens)
    r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                   json={**CHAT, "logprobs": True})
    assert r.json()["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")
    # A request's own false wins.
    tokens = httpx.post(f"{url}/v1/completions", timeout=60, json={
        **body, "return_tokens_as_token_ids": False}).json()["choices"][0]["logprobs"]["tokens"]
    assert not any(t.startswith("token_id:") for t in tokens)


def test_enable_force_include_usage(start_server: Callable[..., ServerThread]) -> None:
    # vLLM's --enable-force-include-usage was unrecognized.
    assert serve._serve_config(_args("--enable-force-include-usage"),
                               EngineArgs(model="m")).enable_force_include_usage
    url = start_server(enable_force_include_usage=True).url
    for options in (None, {"include_usage": False}):
        body = {"prompt": "x", "max_tokens": 2, "stream": True, "stream_options": options}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2


def test_default_chat_template_kwargs(start_server: Callable[..., ServerThread],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's --default-chat-template-kwargs was unrecognized.
    args = _args("--default-chat-template-kwargs", '{"enable_thinking": false}')
    assert serve._serve_config(args, EngineArgs(model="m")).default_chat_template_kwargs == {
        "enable_thinking": False}
    for bad in ("[1]", "nope"):
        with pytest.raises(SystemExit):
            _args("--default-chat-template-kwargs", bad)
        assert "--default-chat-template-kwargs" in capsys.readouterr().err
    template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    url = start_server(chat_template=template,
                       default_chat_template_kwargs={"greeting": "Hello "}).url

    def prompt(**extra: object) -> str:
        r = httpx.post(f"{url}/tokenize", json={"messages": CHAT["messages"], **extra})
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        return httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json()["prompt"]

    assert prompt() == "Hello Hi"
    assert prompt(chat_template_kwargs={"greeting": "Bye "}) == "Bye Hi"  # the request's wins


def test_default_chat_template_kwargs_may_not_set_call_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    from kvfit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--default-chat-template-kwargs", '{"tokenize": true}'])
    assert exit_info.value.code == 2
    assert "may not set tokenize" in capsys.readouterr().err


def test_disable_access_log_for_endpoints(start_server: Callable[..., ServerThread]) -> None:
    # vLLM's --disable-access-log-for-endpoints was unrecognized.
    import logging

    from kvfit.server.api_servers import QuietPaths

    args = _args("--disable-access-log-for-endpoints", "/health, /metrics")
    config = serve._serve_config(args, EngineArgs(model="m"))
    assert config.disable_access_log_for_endpoints == ["/health", "/metrics"]
    app = start_server(disable_access_log_for_endpoints=["/health"]).server.config.app
    uvicorn_server(app, "info")
    uvicorn_server(app, "info")  # one filter, not one a server
    access = logging.getLogger("uvicorn.access")
    (quiet,) = [f for f in access.filters if isinstance(f, QuietPaths)]

    def logged(path: str) -> bool:
        return quiet.filter(logging.LogRecord(
            "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
            ("127.0.0.1:1", "GET", path, "1.1", 200), None))

    assert not logged("/health") and not logged("/health?x=1")
    assert logged("/v1/models") and logged("/metrics")
    uvicorn_server(start_server().server.config.app, "info")
    assert not [f for f in access.filters if isinstance(f, QuietPaths)]


def test_api_key_takes_several_keys(start_server: Callable[..., ServerThread],
                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's --api-key takes several keys (any of them unlocks); a second one was an
    # unrecognized argument here.
    monkeypatch.delenv("KVFIT_API_KEY", raising=False)
    assert serve.server_api_key(_args("--api-key", "a", "b")) == ["a", "b"]
    url = start_server(api_key=["a", "b"]).url
    for key, status in (("a", 200), ("b", 200), ("c", 401), ("a b", 401)):
        r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == status, key
    # A model folder after the keys is no key, as with --served-model-name.
    from kvfit.cli import main

    monkeypatch.setattr(serve, "run_serve", lambda args: 0)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--api-key", "k", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--api-key took the folder" in capsys.readouterr().err


def test_default_chat_template_kwargs_may_not_set_the_conversation(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A request's chat_template_kwargs may not set `messages` (the conversation as the
    # template reads it); the server's defaults were checked against another list.
    from kvfit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "m", "--default-chat-template-kwargs", '{"messages": []}'])
    assert exit_info.value.code == 2
    assert "may not set messages" in capsys.readouterr().err
