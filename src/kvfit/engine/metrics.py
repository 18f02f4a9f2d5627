"""The engine's figures as a list of named metrics: what `LLM.get_metrics()` returns and what
the server's Prometheus `/metrics` exposes (one list, so the two never disagree).

Shaped loosely like vLLM's `LLM.get_metrics()`: each `Metric` has a Prometheus-style `name`
(`kvfit:` prefix; vLLM's name where one exists), a `kind` (`gauge`: a value now; `counter`:
a total since startup, exposed with a `_total` suffix), a `value`, `labels` and a `help` text.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from kvfit.engine.engine_core import EngineStats
    from kvfit.engine.sequence import Sequence
    from kvfit.kv.report import KVCacheReport


@dataclass(frozen=True)
class Metric:
    """One figure: a gauge (a value now) or a counter (a total since startup)."""

    name: str
    kind: Literal["gauge", "counter"]
    value: float
    help: str
    labels: dict[str, str] = field(default_factory=dict)


def engine_metrics(s: EngineStats, report: KVCacheReport) -> list[Metric]:
    """Queues, KV cache use, the startup sizing report, the out-of-memory guard, runtime
    resizes and the prefix cache, from one stats snapshot (sequences, not requests: `n`
    completions count n). Metrics of one name differ by their labels."""

    def gauge(name: str, help: str, value: float, **labels: str) -> Metric:
        return Metric(f"kvfit:{name}", "gauge", float(value), help, labels)

    def counter(name: str, help: str, value: float, **labels: str) -> Metric:
        return Metric(f"kvfit:{name}", "counter", float(value), help, labels)

    in_use = s.num_blocks - s.num_free_blocks
    metrics = [
        gauge("num_requests_running", "Sequences in the running batch (a request with n "
              "completions counts n).", s.num_running),
        gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
        gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
              in_use / s.num_blocks),
        gauge("kv_cache_blocks_total", "KV cache blocks the cache holds now.", s.num_blocks),
        gauge("kv_cache_blocks_in_use", "KV cache blocks referenced by a sequence.", in_use),
        gauge("kv_cache_committed_bytes", "Physical bytes committed to the KV cache.",
              s.committed_kv_bytes),
        gauge("kv_cache_reserved_bytes", "Bytes of address space reserved for the KV cache "
              "(its capacity).", s.reserved_kv_bytes),
        gauge("kv_cache_released", "1 while a failed resize left the KV cache released (no "
              "request runs until the engine backs it again), else 0.", int(s.kv_cache_released)),
        gauge("kv_cache_sizing_info", "How the KV cache was sized at startup (value 1).", 1,
              method=report.method),
        gauge("kv_cache_sizing_transient_bytes", "Transient peak measured at startup.",
              report.transient),
        gauge("kv_cache_sizing_margin_bytes", "Margin kept free at startup.", report.margin),
        gauge("kv_cache_sizing_blocks", "KV cache blocks sized at startup.", report.num_blocks),
    ]
    if report.estimate_num_blocks is not None:
        metrics.append(gauge("kv_cache_sizing_estimate_blocks", "Blocks the profiling estimate "
                             "gives, for comparison.", report.estimate_num_blocks))
    metrics += [
        counter("oom_guard_events", "Device out-of-memory errors the guard absorbed.",
                s.oom_guard_events),
        counter("oom_guard_shrinks", "Times the guard shrank the KV cache.", s.oom_guard_shrinks),
        *(counter("kv_cache_resizes", "Runtime resizes of the KV cache (resize_kv_cache, the "
                  "elastic governor, backing a released cache again), by direction.", value,
                  direction=direction)
          for direction, value in (("shrink", s.kv_cache_shrinks), ("grow", s.kv_cache_grows))),
        counter("kv_cache_idle_shrinks", "Shrinks of an idle KV cache giving back what it did "
                "not use (elastic_idle_s); counted in kv_cache_resizes too.",
                s.kv_cache_idle_shrinks),
        counter("kv_cache_share_shrinks", "Shrinks of a busy KV cache giving its free tail to "
                "engines on the same device that lack blocks (elastic_demand_dir); counted in "
                "kv_cache_resizes too.", s.kv_cache_share_shrinks),
        counter("kv_cache_failed_grows", "Grows of the KV cache that found no memory (the cache "
                "stayed as it was), and failed attempts to back a released one.",
                s.kv_cache_failed_grows),
        counter("kv_cache_failed_shrinks", "Shrinks of the KV cache that failed (a driver "
                "error; the cache keeps what it still backs).", s.kv_cache_failed_shrinks),
        gauge("kv_cache_resize_backoff_seconds", "How long the elastic governor waits before "
              "retrying a resize that failed (doubling with each consecutive failure); 0 when "
              "none failed.", s.kv_cache_resize_backoff_s),
        counter("num_preemptions", "Sequences preempted for want of blocks.", s.num_preemptions),
        counter("prefix_cache_queries", "Tokens looked up in the prefix cache.",
                s.prefix_cache_queried_tokens),
        counter("prefix_cache_hits", "Tokens found in the prefix cache.",
                s.prefix_cache_hit_tokens),
        gauge("prefix_cache_hit_rate", "Prefix cache hits / queries, in tokens, since startup.",
              s.prefix_cache_hit_tokens / max(s.prefix_cache_queried_tokens, 1)),
        counter("engine_steps", "Engine steps launched (one forward pass each).", s.num_steps),
        counter("engine_step_tokens", "Tokens the engine's steps computed, prompt and output "
                "(per step: the batch the device ran).", s.num_step_tokens),
        counter("engine_decode_steps", "Engine steps that computed one token per sequence "
                "(the others ran a prompt chunk, alone or beside decodes).", s.num_decode_steps),
    ]
    if s.kv_connector_failed_saves is not None:
        metrics.append(counter("kv_connector_failed_saves", "KV blocks the connector could not "
                               "save to its store (full or unwritable; requests go on).",
                               s.kv_connector_failed_saves))
        metrics.append(counter("kv_connector_hit_tokens", "Prompt tokens whose K/V the "
                               "connector's store gave (loaded rather than computed).",
                               s.kv_connector_hit_tokens))
    return metrics


ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM's bucket bounds of `iteration_tokens_total`, the tokens of each engine step."""


REQUEST_COUNTERS = {
    "kvfit:prompt_tokens": "Prompt tokens of finished and aborted requests.",
    "kvfit:generation_tokens": "Generated tokens.",
    "kvfit:request_success": "Requests that ran to the end, by finish reason of each completion.",
}
"""The request counters `RequestCounts` and the server's `/metrics` both expose: name -> help."""
FINISH_REASONS = ("stop", "length", "abort")
"""`request_success`'s `finished_reason` values, each a series from the start, as vLLM's."""


@dataclass
class RequestCounts:
    """The request figures of offline `LLM` calls, named as the server's (which counts them as
    requests stream): prompt and generated tokens, and each completion by finish reason."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finish_reasons: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))

    def count(self, requests: Iterable[list[Sequence]]) -> None:
        """Count requests that ended (each a list of its `n` sequences); one not finished
        (an interrupted call aborts it) counts as aborted."""
        for seqs in requests:
            self.prompt_tokens += seqs[0].num_prompt_tokens
            for seq in seqs:
                self.generation_tokens += seq.num_output_tokens
                reason = seq.finish_reason or "abort"
                self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1

    def metrics(self) -> list[Metric]:
        """The counts as `Metric`s, named and labelled as the server's (less `model_name`)."""
        help_of = REQUEST_COUNTERS
        return [
            Metric("kvfit:prompt_tokens", "counter", float(self.prompt_tokens),
                   help_of["kvfit:prompt_tokens"]),
            Metric("kvfit:generation_tokens", "counter", float(self.generation_tokens),
                   help_of["kvfit:generation_tokens"]),
            *(Metric("kvfit:request_success", "counter", float(value),
                     help_of["kvfit:request_success"], {"finished_reason": reason})
              for reason, value in self.finish_reasons.items()),
        ]
