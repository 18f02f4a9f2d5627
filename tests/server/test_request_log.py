"""`kvfit serve --enable-log-requests` (vLLM's): a line on the `kvfit` logger as each
generation request is queued and as it ends, the prompt cut at `--max-log-len`; off by
default. It was refused as "kvfit has no request log". `--enable-log-outputs` (vLLM's, refused
before as "leaves the outputs' text out") adds each completion's text and token ids at the
end."""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections.abc import Callable

import httpx
import pytest

from kvfit.engine.config import EngineArgs
from kvfit.engine.sampling_params import SamplingParams
from kvfit.server import serve
from kvfit.server.request_log import params_summary

from .conftest import MODEL_NAME, ServeProcess, ServerThread

LOGGER = "kvfit.server.request_log"


def _args(*flags: str) -> argparse.Namespace:
    root = argparse.ArgumentParser(prog="kvfit")
    serve.add_serve_parser(root.add_subparsers(dest="command", required=True))
    return root.parse_args(["serve", *flags])


@pytest.mark.parametrize(("flags", "enabled"), [
    ([], False), (["--enable-log-requests"], True), (["--no-enable-log-requests"], False),
    # vLLM's older spellings.
    (["--no-disable-log-requests"], True), (["--disable-log-requests"], False),
    (["--enable-log-requests", "--disable-log-requests"], False),
])
def test_the_flags_reach_the_serve_config(flags: list[str], enabled: bool) -> None:
    config = serve._serve_config(_args("m", *flags), EngineArgs(model="m"))
    assert (config.enable_log_requests, config.max_log_len) == (enabled, None)


def test_log_outputs_reaches_the_serve_config_and_needs_the_request_log(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("m", "--enable-log-requests", "--enable-log-outputs")
    args.check_args(args)
    assert serve._serve_config(args, EngineArgs(model="m")).enable_log_outputs
    assert not serve._serve_config(_args("m"), EngineArgs(model="m")).enable_log_outputs
    # As vLLM, which stops with '--enable-log-outputs requires --enable-log-requests'.
    args = _args("m", "--enable-log-outputs")
    with pytest.raises(SystemExit):
        args.check_args(args)
    assert "--enable-log-outputs needs --enable-log-requests" in capsys.readouterr().err


def test_max_log_len_takes_a_count_and_leaves_the_model_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = _args("--max-log-len", "40", "m")
    assert (args.model_tag, serve._serve_config(args, EngineArgs(model="m")).max_log_len) == (
        "m", 40)
    with pytest.raises(SystemExit):
        _args("m", "--max-log-len", "-1")
    assert "--max-log-len" in capsys.readouterr().err


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_each_request_is_logged_when_queued_and_when_it_ends(
        start_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    url = start_server(enable_log_requests=True, max_log_len=6).url
    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={"X-Request-Id": "abc"},
                   json={"model": MODEL_NAME, "prompt": "Hello there, world", "max_tokens": 3,
                         "temperature": 0, "ignore_eos": True, "n": 2})
    assert r.status_code == 200, r.text
    received, finished = _lines(caplog)
    engine_id = re.match(r"Received request (\S+) \(cmpl-abc\): ", received).group(1)
    num_prompt = r.json()["usage"]["prompt_tokens"]
    assert f"prompt_tokens={num_prompt}," in received
    assert "n=2" in received and "max_tokens=3" in received and "temperature=0" in received
    # The prompt cut at --max-log-len characters, saying how much more there was.
    assert received.endswith("prompt: 'Hello ' (+12 chars)")
    assert finished == (f"Finished request {engine_id}: finish_reasons=['length', 'length'], "
                        f"output_tokens=[3, 3]")


def test_a_streamed_chat_and_a_prompt_of_ids_are_logged(
        start_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    url = start_server(enable_log_requests=True).url
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        r.read()
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 1})
    assert r.status_code == 200, r.text
    chat_in, chat_out, ids_in, ids_out = _lines(caplog)
    assert "(chatcmpl-" in chat_in and "prompt: '" in chat_in  # the rendered template
    assert chat_out.endswith("finish_reason=length, output_tokens=2")
    assert "prompt_tokens=3," in ids_in and ids_in.endswith("prompt_token_ids: [5, 6, 7]")
    assert ids_out.endswith("output_tokens=1")


def _shown(text: str, cut: int | None) -> str:
    more = "" if cut is None or len(text) <= cut else f" (+{len(text) - cut} chars)"
    return f"{text[:cut]!r}{more}"


def test_outputs_are_logged_as_each_completion_ends_cut_at_max_log_len(
        start_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    url = start_server(enable_log_requests=True, enable_log_outputs=True, max_log_len=2).url
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 3,
                         "temperature": 1.0, "seed": 1, "ignore_eos": True, "n": 2,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    received, finished, *generated = _lines(caplog)
    engine_id = re.match(r"Received request (\S+) ", received).group(1)
    assert finished.startswith(f"Finished request {engine_id}: ")
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    # One line a completion, its text and token ids cut at --max-log-len (3 ids, 2 shown).
    assert generated == [
        f"Generated response {engine_id} (index {c['index']}): output: "
        f"{_shown(c['text'], 2)}, output_token_ids: {c['token_ids'][:2]} (+1 ids)"
        for c in choices]


def test_a_streamed_chat_logs_its_whole_output_once_at_the_end(
        start_server: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture) -> None:
    """Each of n=2 streamed completions (sent as deltas) logged whole at the end."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    url = start_server(enable_log_requests=True, enable_log_outputs=True).url
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "n": 2,
            "max_tokens": 4, "temperature": 1.0, "seed": 3, "ignore_eos": True, "stream": True}
    content = ["", ""]
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content[choice["index"]] += choice["delta"].get("content") or ""
    _, finished, *generated = _lines(caplog)
    engine_id = finished.split()[2].rstrip(":")
    assert len(generated) == 2
    for i, line in enumerate(generated):
        prefix = (f"Generated response {engine_id} (index {i}): output: {content[i]!r}, "
                  f"output_token_ids: [")
        assert line.startswith(prefix) and len(line[len(prefix):-1].split(",")) == 4


def test_max_log_len_0_logs_no_outputs(start_server: Callable[..., ServerThread],
                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    url = start_server(enable_log_requests=True, enable_log_outputs=True, max_log_len=0).url
    r = httpx.post(f"{url}/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    received, finished = _lines(caplog)
    assert "prompt:" not in received and finished.startswith("Finished request ")


def test_nothing_is_logged_by_default(start_server: Callable[..., ServerThread],
                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    server = start_server()
    assert server.server.config.app.state.serving.request_log is None
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert _lines(caplog) == []


def test_params_summary_names_what_a_request_sets() -> None:
    summary = params_summary(SamplingParams(max_tokens=8, temperature=0.5, top_k=4,
                                            stop=["\n"], logit_bias=dict.fromkeys(range(20), 1.0)))
    assert summary == ("temperature=0.5, top_k=4, logit_bias=<20 items>, max_tokens=8, "
                       "stop=['\\n']")


def test_kvfit_serve_prints_the_request_log() -> None:
    """In `kvfit serve` (which leaves the `kvfit` logger at WARNING) the lines reach its
    output."""
    server = ServeProcess("--enable-log-requests", "--max-log-len", "0")
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"model": "kvfit-tiny", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
        server.wait_for_output("Finished request")
    finally:
        out = server.stop()
    received = next(line for line in out.splitlines() if "Received request" in line)
    assert received.startswith("INFO ") and "prompt:" not in received  # --max-log-len 0
