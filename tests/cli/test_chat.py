"""`kvfit chat`: piped turns against a local tiny model and against a fake streaming server;
history, /reset, /exit, and a failed turn that does not end the session."""

from __future__ import annotations

import io
import socket
import sys
from collections.abc import Callable

import pytest

from kvfit.cli import main
from kvfit.commands.chat import chat_loop, iter_sse_data


def _chat(argv: list[str], turns: str, monkeypatch: pytest.MonkeyPatch,
          capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(turns))
    status = main(["chat", *argv])
    return status, capsys.readouterr().out


def test_local_model_over_piped_stdin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    engine_flags: list[str],
) -> None:
    from kvfit.engine.llm import LLM

    calls: list[tuple[list[dict[str, str]], str]] = []
    real_chat = LLM.chat

    def recording_chat(self: LLM, messages: list, *args: object, **kwargs: object) -> list:
        outputs = real_chat(self, messages, *args, **kwargs)
        calls.append(([dict(m) for m in messages], outputs[0].outputs[0].text))
        return outputs

    monkeypatch.setattr(LLM, "chat", recording_chat)
    status, out = _chat(["--max-tokens", "4", "--temperature", "0", "--ignore-eos",
                         *engine_flags], "hello\n\n/help\nagain\n/exit\nnever read\n",
                        monkeypatch, capsys)
    assert status == 0
    # Two turns (the blank line and /help are no turns, nothing is read after /exit); the
    # second carries the first exchange; both replies are printed.
    assert [len(messages) for messages, _ in calls] == [1, 3]
    (first, reply1), (second, reply2) = calls
    assert first == [{"role": "user", "content": "hello"}]
    assert second[1:] == [{"role": "assistant", "content": reply1},
                          {"role": "user", "content": "again"}]
    assert reply1 and out.index(reply1) < out.index("/reset") < out.rindex(reply2)



def test_remote_url_without_v1_is_the_servers_root(
    fake_server: Callable, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `--url http://host:8000`, the root `bench serve --base-url` and `curl` users type, got
    # a 404 from /models: the API lives under /v1.
    server = fake_server()
    status, out = _chat(["--url", server.url + "/"], "one\n", monkeypatch, capsys)
    assert status == 0 and out.splitlines() == ["seen 1"]
    assert server.bodies[0]["model"] == "fake-model"

def test_remote_streams_keeps_history_and_resets(
    fake_server: Callable, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = fake_server()
    status, out = _chat(["--url", f"{server.url}/v1", "--system-prompt", "be brief",
                         "--max-tokens", "9", "--top-k", "5"],
                        "one\ntwo\n/reset\nthree\n", monkeypatch, capsys)
    assert status == 0
    # system+user, then system+user+assistant+user, then after /reset system+user again.
    assert out.splitlines() == ["seen 2", "seen 4", "(conversation reset)", "seen 2"]
    bodies = server.bodies
    assert [len(b["messages"]) for b in bodies] == [2, 4, 2]
    assert bodies[1]["messages"][2] == {"role": "assistant", "content": "seen 2"}
    # The model comes from /v1/models; sampling flags that differ from the defaults are sent.
    assert all(b["model"] == "fake-model" and b["stream"] is True for b in bodies)
    assert bodies[0]["max_tokens"] == 9 and bodies[0]["top_k"] == 5
    assert "top_p" not in bodies[0]


def test_remote_error_is_reported_and_the_session_goes_on(
    fake_server: Callable, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = fake_server(behaviors=("500", "ok"))
    status, out = _chat(["--url", f"{server.url}/v1", "--model", "named"], "a\nb\n",
                        monkeypatch, capsys)
    assert status == 1  # a turn failed, though the session went on and the next one did not
    assert "error: HTTP 500" in out and "boom" in out
    # The failed turn left the history: the second request holds only its own message.
    assert out.strip().endswith("seen 1")
    assert [len(b["messages"]) for b in server.bodies] == [1, 1]
    assert server.bodies[0]["model"] == "named"


def test_every_turn_failing_exits_1(
    fake_server: Callable, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = fake_server(behaviors=("500",))
    status, out = _chat(["--url", f"{server.url}/v1", "--model", "m"], "a\nb\n", monkeypatch,
                        capsys)
    assert status == 1 and out.count("error: HTTP 500") == 2
    assert "exits 1 if any turn failed" in " ".join(_chat_help(capsys).split())


def _chat_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        main(["chat", "--help"])
    return capsys.readouterr().out


def test_sse_parsing_skips_non_data_lines_and_raises_error_events() -> None:
    lines = [": comment", "event: x", "", 'data: {"a": 1}', "data:[DONE]", 'data: {"b": 2}']
    assert list(iter_sse_data(iter(lines))) == [{"a": 1}]
    with pytest.raises(RuntimeError, match="engine died"):
        list(iter_sse_data(iter(['data: {"error": {"message": "engine died"}}'])))


def test_chat_loop_ends_at_end_of_input() -> None:
    seen: list[list[dict[str, str]]] = []

    def reply(messages: list[dict[str, str]], out: io.StringIO) -> str:
        seen.append(list(messages))
        out.write("r")
        return "r"

    out = io.StringIO()
    assert chat_loop(reply, io.StringIO("x\ny"), out) == 0  # no trailing newline either
    assert out.getvalue() == "r\nr\n"
    assert seen[1] == [{"role": "user", "content": "x"}, {"role": "assistant", "content": "r"},
                       {"role": "user", "content": "y"}]


def test_remote_unreachable_names_the_url(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    with pytest.raises(SystemExit, match=r"cannot list the served models at .*/v1/models.*--url"):
        main(["chat", "--url", url])


def test_a_turn_that_cannot_reach_the_server_names_the_url(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    # With --model no /v1/models call comes first: the turn said only
    # "error: [Errno 111] Connection refused", naming no URL.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    status, out = _chat(["--url", url, "--model", "m"], "hi\n", monkeypatch, capsys)
    assert status == 1
    assert f"error: the request to {url}/chat/completions failed (ConnectError" in out
    assert "check --url" in out


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_remote_without_the_servers_key_names_api_key(
    fake_server: Callable, monkeypatch: pytest.MonkeyPatch, key: str | None,
) -> None:
    """A server that wants a key answers the model listing with 401: the way out is
    --api-key, not --url or --model (with --model the first turn is refused the same way)."""
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = fake_server(api_key="sk-right")
    argv = ["chat", "--url", server.url] + ([] if key is None else ["--api-key", key])
    with pytest.raises(SystemExit, match=r"HTTP 401.*--api-key") as raised:
        main(argv)
    assert "--model" not in str(raised.value)


@pytest.mark.parametrize("url", ["localhost:8000", "127.0.0.1:notaport/v1", "ftp://h/"])
def test_remote_url_that_is_no_http_url_names_the_flag(url: str) -> None:
    """`--url localhost:8000` (no scheme) parses as scheme "localhost": refused naming --url,
    as `kvfit bench serve` refuses such a --base-url, not as a server that cannot be listed."""
    with pytest.raises(ValueError, match="--url must be an http"):
        main(["chat", "--url", url])


def test_the_commands_that_show_text_default_to_the_trained_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """`generate`, `chat` and `serve` with no model load kvfit-sotu: the shapes' random weights
    print noise (a first `kvfit chat` answered in bytes of no language)."""
    from kvfit.cli import build_parser
    from kvfit.commands import chat
    from kvfit.models.builtins import DEFAULT_MODEL

    assert DEFAULT_MODEL == "kvfit-sotu"
    for command in ("generate", "serve"):
        assert build_parser().parse_args([command]).model == DEFAULT_MODEL
    loaded: list[str] = []

    def no_engine(args: object) -> None:
        loaded.append(args.model)
        raise SystemExit(0)

    monkeypatch.setattr(chat, "build_llm", no_engine)
    with pytest.raises(SystemExit):
        _chat([], "", monkeypatch, capsys)
    assert loaded == [DEFAULT_MODEL]


@pytest.mark.parametrize(("argv", "named"), [
    (["--url", "http://127.0.0.1:1/v1", "--max-model-len", "1k", "--dtype", "bf16"],
     "--dtype, --max-model-len: engine settings"),
    (["--url", "http://127.0.0.1:1/v1", "--no-enable-prefix-caching"], "--enable-prefix-caching"),
    (["--api-key", "sk-1"], "--api-key: settings of a server given by --url"),
    (["--request-timeout", "5"], "--request-timeout: settings of a server"),
])
def test_flags_the_chosen_backend_would_ignore_are_usage_errors(
    argv: list[str], named: str, capsys: pytest.CaptureFixture[str],
) -> None:
    """`chat --url` talks to a server started with its own engine settings, and a local chat
    sends no key or request: such flags were taken and silently did nothing."""
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", *argv])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err.splitlines()[-1]


def test_remote_chat_takes_model_and_sampling_flags(
    fake_server: Callable, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    server = fake_server()
    status, _ = _chat(["--url", server.url, "--model", "fake-model", "--temperature", "0",
                       "--api-key", "k", "--request-timeout", "9"], "hi\n", monkeypatch, capsys)
    assert status == 0
    assert server.bodies[0]["model"] == "fake-model" and server.bodies[0]["temperature"] == 0
    # No --max-tokens: none sent, the server's default (a cap of 256 sent by the client made
    # every turn a 400 on a server whose context had less room left).
    assert "max_tokens" not in server.bodies[0]


@pytest.mark.parametrize("command", [["chat", "--url", "http://127.0.0.1:1"],
                                     ["bench", "serve", "--model", "m"]])
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_request_timeout_must_be_a_positive_number_of_seconds(
    command: list[str], value: str, capsys: pytest.CaptureFixture[str],
) -> None:
    # 0 timed out every chat request at once, and meant "never" to bench serve's aiohttp.
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--request-timeout", value])
    assert exit_info.value.code == 2
    assert f"argument --request-timeout: must be a number of seconds > 0, got {value!r}" in (
        capsys.readouterr().err)
