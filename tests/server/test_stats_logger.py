"""`kvfit serve` prints the engine's figures every few seconds while it works (vLLM's stats
line), quiet when idle; `--disable-log-stats` turns it off."""

from __future__ import annotations

import dataclasses
import io
import time

from kvfit.cli import build_parser
from kvfit.engine.engine_core import EngineStats
from kvfit.server.stats_logger import StatsLogger, stats_line


def stats(running: int = 0, free: int = 100, hits: int = 0, prompt: int = 0,
          generated: int = 0) -> EngineStats:
    return EngineStats(num_running=running, num_waiting=0, num_blocks=100, num_free_blocks=free,
                       committed_kv_bytes=1, reserved_kv_bytes=1, num_preemptions=2,
                       oom_guard_events=0, oom_guard_shrinks=0,
                       prefix_cache_queried_tokens=200, prefix_cache_hit_tokens=hits,
                       num_prefilled_tokens=prompt, num_generated_tokens=generated)


class FakeEngine:
    def __init__(self) -> None:
        self.current = stats()

    def stats(self) -> EngineStats:
        return self.current


def test_stats_line_names_the_figures() -> None:
    assert stats_line(stats(running=3, free=75, hits=50)) == (
        "kvfit serve: running 3 seqs, waiting 0, KV cache 25.0% of 100 blocks, prefix cache "
        "hit rate 25.0%, preemptions 2")


def test_stats_line_says_requests_wait_on_a_paused_engine() -> None:
    held = dataclasses.replace(stats(), num_waiting=3, paused=True)
    assert "running 0 seqs, waiting 3 (generation paused), KV cache" in stats_line(held)


def test_stats_line_leads_with_vllms_throughputs() -> None:
    assert stats_line(stats(running=1), (120.04, 7.25)).startswith(
        "kvfit serve: Avg prompt throughput: 120.0 tokens/s, Avg generation throughput: 7.2 "
        "tokens/s, running 1 seqs")


def test_logger_reports_the_tokens_per_second_of_its_interval() -> None:
    engine, out = FakeEngine(), io.StringIO()
    engine.current = stats(running=1, prompt=1000, generated=50)  # before the logger
    logger = StatsLogger(engine, interval_s=0.5, out=out).start()
    try:
        time.sleep(0.25)
        engine.current = stats(running=1, prompt=1100, generated=60)  # within the interval
        time.sleep(0.4)
    finally:
        logger.stop()
    line = out.getvalue().splitlines()[0]
    prompt = float(line.split("Avg prompt throughput: ")[1].split(" ")[0])
    generation = float(line.split("Avg generation throughput: ")[1].split(" ")[0])
    # 100 prompt and 10 generated tokens over one interval of about 0.5 s.
    assert 150 <= prompt <= 200 and 15 <= generation <= 20


def test_logger_prints_while_busy_and_stays_quiet_when_idle() -> None:
    engine, out = FakeEngine(), io.StringIO()
    logger = StatsLogger(engine, interval_s=0.02, out=out).start()
    try:
        time.sleep(0.2)
        idle = out.getvalue().splitlines()
        assert len(idle) == 1  # the first figures, then nothing while they stay the same
        engine.current = stats(running=1, free=90)
        time.sleep(0.2)
        busy = out.getvalue().splitlines()[1:]
        assert len(busy) >= 3 and all("running 1 seqs" in line for line in busy)
    finally:
        logger.stop()


def test_serve_has_vllms_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "m", "--disable-log-stats"]).disable_log_stats
    assert not parser.parse_args(["serve", "m"]).disable_log_stats
