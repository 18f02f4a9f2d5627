"""A seeded chaos run on `kvfit serve --api-server-count 2`: concurrent clients (the official
async client and raw httpx; completions and chat, streamed or not, n>1, logprobs, streams
dropped mid-way, malformed bodies) while a control task interleaves the lifecycle routes
(/sleep and /wake_up, /pause and /resume, /reset_prefix_cache, /kv_cache/resize). Every
request ends within a bound, with an answer, an abort or a clear 4xx/503; greedy answers
that complete match a quiet server's; afterwards the server is healthy, its gauges are back
to 0 and every KV block is free."""

from __future__ import annotations

import asyncio
import json
import random
import re
from typing import Any

import httpx
import openai
import pytest

from .conftest import ServeProcess

MODEL = "kvfit-tiny"
SEED = 0
CLIENTS = 10
CHAOS_S = 12.0
BOUND_S = 30.0  # what any one request or control call may take
PROMPTS = ["Hello there", "The capital of France is", "1 2 3 4", "Once upon a time"]
BAD_BODIES = [b"{not json", b"[]", b'{"prompt": 5}',
              json.dumps({"model": MODEL, "prompt": "x", "max_tokens": -1}).encode(),
              json.dumps({"model": MODEL, "prompt": "x", "n": 0}).encode(),
              json.dumps({"model": MODEL, "prompt": [10**9]}).encode(),
              json.dumps({"model": MODEL, "messages": "hi"}).encode()]


def _greedy(i: int, chat: bool) -> tuple[str, dict[str, Any]]:
    if chat:
        return "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i]}],
            "max_tokens": 12, "temperature": 0}
    return "/v1/completions", {"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 12,
                               "temperature": 0}


class Chaos:
    """The clients, the control task and what they saw wrong (`problems`)."""

    def __init__(self, http: httpx.AsyncClient, oai: openai.AsyncOpenAI,
                 refs: dict[tuple[int, bool], tuple[str, str]]) -> None:
        self.http, self.oai, self.refs = http, oai, refs
        self.problems: list[str] = []
        self.seen: dict[str, int] = {}

    def error(self, what: str, status: int, message: str) -> None:
        """A refusal must be a client error or a 503, in the server's words (HTTP routes, no
        traceback, no `LLM.` call a client cannot make)."""
        self.seen[str(status)] = self.seen.get(str(status), 0) + 1
        if (status >= 500 and status != 503) or "Traceback" in message or "LLM." in message:
            self.problems.append(f"{what}: {status} {message[:300]}")

    async def client(self, rng: random.Random, until: float) -> None:
        while asyncio.get_running_loop().time() < until:
            kind = rng.choice(["greedy", "stream", "oai", "n", "logprobs", "drop", "bad"])
            try:
                await asyncio.wait_for(self.request(kind, rng), BOUND_S)
            except TimeoutError:
                self.problems.append(f"{kind}: no end within {BOUND_S} s")
            except openai.APIStatusError as e:
                self.error(kind, e.status_code, str(e))
            except openai.APIError as e:  # an error event in a stream
                self.error(kind, 503, str(e))

    async def request(self, kind: str, rng: random.Random) -> None:
        i, chat = rng.randrange(len(PROMPTS)), rng.random() < 0.5
        path, body = _greedy(i, chat)
        if kind == "greedy":
            r = await self.http.post(path, json=body)
            if r.status_code != 200:
                return self.error(kind, r.status_code, r.text)
            choice = r.json()["choices"][0]
            self.compare(i, chat, choice["message"]["content"] if chat else choice["text"],
                         choice["finish_reason"])
        elif kind == "stream":
            await self.stream(i, chat, path, body)
        elif kind == "oai":
            if chat:
                stream = await self.oai.chat.completions.create(
                    model=MODEL, messages=body["messages"], max_tokens=rng.randint(1, 20),
                    temperature=0.8, n=rng.randint(1, 3), stream=True)
            else:
                stream = await self.oai.completions.create(
                    model=MODEL, prompt=PROMPTS[i], max_tokens=rng.randint(1, 20),
                    temperature=0.8, n=rng.randint(1, 3), stream=True, logprobs=2)
            async for _ in stream:
                pass
        elif kind == "n":
            n = rng.randint(2, 4)
            r = await self.http.post("/v1/completions", json={**_greedy(i, False)[1], "n": n,
                                                              "temperature": 1.0})
            if r.status_code != 200:
                return self.error(kind, r.status_code, r.text)
            if len(r.json()["choices"]) != n:
                self.problems.append(f"n={n}: {len(r.json()['choices'])} choices")
        elif kind == "logprobs":
            extra = ({"logprobs": True, "top_logprobs": 2} if chat
                     else {"logprobs": 2, "echo": True})
            r = await self.http.post(path, json={**body, **extra})
            if r.status_code != 200:
                self.error(kind, r.status_code, r.text)
        elif kind == "drop":
            async with self.http.stream("POST", path, json={**body, "stream": True,
                                                            "max_tokens": 60}) as r:
                lines = rng.randint(1, 5)
                async for _ in r.aiter_lines():
                    lines -= 1
                    if lines == 0:
                        break
        else:
            r = await self.http.post(rng.choice(["/v1/completions", "/v1/chat/completions"]),
                                     content=rng.choice(BAD_BODIES),
                                     headers={"content-type": "application/json"})
            if r.status_code == 200:
                self.problems.append(f"bad body answered: {r.text[:200]}")
            # 503 where a check in the engine (token ids in the vocabulary) meets it asleep.
            self.error("bad body", r.status_code, r.text)

    async def stream(self, i: int, chat: bool, path: str, body: dict[str, Any]) -> None:
        text, finish, done = "", None, False
        async with self.http.stream("POST", path, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return self.error("stream", r.status_code, (await r.aread()).decode())
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error("stream", event["error"].get("code") or 503,
                                   event["error"]["message"])
                        finish = "error"
                    for c in event.get("choices", []):
                        text += (c["delta"].get("content") or "") if chat else c["text"]
                        finish = c.get("finish_reason") or finish
        if not done:
            self.problems.append(f"a stream ended without [DONE] (finish {finish})")
        self.compare(i, chat, text, finish)

    def compare(self, i: int, chat: bool, text: str, finish: str | None) -> None:
        """A greedy answer that ended as the quiet server's did has its text."""
        ref_text, ref_finish = self.refs[(i, chat)]
        if finish == ref_finish and text != ref_text:
            self.problems.append(f"prompt {i} chat={chat}: {text!r}, quiet: {ref_text!r}")

    async def control(self, rng: random.Random, until: float) -> None:
        """Lifecycle calls at random times; first a pause that meets a sleep, so that the
        requests held by the pause are queued by a resume while the engine is asleep."""
        first = True
        while asyncio.get_running_loop().time() < until:
            await asyncio.sleep(rng.uniform(0.1, 1.0))
            op = "pause_sleep" if first else rng.choice(
                ["sleep", "pause", "reset", "resize", "pause_sleep"])
            first = False
            try:
                await asyncio.wait_for(self.lifecycle(op, rng), BOUND_S)
            except TimeoutError:
                self.problems.append(f"control {op}: no end within {BOUND_S} s")

    async def lifecycle(self, op: str, rng: random.Random) -> None:
        calls: list[tuple[str, dict[str, Any]]]
        sleep = ("/sleep", {"level": rng.choice([1, 2]), "mode": rng.choice(["wait", "abort"])})
        pause = ("/pause", {"mode": rng.choice(["wait", "abort"])})
        if op == "sleep":
            calls = [sleep, ("/wake_up", {})]
        elif op == "pause":
            calls = [pause, ("/resume", {})]
        elif op == "pause_sleep":
            calls = [pause, sleep, ("/resume", {}), ("/wake_up", {})]
        elif op == "reset":
            calls = [("/reset_prefix_cache", rng.choice(
                [{}, {"reset_running_requests": "true"}, {"reset_external": "true"}]))]
        else:
            calls = [("/kv_cache/resize", {"num_blocks": rng.choice([8, 9, 40, 500, 2048])})]
        for route, params in calls:
            r = await self.http.post(route, params=params)
            if r.status_code >= 500 and r.status_code != 503:
                self.problems.append(f"{route} {params}: {r.status_code} {r.text[:300]}")
            await asyncio.sleep(rng.uniform(0, 0.5))


async def _references(http: httpx.AsyncClient) -> dict[tuple[int, bool], tuple[str, str]]:
    refs = {}
    for i in range(len(PROMPTS)):
        for chat in (False, True):
            path, body = _greedy(i, chat)
            r = await http.post(path, json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            refs[(i, chat)] = (choice["message"]["content"] if chat else choice["text"],
                               choice["finish_reason"])
    return refs


async def _chaos(url: str) -> tuple[list[str], dict[str, int]]:
    async with httpx.AsyncClient(base_url=url, timeout=BOUND_S + 10) as http:
        refs = await _references(http)
        oai = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                 timeout=BOUND_S + 10)
        chaos = Chaos(http, oai, refs)
        until = asyncio.get_running_loop().time() + CHAOS_S
        await asyncio.gather(
            *(chaos.client(random.Random(SEED * 1000 + c), until) for c in range(CLIENTS)),
            chaos.control(random.Random(SEED), until))
        # Whatever the last control call left: awake and resumed.
        await http.post("/resume")
        if (await http.get("/is_sleeping")).json()["is_sleeping"]:
            assert (await http.post("/wake_up")).status_code == 200
        assert await _references(http) == refs
        return chaos.problems, chaos.seen


def _gauges(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"^(kvfit:\w+)\{[^}]*\} (\S+)$", text, re.M)}


@pytest.mark.slow
def test_lifecycle_routes_under_concurrent_clients_break_nothing() -> None:
    server = ServeProcess("--enable-sleep-mode", "--api-server-count", "2",
                          env={"KVFIT_SERVER_DEV_MODE": "1"}, num_gpu_blocks=None)
    try:
        problems, seen = asyncio.run(_chaos(server.url))
        assert not problems, "\n".join(problems)
        assert seen.get("503"), "no lifecycle call ever met a request"
        assert httpx.get(f"{server.url}/health").status_code == 200
        gauges = _gauges(httpx.get(f"{server.url}/metrics").text)
        assert all(value >= 0 for value in gauges.values()), gauges
        assert gauges["kvfit:num_requests_running"] == gauges["kvfit:num_requests_waiting"] == 0
        kv = httpx.get(f"{server.url}/kv_cache").json()
        assert kv["num_free_blocks"] == kv["num_blocks"], kv  # no block leaked
    finally:
        server.stop()
