"""`kvfit serve` logs the engine's figures every few seconds while it works, as vLLM's server
does; `--disable-log-stats` turns it off."""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from kvfit.engine.engine_core import EngineStats
    from kvfit.server.async_llm import AsyncLLM

LOG_STATS_INTERVAL_S = 10.0


def stats_line(s: EngineStats, throughput: tuple[float, float] | None = None,
               source: str = "kvfit serve") -> str:
    """One line of queues, KV cache use, prefix cache hit rate and preemptions, after
    `throughput` (prompt, generation tokens/s) in vLLM's words where given, led by
    `source`."""
    in_use = s.num_blocks - s.num_free_blocks
    hit_rate = s.prefix_cache_hit_tokens / max(s.prefix_cache_queried_tokens, 1)
    rates = "" if throughput is None else (
        f"Avg prompt throughput: {throughput[0]:.1f} tokens/s, Avg generation throughput: "
        f"{throughput[1]:.1f} tokens/s, ")
    # Why requests wait with nothing running: they run only after a resume.
    paused = " (generation paused)" if s.paused else ""
    return (f"{source}: {rates}running {s.num_running} seqs, waiting {s.num_waiting}{paused}, "
            f"KV cache {in_use / s.num_blocks:.1%} of {s.num_blocks:,} blocks, prefix cache hit "
            f"rate {hit_rate:.1%}, preemptions {s.num_preemptions}")


class StatsLogger:
    """A daemon thread printing `stats_line` every `interval_s` seconds while the engine is
    busy or its figures changed since the last line (an idle server stays quiet)."""

    def __init__(self, engine: AsyncLLM, interval_s: float = LOG_STATS_INTERVAL_S,
                 out: IO[str] | None = None) -> None:
        self.engine, self.interval_s, self.out = engine, interval_s, out
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvfit-stats", daemon=True)

    def start(self) -> StatsLogger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last, last_time = self.engine.stats(), time.monotonic()
        first = True
        while not self._stop.wait(self.interval_s):
            s, now = self.engine.stats(), time.monotonic()
            if first or s != last or s.num_running or s.num_waiting:
                # Tokens per second since the last look, as vLLM's line averages its interval.
                elapsed = max(now - last_time, 1e-9)
                throughput = ((s.num_prefilled_tokens - last.num_prefilled_tokens) / elapsed,
                              (s.num_generated_tokens - last.num_generated_tokens) / elapsed)
                print(stats_line(s, throughput), file=self.out or sys.stdout, flush=True)
            first = False
            last, last_time = s, now
