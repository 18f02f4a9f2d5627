"""Host time per engine step, without the model's compute: offline `LLM.generate`, and the
two processes behind `kvfit serve` (the engine core loop and the API process's per-token work).

    PYTHONPATH=src python3 bench/host_overhead.py --out host.json            # CPU, ~1 minute
    PYTHONPATH=src python3 bench/host_overhead.py --profile --out host.json  # + cProfile tops

The workload of `bench/serving.py` on the H200 in small: `--num-prompts` prompts of
`--input-len` random token ids, `--output-len` tokens each, greedy, ignore_eos, `--max-num-seqs`
256, prefix caching off, kvfit-tiny (its tokenizer detokenizes every token, as the serving
bench's word tokenizer does). By default the model's forward is replaced by its embedding
lookup (`--forward stub`): the steps, their batches, inputs, sampling, outputs and text are
the engine's own, only the decoder layers are skipped, so what is left is the host's work.

Each pass is timed twice, in the thread's CPU time (`CLOCK`): plain (time per step, no
instrumentation; the fastest of
`--repeat` passes, the one other processes disturbed least), then with a timer
around each phase (exclusive microseconds per step: a phase's time less that of the phases
inside it; the timers' own cost is the timed pass's step less the plain one's):
- offline: `schedule`, `prepare_inputs`, `forward` (the stub; on a GPU the forward's launch or
  graph replay, its device time hidden behind the host's next step), `sampling_metadata`,
  `logits_and_sample` (logits head and sampler; device work on a GPU, launches only), `launch`
  (the rest of the model runner's launch: copies to the host, the pending-token map), `advance`,
  `result` (the output to Python lists), `update` (token bookkeeping, stop checks),
  `detokenize` (`Detokenizer.step`, one call per sequence per step), `engine` (the rest of
  `EngineCore.step`); `host` = the plain step less `forward` and `logits_and_sample`.
- served, engine process: `EngineCoreLoop.run` over the same engine with every request added
  up front; the phases above plus `commands`, `publish` (the per-request deltas and the
  message), `stats` (`EngineCore.stats`, once per step), `encode` (pickling the message, as the
  engine process's channel does; the socket write is not included) and `loop`.
- served, API process: every request admitted as the server admits it (`admit`: its JSON
  body parsed and validated, its sampling params, `add_request`, the request metrics; us a
  request), then the engine's messages, as pickled, replayed into that `AsyncLLM` (a
  client that only records commands), whose request streams are read through the server's own
  streamed `/v1/completions` path to SSE bytes: `decode` (unpickling), `on_outputs`
  (dispatch to the streams), `streams` (the event loop running every reader: folding deltas,
  text, the request metrics, the chunk dicts and their JSON). HTTP (uvicorn, h11, the
  socket) is not included.
- http, API process over HTTP (`--parts http`): the real app (`build_app`) on uvicorn,
  configured as `kvfit serve` configures it, on a local socket, the engine's messages
  replayed into its `AsyncLLM` one step at a time (the next once every woken stream has
  written its chunk), while a client process streams every prompt as a `/v1/completions`
  request at once. The server thread's CPU time, split in `admit` (from the first
  connection until the engine holds every request: accept, HTTP parsing, routing,
  validation, admission, the response's start; us a request) and `stream` (from the first
  message until every response is complete: the messages' decoding and dispatch, the
  streams, the SSE chunks and their HTTP writes, each request's end; us a chunk, `stream`
  less `decode` and `on_outputs` as `http_us_per_chunk`). With `--profile`, one more pass
  under cProfile, its time grouped by layer (`layers_us_per_chunk`: the package a function
  belongs to, the event loop's and sockets' builtins as `loop`).

What the CPU's numbers mean for a GPU machine: the host code is the same, its speed is not.
`python_ref_us` times a fixed pure-Python workload on this host; the ratio of a GPU host's
figure to this one scales these numbers to it, to first order. On a GPU a step takes
max(host, device) when the two overlap (the engine launches step k + 1 before reading step
k's tokens), so host time matters once it nears the device's step time.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import gc
import importlib.util
import io
import os
import pickle
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.record import write_record
from kvfit.engine.async_output import AsyncModelOutput
from kvfit.engine.sampler import SamplingMetadata
from kvfit.server.engine_core_loop import EngineCoreLoop

CLOCK = time.thread_time
"""Every time here is the measuring thread's CPU time: on a shared host, time spent waiting
for a core is the machine's, not the code's (the engine and the replay run on one thread:
torch's intra-op threads are set to 1)."""

DEVICE_PHASES = ("forward", "logits_and_sample")
"""Phases that are the model's compute on the CPU (launches on a GPU): not host time."""


class PhaseTimer:
    """Exclusive wall time per phase of wrapped calls: a phase's time less the wrapped calls
    inside it, so the phases of one pass add up to its wall time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._inner: list[float] = []  # per open call: time spent in wrapped calls inside it
        self._undo: list[tuple[Any, str, Any]] = []

    def timed(self, fn: Callable[..., Any], phase: str) -> Callable[..., Any]:
        seconds, calls, inner, clock = self.seconds, self.calls, self._inner, CLOCK
        seconds.setdefault(phase, 0.0)
        calls.setdefault(phase, 0)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            inner.append(0.0)
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = clock() - start
                seconds[phase] += elapsed - inner.pop()
                calls[phase] += 1
                if inner:
                    inner[-1] += elapsed

        return wrapper

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        """Time `owner.name` (an instance's method or a class's attribute) as `phase`."""
        saved = owner.__dict__.get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        setattr(owner, name, self.timed(getattr(owner, name), phase))
        self._undo.append((owner, name, saved))

    def restore(self) -> None:
        for owner, name, saved in reversed(self._undo):
            if saved is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
        self._undo.clear()

    def per_step_us(self, num_steps: int) -> dict[str, float]:
        return {phase: s / num_steps * 1e6 for phase, s in self.seconds.items()}


_MISSING = object()


def stub_forward(llm: LLM) -> None:
    """Replace the model's decoder layers by nothing: the hidden states are the embeddings.
    Inputs, logits, sampling and outputs stay the engine's own."""
    model = llm.engine.executor.workers[0].runner.model
    embed = model.model.embed_tokens
    model.forward = lambda input_ids, positions, attn_metadata: embed(input_ids)


def python_ref_us(repeat: int = 5) -> float:
    """Median microseconds of a fixed pure-Python workload (list, dict and attribute work like
    the engine's per-sequence loops): this host's Python speed, to scale by."""
    def work() -> int:
        d: dict[int, list[int]] = {}
        total = 0
        for i in range(20000):
            lst = d.setdefault(i & 255, [])
            lst.append(i)
            total += len(lst) + lst[-1] % 7
        return total

    times = []
    for _ in range(repeat):
        start = CLOCK()
        work()
        times.append(CLOCK() - start)
    return statistics.median(times) * 1e6


def workload(args: argparse.Namespace, vocab_size: int) -> list[dict[str, list[int]]]:
    rng = random.Random(args.seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab_size) for _ in range(args.input_len)]}
            for _ in range(args.num_prompts)]


def wrap_engine(timer: PhaseTimer, llm: LLM) -> None:
    """Timers around every phase of the engine's step (see the module docstring)."""
    core = llm.engine
    runner = core.executor.workers[0].runner
    timer.wrap(core, "step", "engine")
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "advance", "advance")
    timer.wrap(core.scheduler, "update", "update")
    timer.wrap(core.scheduler.detokenizer, "step", "detokenize")
    timer.wrap(runner, "launch", "launch")
    timer.wrap(runner, "prepare_inputs", "prepare_inputs")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "logits_and_sample")
    timer.wrap(runner, "sampler", "logits_and_sample")
    timer.wrap(SamplingMetadata, "from_seqs", "sampling_metadata")
    timer.wrap(AsyncModelOutput, "result", "result")


def host_us(plain_step_us: float, phases: dict[str, float]) -> float:
    return plain_step_us - sum(phases.get(p, 0.0) for p in DEVICE_PHASES)


def profile_top(profiler: cProfile.Profile, num: int) -> list[str]:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(num)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    return [line.rstrip() for line in lines[start:] if line.strip()]


def offline(args: argparse.Namespace, llm: LLM, prompts: list[Any],
            params: SamplingParams) -> dict[str, Any]:
    core = llm.engine

    def run() -> tuple[float, int]:
        steps = core.scheduler.num_steps
        start = CLOCK()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = CLOCK() - start
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == len(prompts) * args.output_len
        return elapsed, core.scheduler.num_steps - steps

    run()  # warm: first-call costs (the detokenizer's caches, allocator) out of the figures
    plain = [run() for _ in range(args.repeat)]
    num_steps = plain[0][1]
    step_us = min(e for e, _ in plain) / num_steps * 1e6
    timer = PhaseTimer()
    wrap_engine(timer, llm)
    try:
        timed_s, _ = run()
    finally:
        timer.restore()
    phases = timer.per_step_us(num_steps)
    result = {"num_steps": num_steps, "step_us": step_us,
              "step_us_runs": [e / n * 1e6 for e, n in plain],
              "timed_step_us": timed_s / num_steps * 1e6,
              "phases_us": phases, "calls": timer.calls,
              "host_step_us": host_us(step_us, phases)}
    result["host_us_per_token"] = result["host_step_us"] * num_steps / (len(prompts)
                                                                       * args.output_len)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        run()
        profiler.disable()
        result["profile"] = profile_top(profiler, args.profile_top)
    return result


def engine_loop(args: argparse.Namespace, llm: LLM, prompts: list[Any],
                params: SamplingParams, timer: PhaseTimer | None = None,
                profiler: cProfile.Profile | None = None) -> tuple[float, int, list[bytes]]:
    """One pass of the engine core loop over every prompt; (seconds, steps, the messages it
    sent, pickled). With `timer`, its phases are timed."""
    messages: list[bytes] = []
    remaining = {f"r{i}" for i in range(len(prompts))}
    loop: EngineCoreLoop

    def send(outputs: Any) -> None:
        messages.append(pickle.dumps(outputs, pickle.HIGHEST_PROTOCOL))
        for delta in outputs.outputs:
            if delta[2]:
                remaining.discard(delta[0])
        if not remaining:
            loop.submit(("stop",))

    encode = send if timer is None else timer.timed(send, "encode")
    loop = EngineCoreLoop(llm, encode)
    if timer is not None:
        wrap_engine(timer, llm)
        for name, phase in (("_apply_commands", "commands"), ("_publish", "publish"),
                            ("run", "loop")):
            timer.wrap(loop, name, phase)
        timer.wrap(llm.engine, "stats", "stats")
    # As `AsyncLLM.add_request` sends them: text is the API process's (no stop strings here).
    engine_params = dataclasses.replace(params, detokenize=False)
    for i, prompt in enumerate(prompts):
        loop.submit(("add", f"r{i}", prompt["prompt_token_ids"], None, engine_params, 0))
    steps = llm.engine.scheduler.num_steps
    start = CLOCK()
    try:
        if profiler is not None:
            profiler.enable()
        loop.run()
    finally:
        if profiler is not None:
            profiler.disable()
        if timer is not None:
            timer.restore()
    elapsed = CLOCK() - start
    return elapsed, llm.engine.scheduler.num_steps - steps, messages


class _RecordingClient:
    """An engine client for `AsyncLLM` that only records what it is sent."""

    pid = None

    def __init__(self, ready: Any) -> None:
        self.ready = ready
        self.sent: list[Any] = []

    def send(self, command: Any) -> None:
        self.sent.append(command)

    def is_alive(self) -> bool:
        return True

    def shutdown(self) -> None:
        pass


async def api_replay(args: argparse.Namespace, prompts: list[Any], messages: list[bytes],
                     ready: Any, timer: PhaseTimer | None) -> tuple[float, int, float]:
    """Admit every prompt as the server does (its JSON body parsed and validated, its sampling
    params made, `add_request`, the request metrics), then replay the engine's `messages` into
    the `AsyncLLM` whose streams are read to SSE bytes as the server streams
    `/v1/completions`; (seconds of the replay, SSE events, seconds of the admissions)."""
    import json

    from kvfit.engine.config import EngineArgs
    from kvfit.server.async_llm import AsyncLLM
    from kvfit.server.metrics import ServerMetrics
    from kvfit.server.protocol import CompletionRequest
    from kvfit.server.streaming import EventStream, completion_events

    engine = AsyncLLM(EngineArgs(model=args.model, device="cpu"),
                      client=lambda *_: _RecordingClient(ready))
    metrics = ServerMetrics(engine, args.model)
    bodies = [json.dumps({"model": args.model, "prompt": p["prompt_token_ids"],
                          "max_tokens": args.output_len, "temperature": 0.0, "stream": True,
                          "ignore_eos": True}).encode() for p in prompts]
    start = CLOCK()
    admitted = []
    for i, data in enumerate(bodies):
        body = CompletionRequest.model_validate(json.loads(data))
        params = body.sampling_params(body.max_tokens, body.logprobs)
        prompt = {"prompt_token_ids": body.prompt, "prompt": None}
        stream = engine.add_request(prompt, params, request_id=f"r{i}")
        metrics.track(stream, len(body.prompt))
        admitted.append((body, aiter(stream)))
    admit_s = CLOCK() - start
    events = 0

    async def read(i: int, body: CompletionRequest, tracked: Any) -> None:
        async def send(message: dict[str, Any]) -> None:
            nonlocal events
            events += message["type"] == "http.response.body"

        response = EventStream(completion_events([tracked], body, f"cmpl-{i}", 0, args.model,
                                                 engine, None, lambda e: e), lambda: None)
        await response._stream(send, send)  # the events to SSE bytes, as the server sends

    readers = [asyncio.ensure_future(read(i, *a)) for i, a in enumerate(admitted)]
    await asyncio.sleep(0)  # every reader waiting
    decode, on_outputs = pickle.loads, engine._on_outputs
    if timer is not None:
        decode, on_outputs = timer.timed(decode, "decode"), timer.timed(on_outputs, "on_outputs")
        settle = timer.timed(lambda: None, "streams")  # a phase entry; time taken below
    start = CLOCK()
    for data in messages:
        on_outputs(decode(data))
        turn = CLOCK()
        for _ in range(4):  # deliver, then every woken reader runs up to its next wait
            await asyncio.sleep(0)
        if timer is not None:
            settle()
            timer.seconds["streams"] += CLOCK() - turn
    elapsed = CLOCK() - start
    await asyncio.gather(*readers)
    return elapsed, events, admit_s


def served(args: argparse.Namespace, llm: LLM, prompts: list[Any],
           params: SamplingParams) -> dict[str, Any]:
    engine_loop(args, llm, prompts, params)  # warm
    plain = [engine_loop(args, llm, prompts, params) for _ in range(args.repeat)]
    num_steps = plain[0][1]
    step_us = min(e for e, *_ in plain) / num_steps * 1e6
    timer = PhaseTimer()
    timed_s, _, messages = engine_loop(args, llm, prompts, params, timer)
    phases = timer.per_step_us(num_steps)
    tokens = len(prompts) * args.output_len
    engine_result = {"num_steps": num_steps, "step_us": step_us,
                     "step_us_runs": [e / n * 1e6 for e, n, _ in plain],
                     "timed_step_us": timed_s / num_steps * 1e6, "phases_us": phases,
                     "calls": timer.calls, "host_step_us": host_us(step_us, phases),
                     "num_messages": len(messages),
                     "message_bytes": sum(map(len, messages)) / len(messages)}
    engine_result["host_us_per_token"] = engine_result["host_step_us"] * num_steps / tokens
    ready = EngineCoreLoop(llm, lambda _: None).ready()

    def replay(timer: PhaseTimer | None) -> tuple[float, int, float]:
        return asyncio.run(api_replay(args, prompts, messages, ready, timer))

    replay(None)  # warm
    plain_api = [replay(None) for _ in range(args.repeat)]
    api_timer = PhaseTimer()
    api_timed_s, events, _ = replay(api_timer)
    api_s = min(e for e, *_ in plain_api)
    api_result = {"num_messages": len(messages), "events": events,
                  "step_us": api_s / len(messages) * 1e6,
                  "us_per_token": api_s / tokens * 1e6,
                  "admit_us_per_request": min(a for *_, a in plain_api) / len(prompts) * 1e6,
                  "timed_step_us": api_timed_s / len(messages) * 1e6,
                  "phases_us": api_timer.per_step_us(len(messages))}
    if args.profile:
        profiler = cProfile.Profile()
        engine_loop(args, llm, prompts, params, profiler=profiler)
        engine_result["profile"] = profile_top(profiler, args.profile_top)
        profiler = cProfile.Profile()
        profiler.enable()
        replay(None)
        profiler.disable()
        api_result["profile"] = profile_top(profiler, args.profile_top)
    return {"engine": engine_result, "api": api_result}


HTTP_CLIENT = r"""
import json, selectors, socket, sys, time

host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
bodies = [line.encode() for line in open(path).read().splitlines()]
socks = [socket.create_connection((host, port)) for _ in bodies]
for sock, body in zip(socks, bodies):
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                 b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
data = {sock: bytearray() for sock in socks}
sel = selectors.DefaultSelector()
for sock in socks:
    sel.register(sock, selectors.EVENT_READ)
deadline = time.monotonic() + 300
while sel.get_map() and time.monotonic() < deadline:
    time.sleep(0.002)  # few wake-ups: the server's core is not the client's to share
    for key, _ in sel.select(1):
        chunk = key.fileobj.recv(1 << 20)
        data[key.fileobj] += chunk
        if not chunk or data[key.fileobj].endswith(b"0\r\n\r\n"):
            sel.unregister(key.fileobj)
            key.fileobj.close()
out = list(data.values())
ok = sum(d.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in d for d in out)
events = sum(d.count(b"data: {") for d in out)
print(json.dumps({"responses": len(out), "ok": ok, "events": events}))
"""
"""The client process of the http part: sends every body of a file (one a line) as a
streamed `/v1/completions` request at once, reads each response to its end (every 2 ms,
all that came: a client reading each chunk as it comes would take the server's core)."""

LAYERS = (("uvicorn", "uvicorn"), ("httptools", "http_parser"), ("h11", "http_parser"),
          ("starlette", "starlette"), ("fastapi", "fastapi"), ("pydantic", "pydantic"),
          ("anyio", "anyio"), ("kvfit/server/async_llm", "streams"),
          ("kvfit/engine/detokenizer", "text"), ("tokenizers", "text"),
          ("transformers", "text"), ("kvfit/server/openai_api", "openai_api"),
          ("kvfit/server/serving", "openai_api"), ("kvfit/server/streaming", "openai_api"),
          ("kvfit/server/responses", "openai_api"), ("kvfit/server/errors", "openai_api"),
          ("kvfit/server/metrics", "metrics"), ("prometheus_client", "metrics"),
          ("kvfit/server", "kvfit_server"), ("asyncio", "loop"), ("uvloop", "loop"),
          ("selectors", "loop"), ("socket", "loop"), ("logging", "logging"),
          ("orjson", "json"), ("json", "json"), ("pickle", "decode"), ("uuid", "uuid"))


def layer_of(filename: str, name: str) -> str:
    """The layer a profiled function belongs to: its file's package, or for a builtin
    (`~`) the module or type its name gives."""
    where = name if filename == "~" else filename
    for key, layer in LAYERS:
        if key in where:
            return layer
    if filename == "~" and any(k in name for k in ("Transport", "socket", "select", "poll",
                                                   "epoll", "Handle", "Future", "Task")):
        return "loop"
    return "other"


def profile_layers(profiler: cProfile.Profile) -> dict[str, float]:
    """Seconds of `profiler`'s own time (tottime) per layer."""
    layers: dict[str, float] = {}
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        layer = layer_of(filename, name)
        layers[layer] = layers.get(layer, 0.0) + tottime
    return layers


async def http_pass(args: argparse.Namespace, prompts: list[Any], messages: list[bytes],
                    ready: Any, profilers: tuple[cProfile.Profile, cProfile.Profile] | None = None
                    ) -> dict[str, Any]:
    """One pass of the http part (see the module docstring): the server thread's seconds
    admitting and streaming, and what the client got; with `profilers`, the admissions
    profiled by the first, the streaming by the second."""
    import json
    import socket

    from kvfit.engine.config import EngineArgs
    from kvfit.server.api_servers import uvicorn_server
    from kvfit.server.async_llm import AsyncLLM
    from kvfit.server.openai_api import ServeConfig, build_app

    engine = AsyncLLM(EngineArgs(model=args.model, device="cpu"),
                      client=lambda *_: _RecordingClient(ready))
    client = engine._client
    admitted = asyncio.Event()
    record, adds = client.send, []

    def send(command: Any) -> None:
        record(command)
        if command[0] == "add":
            adds.append(command[1])
            if len(adds) == len(prompts):
                admitted.set()

    client.send = send
    app = build_app(engine, ServeConfig(served_model_names=[args.model]))
    server = uvicorn_server(app, args.uvicorn_log_level)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(len(prompts))
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for p in prompts:
            f.write(json.dumps({"model": args.model, "prompt": p["prompt_token_ids"],
                                "max_tokens": args.output_len, "temperature": 0.0,
                                "stream": True, "ignore_eos": True}) + "\n")
    result: dict[str, Any] = {}

    async def drive() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", HTTP_CLIENT, "127.0.0.1", str(sock.getsockname()[1]), f.name,
            stdout=subprocess.PIPE)
        start = CLOCK()  # after the client's spawn, the server's fork and exec
        if profilers is not None:
            profilers[0].enable()
        await admitted.wait()
        result["admit_s"] = CLOCK() - start
        if profilers is not None:
            profilers[0].disable()
        # The engine's request ids, in the order the engine loop saw its r0, r1, ...
        ids = {f"r{i}": request_id for i, request_id in enumerate(adds)}
        replayed = []
        for data in messages:
            m = pickle.loads(data)
            m.tokens = [(ids[d[0]], *d[1:]) for d in m.tokens]
            m.outputs = [(ids[d[0]], *d[1:]) for d in m.outputs]
            replayed.append(pickle.dumps(m, pickle.HIGHEST_PROTOCOL))
        streams = list(engine._streams.values())
        decode_s = 0.0
        if profilers is not None:
            profilers[1].enable()
        start = CLOCK()
        for data in replayed:
            turn = CLOCK()
            engine._on_outputs(pickle.loads(data))
            decode_s += CLOCK() - turn
            await asyncio.sleep(0)
            while any(s.items for s in streams):  # every woken stream has written its chunk
                await asyncio.sleep(0)
        while server.server_state.tasks:  # every response complete
            await asyncio.sleep(0.0005)
        result["stream_s"] = CLOCK() - start
        if profilers is not None:
            profilers[1].disable()
        result["decode_s"] = decode_s
        out, _ = await proc.communicate()
        result["client"] = json.loads(out)
        server.should_exit = True

    # As serve does before it serves: startup's objects (here the engine's too) kept off the
    # collector's full passes; unfrozen when the pass ends, or each pass's server and engine
    # (cycles, which only the collector frees) would outlive it, in later passes and pytest.
    gc.collect()
    gc.freeze()
    try:
        await asyncio.gather(server.serve(sockets=[sock]), drive())
    finally:
        sock.close()
        gc.unfreeze()
        os.unlink(f.name)  # the client has read it (or is gone)
    return result


def http(args: argparse.Namespace, llm: LLM, prompts: list[Any],
         params: SamplingParams) -> dict[str, Any]:
    """The http part: the API process serving streamed requests over a local socket."""
    _, _, messages = engine_loop(args, llm, prompts, params)
    ready = EngineCoreLoop(llm, lambda _: None).ready()
    loop_factory = None
    if args.loop == "uvloop" or (args.loop == "auto"
                                 and importlib.util.find_spec("uvloop") is not None):
        import uvloop
        loop_factory = uvloop.new_event_loop

    def one(profilers: tuple[cProfile.Profile, cProfile.Profile] | None = None
            ) -> dict[str, Any]:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            r = runner.run(http_pass(args, prompts, messages, ready, profilers))
        expected = len(prompts)
        if r["client"]["ok"] != expected:
            raise RuntimeError(f"http pass: {r['client']} (expected {expected} streams)")
        return r

    one()  # warm
    runs = [one() for _ in range(args.repeat)]
    chunks = runs[0]["client"]["events"]
    admit = min(r["admit_s"] for r in runs)
    best = min(runs, key=lambda r: r["stream_s"])
    result = {"loop": "uvloop" if loop_factory else "asyncio", "requests": len(prompts),
              "chunks": chunks, "num_messages": len(messages),
              "admit_us_per_request": admit / len(prompts) * 1e6,
              "admit_us_per_request_runs": [r["admit_s"] / len(prompts) * 1e6 for r in runs],
              "stream_us_per_chunk": best["stream_s"] / chunks * 1e6,
              "stream_us_per_chunk_runs": [r["stream_s"] / chunks * 1e6 for r in runs],
              "decode_us_per_chunk": best["decode_s"] / chunks * 1e6,
              "http_us_per_chunk": (best["stream_s"] - best["decode_s"]) / chunks * 1e6}
    result["api_us_per_token"] = (admit + best["stream_s"]) / (len(prompts) * args.output_len
                                                              ) * 1e6
    if args.profile:
        # CPU time: wall time on a shared host is not the code's.
        admit, stream = cProfile.Profile(CLOCK), cProfile.Profile(CLOCK)
        one((admit, stream))
        for name, profiler, num in (("admit", admit, len(prompts)), ("stream", stream, chunks)):
            per = "request" if name == "admit" else "chunk"
            result[f"{name}_layers_us_per_{per}"] = {
                k: v / num * 1e6 for k, v in sorted(profile_layers(profiler).items(),
                                                    key=lambda kv: -kv[1])}
            result[f"{name}_profile"] = profile_top(profiler, args.profile_top)
    return result


def print_report(result: dict[str, Any]) -> None:
    print(f"python_ref_us {result['python_ref_us']:.0f} (this host's Python speed)")
    engines = [(name, r) for name, r in (("offline", result.get("offline")),
                                         ("served engine", result.get("served", {}).get("engine")))
               if r is not None]
    for name, r in engines:
        print(f"{name}: {r['num_steps']} steps, {r['step_us']:.0f} us/step plain "
              f"({r['timed_step_us']:.0f} timed), host {r['host_step_us']:.0f} us/step, "
              f"{r['host_us_per_token']:.2f} us/token")
        for phase, us in sorted(r["phases_us"].items(), key=lambda kv: -kv[1]):
            print(f"  {phase:<20} {us:8.1f} us/step  ({r['calls'][phase]} calls)")
    if "http" in result:
        h = result["http"]
        print(f"http ({h['loop']}): {h['requests']} requests, {h['chunks']} chunks: "
              f"{h['admit_us_per_request']:.0f} us to admit a request, "
              f"{h['stream_us_per_chunk']:.1f} us a chunk ({h['http_us_per_chunk']:.1f} "
              f"less the messages' {h['decode_us_per_chunk']:.1f}), "
              f"{h['api_us_per_token']:.1f} us a token in all")
        for name, per in (("admit", "request"), ("stream", "chunk")):
            for layer, us in h.get(f"{name}_layers_us_per_{per}", {}).items():
                print(f"  {name} {layer:<20} {us:8.2f} us/{per} (profiled)")
    if "served" not in result:
        return
    api = result["served"]["api"]
    print(f"served API: {api['num_messages']} messages, {api['step_us']:.0f} us/step plain "
          f"({api['timed_step_us']:.0f} timed), {api['us_per_token']:.2f} us/token, "
          f"{api['admit_us_per_request']:.0f} us to admit a request")
    for phase, us in sorted(api["phases_us"].items(), key=lambda kv: -kv[1]):
        print(f"  {phase:<20} {us:8.1f} us/step")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON record path")
    p.add_argument("--model", default="kvfit-tiny")
    p.add_argument("--forward", choices=["stub", "model"], default="stub",
                   help="stub: the embeddings stand for the decoder (no model compute)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--parts", nargs="+", choices=["offline", "served", "http"],
                   default=["offline", "served"])
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto",
                   help="the http part's event loop (auto: uvloop where installed, as serve)")
    p.add_argument("--uvicorn-log-level", default="info",
                   help="the http part's uvicorn log level (serve's default: info)")
    p.add_argument("--repeat", type=int, default=3,
                   help="plain passes; the fastest is kept (the least disturbed on a shared host)")
    p.add_argument("--profile", action="store_true", help="one more pass of each under cProfile")
    p.add_argument("--profile-top", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    # The host's work is one thread's; idle intra-op threads spinning beside other processes
    # on a shared machine would time the machine, not the code.
    torch.set_num_threads(1)
    llm = LLM(args.model, device="cpu", max_model_len=args.input_len + args.output_len,
              max_num_seqs=args.max_num_seqs, enable_prefix_caching=False, seed=args.seed)
    try:
        if args.forward == "stub":
            stub_forward(llm)
        vocab_size = llm.config.model_config.hf_config.vocab_size
        prompts = workload(args, vocab_size)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        result = {"python_ref_us": python_ref_us()}
        if "offline" in args.parts:
            result["offline"] = offline(args, llm, prompts, params)
        if "served" in args.parts:
            result["served"] = served(args, llm, prompts, params)
        if "http" in args.parts:
            result["http"] = http(args, llm, prompts, params)
    finally:
        llm.shutdown()
    print_report(result)
    write_record(args.out, record_of("host-overhead", result, vars(args)))
    return result


if __name__ == "__main__":
    main()
