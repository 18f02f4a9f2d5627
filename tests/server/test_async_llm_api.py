"""`AsyncLLM` called as vLLM's: code written for vLLM's `AsyncLLM` (a custom server, an RL
trainer) runs against kvfit's, under vLLM's names and calling conventions."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import engine_hooks
import pytest
import torch

from kvfit import SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.engine.outputs import RequestOutput
from kvfit.server.async_llm import AsyncLLM, EngineDeadError

from .conftest import engine_kwargs


def test_generate_takes_vllms_keywords(engine: AsyncLLM) -> None:
    # vLLM's examples call `engine.generate(prompt=..., sampling_params=..., request_id=...)`:
    # `sampling_params=` was a TypeError (the argument was named `params`).
    params = SamplingParams(temperature=0.0, max_tokens=6)

    async def run() -> tuple[RequestOutput, RequestOutput]:
        by_keyword = [out async for out in engine.generate(
            prompt="The sky is", sampling_params=params, request_id="keywords")][-1]
        by_position = [out async for out in engine.generate("The sky is", params)][-1]
        return by_keyword, by_position

    by_keyword, by_position = asyncio.run(run())
    assert by_keyword.request_id == "keywords" and by_keyword.finished
    assert by_keyword.outputs[0].token_ids == by_position.outputs[0].token_ids
    assert len(by_keyword.outputs[0].token_ids) == 6


def test_the_engines_state_under_vllms_names(engine: AsyncLLM, model_path: Path) -> None:
    # vLLM's servers and frameworks read `errored`, `is_running`, `is_stopped` and
    # `dead_error`, and await `check_health()`: each was an AttributeError.
    assert engine.is_running and not engine.errored and not engine.is_stopped
    assert asyncio.run(engine.check_health()) is None

    stopped = AsyncLLM(EngineArgs(**engine_kwargs(model_path)), engine_process=False)
    stopped.shutdown()
    assert stopped.errored and stopped.is_stopped and not stopped.is_running
    assert isinstance(stopped.dead_error, EngineDeadError)
    with pytest.raises(EngineDeadError, match="not running"):
        asyncio.run(stopped.check_health())


def test_the_tokenizer_and_configs_under_vllms_names(engine: AsyncLLM) -> None:
    # vLLM's `get_tokenizer()`, `model_config` and `vllm_config` were AttributeErrors.
    tokenizer = engine.get_tokenizer()
    assert tokenizer is engine.tokenizer and tokenizer.decode(tokenizer.encode("hi")) == "hi"
    assert engine.model_config is engine.config.model_config
    assert engine.model_config.max_model_len == engine.max_model_len == 128
    assert engine.vllm_config is engine.config
    assert engine.vllm_config.scheduler_config.max_num_seqs == 64


def test_vllms_engine_client_coroutines(engine: AsyncLLM) -> None:
    # vLLM's EngineClient coroutines that code written for its older releases, or for its
    # serving layer, awaits: each was an AttributeError.
    async def run() -> tuple:
        return (await engine.get_model_config(), await engine.get_vllm_config(),
                await engine.get_supported_tasks(), await engine.is_tracing_enabled())

    assert asyncio.run(run()) == (engine.model_config, engine.config, ("generate",), False)


def test_reset_prefix_cache_takes_vllms_arguments(engine: AsyncLLM) -> None:
    # vLLM's `reset_prefix_cache(reset_running_requests, reset_connector)`: `reset_connector`
    # was a TypeError; False resets; True with no connector configured is False, as vLLM's.
    assert asyncio.run(engine.reset_prefix_cache(reset_running_requests=False,
                                                 reset_connector=False)) is True
    assert asyncio.run(engine.reset_prefix_cache(reset_connector=True)) is False
    assert engine.is_running


def test_collective_rpc_as_vllms(engine: AsyncLLM) -> None:
    # vLLM's `await engine.collective_rpc(method, timeout, args, kwargs)` was an
    # AttributeError. A worker method by name or a callable taking the worker; one answer per
    # worker (the engine here runs in a process: what is sent must pickle).
    async def run() -> tuple[list, list, list]:
        return (await engine.collective_rpc(getattr, args=("rank",)),
                await engine.collective_rpc("apply_model", kwargs={"func": type}),
                await engine.collective_rpc("sleep_state"))

    ranks, [model_type], [state] = asyncio.run(run())
    assert ranks == [0] and issubclass(model_type, torch.nn.Module)
    assert not state.is_sleeping
    with pytest.raises(ValueError, match="timeout"):
        asyncio.run(engine.collective_rpc("sleep_state", timeout=1.0))


def test_from_engine_args_is_vllms_constructor(model_path: Path) -> None:
    # vLLM's scripts start with `AsyncLLM.from_engine_args(engine_args)`: an AttributeError.
    args = EngineArgs(**engine_kwargs(model_path))
    with pytest.raises(ValueError, match="stat_loggers"):
        AsyncLLM.from_engine_args(args, stat_loggers=[object])
    engine = AsyncLLM.from_engine_args(args, start_engine_loop=True, engine_process=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=3)

        async def run() -> RequestOutput:
            return [out async for out in engine.generate("The sky is", params, "a")][-1]

        assert len(asyncio.run(run()).outputs[0].token_ids) == 3
    finally:
        engine.shutdown()


def test_generate_takes_vllms_keywords_that_ask_for_nothing(engine: AsyncLLM) -> None:
    # Frameworks on vLLM pass `lora_request=None` (and `trace_headers`, ...) to `generate`:
    # each was a TypeError. Those asking for nothing are taken; the rest refused by name.
    params = SamplingParams(temperature=0.0, max_tokens=3)

    async def run(**kwargs: object) -> RequestOutput:
        return [out async for out in engine.generate("The sky is", params, **kwargs)][-1]

    taken = asyncio.run(run(lora_request=None, tokenization_kwargs={}, data_parallel_rank=0,
                            trace_headers={"traceparent": "00-0-0-01"}))
    assert taken.outputs[0].token_ids == asyncio.run(run()).outputs[0].token_ids
    for refused, name in [({"lora_request": object()}, "lora_request"),
                          ({"tokenization_kwargs": {"truncation": True}}, "tokenization_kwargs"),
                          ({"data_parallel_rank": 1}, "data_parallel_rank")]:
        with pytest.raises(ValueError, match=name):
            asyncio.run(run(**refused))
    assert engine.num_requests == 0  # nothing was queued for a refused call


def test_profiling_calls_say_how_to_profile(engine: AsyncLLM) -> None:
    # vLLM's `await engine.start_profile()` / `stop_profile()` were AttributeErrors; there is
    # no engine profiler here: the error says how to profile instead.
    for call in (engine.start_profile(), engine.stop_profile()):
        with pytest.raises(NotImplementedError, match="torch.profiler"):
            asyncio.run(call)


@pytest.mark.parametrize(("params", "hint"), [(None, "got None"),
                                              ({"max_tokens": 3}, r"SamplingParams\(\*\*params\)")])
def test_sampling_params_of_another_type_are_named(engine: AsyncLLM, params: object,
                                                   hint: str) -> None:
    # `generate(prompt, None)` or a dict of params was an AttributeError ('NoneType' object has
    # no attribute 'detokenize') from deep inside; it names the argument, and nothing is queued.
    async def run() -> None:
        async for _ in engine.generate("The sky is", params):  # type: ignore[arg-type]
            pass

    with pytest.raises(TypeError, match=f"sampling_params must be a SamplingParams; .*{hint}"):
        asyncio.run(run())
    assert engine.num_requests == 0


def test_vllms_add_request_order_is_named(engine: AsyncLLM) -> None:
    # vLLM's `add_request(request_id, prompt, params)` put the id where the prompt goes here.
    with pytest.raises(TypeError, match=r"vLLM's add_request\(request_id, prompt, params\)"):
        engine.add_request("req-1", "The sky is", SamplingParams())  # type: ignore[arg-type]
    assert engine.num_requests == 0


def test_shutdown_takes_vllms_timeout(model_path: Path) -> None:
    # vLLM's `shutdown(timeout=...)` was a TypeError. An engine process busy past it (here
    # held between two steps for a minute) is terminated instead of waited for.
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path)))

    async def hold_and_shut_down() -> float:
        held = asyncio.ensure_future(engine.call_engine(engine_hooks.pause, 60.0))
        await asyncio.sleep(0.5)  # the engine is inside the call
        start = time.monotonic()
        engine.shutdown(timeout=1.0)
        elapsed = time.monotonic() - start
        with pytest.raises(EngineDeadError):
            await held
        return elapsed

    try:
        assert asyncio.run(hold_and_shut_down()) < 20
        assert engine.errored
    finally:
        engine.shutdown()


def test_do_log_stats_logs_the_engines_figures(engine: AsyncLLM,
                                               caplog: pytest.LogCaptureFixture) -> None:
    # vLLM's servers await `engine.do_log_stats()` every few seconds: an AttributeError.
    with caplog.at_level(logging.INFO, logger="kvfit.server.async_llm"):
        asyncio.run(engine.do_log_stats())
    assert any(r.getMessage().startswith("AsyncLLM: running 0 seqs") for r in caplog.records)


def test_an_engine_thread_busy_past_the_shutdown_timeout_frees_the_model_as_it_stops(
        model_path: Path) -> None:
    # An engine on a thread cannot be stopped inside a step: `shutdown(timeout=...)` freed the
    # model from the caller's thread once the timeout passed, under the step still running.
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path)), engine_process=False)
    client = engine._client
    core = client._llm.engine
    entered, release = threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def hold(llm: Any) -> None:  # as a long step: the loop thread is busy in the engine
        entered.set()
        release.wait(60)
        seen["shut_down"] = llm.engine._shut_down  # what the step would run on

    async def run() -> None:
        held = asyncio.ensure_future(engine.call_engine(hold))
        await asyncio.sleep(0)  # sends the call
        assert entered.wait(60)
        engine.shutdown(timeout=0.2)
        assert not core._shut_down  # the loop is still in the engine
        release.set()
        client._thread.join(60)
        with contextlib.suppress(EngineDeadError):
            await asyncio.wait_for(held, 10)

    asyncio.run(run())
    assert seen == {"shut_down": False}
    assert core._shut_down  # freed by the loop as it stopped
