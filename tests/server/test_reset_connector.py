"""`POST /reset_prefix_cache?reset_external=true` over an engine with a host tier (in its own
process, as `kvfit serve` runs it): after weights change through `collective_rpc`, which the
engine does not see, the tier answers prompts only with what the new weights computed."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.openai_api import ServeConfig, build_app

from .conftest import MODEL_NAME, ServerThread, engine_kwargs

PROMPT = list(range(5, 50))  # two full blocks of 16 tokens
COMPLETION = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
              "ignore_eos": True}


@pytest.fixture(scope="module")
def served(model_path: Path) -> Iterator[tuple[AsyncLLM, httpx.Client]]:
    """An engine with a host tier and a server over it with `/reset_prefix_cache`."""
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path), kv_offloading_size=0.01))
    server = ServerThread(build_app(engine, ServeConfig(served_model_names=[MODEL_NAME],
                                                        enable_kv_cache_endpoints=True)))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            yield engine, client
    finally:
        server.stop()
        engine.shutdown()


def updated(model: Path, folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """New K and V projections for `model` (a trainer's update), and a copy of `model`
    whose checkpoint holds them."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(1)
    weights = {name: (0.3 * torch.randn(t.shape, generator=generator)
                      if "k_proj" in name or "v_proj" in name else t)
               for name, t in load_file(model / "model.safetensors").items()}
    folder = Path(shutil.copytree(model, folder))
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return weights, folder


def text(client: httpx.Client) -> str:
    response = client.post("/v1/completions", json=COMPLETION)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_reset_external_drops_the_old_weights_blocks_and_the_tier_goes_on(
        served, model_path, tmp_path) -> None:
    engine, client = served
    weights, folder = updated(model_path, tmp_path / "model")
    fresh = LLM(**engine_kwargs(folder))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        expect = fresh.generate([{"prompt_token_ids": PROMPT}], params,
                                use_tqdm=False)[0].outputs[0].text
    finally:
        fresh.shutdown()
    assert text(client) != expect  # the tier saves the prompt's blocks
    asyncio.run(engine.collective_rpc("load_weights", args=(list(weights.items()),)))
    # The prefix cache alone: the tier answers with the old weights' K/V.
    assert client.post("/reset_prefix_cache").json() == {"reset": True}
    hits = engine.stats().kv_connector_hit_tokens
    assert text(client) != expect
    assert engine.stats().kv_connector_hit_tokens == hits + 32
    reset = client.post("/reset_prefix_cache", params={"reset_external": "true"})
    assert reset.json() == {"reset": True}
    assert text(client) == expect
    # What the new weights computed was saved, and is what the tier serves now.
    assert client.post("/reset_prefix_cache").json() == {"reset": True}
    hits = engine.stats().kv_connector_hit_tokens
    assert text(client) == expect
    assert engine.stats().kv_connector_hit_tokens == hits + 32
