"""A request's unset sampling fields take generation_config.json's defaults (vLLM's
`--generation-config auto`); the fields it sets win."""

from __future__ import annotations

import pytest

pytest.importorskip("pydantic")

from kvfit.server.protocol import ChatCompletionRequest, CompletionRequest  # noqa: E402

DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}


def test_unset_fields_take_the_models_defaults() -> None:
    params = CompletionRequest(prompt="x").sampling_params(16, None, None, DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.95, 20)
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0  # not in the file
    assert params.max_tokens == 16  # the length is the server's to cut (check_length)


def test_fields_the_request_sets_win() -> None:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], temperature=0,
                                 top_k=-1)
    params = body.sampling_params(8, None, None, DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.95, -1)


def test_without_defaults_sampling_params_own() -> None:
    params = CompletionRequest(prompt="x").sampling_params(16, None)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)


def test_max_new_tokens_caps_the_completion_length() -> None:
    # vLLM's get_max_tokens: the least of the context left, the request's max_tokens and
    # generation_config.json's max_new_tokens.
    from types import SimpleNamespace

    from kvfit.server.serving import OpenAIServing

    def serving(defaults: dict) -> OpenAIServing:
        serving = OpenAIServing.__new__(OpenAIServing)
        model_config = SimpleNamespace(sampling_defaults=defaults)
        serving.engine = SimpleNamespace(max_model_len=128,
                                         config=SimpleNamespace(model_config=model_config))
        return serving

    capped = serving({"max_tokens": 20})
    assert capped.check_length(10, None, "prompt", "max_tokens") == 20
    assert capped.check_length(10, 50, "prompt", "max_tokens") == 20
    assert capped.check_length(10, 5, "prompt", "max_tokens") == 5
    assert capped.check_length(120, None, "prompt", "max_tokens") == 8
    assert serving({}).check_length(10, None, "prompt", "max_tokens") == 118


def test_seed_minus_one_is_no_seed_as_in_vllm() -> None:
    # vLLM's and OpenAI's "random": the request samples from the engine's generator.
    assert CompletionRequest(prompt="x", seed=-1).sampling_params(16, None).seed is None
    assert CompletionRequest(prompt="x", seed=-2).sampling_params(16, None).seed == -2


def test_the_help_and_readme_say_max_new_tokens_caps_a_served_request() -> None:
    # They said only that an unset max_tokens takes it; the server caps a set one too.
    import argparse
    from pathlib import Path

    from kvfit.engine.config import EngineArgs

    text = " ".join(EngineArgs.add_cli_args(argparse.ArgumentParser()).format_help().split())
    assert "its max_new_tokens also caps every served request's max_tokens" in text
    readme = " ".join((Path(__file__).resolve().parents[2] / "README.md").read_text().split())
    assert "holds every request's max_tokens to max_new_tokens" in readme
