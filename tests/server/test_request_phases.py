"""vLLM's request phase histograms (`request_prefill_time_seconds`, `..._decode_...`,
`..._inference_...`), `request_params_n`, `request_params_max_tokens` and
`iteration_tokens_total` on `/metrics`, against a workload whose counts, sums and times are
known: `max_num_seqs=1`, so requests and completions run one after another."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvfit.engine.config import EngineArgs
from kvfit.server.async_llm import AsyncLLM

from . import engine_hooks
from .conftest import MODEL_NAME, ServerThread, engine_kwargs, in_engine

STEP_S = 0.2
PHASES = ("prefill", "decode", "inference", "queue")


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(**{**engine_kwargs(model_path), "max_num_seqs": 1}))
    yield engine
    engine.shutdown()


def _samples(url: str) -> dict[str, float]:
    """Every sample of `/metrics`, keyed by name plus its `le` bound (model_name left out)."""
    text = httpx.get(f"{url}/metrics").text
    return {s.name + s.labels.get("le", "") + s.labels.get("finished_reason", ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after[name] - before.get(name, 0.0)


def test_phases_n_and_max_tokens_agree_with_the_workload(
        start_server: object, engine: AsyncLLM) -> None:
    server: ServerThread = start_server()  # type: ignore[operator]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    before = _samples(server.url)
    in_engine(engine, engine_hooks.slow, "slow", STEP_S)  # each step of "slow" takes 0.2 s
    try:
        client.completions.create(model=MODEL_NAME, prompt="slow", max_tokens=4,
                                  extra_body={"ignore_eos": True})
    finally:
        in_engine(engine, engine_hooks.clear)
    client.completions.create(model=MODEL_NAME, prompt="fast", max_tokens=3, n=2,
                              extra_body={"ignore_eos": True})
    after = _samples(server.url)

    def d(name: str) -> float:
        return _delta(before, after, f"kvfit:{name}")

    # Three completions: "slow" and the two of "fast" (each a request, as vLLM's children).
    for phase in PHASES:
        assert d(f"request_{phase}_time_seconds_count") == 3, phase
    assert d("e2e_request_latency_seconds_count") == 3
    prefill, decode = d("request_prefill_time_seconds_sum"), d("request_decode_time_seconds_sum")
    inference = d("request_inference_time_seconds_sum")
    # Inference is prefill then decode, on one clock; all of it within the requests' e2e.
    assert inference == pytest.approx(prefill + decode, abs=1e-6)
    assert d("request_queue_time_seconds_sum") + inference <= (
        d("e2e_request_latency_seconds_sum") + 0.05)
    # "slow" ran 4 steps of 0.2 s: its prompt in the first, a token in each.
    assert inference >= 4 * STEP_S
    assert prefill >= STEP_S
    assert decode >= 2 * STEP_S
    # n: one observation per request (1 and 2); max_tokens: one per completion (4, 3, 3).
    assert d("request_params_n_count") == 2
    assert d("request_params_n_sum") == 3
    assert d("request_params_n_bucket1.0") == 1
    assert d("request_params_n_bucket2.0") == 2
    assert d("request_params_max_tokens_count") == 3
    assert d("request_params_max_tokens_sum") == 10
    assert d("request_params_max_tokens_bucket2.0") == 0
    assert d("request_params_max_tokens_bucket5.0") == 3


def test_iteration_tokens_count_each_step_and_its_tokens(
        start_server: object, engine: AsyncLLM) -> None:
    server: ServerThread = start_server()  # type: ignore[operator]
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    before, stats_before = _samples(server.url), engine.stats()
    # A prompt no earlier request shares a block with: every prompt token is computed.
    out = client.completions.create(model=MODEL_NAME, prompt="tokens of every step counted",
                                    max_tokens=5, extra_body={"ignore_eos": True})
    after = _samples(server.url)

    def d(name: str) -> float:
        return _delta(before, after, f"kvfit:{name}")

    num_prompt = out.usage.prompt_tokens
    assert 8 < num_prompt <= 16  # the prompt's step falls in bucket 16
    # One step computes the prompt and samples the first token; four decode steps compute
    # one token each (the fifth token is sampled, never computed).
    assert d("iteration_tokens_total_count") == 5
    assert d("iteration_tokens_total_sum") == num_prompt + 4
    assert d("iteration_tokens_total_bucket1.0") == 4
    assert d("iteration_tokens_total_bucket8.0") == 4
    assert d("iteration_tokens_total_bucket16.0") == 5
    assert d("iteration_tokens_total_bucket+Inf") == 5
    # The engine's step counters say the same.
    assert d("engine_steps_total") == 5
    assert d("engine_step_tokens_total") == num_prompt + 4
    # The stats line's throughputs count the prompt once prefilled, and each sampled token.
    stats = engine.stats()
    assert stats.num_prefilled_tokens - stats_before.num_prefilled_tokens == num_prompt
    assert stats.num_generated_tokens - stats_before.num_generated_tokens == 5
