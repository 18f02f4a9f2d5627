"""bench/serving.py end to end on the CPU: kvfit-tiny served, swept at rate inf, then offline."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from .scripts import load_bench


def test_serving_bench_smoke(tmp_path: Path) -> None:
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    serving = load_bench("serving")

    out = tmp_path / "serving.json"
    result = serving.main(["--device", "cpu", "--model", "kvfit-tiny", "--num-prompts", "6",
                           "--input-len", "12", "--output-len", "6", "--request-rates", "inf",
                           "--max-num-seqs", "4", "--max-model-len", "32", "--no-warmup",
                           "--max-concurrency", "2", "0", "--stream-interval", "2",
                           "--out", str(out)])

    assert json.loads(out.read_text())["results"] == json.loads(json.dumps(result))
    rows = result["serve"]["rows"]
    assert [r["max_concurrency"] for r in rows] == [2, None]  # one row per limit, 0: none
    for row in rows:
        assert row["request_rate"] is None and row["completed"] == 6
        assert row["failed"] == 0 and row["errors"] == {}
        assert row["total_output_tokens"] == result["offline"]["total_output_tokens"] == 6 * 6
        assert row["output_throughput"] > 0 and row["p99_itl_ms"] >= row["p50_itl_ms"] > 0
        # CPU over the row alone (a tiny row may measure 0 at the clock's 10 ms ticks): the
        # server's start-up, seconds of CPU, would put a whole-life figure far above the cores.
        cores = psutil.cpu_count()
        assert 0 <= row["server_cpu"] <= cores and 0 <= row["engine_cpu"] <= cores
    # The engine's steps over each pass, read from /metrics, and over offline's: each request
    # computes its 12 prompt tokens and 5 of its 6 output tokens (the prefill samples the
    # first; the last is sampled by a step that needs no successor), prefix caching off.
    for shape in (*rows, result["offline"]):
        assert shape["engine_steps"] * shape["tokens_per_step"] == pytest.approx(6 * (12 + 5))
        assert shape["engine_steps"] >= 5 and 0 < shape["decode_step_share"] < 1
    # Saturation is the best of the rate-inf rows, whichever limit gave it.
    best = max(rows, key=lambda r: r["output_throughput"])
    assert result["saturation_concurrency"] == best["max_concurrency"]
    assert result["ratio"] == best["output_throughput"] / result["offline"]["output_throughput"]
    assert result["saturation_rate"] == "inf"
    # The server exited on its own (SIGINT) and left no process behind.
    assert result["serve"]["returncode"] == 0
    # (`kvfit serve` by its argument; the load's fork server, a child for this process's life,
    # is not a server.)
    assert not [p for p in psutil.Process().children(recursive=True) if "serve" in p.cmdline()]
    assert "kvfit serve" in Path(result["server_log"]).read_text()
    assert "stream interval 2" in Path(result["server_log"]).read_text()  # passed to the server


def test_serving_bench_spreads_lengths_alike_served_and_offline(tmp_path: Path) -> None:
    """--random-range-ratio: the load and offline run the same per-request output lengths."""
    for module in ("fastapi", "uvicorn", "httpx"):
        pytest.importorskip(module)
    serving = load_bench("serving")

    args = ["--device", "cpu", "--model", "kvfit-tiny", "--num-prompts", "6", "--input-len",
            "12", "--output-len", "6", "--random-range-ratio", "0.5", "--request-rates", "inf",
            "--max-num-seqs", "4", "--no-warmup", "--out", str(tmp_path / "s.json")]
    requests = serving.workload(serving.parse_args(args))
    assert len({n for _, n in requests}) > 1 and all(3 <= n <= 9 for _, n in requests)
    result = serving.main(args)
    expected = sum(n for _, n in requests)
    assert result["offline"]["total_output_tokens"] == expected
    assert result["serve"]["rows"][0]["total_output_tokens"] == expected
    assert result["args"]["max_model_len"] >= 18 + 9  # the longest request fits


def test_serving_bench_checks_the_workload_flags_as_bench_serve_does() -> None:
    serving = load_bench("serving")
    for flag, value in (("--random-range-ratio", "1"), ("--input-len", "0"),
                        ("--max-concurrency", "-1")):
        with pytest.raises(ValueError, match=flag):
            serving.parse_args(["--out", "/tmp/s.json", "--device", "cpu", flag, value])


def test_serving_bench_starts_a_server_per_api_server_count_and_one_thread_server() -> None:
    serving = load_bench("serving")
    args = serving.parse_args(["--device", "cpu", "--model", "kvfit-tiny", "--engines",
                               "process", "thread", "--api-server-count", "1", "4",
                               "--out", "s.json"])
    assert serving.servers(args) == [("process", 1), ("process", 4), ("thread", None)]
    labels = [serving.server_label({"engine": m, "api_server_count": n or 1})
              for m, n in serving.servers(args)]
    assert labels == ["process", "process x 4", "thread"]
    logs = {serving.server_log(Path("s.json"), m, n).name for m, n in serving.servers(args)}
    assert len(logs) == 3  # one log per server: none overwrites another's
