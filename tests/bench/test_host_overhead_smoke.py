"""bench/host_overhead.py on the CPU: every phase is timed, and the API replay streams every
token of every request as one SSE event, as the server would."""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path

import pytest

from .scripts import load_bench


def test_host_overhead_bench_times_each_phase_and_replays_every_token(tmp_path: Path) -> None:
    bench = load_bench("host_overhead")
    out = tmp_path / "host.json"
    bench.main(["--num-prompts", "6", "--input-len", "8", "--output-len", "5",
                "--max-num-seqs", "4", "--repeat", "1", "--out", str(out)])
    record = json.loads(out.read_text())
    result = record["results"]
    offline, engine, api = result["offline"], result["served"]["engine"], result["served"]["api"]
    tokens = 6 * 5
    # Offline detokenizes every token; the served engine leaves text to the API process.
    assert offline["calls"]["detokenize"] == tokens
    assert engine["calls"]["detokenize"] == 0
    assert engine["calls"]["encode"] == engine["num_messages"] == api["num_messages"]
    assert engine["calls"]["engine"] >= engine["num_steps"] == offline["num_steps"] > 5
    # One event per token (each message is read before the next arrives) and one [DONE].
    assert api["events"] == 6 * (5 + 1)
    assert set(offline["phases_us"]) >= {"schedule", "prepare_inputs", "forward", "update",
                                         "sampling_metadata", "result", "engine"}
    assert set(api["phases_us"]) == {"decode", "on_outputs", "streams"}
    assert "served.api.admit_us_per_request" in record["figures"]
    assert record["bench"] == "host-overhead"
    assert record["figures"]["offline.host_step_us"]["value"] == offline["host_step_us"]


def test_host_overhead_http_part_streams_every_request_over_a_socket(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    bench = load_bench("host_overhead")
    out = tmp_path / "host.json"
    frozen = gc.get_freeze_count()
    bench.main(["--parts", "http", "--num-prompts", "6", "--input-len", "8", "--output-len",
                "5", "--max-num-seqs", "4", "--repeat", "1", "--uvicorn-log-level", "warning",
                "--out", str(out)])
    record = json.loads(out.read_text())
    http = record["results"]["http"]
    # Every request got a 200 and [DONE] (checked by the bench), one chunk per token.
    assert http["requests"] == 6 and http["chunks"] == 6 * 5
    assert record["figures"]["http.stream_us_per_chunk"]["value"] == http["stream_us_per_chunk"]
    # Each pass freezes the heap as serve does; left frozen, every pass's server and engine
    # would outlive it (the collector never frees frozen cycles), in the bench and in pytest.
    assert gc.get_freeze_count() <= frozen
    assert not list(scratch.iterdir())  # the client's request file of each pass is removed
