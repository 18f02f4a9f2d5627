"""The engine in a process of its own: a killed engine fails the requests it held with 5xx and
nothing hangs, /health turns 503 and `kvfit serve` exits; no engine process outlives its
server; the in-thread engine (`engine_process=False`) still serves the same."""

from __future__ import annotations

import asyncio
import importlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import engine_hooks
import httpx
import psutil
import pytest

from kvfit import LLM, SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.engine.outputs import RequestOutput
from kvfit.server.async_llm import AsyncLLM, EngineDeadError
from kvfit.server.openai_api import ServeConfig, build_app

from .conftest import MODEL_NAME, ServeProcess, ServerThread, engine_kwargs, in_engine


@pytest.fixture
def doomed(model_path: Path) -> Iterator[AsyncLLM]:
    """An engine of the test's own, for it to kill."""
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path)))
    yield engine
    engine.shutdown()


def _wait_for(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_killed_engine_fails_what_it_held_and_health(doomed: AsyncLLM, tmp_path: Path) -> None:
    died: list[BaseException] = []
    doomed.add_dead_callback(died.append)
    # Steps holding "held" stall until killed (the release file never appears).
    in_engine(doomed, engine_hooks.stall, "held", str(tmp_path / "never"))
    server = ServerThread(build_app(doomed, ServeConfig([MODEL_NAME])))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            plain: list[httpx.Response] = []
            waiter = threading.Thread(target=lambda: plain.append(http.post(
                "/v1/completions", json={"prompt": "held", "max_tokens": 4})))
            body = {"prompt": "held", "max_tokens": 4, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as streamed:
                assert streamed.status_code == 200
                waiter.start()
                _wait_for(lambda: doomed.num_requests == 2, "the requests never arrived")
                os.kill(doomed.engine_pid, signal.SIGKILL)
                events = [line for line in streamed.iter_lines() if line.startswith("data:")]
            waiter.join(timeout=30)
            assert not waiter.is_alive(), "a request held by the dead engine hung"
            assert plain[0].status_code == 503
            assert plain[0].json()["error"]["type"] == "service_unavailable"
            assert "service_unavailable" in events[0] and events[-1] == "data: [DONE]"
            assert http.get("/health").status_code == 503
            r = http.post("/v1/completions", json={"prompt": "later", "max_tokens": 2})
            assert r.status_code == 503 and "engine" in r.json()["error"]["message"]
    finally:
        server.stop()
    assert not doomed.is_alive and doomed.num_requests == 0
    assert len(died) == 1 and isinstance(died[0], EngineDeadError)
    assert "exit code -9" in str(died[0])


def test_a_call_in_flight_when_the_engine_dies_fails(doomed: AsyncLLM, tmp_path: Path) -> None:
    async def run() -> None:
        in_flight = asyncio.ensure_future(doomed.call_engine(engine_hooks.pause, 30))
        await asyncio.sleep(0.5)
        os.kill(doomed.engine_pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(in_flight, 30)
        with pytest.raises(EngineDeadError):
            await doomed.call_engine(engine_hooks.pause, 0)

    asyncio.run(run())


def test_a_call_that_does_not_pickle_is_refused_and_the_engine_serves_on(
        doomed: AsyncLLM) -> None:
    # Found by the hunt: a lambda sent to the engine process stopped the thread that sends
    # commands: the call, and every request after it, waited forever.
    async def run() -> str | None:
        with pytest.raises(TypeError, match="must pickle"):
            await asyncio.wait_for(doomed.call_engine(lambda llm: 1), 30)
        outputs = [out async for out in doomed.generate("later", SamplingParams(max_tokens=2))]
        return outputs[-1].outputs[0].finish_reason

    assert asyncio.run(asyncio.wait_for(run(), 60)) is not None


def test_a_call_whose_function_the_engine_cannot_import_fails_alone(
        doomed: AsyncLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by the hunt: it failed to unpickle in the engine's command reader, which stopped:
    # the call, and every request after it, waited forever.
    (tmp_path / "hunt_late_hooks.py").write_text("def one(llm):\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))  # here only: the engine process started before
    late = importlib.import_module("hunt_late_hooks")

    async def run() -> str | None:
        with pytest.raises(ModuleNotFoundError, match="hunt_late_hooks"):
            await asyncio.wait_for(doomed.call_engine(late.one), 30)
        outputs = [out async for out in doomed.generate("later", SamplingParams(max_tokens=2))]
        return outputs[-1].outputs[0].finish_reason

    assert asyncio.run(asyncio.wait_for(run(), 60)) is not None


def test_an_engine_that_fails_tells_its_clients_why(doomed: AsyncLLM) -> None:
    # Its loop raised outside any step (its workers died): the clients' error says why, not
    # only "the engine process exited (exit code 1)".
    died: list[BaseException] = []
    doomed.add_dead_callback(died.append)

    async def run() -> None:
        # The call's own answer is the first thing the broken loop cannot send.
        with pytest.raises(EngineDeadError, match="worker rank 1 was killed"):
            await doomed.call_engine(engine_hooks.break_stats)

    asyncio.run(run())
    _wait_for(lambda: died, "the engine was not reported dead")
    assert "worker rank 1 was killed" in str(died[0])


def test_a_dead_callback_added_after_the_engine_died_is_called_at_once(doomed: AsyncLLM) -> None:
    # `kvfit serve` adds its callback after the engine started: an engine that died in between
    # must still stop the server.
    async def run() -> None:
        with pytest.raises(EngineDeadError):
            await doomed.call_engine(engine_hooks.break_stats)

    asyncio.run(run())
    _wait_for(lambda: doomed._died_of is not None, "the engine was not reported dead")
    died: list[BaseException] = []
    doomed.add_dead_callback(died.append)
    assert len(died) == 1 and "worker rank 1 was killed" in str(died[0])


def test_kvfit_serve_exits_when_its_engine_process_dies() -> None:
    server = ServeProcess()
    try:
        (engine,) = server.engine_processes()
        engine.kill()
        server.proc.wait(timeout=60)
    finally:
        output = server.stop()
    assert server.proc.returncode == 1, output
    assert "exiting, the engine stopped" in output


def test_kvfit_serve_with_two_ranks_answers_as_one_and_exits_when_a_worker_dies() -> None:
    import openai

    prompt = "Hello there, how"
    one = LLM("kvfit-tiny", device="cpu", max_model_len=128, num_gpu_blocks_override=64)
    try:
        expected = one.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True), use_tqdm=False)
    finally:
        one.shutdown()
    server = ServeProcess("--tensor-parallel-size", "2")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        completion = client.completions.create(model="kvfit-tiny", prompt=prompt, max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert completion.choices[0].text == expected[0].outputs[0].text
        (engine,) = server.engine_processes()
        workers = [p for p in engine.children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(workers) == 2
        workers[1].kill()  # while idle: /health must not answer 200 over it
        server.proc.wait(timeout=60)
    finally:
        output = server.stop()
    assert server.proc.returncode == 1, output
    assert re.search(r"exiting, the engine stopped: .*worker rank \d .* killed by SIGKILL",
                     output), output


def test_no_engine_process_outlives_a_killed_server() -> None:
    server = ServeProcess()
    (engine,) = server.engine_processes()
    server.stop(signal.SIGKILL)
    # The pipe's far end closed with the server: the engine process stops by itself.
    engine.wait(timeout=60)
    assert not engine.is_running()


def test_an_engine_that_cannot_start_raises_its_error(model_path: Path) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        AsyncLLM(EngineArgs(**{**engine_kwargs(model_path), "max_num_seqs": 0}))
    assert not [p for p in psutil.Process().children() if _live_spawned(p)]


def _live_spawned(proc: psutil.Process) -> bool:
    """A multiprocessing child still running (a zombie's or a gone process's cmdline cannot be
    read, and neither holds anything)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def test_the_in_thread_engine_serves_the_same(model_path: Path) -> None:
    prompts = [f"The number {i} is followed by" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(**engine_kwargs(model_path))
    refs = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path)), engine_process=False)

    async def text(prompt: str) -> str:
        output = None
        async for output in engine.generate(prompt, params):  # noqa: B007
            pass
        return output.outputs[0].text

    async def run() -> list[str]:
        return await asyncio.gather(*(text(p) for p in prompts))

    try:
        assert engine.engine_pid is None
        assert asyncio.run(run()) == refs
    finally:
        engine.shutdown()
    assert not engine.is_alive



def test_the_front_end_tokenizes_with_the_tokenizer_flag(
        model_path: Path, split_tokenizer: Callable[[Path], tuple[Path, Path]]) -> None:
    # `--tokenizer FOLDER` for a model folder without tokenizer files: the engine took it, but
    # the front end loaded the model folder's (none), so every text prompt was refused.
    model, tokenizer = split_tokenizer(model_path)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(**engine_kwargs(model_path))
    [ref] = llm.generate("The sky is", params, use_tqdm=False)
    llm.shutdown()
    engine = AsyncLLM(EngineArgs(**{**engine_kwargs(model), "tokenizer": str(tokenizer)}),
                      engine_process=False)

    async def run() -> RequestOutput:
        output = None
        async for output in engine.generate("The sky is", params):  # noqa: B007
            pass
        return output

    try:
        assert engine.tokenizer is not None
        out = asyncio.run(run())
    finally:
        engine.shutdown()
    assert out.prompt_token_ids == ref.prompt_token_ids
    assert out.outputs[0].text == ref.outputs[0].text != ""


def test_the_async_engine_holds_a_params_object_changed_after_construction_to_its_bounds(
        model_path: Path) -> None:
    # `add_request` queues a shallow copy of the caller's params, no constructor run: a list
    # grown past MAX_TOKEN_LIST afterwards reached the sampler beyond what warmup measured.
    engine = AsyncLLM(EngineArgs(**engine_kwargs(model_path)), engine_process=False)
    params = SamplingParams(max_tokens=1)
    params.allowed_token_ids = list(range(500)) * 3

    async def run() -> None:
        engine.add_request({"prompt_token_ids": [5, 6]}, params)

    try:
        with pytest.raises(ValueError, match="SamplingParams.allowed_token_ids holds at most"):
            asyncio.run(run())
    finally:
        engine.shutdown()


def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path: Path) -> None:
    """A vLLM user's script making an AsyncLLM at its top level: the spawned engine process
    runs that top level again and dies, and the error said only that the engine exited."""
    import subprocess
    import sys

    script = tmp_path / "no_guard.py"
    script.write_text("from kvfit.engine.config import EngineArgs\n"
                      "from kvfit.server.async_llm import AsyncLLM\n"
                      "AsyncLLM(EngineArgs(model='kvfit-tiny', max_model_len=32, "
                      "max_num_seqs=1, device='cpu'))\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1
    assert last.startswith("RuntimeError: the engine process exited") and "__main__" in last
