"""`kvfit bench`: throughput and latency on the tiny model; serve against a fake server whose
chunk timing and failures are scripted, so TTFT, ITL and E2E can be checked against it."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import kvfit
from kvfit.cli import build_parser, main
from kvfit.commands.bench_serve import (
    RequestResult,
    failure_lines,
    make_workload,
    per_token_itl,
    summarize,
)


def test_bench_throughput(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                          engine_flags: list[str]) -> None:
    path = tmp_path / "t.json"
    argv = ["bench", "throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
            "--result-file", str(path), *engine_flags]
    assert main(argv) == 0
    record = json.loads(path.read_text())
    result = record["results"]
    assert result["num_prompts"] == 4 and result["output_tokens"] == 4 * 5  # EOS ignored
    assert result["output_tokens_per_s"] == pytest.approx(20 / result["elapsed_s"])
    assert result["requests_per_s"] == pytest.approx(4 / result["elapsed_s"])
    assert record["bench"] == "bench-throughput" and record["config"]["num_prompts"] == 4
    assert record["figures"]["output_tokens_per_s"] == {
        "value": result["output_tokens_per_s"], "unit": "tokens/s", "direction": "higher"}
    assert "Output tokens/s:" in capsys.readouterr().out


def test_bench_latency(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                       engine_flags: list[str]) -> None:
    path = tmp_path / "l.json"
    argv = ["bench", "latency", "--batch-size", "2", "--input-len", "4", "--output-len", "3",
            "--num-iters-warmup", "0", "--num-iters", "3", "--percentiles", "50,99",
            "--result-file", str(path), *engine_flags]
    assert main(argv) == 0
    record = json.loads(path.read_text())
    result = record["results"]
    latencies = result["latencies_s"]
    assert len(latencies) == 3 and all(t > 0 for t in latencies)
    assert result["latency_mean_s"] == pytest.approx(sum(latencies) / 3)
    assert result["latency_p50_s"] == pytest.approx(sorted(latencies)[1])
    assert "P99 latency (s):" in capsys.readouterr().out


def test_bench_offline_bad_flag_names_it(engine_flags: list[str]) -> None:
    with pytest.raises(ValueError, match="--num-prompts must be >= 1"):
        main(["bench", "throughput", "--num-prompts", "0", *engine_flags])


@pytest.mark.parametrize("mode", ["throughput", "latency"])
def test_bench_offline_past_max_model_len_names_the_flags(mode: str,
                                                          engine_flags: list[str]) -> None:
    # Outputs cut at the context's end would time another workload than the one asked for.
    with pytest.raises(ValueError, match=r"--input-len 60 \+ --output-len 8 is more than "
                       r"max_model_len \(64\)"):
        main(["bench", mode, "--input-len", "60", "--output-len", "8", *engine_flags,
              "--max-model-len", "64"])


@pytest.mark.parametrize("mode", ["throughput", "latency"])
def test_bench_offline_on_cuda_where_there_is_none_names_the_device(
        mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The record's limits are measured first: that step, too, is a setting error (one line
    # from `kvfit`), not a traceback from the process that measures them.
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device='cuda' but CUDA is not available"):
        main(["bench", mode, "--model", "kvfit-tiny", "--device", "cuda",
              "--result-file", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()


def test_summarize_derives_metrics_from_request_times() -> None:
    ok = [RequestResult(ok=True, prompt_tokens=3, output_tokens=3, ttft=0.1, itl=[0.02, 0.04],
                        e2e=0.2),
          RequestResult(ok=True, prompt_tokens=3, output_tokens=1, ttft=0.3, itl=[], e2e=0.3)]
    failed = [RequestResult(error="HTTP 500: x"), RequestResult(error="HTTP 500: x"),
              RequestResult(error="drop")]
    m = summarize([*ok, *failed], duration=2.0, ps=[50.0, 99.0])
    assert (m["completed"], m["failed"]) == (2, 3)
    assert m["errors"] == {"HTTP 500: x": 2, "drop": 1}
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 2.0
    assert m["total_token_throughput"] == 5.0
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["p50_ttft_ms"] == pytest.approx(200)
    assert m["mean_itl_ms"] == pytest.approx(30) and m["p99_itl_ms"] == pytest.approx(39.8)
    assert m["mean_e2el_ms"] == pytest.approx(250)
    # TPOT only over requests with more than one token: (0.2 - 0.1) / 2.
    assert m["mean_tpot_ms"] == pytest.approx(50)


def test_summarize_with_no_success_reports_zeros() -> None:
    m = summarize([RequestResult(error="refused")], duration=0.5, ps=[50.0])
    assert m["completed"] == 0 and m["mean_ttft_ms"] == 0.0 and m["p50_itl_ms"] == 0.0


TTFT, ITL, OUTPUT_LEN = 0.2, 0.05, 4


def test_bench_serve_times_chunks_and_counts_failures(
    fake_server: Callable, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    server = fake_server(behaviors=("ok", "500", "ok", "drop", "error"), ttft=TTFT, itl=ITL)
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "10",
            "--max-concurrency", "5", "--input-len", "6", "--output-len", str(OUTPUT_LEN),
            "--result-file", str(path), "--save-detailed"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    record = json.loads(path.read_text())
    result = record["results"]
    assert (result["completed"], result["failed"]) == (4, 6)
    errors = result["errors"]
    assert sum(errors.values()) == 6
    assert sum(n for e, n in errors.items() if e.startswith("HTTP 500")) == 2
    # A connection dropped mid-stream: aiohttp's payload error.
    assert sum(n for e, n in errors.items() if "ClientPayloadError" in e) == 2
    assert errors["error event: engine died"] == 2
    assert result["model"] == "fake-model" and result["request_rate"] is None
    body = server.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["max_tokens"] == OUTPUT_LEN and len(body["prompt"]) == 6
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    ok = [r for r in result["requests"] if r["ok"]]
    for r in ok:
        # TTFT is the first content chunk (the empty one before it is sent at once), ITL the
        # gaps after it, E2E runs to [DONE]; output tokens from the streamed usage.
        assert TTFT <= r["ttft"] < TTFT + 0.5
        assert len(r["itl"]) == OUTPUT_LEN - 1
        assert sum(r["itl"]) >= (OUTPUT_LEN - 1) * ITL * 0.9
        assert r["e2e"] >= r["ttft"] + sum(r["itl"])
        assert r["output_tokens"] == OUTPUT_LEN and r["prompt_tokens"] == 7
    assert ITL * 0.5 <= result["p50_itl_ms"] / 1000 < ITL + 0.2
    assert result["output_throughput"] == pytest.approx(4 * OUTPUT_LEN / result["duration_s"])
    assert "Successful requests:" in out and "failed x2: HTTP 500" in out


def test_bench_serve_counts_tokens_whose_text_is_held_back(
    fake_server: Callable, tmp_path: Path,
) -> None:
    # Random token ids often sample byte tokens: a streamed chunk then carries tokens (its
    # usage grew) but no text yet. The request succeeded; its chunks are timed.
    server = fake_server(behaviors=("held",), ttft=TTFT, itl=ITL)
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2",
            "--input-len", "3", "--output-len", str(OUTPUT_LEN), "--result-file", str(path),
            "--save-detailed"]
    assert main(argv) == 0
    result = json.loads(path.read_text())["results"]
    assert (result["completed"], result["failed"]) == (2, 0), result["errors"]
    for r in result["requests"]:
        assert r["output_tokens"] == OUTPUT_LEN and len(r["itl"]) == OUTPUT_LEN - 1
        assert TTFT <= r["ttft"] < TTFT + 0.5


def test_bench_serve_request_rate_spreads_arrivals(fake_server: Callable,
                                                   tmp_path: Path) -> None:
    server = fake_server()
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", server.url, "--model", "m", "--num-prompts", "4",
            "--request-rate", "20", "--output-len", "2", "--input-len", "3",
            "--prompt-kind", "words", "--no-continuous-usage", "--result-file", str(path)]
    assert main(argv) == 0
    record = json.loads(path.read_text())
    result = record["results"]
    assert result["completed"] == 4 and result["request_rate"] == 20
    assert "requests" not in result  # per-request rows only with --save-detailed
    assert all(b["stream_options"] == {"include_usage": True} for b in server.bodies)
    assert all(isinstance(b["prompt"], str) and len(b["prompt"].split()) == 3
               for b in server.bodies)
    assert all(b["model"] == "m" for b in server.bodies)


def test_bench_serve_record_keeps_no_api_key(fake_server: Callable, tmp_path: Path) -> None:
    # Records are published (docs/results): the key the load authenticated with is not config.
    server = fake_server()
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", server.url, "--model", "m", "--num-prompts", "2",
            "--output-len", "2", "--input-len", "3", "--api-key", "sk-secret-123",
            "--result-file", str(path)]
    assert main(argv) == 0
    assert "sk-secret-123" not in path.read_text()
    assert json.loads(path.read_text())["config"]["api_key"] == "<set>"


def test_bench_serve_takes_vllms_ignore_eos_and_openai_backends(
        fake_server: Callable, capsys: pytest.CaptureFixture[str]) -> None:
    # vLLM's `bench serve --backend vllm --ignore-eos` was "unrecognized arguments".
    server = fake_server()
    for flags in (["--backend", "vllm", "--ignore-eos"], ["--backend", "openai"]):
        argv = ["bench", "serve", "--base-url", server.url, "--model", "m", "--num-prompts",
                "1", "--output-len", "2", "--input-len", "3", *flags]
        assert main(argv) == 0
        note = "note: --ignore-eos has no effect: ignore_eos is always sent"
        assert (note in capsys.readouterr().err) == ("--ignore-eos" in flags)
    assert all(b["ignore_eos"] is True for b in server.bodies)


def test_bench_serve_unreachable_server_fails_every_request_without_crashing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--model", "m",
            "--num-prompts", "3", "--result-file", str(path)]
    assert main(argv) == 1
    record = json.loads(path.read_text())
    result = record["results"]
    assert result["failed"] == 3 and result["completed"] == 0
    assert all("Cannot connect to host" in e for e in result["errors"])
    assert math.isclose(result["request_throughput"], 0.0)
    assert "Failed requests:" in capsys.readouterr().out


def test_bench_serve_random_range_ratio_spreads_lengths(fake_server: Callable,
                                                       tmp_path: Path) -> None:
    """Lengths spread over [len (1 - R), len (1 + R)], both sides; each request asks for its
    own max_tokens and its tokens are counted; the first k requests are those of a longer run
    (bench/serving.py's finite rates send a prefix of the workload)."""
    server = fake_server()
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", server.url, "--model", "m", "--num-prompts", "40",
            "--input-len", "20", "--output-len", "10", "--random-range-ratio", "0.5",
            "--max-concurrency", "4",  # the fake server's listen backlog is small
            "--num-client-processes", "1", "--result-file", str(path), "--save-detailed"]
    assert main(argv) == 0
    result = json.loads(path.read_text())["results"]
    assert result["completed"] == 40 and result["random_range_ratio"] == 0.5
    prompt_lens = [len(b["prompt"]) for b in server.bodies]
    max_tokens = [b["max_tokens"] for b in server.bodies]
    assert min(prompt_lens) >= 10 and max(prompt_lens) <= 30 and len(set(prompt_lens)) > 5
    assert min(max_tokens) >= 5 and max(max_tokens) <= 15 and len(set(max_tokens)) > 3
    assert result["total_output_tokens"] == sum(max_tokens)
    assert sorted(r["output_tokens"] for r in result["requests"]) == sorted(max_tokens)

    def workload(n: int, ratio: float) -> list:
        return make_workload(argparse.Namespace(
            num_prompts=n, input_len=128, output_len=128, random_range_ratio=ratio,
            prompt_kind="token-ids", random_vocab_size=512, seed=0, request_rate=math.inf))

    assert workload(40, 0.5)[:7] == workload(7, 0.5)
    fixed = workload(5, 0.0)
    assert {len(p) for p, _, _ in fixed} == {128} and {n for _, _, n in fixed} == {128}


def test_bench_serve_bad_flags_name_them() -> None:
    with pytest.raises(ValueError, match="--random-range-ratio must be in"):
        main(["bench", "serve", "--base-url", "http://x", "--random-range-ratio", "1"])
    with pytest.raises(ValueError, match="--request-rate must be > 0"):
        main(["bench", "serve", "--base-url", "http://x", "--request-rate", "0"])
    with pytest.raises(ValueError, match="--max-concurrency must be >= 1"):
        main(["bench", "serve", "--base-url", "http://x", "--max-concurrency", "0"])
    with pytest.raises(ValueError, match="--num-client-processes must be >= 1"):
        main(["bench", "serve", "--base-url", "http://x", "--num-client-processes", "0"])


def test_bench_serve_merges_client_processes(fake_server: Callable, tmp_path: Path) -> None:
    """Three client processes share the load: every request is in the merged results, in
    order, with the failures counted by reason as one process would."""
    server = fake_server(behaviors=("ok", "500", "ok", "drop", "error"))
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", server.url, "--model", "m", "--num-prompts", "10",
            "--max-concurrency", "4", "--input-len", "5", "--output-len", "3",
            "--num-client-processes", "3", "--result-file", str(path), "--save-detailed"]
    assert main(argv) == 0
    record = json.loads(path.read_text())
    result = record["results"]
    assert result["num_client_processes"] == 3 and len(result["requests"]) == 10
    assert result["client_cpu_s"] > 0
    assert (result["completed"], result["failed"]) == (4, 6)
    errors = result["errors"]
    assert sum(n for e, n in errors.items() if e.startswith("HTTP 500")) == 2
    assert sum(n for e, n in errors.items() if "ClientPayloadError" in e) == 2
    assert errors["error event: engine died"] == 2
    assert sorted(len(b["prompt"]) for b in server.bodies) == [5] * 10
    assert all(len(r["itl"]) == 2 and r["output_tokens"] == 3
               for r in result["requests"] if r["ok"])
    assert result["output_throughput"] == pytest.approx(4 * 3 / result["duration_s"])


def test_bench_serve_client_processes_each_keep_a_share_of_max_concurrency(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `--max-concurrency 1` on a 2-CPU machine ran two processes, the second with a share of
    # 0, which it took as no limit: all its requests at once.
    from kvfit.cli import build_parser
    from kvfit.commands import bench_serve

    monkeypatch.setattr(bench_serve.os, "cpu_count", lambda: 8)
    for limit in (1, 2, 3, 5, None):
        flags = ["--max-concurrency", str(limit)] if limit else []
        args = build_parser().parse_args(["bench", "serve", "--num-prompts", "20", *flags])
        n = bench_serve.num_client_processes(args)
        assert n == min(4, limit or 4)
        shares = bench_serve._shares(limit, n)
        if limit is None:
            assert shares == [None] * n
        else:  # every process a slot at least, all of them the limit
            assert min(shares) >= 1 and sum(shares) == limit
    with pytest.raises(ValueError, match="--num-client-processes 3 is more than "
                       "--max-concurrency 2"):
        main(["bench", "serve", "--base-url", "http://x", "--max-concurrency", "2",
              "--num-client-processes", "3"])


@pytest.mark.parametrize("processes", [None, "2"])
def test_bench_serve_max_concurrency_holds_over_client_processes(
    fake_server: Callable, processes: str | None,
) -> None:
    """--max-concurrency 1 is one request in flight, however many client processes the load
    is spread over by default (each took a share of the cap, and a share of 0 was no cap)."""
    server = fake_server(ttft=0.05)
    argv = ["bench", "serve", "--base-url", server.url, "--model", "m", "--num-prompts", "4",
            "--max-concurrency", "1", "--input-len", "3", "--output-len", "2"]
    if processes is None:  # the default: min(4, CPUs, --num-prompts) processes, here 1
        assert main(argv) == 0
        assert server.most_in_flight == 1
    else:  # more processes than requests may be in flight: refused, naming both flags
        with pytest.raises(ValueError, match="--num-client-processes 2 is more than "
                           "--max-concurrency 1"):
            main([*argv, "--num-client-processes", processes])


def test_bench_serve_save_result_writes_where_vllms_flags_say(fake_server: Callable,
                                                              tmp_path: Path) -> None:
    """vLLM's --save-result, --result-dir (made if missing) and --result-filename; the
    default name is vLLM's pattern, rate, concurrency and model."""
    server = fake_server()
    folder = tmp_path / "new" / "results"
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "2", "--input-len",
            "3", "--output-len", "2", "--max-concurrency", "2", "--save-result",
            "--result-dir", str(folder), "--save-detailed"]
    assert main(argv) == 0
    (path,) = folder.iterdir()
    assert re.fullmatch(r"kvfit-infqps-concurrency2-fake-model-\d{8}-\d{6}\.json", path.name)
    result = json.loads(path.read_text())["results"]
    assert result["completed"] == 2 and len(result["requests"]) == 2
    assert main([*argv, "--result-filename", "mine.json"]) == 0
    assert json.loads((folder / "mine.json").read_text())["results"]["completed"] == 2


@pytest.mark.parametrize(("flags", "message"), [
    (("--result-dir", "d"), "--result-dir names where --save-result writes the record"),
    (("--result-filename", "f.json"), "--result-filename names where --save-result"),
    (("--save-result", "--result-file", "f.json"), "--save-result and --result-file both"),
    (("--save-result", "--result-filename", "a/b.json"), "--result-filename must be a file "
     "name"),
])  # fmt: skip
def test_bench_serve_save_result_flags_that_would_go_nowhere_are_refused(
        flags: tuple[str, ...], message: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "m", *flags])


def test_bench_offline_takes_vllms_output_json() -> None:
    for mode in ("throughput", "latency"):
        args = build_parser().parse_args(["bench", mode, "--output-json", "r.json"])
        assert args.result_file == "r.json"


def test_bench_serve_clients_never_import_the_callers_main_module(fake_server: Callable,
                                                                 tmp_path: Path) -> None:
    """A client process imports the load generator alone: a caller whose main module is heavy
    (bench/serving.py imports torch and the engine) must not pay for it once per client."""
    server = fake_server(behaviors=("ok",))
    imports, path = tmp_path / "imports", tmp_path / "s.json"
    caller = tmp_path / "caller.py"
    caller.write_text(f"import sys\nopen({str(imports)!r}, 'a').write('x')\n"
                      "from kvfit.cli import main\n"
                      "if __name__ == '__main__':\n    sys.exit(main(sys.argv[1:]))\n")
    argv = ["bench", "serve", "--base-url", server.url, "--model", "m", "--num-prompts", "6",
            "--input-len", "5", "--output-len", "3", "--num-client-processes", "3",
            "--result-file", str(path)]
    src = str(Path(kvfit.__file__).resolve().parents[1])
    subprocess.run([sys.executable, str(caller), *argv], check=True, timeout=120,
                   capture_output=True, env=dict(os.environ, PYTHONPATH=src))
    assert imports.read_text() == "x"  # the caller's own import, none in its three clients
    result = json.loads(path.read_text())["results"]
    assert result["num_client_processes"] == 3 and result["completed"] == 6


def test_bench_serve_a_failing_client_process_fails_its_requests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every client process fails before its first request: a sitecustomize on its PYTHONPATH
    # breaks the session it opens.
    (tmp_path / "sitecustomize.py").write_text(
        "import kvfit.commands.bench_serve as b\n"
        "def _broken(args, connections):\n"
        "    raise RuntimeError('no session in this client')\n"
        "b._session = _broken\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
    path = tmp_path / "s.json"
    argv = ["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "m",
            "--num-prompts", "4", "--num-client-processes", "2", "--result-file", str(path),
            "--save-detailed"]
    assert main(argv) == 1
    record = json.loads(path.read_text())
    result = record["results"]
    assert result["failed"] == 4 and len(result["requests"]) == 4
    assert result["errors"] == {
        "client process failed: RuntimeError: no session in this client": 4}


@pytest.mark.parametrize("url", ["http://127.0.0.1:notaport", "127.0.0.1:8000", "ftp://h/"])
def test_bench_serve_a_bad_base_url_names_the_flag(url: str) -> None:
    with pytest.raises(ValueError, match="--base-url must be an http"):
        main(["bench", "serve", "--base-url", url, "--model", "m"])


def test_per_token_itl_spreads_a_chunk_over_its_tokens() -> None:
    # Chunks at 1.0 (2 tokens: the second is part of TTFT), 1.3 (3 tokens), 1.4 (1 token).
    assert per_token_itl([(1.0, 2), (1.3, 3), (1.4, 1)]) == pytest.approx(
        [0.1, 0.1, 0.1, 0.1])
    assert per_token_itl([(1.0, 1)]) == []


def test_failure_lines_keep_the_commonest_reasons_and_count_the_rest() -> None:
    errors = {f"HTTP 400: token {i} out of range": 1 for i in range(30)} | {"timeout": 5}
    lines = failure_lines(errors, most=3)
    assert lines[0] == "failed x5: timeout" and len(lines) == 4
    assert lines[-1] == "failed x28: 28 other reasons (all of them in --result-file)"
    assert failure_lines({"a": 2}) == ["failed x2: a"]


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_bench_serve_without_the_servers_key_names_api_key(
    fake_server: Callable, monkeypatch: pytest.MonkeyPatch, key: str | None,
) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    server = fake_server(api_key="sk-right")
    argv = ["bench", "serve", "--base-url", server.url, "--num-prompts", "1"]
    with pytest.raises(SystemExit, match=r"HTTP 401.*--api-key") as raised:
        main(argv + ([] if key is None else ["--api-key", key]))
    assert "pass --model" not in str(raised.value)


def test_bench_serve_unreachable_without_model_names_base_url() -> None:
    """With no --model the first request lists the models: a server that is not there is
    a --base-url matter (passing --model alone would fail every request instead)."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=r"Cannot connect to host.*check --base-url"):
        main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"])


@pytest.mark.parametrize("mode", ["throughput", "latency"])
@pytest.mark.parametrize("value", ["-1", "nan"])
def test_bench_offline_bad_temperature_is_named_before_the_engine_loads(
        mode: str, value: str, monkeypatch: pytest.MonkeyPatch, engine_flags: list[str]) -> None:
    # It was found after the model loaded and warmed up, as `SamplingParams.temperature`.
    from kvfit.commands import bench_offline

    def no_engine(args: object) -> None:
        raise AssertionError("the engine was started")

    monkeypatch.setattr(bench_offline, "build_llm", no_engine)
    with pytest.raises(ValueError, match=r"^--temperature must be"):
        main(["bench", mode, "--temperature", value, *engine_flags])


@pytest.mark.parametrize("argv", [
    ["throughput", "--num-prompts", "1"], ["latency", "--batch-size", "1", "--num-iters", "1"],
    ["serve", "--base-url", "http://127.0.0.1:1", "--model", "m", "--num-prompts", "1"],
])
@pytest.mark.parametrize(("where", "match"), [
    ("missing/r.json", r"--result-file .*r\.json: the folder .*missing.* does not exist"),
    ("", "--result-file .* is a folder"),
])
def test_bench_result_file_that_cannot_be_written_fails_before_the_run(
        argv: list[str], where: str, match: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, engine_flags: list[str]) -> None:
    # It failed after the whole run, with a bare "[Errno 2] No such file or directory".
    from kvfit.commands import bench_offline, bench_serve

    def no_run(*args: object) -> None:
        raise AssertionError("the benchmark ran")

    monkeypatch.setattr(bench_offline, "build_llm", no_run)
    monkeypatch.setattr(bench_serve, "_main", no_run)
    flags = engine_flags if argv[0] != "serve" else []
    with pytest.raises(ValueError, match=match):
        main(["bench", *argv, *flags, "--result-file", str(tmp_path / where)])


@pytest.mark.parametrize(("argv", "match"), [
    # Each was taken and did nothing, or failed every request with an obscure reason.
    (["--base-url", "http://127.0.0.1:1", "--port", "9000"], "--host and --port would be "
     "ignored"),
    (["--base-url", "http://127.0.0.1:1", "--host", "10.0.0.1"], "--host and --port"),
    (["--port", "70000"], r"--port must be in \[1, 65535\], got 70000"),
    (["--port", "0"], r"--port must be in \[1, 65535\]"),
    (["--endpoint", "v1/completions"], "--endpoint must be a path starting with '/'"),
    # vLLM's chat endpoint: every request failed with "messages: Field required".
    (["--endpoint", "/v1/chat/completions"], "a chat route refuses; use a completions path"),
    # vLLM's other backends speak other protocols (unrecognized arguments before).
    (["--backend", "tgi"], r"--backend tgi: kvfit's bench serve sends streamed OpenAI "
     r"completions requests only \(vllm or openai"),
    (["--backend", "openai-chat"], "pass --backend openai"),
    (["--save-detailed"], "--save-detailed adds to --result-file's record"),
    (["--limits-device", "cuda"], "--limits-device adds to --result-file's record"),
])
def test_bench_serve_flags_that_would_be_ignored_or_misjoined_are_refused(
        argv: list[str], match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfit.commands import bench_serve

    def no_run(*args: object) -> None:
        raise AssertionError("the load ran")

    monkeypatch.setattr(bench_serve, "_main", no_run)
    with pytest.raises(ValueError, match=match):
        main(["bench", "serve", "--model", "m", "--num-prompts", "1", *argv])
