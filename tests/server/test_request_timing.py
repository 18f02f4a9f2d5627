"""The server's per-request latency figures count tokens, not deliveries: an API process that
falls behind gets several tokens in one output, and vLLM's inter-token count is still one per
token after the first."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client.metrics import MetricWrapperBase  # noqa: E402

from kvfit.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from kvfit.server.metrics import ServerMetrics, _RequestTiming  # noqa: E402


def _output(*token_counts: int, finished: bool = False) -> RequestOutput:
    outputs = [CompletionOutput(index=i, text="", token_ids=list(range(k)),
                                cumulative_logprob=None, logprobs=None,
                                finish_reason="length" if finished else None)
               for i, k in enumerate(token_counts)]
    return RequestOutput("r", None, [1, 2], None, outputs, finished)


def _sample(metric: object, suffix: str) -> float:
    (family,) = metric.collect()  # type: ignore[attr-defined]
    return next(s.value for s in family.samples if s.name.endswith(suffix))


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(engine=None, model_name="tiny", max_model_len=128)  # type: ignore[arg-type]  # the engine's collector is not read


@pytest.mark.parametrize("deliveries", [[1, 2, 3], [2, 3], [3], [1, 3]])
def test_one_inter_token_sample_per_token_after_the_first(metrics: ServerMetrics,
                                                          deliveries: list[int]) -> None:
    timing = _RequestTiming(metrics, num_prompt_tokens=2)
    for k in deliveries:
        timing.output(_output(k, finished=k == 3))
    timing.end(failed=False)
    assert _sample(metrics.ttft, "_count") == 1
    assert _sample(metrics.itl, "_count") == 2
    assert _sample(metrics.generation_tokens, "_total") == 3


def test_n_completions_each_count_their_own_tokens(metrics: ServerMetrics,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr("kvfit.server.metrics.time.perf_counter", lambda: next(clock))
    timing = _RequestTiming(metrics, num_prompt_tokens=2)
    for k in (1, 2, 4):  # at 1 s, 2 s and 3 s
        timing.output(_output(k, k, finished=k == 4))
    # Each completion is a request to the request figures, as vLLM's n child requests are.
    assert _sample(metrics.ttft, "_sum") == 2 * 1.0 and _sample(metrics.ttft, "_count") == 2
    assert _sample(metrics.itl, "_count") == 2 * 3
    # Each completion's gap is the whole interval, never a share of it split between the n:
    # one token each at 2 s (1 s apart), then two each at 3 s (0.5 s apart).
    assert _sample(metrics.itl, "_sum") == pytest.approx(2 * 1.0 + 4 * 0.5)


def _bucket_count(metric: object, le: str) -> float:
    (family,) = metric.collect()  # type: ignore[attr-defined]
    return next(s.value for s in family.samples
                if s.name.endswith("_bucket") and s.labels["le"] == le)


def test_long_requests_land_in_finite_buckets(metrics: ServerMetrics,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A 5-minute answer after a 3-minute wait has finite buckets (vLLM's), so a quantile of
    them reads its size rather than the last bound (80 s, whatever the latency)."""
    clock = iter([0.0, 180.0, 300.0, 300.0])
    monkeypatch.setattr("kvfit.server.metrics.time.perf_counter", lambda: next(clock))
    timing = _RequestTiming(metrics, num_prompt_tokens=2)
    timing.output(_output(1))  # the first token at 180 s
    timing.output(_output(2, finished=True))  # the last at 300 s
    timing.end(failed=False)
    assert _bucket_count(metrics.ttft, "160.0") == 0 and _bucket_count(metrics.ttft, "640.0") == 1
    assert _bucket_count(metrics.e2e, "240.0") == 0 and _bucket_count(metrics.e2e, "480.0") == 1
    assert _bucket_count(metrics.itl, "80.0") == 0  # 120 s between the two tokens: past vLLM's too


def _sample_of(metrics: ServerMetrics, name: str, **labels: str) -> float:
    """A sample of the request figures by its full name and labels (model_name aside)."""
    figures = [v for v in vars(metrics).values() if isinstance(v, MetricWrapperBase)]
    return next((s.value for figure in figures for family in figure.collect()
                 for s in family.samples if s.name == name
                 and {**s.labels, "model_name": "tiny"} == {"model_name": "tiny", **labels}), 0.0)


def test_each_completion_counts_as_a_request(metrics: ServerMetrics,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """n completions are n requests to every request figure, as vLLM's child requests: each
    has its own time to first token, its own end (e2e latency, success by its finish reason,
    token histograms) when it finishes, and those left unfinished count as aborted."""
    clock = iter([0.0, 1.0, 2.0, 3.0])
    monkeypatch.setattr("kvfit.server.metrics.time.perf_counter", lambda: next(clock))
    timing = _RequestTiming(metrics, num_prompt_tokens=5, num_completions=3)
    out = _output(1, 1, 1)
    timing.output(out)  # 1 s: every first token
    out.outputs[0].token_ids.append(7)
    out.outputs[0].finish_reason = "stop"
    out.outputs[1].token_ids.append(7)
    timing.output(out)  # 2 s: the first completion stops
    for o in out.outputs[1:]:
        o.token_ids += [8, 9]
    out.outputs[1].finish_reason = "length"
    timing.output(out)  # 3 s: the second one ends too; the third is left unfinished
    timing.end(failed=False)
    assert _sample_of(metrics, "kvfit:time_to_first_token_seconds_count") == 3
    assert _sample_of(metrics, "kvfit:request_success_total", finished_reason="stop") == 1
    assert _sample_of(metrics, "kvfit:request_success_total", finished_reason="length") == 1
    assert _sample_of(metrics, "kvfit:request_success_total", finished_reason="abort") == 2 - 1
    assert _sample_of(metrics, "kvfit:e2e_request_latency_seconds_count") == 2
    assert _sample_of(metrics, "kvfit:e2e_request_latency_seconds_sum") == 2.0 + 3.0
    assert _sample_of(metrics, "kvfit:request_generation_tokens_count") == 2
    assert _sample_of(metrics, "kvfit:request_generation_tokens_sum") == 2 + 4
    assert _sample_of(metrics, "kvfit:request_prompt_tokens_sum") == 2 * 5
    assert _sample_of(metrics, "kvfit:generation_tokens_total") == 2 + 4 + 3
    assert _sample_of(metrics, "kvfit:prompt_tokens_total") == 5  # once, as the usage has it
