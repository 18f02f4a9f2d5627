"""`kvfit serve`'s parser and entry point, and the package's lazy imports."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvfit.server import serve

from .conftest import ServeProcess

SRC = Path(__file__).resolve().parents[2] / "src"


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="kvfit")
    serve.add_serve_parser(root.add_subparsers(dest="command", required=True))
    return root


def test_serve_takes_the_engine_and_server_flags() -> None:
    args = parser().parse_args([
        "serve", "/models/x", "--max-num-seqs", "4", "--gpu-memory-utilization", "0.5",
        "--host", "0.0.0.0", "--port", "9000", "--served-model-name", "a", "b",
        "--api-key", "k", "--max-concurrent-requests", "7"])
    assert args.func is serve.run_serve
    assert (args.model_tag, args.max_num_seqs, args.gpu_memory_utilization) == ("/models/x", 4, 0.5)
    assert (args.host, args.port, args.served_model_name) == ("0.0.0.0", 9000, ["a", "b"])
    assert (args.api_key, args.max_concurrent_requests) == (["k"], 7)
    sub = argparse.ArgumentParser().add_subparsers()
    assert {"engine", "server"} <= {g.title for g in serve.add_serve_parser(sub)._action_groups}


def test_enable_prompt_tokens_details_reaches_the_serve_config() -> None:
    """vLLM's --enable-prompt-tokens-details, off by default as there."""
    from kvfit.engine.config import EngineArgs

    for flags, on in (([], False), (["--enable-prompt-tokens-details"], True)):
        args = parser().parse_args(["serve", "m", *flags])
        config = serve._serve_config(args, EngineArgs(model="m"))
        assert config.enable_prompt_tokens_details is on


def test_stream_interval_is_a_count_of_at_least_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["serve", "m"]).stream_interval == 1
    assert parser().parse_args(["serve", "m", "--stream-interval", "8"]).stream_interval == 8
    for bad in ("0", "-1", "2.5", "many"):
        with pytest.raises(SystemExit) as exit_:
            parser().parse_args(["serve", "m", "--stream-interval", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --stream-interval" in err and ">= 1" in err and repr(bad) in err


def test_api_server_count_is_at_least_one_and_needs_the_engine_process(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["serve", "m"]).api_server_count == 1
    assert parser().parse_args(["serve", "m", "--api-server-count", "4"]).api_server_count == 4
    for bad in ("0", "-2", "two"):
        with pytest.raises(SystemExit) as exit_:
            parser().parse_args(["serve", "m", "--api-server-count", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --api-server-count" in err and ">= 1" in err and repr(bad) in err
    args = parser().parse_args(["serve", "m", "--api-server-count", "2", "--no-engine-process"])
    with pytest.raises(SystemExit) as exit_:
        serve.run_serve(args)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--api-server-count" in err and "--no-engine-process" in err and "usage:" in err
    help_text = parser().parse_args(["serve", "m"]).serve_parser.format_help()
    assert "--api-server-count N" in help_text


def test_the_help_says_the_sleep_routes_need_the_development_flag_too() -> None:
    # It read "with --enable-sleep-mode /sleep, /wake_up, /is_sleeping", routes that sleep
    # mode alone never serves (`sleep_endpoints` wants KVFIT_SERVER_DEV_MODE=1 as well).
    text = " ".join(parser().parse_args(["serve", "m"]).serve_parser.format_help().split())
    dev_mode = text.index(f"with {serve.DEV_MODE_ENV}=1 also")
    assert text.index("/sleep, /wake_up, /is_sleeping where --enable-sleep-mode is given "
                      "too") > dev_mode


def test_port_is_a_port_number(capsys: pytest.CaptureFixture[str]) -> None:
    assert parser().parse_args(["serve", "m", "--port", "0"]).port == 0
    for bad in ("70000", "-1", "http"):
        with pytest.raises(SystemExit) as exit_:
            parser().parse_args(["serve", "m", "--port", bad])
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "argument --port" in err and "65535" in err and repr(bad) in err


@pytest.mark.parametrize("host", ["127.0.0.1", "999.1.1.1"])
def test_a_port_it_cannot_listen_on_fails_before_the_engine_loads(host: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "kvfit", "serve", "kvfit-tiny", "--device",
                              "cpu", "--host", host, "--port", str(port)],
                             capture_output=True, text=True, cwd=SRC, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"cannot listen on {host}:{port}" in out.stderr
    assert "loading kvfit-tiny" not in out.stdout  # no model loaded for nothing


@pytest.mark.parametrize("count", [1, 2])
def test_the_port_refuses_clients_until_the_engine_is_up(count: int) -> None:
    """The port is bound before the engine loads (minutes for a large model) and listens only
    once it is up: a client or health probe meanwhile is refused at once, as by a server that
    is not up, not accepted into the backlog and left without an answer for the whole load."""
    from kvfit.server.api_servers import bind_sockets

    sockets = bind_sockets("127.0.0.1", 0, count, reuse_port=count > 1)
    try:
        port = sockets[0].getsockname()[1]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=30).close()
        from kvfit.server.api_servers import listen

        listen(sockets)
        socket.create_connection(("127.0.0.1", port), timeout=30).close()
    finally:
        for sock in sockets:
            sock.close()


def test_a_port_taken_while_the_engine_loaded_is_named(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Two bound sockets that do not listen may share a port: a server started on it while
    this one loaded is caught when this one starts to listen, with the flags to change."""
    from kvfit.server.api_servers import bind_sockets

    (sock,) = bind_sockets("127.0.0.1", 0, 1, reuse_port=False)
    port = sock.getsockname()[1]
    with sock, socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("127.0.0.1", port))
        other.listen()
        args = argparse.Namespace(host="127.0.0.1", port=port)
        assert not serve._listen(args, [sock])
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_serve_without_the_extra_names_the_install_command(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(serve, "missing_server_modules", lambda: ["fastapi", "uvicorn"])
    args = parser().parse_args(["serve", "kvfit-tiny"])
    assert serve.run_serve(args) == 1
    err = capsys.readouterr().err
    assert "pip install 'kvfit[server]'" in err and "fastapi" in err


def test_imports_stay_lazy() -> None:
    code = ("import sys, kvfit.server.serve, kvfit.cli, kvfit.engine.llm; "
            "bad = [m for m in ('fastapi', 'uvicorn', 'prometheus_client', 'kvfit.server."
            "openai_api') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=SRC)


def test_the_engine_never_imports_the_server() -> None:
    # Only the CLI, the top layer, may: it registers `serve`.
    top = {SRC / "kvfit" / "cli.py", SRC / "kvfit" / "__main__.py"}
    for path in set((SRC / "kvfit").rglob("*.py")) - top:
        if "server" not in path.relative_to(SRC / "kvfit").parts:
            assert "kvfit.server" not in path.read_text(), path


def test_python_dash_m_kvfit_is_the_cli() -> None:
    out = subprocess.run([sys.executable, "-m", "kvfit", "--help"], capture_output=True,
                         text=True, check=True, cwd=SRC)
    assert "usage: kvfit" in out.stdout


def test_run_serve_prints_the_sizing_report_and_serves() -> None:
    import httpx

    server = ServeProcess()
    try:
        (engine,) = server.engine_processes()  # the engine runs in a process of its own
        models = httpx.get(f"{server.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["kvfit-tiny"]
    finally:
        output = server.stop()
    assert server.proc.returncode == 0, output
    assert "loading kvfit-tiny" in output
    assert "KV cache blocks" in output and "64" in output  # the sizing report
    assert f"http://127.0.0.1:{server.port}/v1 (engine in its own process" in output
    engine.wait(timeout=10)  # gone with its server


def test_vllm_api_key_alone_does_not_leave_the_server_open(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A vLLM user's VLLM_API_KEY is not read here: serving with no key at all, as kvfit did,
    # opened a server its owner believed locked. It stops before the engine loads.
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    monkeypatch.delenv("KVFIT_API_KEY", raising=False)
    monkeypatch.setattr(serve, "missing_server_modules", lambda: [])

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine loaded")

    monkeypatch.setattr("kvfit.server.async_llm.AsyncLLM", no_engine)
    with pytest.raises(ValueError, match="VLLM_API_KEY.*--api-key.*KVFIT_API_KEY"):
        serve.run_serve(parser().parse_args(["serve", "m", "--port", "0"]))
    # With a key of kvfit's, the server is locked and VLLM_API_KEY changes nothing.
    args = parser().parse_args(["serve", "m", "--api-key", "k"])
    assert serve.server_api_key(args) == ["k"]
    monkeypatch.delenv("VLLM_API_KEY")
    assert serve.server_api_key(parser().parse_args(["serve", "m"])) is None


@pytest.mark.parametrize(("argv", "env"), [(["--api-key", ""], None), (["--api-key", " "], None),
                                           ([], "")])
def test_an_empty_api_key_does_not_leave_the_server_open(
    argv: list[str], env: str | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `--api-key "$KEY"` with KEY unset (or KVFIT_API_KEY= ) served without a key, unsaid.
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    if env is None:
        monkeypatch.delenv("KVFIT_API_KEY", raising=False)
    else:
        monkeypatch.setenv("KVFIT_API_KEY", env)
    monkeypatch.setattr(serve, "missing_server_modules", lambda: [])

    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("the engine loaded")

    monkeypatch.setattr("kvfit.server.async_llm.AsyncLLM", no_engine)
    with pytest.raises(ValueError, match=r"--api-key \(else \$KVFIT_API_KEY\) is empty"):
        serve.run_serve(parser().parse_args(["serve", "m", "--port", "0", *argv]))
