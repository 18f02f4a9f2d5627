"""`kvfit serve --api-server-count 2`: two API processes in front of one engine process serve
the same answers as `LLM.generate`, both take connections, `/metrics` adds both up; one killed
has its requests aborted while the other serves on; shutdown leaves no process and no metrics
folder. And `ChannelRouter`, which shares the engine between the API processes, on its own."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import engine_hooks
import httpx
import openai
import psutil
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from kvfit import LLM, SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.engine.engine_core import EngineStats
from kvfit.server.async_llm import AsyncLLM
from kvfit.server.engine_client import AttachedEngine, EngineProcess
from kvfit.server.engine_messages import EngineOutputs
from kvfit.server.engine_router import ChannelRouter

from .conftest import ServeProcess, engine_kwargs

FLAGS = ("--max-model-len", "2048", "--num-gpu-blocks-override", "2200", "--api-server-count",
         "2")
PROMPTS = [f"The number {i} is followed by" for i in range(32)]


def _stats(running: int = 0) -> EngineStats:
    return EngineStats(running, 0, 10, 10 - running, 0, 0, 0, 0, 0, 0, 0)


# --- ChannelRouter, without processes ---

def test_router_splits_outputs_by_channel_and_remaps_call_ids() -> None:
    router = ChannelRouter(3, _stats(), False)
    router.attach(1)  # channel 2 never attaches
    assert router.command(0, ("add", "a", [1], None, None)) == (("add", "a", [1], None, None),
                                                               None)
    router.command(1, ("add", "b", [1], None, None))
    router.command(1, ("add", "c", [1], None, None))
    # Both API processes count their calls from 0: the engine sees two ids.
    call0, _ = router.command(0, ("call", 0, "sleep", (1,)))
    call1, _ = router.command(1, ("call", 0, "wake_up", (None,)))
    assert call0[0] == call1[0] == "call" and call0[1] != call1[1]
    assert call0[2:] == ("sleep", (1,)) and call1[2:] == ("wake_up", (None,))
    error = RuntimeError("step failed")
    stats = _stats(running=2)
    routed = dict(router.route(EngineOutputs(
        tokens=[("a", [5]), ("b", [6]), ("ghost", [7])],
        outputs=[("b", [(0, [8], None, "stop", None, None)], True, None)],
        errors=[("c", error)], stats=stats, is_sleeping=True,
        results=[(call1[1], "woke", None), (call0[1], "slept", None)])))
    assert set(routed) == {0, 1}  # not the channel that never attached
    zero, one = routed[0], routed[1]
    assert zero.tokens == [("a", [5])] and zero.outputs == [] and zero.errors == []
    assert zero.results == [(0, "slept", None)]
    assert one.tokens == [("b", [6])] and one.errors == [("c", error)]
    assert one.outputs == [("b", [(0, [8], None, "stop", None, None)], True, None)]
    assert one.results == [(0, "woke", None)]
    for message in (zero, one):  # the engine-wide state goes to every channel
        assert message.stats == stats and message.is_sleeping
    # "b" finished and "c" failed: their ids are free again; results are settled once.
    again = dict(router.route(EngineOutputs([("b", [9]), ("c", [9])], [], [], stats, True,
                                            results=[(call0[1], "twice", None)])))
    assert again[1].tokens == [] and again[0].results == []


def test_router_refuses_a_request_id_of_another_channel() -> None:
    router = ChannelRouter(2, _stats(), False)
    router.attach(1)
    router.command(0, ("add", "x", [1], None, None))
    command, reply = router.command(1, ("add", "x", [1], None, None))
    assert command is None
    ((request_id, error),) = reply.errors
    assert request_id == "x" and isinstance(error, ValueError) and "already running" in str(error)
    # Nor can a channel abort another's request; its own, yes.
    assert router.command(1, ("abort", "x")) == (None, None)
    assert router.command(0, ("abort", "x")) == (("abort", "x"), None)
    # "x" still belongs to channel 0.
    assert [i for i, m in router.route(EngineOutputs([("x", [1])], [], [], _stats(), False))
            if m.tokens] == [0]


def test_router_detaches_a_closed_channel() -> None:
    router = ChannelRouter(2, _stats(), False)
    router.attach(1)
    router.command(0, ("add", "keep", [1], None, None))
    for request_id in ("gone-1", "gone-2"):
        router.command(1, ("add", request_id, [1], None, None))
    call, _ = router.command(1, ("call", 0, "sleep", ()))
    assert sorted(router.detach(1)) == [("abort", "gone-1"), ("abort", "gone-2")]
    assert router.command(0, ("stop",)) == (("stop",), None)  # channel 0 owns the engine
    assert router.command(1, ("stop",)) == (None, None)
    routed = router.route(EngineOutputs(
        [("keep", [1]), ("gone-1", [2])],
        [("gone-2", [(0, [3], None, "abort", None, None)], True, None)], [], _stats(), False,
        results=[(call[1], None, None)]))
    assert [(i, m.tokens, m.outputs, m.results) for i, m in routed] == \
        [(0, [("keep", [1])], [], [])]
    # The last channel to close stops the engine.
    assert router.detach(0) == [("abort", "keep"), ("stop",)]


# --- one engine process, two front ends (in this process) ---

def test_two_front_ends_share_one_engine_process(model_path: Path) -> None:
    """An `AsyncLLM` attached over the second pipe gets its own requests' outputs and its own
    calls' results (both front ends number their calls from 0); detaching it leaves the
    engine serving the first."""
    args = EngineArgs(**engine_kwargs(model_path))
    first = AsyncLLM(args, client=functools.partial(EngineProcess, num_api_servers=2))
    (conn,) = first.engine_client.api_server_conns
    first.engine_client.api_server_conns = []
    second = AsyncLLM(args, client=lambda _, on_outputs, on_dead: AttachedEngine(
        conn, on_outputs, on_dead, first.engine_pid))
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(**engine_kwargs(model_path))
    refs = [o.outputs[0].text for o in llm.generate(PROMPTS[:8], params, use_tqdm=False)]
    llm.shutdown()

    async def text(engine: AsyncLLM, prompt: str) -> str:
        output = None
        async for output in engine.generate(prompt, params):  # noqa: B007
            pass
        return output.outputs[0].text

    async def both() -> tuple[list[str], list[int]]:
        texts = await asyncio.gather(*(text((first, second)[i % 2], p)
                                       for i, p in enumerate(PROMPTS[:8])))
        # Both calls are in flight in the engine at once, with the same id on either side.
        slow = asyncio.ensure_future(first.call_engine(engine_hooks.pause, 0.5))
        await asyncio.sleep(0.1)
        quick = second.call_engine(engine_hooks.num_unfinished)
        results = await asyncio.wait_for(asyncio.gather(slow, quick), 30)
        return texts, results

    try:
        assert second.engine_pid == first.engine_pid
        assert second.max_model_len == first.max_model_len
        texts, results = asyncio.run(both())
        assert texts == refs
        assert results == [None, 0]  # each call settled with its own result
        second.shutdown()
        assert not second.is_alive and first.is_alive
        assert asyncio.run(text(first, PROMPTS[0])) == refs[0]
    finally:
        second.shutdown()
        first.shutdown()


# --- kvfit serve --api-server-count 2 ---

@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, Path]]:
    tmp = tmp_path_factory.mktemp("tmpdir")  # the server's TMPDIR: its metrics folder goes here
    server = ServeProcess(*FLAGS, env={"TMPDIR": str(tmp)})
    yield server, tmp
    server.stop(signal.SIGKILL)


def _api_pids(server: ServeProcess) -> list[int]:
    """The processes listening on the server's port: the first, then the other."""
    pids = [p.pid for p in [psutil.Process(server.proc.pid), *server.engine_processes()]
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
                   for c in p.net_connections("tcp"))]
    assert len(pids) == 2 and pids[0] == server.proc.pid
    return pids


def _requests_by_pid(tmp: Path) -> dict[int, float]:
    """Requests each API process counted (`kvfit:request_success`), from its own file of the
    multiprocess metrics folder."""
    (folder,) = tmp.glob("kvfit-metrics-*")
    counts = {}
    for path in folder.glob("counter_*.db"):
        alone = tmp / f"one-{path.stem}"
        alone.mkdir(exist_ok=True)
        shutil.copy(path, alone)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(alone))
        counts[int(path.stem.split("_")[1])] = sum(
            s.value for m in registry.collect() if m.name == "kvfit:request_success"
            for s in m.samples if s.name.endswith("_total"))
        shutil.rmtree(alone)
    return counts


def _scrape(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics").text
    return {s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")):
            s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_two_api_servers_answer_as_llm_generate(served: tuple[ServeProcess, Path]) -> None:
    server, tmp = served
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm = LLM(model="kvfit-tiny", device="cpu", max_model_len=2048, num_gpu_blocks_override=2200)
    refs = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.shutdown()
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)

    def complete(i: int) -> str:
        kwargs = dict(model="kvfit-tiny", prompt=PROMPTS[i], max_tokens=8, temperature=0.0)
        if i % 2:
            return "".join(c.choices[0].text for c in
                           client.completions.create(**kwargs, stream=True))
        return client.completions.create(**kwargs).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(complete, range(32))) == refs
    # Connections are spread over both processes: each answered some of them.
    counts = _requests_by_pid(tmp)
    assert set(counts) == set(_api_pids(server)), counts
    assert sum(counts.values()) == 32 and min(counts.values()) > 0, counts


def test_metrics_add_up_every_api_server(served: tuple[ServeProcess, Path]) -> None:
    server, tmp = served
    key = "kvfit:request_success_total[('finished_reason', 'length')]"
    before = _scrape(server.url)[key]
    for _ in range(6):  # a new connection each: the kernel picks the process
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    assert sum(_requests_by_pid(tmp).values()) == before + 6
    # Whichever process answers, it reports the same totals.
    for _ in range(4):
        assert _scrape(server.url)[key] == before + 6


def test_a_killed_api_server_has_its_requests_aborted(served: tuple[ServeProcess, Path]) -> None:
    server, _ = served
    first, other = _api_pids(server)
    body = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        streams = []
        try:
            for _ in range(16):
                # A client of its own per stream: a new connection, hashed to either process.
                client = httpx.Client(base_url=server.url, timeout=60)
                response = client.send(client.build_request("POST", "/v1/completions",
                                                            json=body), stream=True)
                assert response.status_code == 200
                lines = response.iter_lines()  # kept: a dropped iterator closes the response
                next(lines)  # the request runs in the engine
                streams.append((client, response, lines))
            held = [c for c in psutil.Process(other).net_connections("tcp")
                    if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == server.port]
            assert held, "no stream went to the second API process"
            psutil.Process(other).kill()
            psutil.Process(other).wait(timeout=30)
        finally:
            for client, response, _ in streams:  # the first process's streams end here too
                response.close()
                client.close()
        # Unaborted, the killed process's requests would run on for their 2000 tokens (over
        # 10 s here); aborted, they are gone at the next step.
        deadline = time.monotonic() + 5
        while True:
            metrics = _scrape(server.url)
            if (metrics["kvfit:num_requests_running[]"] == 0
                    and metrics["kvfit:num_requests_waiting[]"] == 0
                    and metrics["kvfit:kv_cache_usage_perc[]"] == 0):
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        # The first process serves on.
        r = http.post("/v1/completions", json={"prompt": "still", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert psutil.Process(first).is_running() and server.proc.poll() is None


def test_sigterm_stops_what_is_left(served: tuple[ServeProcess, Path]) -> None:
    server, tmp = served
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children  # the engine (the other API process was killed above)
    output = server.stop(signal.SIGTERM)
    assert server.proc.returncode == 0, output
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert not list(tmp.glob("kvfit-metrics-*"))


def test_max_concurrent_requests_bounds_every_api_server_together() -> None:
    # Found by the hunt: each API process counted its own requests against the bound, so
    # --max-concurrent-requests 2 with --api-server-count 2 let 4 run at once.
    server = ServeProcess(*FLAGS, "--max-concurrent-requests", "2")
    body = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    clients, answers = [], []
    try:
        for _ in range(16):
            # A client of its own per request: a new connection, hashed to either process.
            client = httpx.Client(base_url=server.url, timeout=60)
            clients.append(client)
            response = client.send(client.build_request("POST", "/v1/completions", json=body),
                                   stream=True)
            if response.status_code == 200:
                lines = response.iter_lines()  # kept: a dropped iterator closes the response
                next(lines)  # it runs: its slot is held until the stream ends
                answers.append((response, lines))
            else:
                assert response.status_code == 503, response.read()
                assert "--max-concurrent-requests" in response.read().decode()
        assert len(answers) == 2
        for response, _ in answers:  # the slots are given back as the streams end
            response.close()
        deadline = time.monotonic() + 30
        while (r := httpx.post(f"{server.url}/v1/completions",
                               json={"prompt": "a", "max_tokens": 2})).status_code == 503:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.1)
        assert r.status_code == 200
    finally:
        for client in clients:
            client.close()
        output = server.stop()
    assert server.proc.returncode == 0, output


def test_every_api_server_stops_taking_requests_as_the_first_begins_to_stop() -> None:
    # Found by the hunt: the others were sent their SIGTERM only once the first had drained
    # (--shutdown-timeout), and took new requests all that while, then drained again.
    server = ServeProcess(*FLAGS, "--shutdown-timeout", "5")
    body = {"prompt": "go on", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    clients, answers = [], []
    try:
        for _ in range(8):  # a client of its own each: held streams in both processes
            client = httpx.Client(base_url=server.url, timeout=60)
            clients.append(client)
            response = client.send(client.build_request("POST", "/v1/completions", json=body),
                                   stream=True)
            lines = response.iter_lines()  # kept: a dropped iterator closes the response
            next(lines)
            answers.append(lines)
        server.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)  # the first process drains its streams for up to 5 s
        for _ in range(6):
            try:
                r = httpx.post(f"{server.url}/v1/completions",
                               json={"prompt": "new", "max_tokens": 2}, timeout=10)
            except httpx.TransportError:
                continue  # no process listens any more
            assert r.status_code == 503, "an API process took a request while stopping"
    finally:
        for client in clients:
            client.close()
        output = server.stop()
    assert server.proc.returncode == 0, output


def test_sigint_stops_every_process_and_removes_the_metrics_folder(tmp_path: Path) -> None:
    server = ServeProcess("--api-server-count", "3", env={"TMPDIR": str(tmp_path)})
    try:
        assert len(server.engine_processes()) == 3  # the engine and two more API processes
        # (and multiprocessing's resource tracker)
        children = psutil.Process(server.proc.pid).children(recursive=True)
        assert len(list(tmp_path.glob("kvfit-metrics-*"))) == 1
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 200
        server.wait_for_output("3 API server processes")  # the first process's banner
    finally:
        output = server.stop(signal.SIGINT)
    assert server.proc.returncode == 0, output
    _, alive = psutil.wait_procs(children, timeout=30)
    assert not alive
    assert not list(tmp_path.glob("kvfit-metrics-*"))


def test_every_api_process_exits_when_the_engine_dies() -> None:
    server = ServeProcess("--api-server-count", "2")
    try:
        processes = server.engine_processes()
        (engine,) = [p for p in processes if not any(
            c.status == psutil.CONN_LISTEN for c in p.net_connections("tcp"))]
        (other,) = [p for p in processes if p.pid != engine.pid]
        engine.kill()
        server.proc.wait(timeout=60)
        other.wait(timeout=30)
    finally:
        output = server.stop()
    assert server.proc.returncode == 1, output
    assert "exiting, the engine stopped" in output
    assert "API server 1 exiting, the engine stopped" in output
