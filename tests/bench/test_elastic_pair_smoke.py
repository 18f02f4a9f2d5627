"""bench/elastic_pair.py end to end on the CPU: two kvfit-tiny engines in two spawned processes
take turns being busy, static split then elastic. Host memory moves with other processes, so
the smoke checks the flow, the record and that the idle engine gave memory back, not the
speedup."""

from __future__ import annotations

import json
import random
import sys
from itertools import pairwise
from pathlib import Path

import psutil
import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 (the bench module)
    # Importable by name, so the spawned engines can unpickle their target.
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    monkeypatch.delitem(sys.modules, "elastic_pair", raising=False)
    import elastic_pair

    return elastic_pair


def test_elastic_pair_bench_smoke(bench, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "pair.json"
    result = bench.main(["--device", "cpu", "--models", "kvfit-tiny", "kvfit-tiny",
                         "--max-model-len", "256", "--max-num-seqs", "8", "--concurrency", "8",
                         "--input-len", "32", "--output-len", "16", "--phase-s", "2",
                         "--num-phases", "2", "--idle-s", "0.5", "--min-interval", "0.5",
                         "--modes", "static", "elastic", "elastic-alone", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["bench"] == "elastic-pair"
    assert record["results"] == json.loads(json.dumps(result))
    assert record["figures"]["token_ratio"]["value"] == pytest.approx(result["token_ratio"])
    for mode in ("static", "elastic", "elastic-alone"):
        r = result["modes"][mode]
        assert r["output_tokens"] == sum(e["output_tokens"] for e in r["engines"]) > 0
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] <= 2.0  # a phase at most
        for engine in r["engines"]:
            assert engine["output_tokens"] > 0 and engine["samples"]
            assert sum(engine["phase_tokens"]) == engine["output_tokens"]
            assert [s["output_tokens"] for s in engine["samples"]] == sorted(
                s["output_tokens"] for s in engine["samples"])  # tokens so far, never fewer
            # Within the run (4 s), give or take the last step on two shared cores.
            assert all(0 <= s["t"] <= 6.0 for s in engine["samples"])
        # Engine i is busy in phases i, i + 2, ...: the other phases serve nothing new (but
        # a step begun at a phase's end).
        assert r["engines"][0]["phase_tokens"][0] > r["engines"][0]["phase_tokens"][1]
        assert r["engines"][1]["phase_tokens"][1] > r["engines"][1]["phase_tokens"][0]
    static_run, elastic_run = result["modes"]["static"], result["modes"]["elastic"]
    assert result["phase_token_ratios"] == pytest.approx(
        [elastic_run["engines"][i]["phase_tokens"][i] / static_run["engines"][i]["phase_tokens"][i]
         for i in range(2)])
    static, alone = (result["modes"][m]["engines"] for m in ("static", "elastic-alone"))
    assert all(e["kv_cache_idle_shrinks"] == 0 and not e["resizes"] for e in static)
    # Engine 0 idles in the second phase: alone, by its end it has given its cache back.
    # (Sharing demand it gives only what engine 1 lacks, here nothing: this load fits.)
    assert alone[0]["kv_cache_idle_shrinks"] >= 1
    assert any(r["cause"] == "idle" and r["time"] >= 2.0 for r in alone[0]["resizes"])
    assert "elastic-alone.output_tokens" in record["figures"]
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE and "spawn" in " ".join(p.cmdline())]


def test_a_chat_pair_gives_both_modes_host_memory_tiers(
        bench, tmp_path: Path) -> None:  # noqa: ANN001
    # The flag reaches every engine in both modes (whether a turn comes back within a phase
    # of a few seconds depends on the machine's speed: the engine tests check the loads).
    out = tmp_path / "pair.json"
    result = bench.main(["--device", "cpu", "--models", "kvfit-tiny", "kvfit-tiny",
                         "--workload", "chat", "--max-model-len", "256", "--max-num-seqs", "8",
                         "--concurrency", "8", "--input-len", "64", "--turn-len", "16",
                         "--output-len", "8", "--phase-s", "3", "--num-phases", "2",
                         "--idle-s", "0.5", "--min-interval", "0.5", "--kv-offloading-size",
                         "0.01", "--modes", "static", "elastic", "--out", str(out)])
    assert json.loads(out.read_text())["config"]["kv_offloading_size"] == [0.01]
    for mode in ("static", "elastic"):
        for engine in result["modes"][mode]["engines"]:
            assert engine["output_tokens"] > 0 and engine["kv_connector_hit_tokens"] is not None


def test_chat_turns_extend_their_history_and_start_over_past_max_model_len(bench) -> None:  # noqa: ANN001
    # --device cpu: the default (cuda) is a usage error where torch sees no CUDA device.
    args = bench.parse_args(["--device", "cpu", "--workload", "chat", "--concurrency", "2",
                             "--input-len", "40", "--turn-len", "8", "--output-len", "4",
                             "--max-model-len", "64"])
    chats = bench.Conversations(args, random.Random(0), vocab=1000)
    first = chats.next_turn("a")
    assert 10 <= len(first) <= 40  # a new conversation: 1/4 to 1x input_len
    answer = first + [7, 7, 7, 7]
    chats.answered("a", answer)
    second = chats.next_turn("b")
    assert second[:len(answer)] == answer and len(second) == len(answer) + 8
    chats.abandoned("b")  # aborted at a phase's end: asked again later, same history
    again = chats.next_turn("c")
    assert again[:len(answer)] == answer and len(again) == len(answer) + 8
    chats.answered("c", again + [1] * 4)
    lengths = []
    for i in range(20):  # grows by 12 a turn until the next would pass 64, then starts over
        prompt = chats.next_turn(f"t{i}")
        lengths.append(len(prompt))
        chats.answered(f"t{i}", prompt + [0] * 4)
    assert max(lengths) + 4 <= 64 and any(b < a for a, b in pairwise(lengths))


def test_four_engines_two_busy_at_a_time(bench, tmp_path: Path) -> None:  # noqa: ANN001
    """Four kvfit-tiny engines, two busy in each phase (engine i in phases p with
    (p - i) mod 4 < 2): each phase's busy engines serve, the idle ones do not, and the phase
    ratios add up the busy engines."""
    out = tmp_path / "four.json"
    result = bench.main(["--device", "cpu", "--models", *["kvfit-tiny"] * 4,
                         "--busy-per-phase", "2", "--max-model-len", "256",
                         "--max-num-seqs", "4", "--concurrency", "4", "--input-len", "32",
                         "--output-len", "8", "--phase-s", "2", "--num-phases", "4",
                         "--idle-s", "0.5", "--min-interval", "0.5", "--out", str(out)])
    assert json.loads(out.read_text())["config"]["gpu_memory_utilization_static"] == 0.225
    for mode in ("static", "elastic"):
        engines = result["modes"][mode]["engines"]
        assert len(engines) == 4
        for phase in range(4):
            tokens = [e["phase_tokens"][phase] for e in engines]
            busy = [tokens[i] for i in range(4) if (phase - i) % 4 < 2]
            idle = [tokens[i] for i in range(4) if (phase - i) % 4 >= 2]
            # An idle engine serves nothing but a step begun at its phase's end.
            assert min(busy) > max(idle), (mode, phase, tokens)
        assert all("kv_cache_share_shrinks" in e for e in engines)
    static, elastic = (result["modes"][m]["engines"] for m in ("static", "elastic"))
    assert result["phase_token_ratios"] == pytest.approx([
        sum(elastic[i]["phase_tokens"][p] for i in range(4) if (p - i) % 4 < 2)
        / sum(static[i]["phase_tokens"][p] for i in range(4) if (p - i) % 4 < 2)
        for p in range(4)])


@pytest.mark.parametrize("argv,match", [
    (["--models", "kvfit-tiny"], "at least two"),
    (["--models", "a", "b", "c", "--busy-per-phase", "3"], "one engine idle at least"),
    (["--models", "a", "b", "--busy-per-phase", "0"], "busy-per-phase"),
])
def test_engine_counts_and_busy_sets_are_checked(bench, argv: list[str], match: str,  # noqa: ANN001
                                                 capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", *argv])
    assert match in capsys.readouterr().err
