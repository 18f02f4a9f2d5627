"""Prometheus metrics of one server app, named like vLLM's where one exists (`kvfit:` prefix).

Each app has its own `CollectorRegistry`, so two apps (or tests) in one process never share
counts. Request figures (tokens, latencies, outcomes) are observed as requests stream; engine
figures (queues, KV cache, sizing report, out-of-memory guard, prefix cache) are read from the
engine's latest stats snapshot at every scrape. With several API processes
(`--api-server-count`, prometheus_client's multiprocess mode) the request figures of every
process are summed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from kvfit.engine.metrics import (
    FINISH_REASONS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_COUNTERS,
    engine_metrics,
)
from kvfit.engine.outputs import RequestOutput
from kvfit.server.api_servers import PROMETHEUS_MULTIPROC_ENV
from kvfit.server.async_llm import AsyncLLM, RequestStream

if TYPE_CHECKING:
    from kvfit.engine.engine_core import EngineStats
    from kvfit.server.engine_messages import PhaseTimes

# vLLM's buckets, so a dashboard's quantiles read alike. A request's latency runs to hours (a
# long answer, a long queue): past the last bound histogram_quantile can only answer that bound.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                            50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)


def _token_buckets(max_model_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_model_len` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


# Status code -> failure reason label.
# `error` is the server's fault (5xx); other client errors are `invalid`. A client that left
# before its answer (499) is counted apart: nothing went wrong on this side.
_FAILURE_REASONS = {400: "invalid", 401: "unauthorized", 404: "not_found", 503: "rejected",
                    499: "client_disconnected"}


class _EngineCollector(Collector):
    """Reads the engine's stats snapshot and KV sizing report when scraped."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        stats = self.engine.stats()
        for m in engine_metrics(stats, self.engine.kv_cache_report):
            family = families.get(m.name)
            if family is None:  # one family per name: metrics of a name differ by labels
                kind = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
                family = families[m.name] = kind(m.name, m.help,
                                                 labels=["model_name", *m.labels])
            family.add_metric([self.model_name, *m.labels.values()], m.value)
        yield from families.values()
        yield self._iteration_tokens(stats)

    def _iteration_tokens(self, s: EngineStats) -> HistogramMetricFamily:
        """vLLM's histogram of the tokens each engine step computed (prompt chunks and
        decodes), from the engine's counts: every process of the server reads the same."""
        family = HistogramMetricFamily("kvfit:iteration_tokens_total", "Histogram of the "
                                       "number of tokens per engine step.",
                                       labels=["model_name"])
        counts = s.step_token_counts or (0,) * (len(ITERATION_TOKENS_BUCKETS) + 1)
        buckets, total = [], 0
        for bound, count in zip((*map(float, ITERATION_TOKENS_BUCKETS), "+Inf"), counts,
                                strict=True):
            total += count
            buckets.append((str(bound), total))
        family.add_metric([self.model_name], buckets, float(s.num_step_tokens))
        return family


class ServerMetrics:
    """The collectors of one app and the hooks that feed them. Every series carries
    `model_name` (the first served name), as vLLM's do: its dashboards select by it."""

    def __init__(self, engine: AsyncLLM, model_name: str, multiprocess: bool = False,
                 max_model_len: int | None = None) -> None:
        self.registry = CollectorRegistry()
        if max_model_len is None:
            max_model_len = engine.max_model_len
        self.model_name = model_name
        r = self.registry
        r.register(_EngineCollector(engine, model_name))
        self._scrape = r
        if multiprocess:
            # Counts go to files only where the variable was set before prometheus_client's
            # import (it picks the kind of value then); else every process would report zeros.
            if (not os.environ.get(PROMETHEUS_MULTIPROC_ENV)
                    or values.ValueClass.__name__ != "MmapedValue"):
                raise RuntimeError("multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set "
                                   "before prometheus_client is imported")
            # Several API processes (`--api-server-count`): the request figures are the sum of
            # every process's files; the engine's are the same in every process (each gets the
            # engine-wide state), so this process's own snapshot reports them. There are no
            # `Gauge`s (a gauge added here needs an explicit `multiprocess_mode`).
            self._scrape = CollectorRegistry()
            MultiProcessCollector(self._scrape)
            self._scrape.register(_EngineCollector(engine, model_name))
        # The hot path feeds each figure's one child (labelled once, here).
        model = ["model_name"]
        help_of = REQUEST_COUNTERS  # named and described as `LLM.get_metrics()`'s
        self.prompt_tokens = Counter("kvfit:prompt_tokens", help_of["kvfit:prompt_tokens"],
                                     model, registry=r).labels(model_name)
        self.generation_tokens = Counter("kvfit:generation_tokens",
                                         help_of["kvfit:generation_tokens"], model,
                                         registry=r).labels(model_name)
        self.request_success = Counter("kvfit:request_success",
                                       help_of["kvfit:request_success"],
                                       [*model, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # at 0 from the start, as vLLM's
            self.request_success.labels(model_name, reason)
        self.request_failure = Counter("kvfit:request_failure", "Requests answered with an "
                                       "error, by reason.", [*model, "reason"], registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, model, buckets=buckets, registry=r).labels(model_name)

        tokens = _token_buckets(max_model_len)
        self.ttft = histogram("kvfit:time_to_first_token_seconds", "Time to the first token.",
                              _TTFT_BUCKETS)
        self.itl = histogram("kvfit:inter_token_latency_seconds", "Time between tokens.",
                             _ITL_BUCKETS)
        self.e2e = histogram("kvfit:e2e_request_latency_seconds", "Time from arrival to the "
                             "last token.", _REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "kvfit:request_queue_time_seconds", "Time each finished request waited in the "
            "engine's queue before it was first scheduled.", _REQUEST_LATENCY_BUCKETS)
        # vLLM's phases of a request on the engine's clock: first scheduled -> first token
        # (prefill), first token -> finished (decode), first scheduled -> finished (inference).
        self.prefill_time = histogram(
            "kvfit:request_prefill_time_seconds", "Time each finished request spent from its "
            "first scheduling to its first token.", _REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(
            "kvfit:request_decode_time_seconds", "Time each finished request spent from its "
            "first token to its end.", _REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "kvfit:request_inference_time_seconds", "Time each finished request spent from "
            "its first scheduling to its end.", _REQUEST_LATENCY_BUCKETS)
        self.request_params_n = histogram(
            "kvfit:request_params_n", "Histogram of the n request parameter (one per request "
            "once all its completions finished).", _N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "kvfit:request_params_max_tokens", "Histogram of the max_tokens request parameter "
            "(as the engine ran it), one per finished completion.", tokens)
        self.request_prompt_tokens = histogram(
            "kvfit:request_prompt_tokens", "Prompt tokens of each finished request.", tokens)
        self.request_generation_tokens = histogram(
            "kvfit:request_generation_tokens", "Generated tokens of each finished request.",
            tokens)

    def render(self) -> bytes:
        """The exposition text of every collector."""
        return generate_latest(self._scrape)

    def failure(self, status_code: int) -> None:
        """Count a request answered with an error status."""
        reason = _FAILURE_REASONS.get(status_code)
        if reason is None:
            reason = "invalid" if 400 <= status_code < 500 else "error"
        self.request_failure.labels(self.model_name, reason).inc()

    def track(self, stream: RequestStream, num_prompt_tokens: int,
              max_tokens: int | None = None) -> None:
        """Time `stream`'s tokens as they pass (before it is iterated); its tokens are
        counted when it ends, each completion's outcome as it finishes (one left early counts
        as aborted)."""
        stream.observer = _RequestTiming(self, num_prompt_tokens, len(stream.output.outputs),
                                         stream.phase_times, max_tokens)


class _RequestTiming:
    """One request's figures, fed by its stream (`StreamObserver`). Each of its `n`
    completions is a request to the request figures (success, time to first token, e2e
    latency, token histograms), as vLLM's n child requests are, so their counts agree."""

    __slots__ = ("metrics", "num_prompt_tokens", "num_completions", "phase_times",
                 "max_tokens", "start", "last", "counts", "done")

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int,
                 num_completions: int = 1, phase_times: dict[int, PhaseTimes] | None = None,
                 max_tokens: int | None = None) -> None:
        self.metrics, self.num_prompt_tokens = metrics, num_prompt_tokens
        self.num_completions, self.max_tokens = num_completions, max_tokens
        # The stream's: each completion's queue, prefill, decode and inference times, in by
        # its end.
        self.phase_times = {} if phase_times is None else phase_times
        self.start = self.last = time.perf_counter()
        self.counts: dict[int, int] = {}  # tokens seen so far, by completion index
        self.done: set[int] = set()  # completions counted as finished

    @property
    def num_tokens(self) -> int:
        return sum(self.counts.values())

    def output(self, output: RequestOutput) -> None:
        new = {o.index: len(o.token_ids) - self.counts.get(o.index, 0) for o in output.outputs}
        new = {i: k for i, k in new.items() if k > 0}
        now = self._tokens(new) if new else None
        for o in output.outputs:
            if o.finish_reason is not None and o.index not in self.done:
                self._finished(o.index, o.finish_reason,
                               time.perf_counter() if now is None else now)

    def _tokens(self, new: dict[int, int]) -> float:
        """Time the new tokens (by completion index); the time now."""
        # One inter-token sample per token after a completion's first, as vLLM counts them,
        # however the outputs were coalesced on their way here. A completion's tokens that
        # came together share the gap since its last ones; those that came with its first
        # token came at once (a gap of 0). The n completions advance side by side, so each
        # one's gap is the whole interval, not a share of it.
        now = time.perf_counter()
        for i, k in new.items():
            first = i not in self.counts
            if first:
                self.metrics.ttft.observe(now - self.start)
            gap = 0.0 if first else (now - self.last) / k
            for _ in range(k - 1 if first else k):
                self.metrics.itl.observe(gap)
            self.counts[i] = self.counts.get(i, 0) + k
        self.last = now
        return now

    def _finished(self, index: int, finish_reason: str, now: float) -> None:
        m = self.metrics
        self.done.add(index)
        m.e2e.observe(now - self.start)
        m.request_success.labels(m.model_name, finish_reason).inc()
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(self.counts.get(index, 0))
        if self.max_tokens:  # as vLLM: an unset max_tokens is no observation
            m.request_params_max_tokens.observe(self.max_tokens)
        if (times := self.phase_times.get(index)) is not None:
            queue, prefill, decode, inference = times
            m.queue_time.observe(queue)
            m.prefill_time.observe(prefill)
            m.decode_time.observe(decode)
            m.inference_time.observe(inference)
        if len(self.done) == self.num_completions:  # vLLM's parent request: once, at its end
            m.request_params_n.observe(self.num_completions)

    def end(self, failed: bool) -> None:
        m = self.metrics
        m.prompt_tokens.inc(self.num_prompt_tokens)
        m.generation_tokens.inc(self.num_tokens)
        aborted = self.num_completions - len(self.done)
        if aborted and not failed:  # a failure is counted by the error handler that answers it
            m.request_success.labels(m.model_name, "abort").inc(aborted)
