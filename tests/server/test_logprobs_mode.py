"""A server whose engine runs logprobs_mode=processed_logprobs: vLLM's values, and the -inf of
filtered tokens sent as vLLM's -9999.0 (JSON has no infinity)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvfit.engine.config import EngineArgs
from kvfit.server.async_llm import AsyncLLM

from .conftest import MODEL_NAME, engine_kwargs

PROMPT = [5, 17, 300, 42, 9]


@pytest.fixture(scope="module")
def engine(model_path: Path) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path), logprobs_mode="processed_logprobs"))
    yield engine
    engine.shutdown()


@torch.no_grad()
def hf_logits(model_path: Path, tokens: list[int]) -> torch.Tensor:
    """The model's float64 logits after each of `tokens`, by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return model(torch.tensor([tokens])).logits[0].double()


def test_completion_logprobs_are_the_processed_ones(http: httpx.Client,
                                                    model_path: Path) -> None:
    r = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1, "temperature": 0.8,
        "top_k": 3, "seed": 1, "logprobs": 5, "prompt_logprobs": 1,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    assert "Infinity" not in r.text and "NaN" not in r.text
    choice = r.json()["choices"][0]
    logits = hf_logits(model_path, PROMPT)
    # By hand: temperature, then top-k; the 2 entries past the top 3 are -inf, sent as -9999.
    x = logits[-1] / 0.8
    x[x < x.topk(3).values[-1]] = float("-inf")
    expected = x.log_softmax(-1).clamp_min(-9999.0)
    top = choice["logprobs"]["top_logprobs"][0]
    assert len(top) == 5 and sorted(top.values()).count(-9999.0) == 2
    for key, value in top.items():
        assert value == pytest.approx(expected[int(key.removeprefix("token_id:"))].item(),
                                      abs=1e-4)
    token = int(choice["logprobs"]["tokens"][0].removeprefix("token_id:"))
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(expected[token].item(),
                                                                    abs=1e-4)
    # prompt_logprobs stay raw, as vLLM's.
    raw = logits[:-1].log_softmax(-1)
    for position, entries in enumerate(choice["prompt_logprobs"][1:]):
        for token_id, entry in entries.items():
            assert entry["logprob"] == pytest.approx(raw[position, int(token_id)].item(),
                                                     abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_of_filtered_tokens_are_minus_9999(http: httpx.Client,
                                                         stream: bool) -> None:
    # Whole or streamed (orjson wrote -inf as null, json.dumps refused it).
    r = http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "temperature": 1.0, "top_k": 2, "seed": 3, "logprobs": True, "top_logprobs": 5,
        "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        content = [c for chunk in chunks for choice in chunk["choices"]
                   if choice.get("logprobs") for c in choice["logprobs"]["content"]]
    else:
        content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for item in content:
        values = [entry["logprob"] for entry in item["top_logprobs"]]
        assert values[2:] == [-9999.0] * 3
        # The two tokens top-k keeps hold the whole processed distribution.
        assert torch.tensor(values[:2]).logsumexp(0).item() == pytest.approx(0.0, abs=1e-5)
        assert item["logprob"] in values[:2]  # the sampled token is one of them
