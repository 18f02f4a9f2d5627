"""Coalesced streaming: a reader (or an event loop) that falls behind the engine gets the steps
it missed in one output / one SSE event, with every token exactly once, in order."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvfit import LLM, SamplingParams
from kvfit.engine.sampling_params import RequestOutputKind
from kvfit.server.async_llm import AsyncLLM

from .conftest import MODEL_NAME, ServerThread, engine_kwargs

PROMPT = "The number 7 is followed by"


@pytest.fixture(scope="module")
def llm(model_path: Path) -> Iterator[LLM]:
    llm = LLM(**engine_kwargs(model_path))
    yield llm
    llm.shutdown()


def _finished_queued(stream: Any) -> bool:
    """Whether the engine's last delta (`finished`) waits, unread, in the stream."""
    return any(len(item) > 2 and item[2] for item in stream._stream.items
               if not isinstance(item, BaseException))


def test_a_reader_behind_gets_the_missed_steps_in_one_output(engine: AsyncLLM,
                                                             llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)
    (ref,) = llm.generate(PROMPT, params, use_tqdm=False)
    want = ref.outputs[0]

    async def read() -> tuple[int, list[int], Any]:
        stream = engine.add_request(PROMPT, params)
        outputs = aiter(stream)
        first = len((await anext(outputs)).outputs[0].token_ids)
        deadline = time.monotonic() + 30
        while not _finished_queued(stream):  # the engine runs on; this reader does not
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        sizes = [len(out.outputs[0].token_ids) async for out in outputs]
        return first, sizes, stream.output

    first, sizes, out = asyncio.run(read())
    # Everything after the first output came as one: its tokens once each, in order.
    assert first < 48 and sizes == [48] and out.finished
    got = out.outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.finish_reason == want.finish_reason == "length"
    assert len(got.logprobs) == 48
    assert [lp[t].logprob for t, lp in zip(got.token_ids, got.logprobs, strict=True)] == \
        pytest.approx([lp[t].logprob for t, lp in zip(want.token_ids, want.logprobs,
                                                      strict=True)], abs=1e-4)
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)


def _events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


def test_a_stalled_event_loop_sends_the_backlog_as_one_event(server: ServerThread) -> None:
    """The server's loop is blocked mid-stream while the engine finishes: the backlog goes out
    as one event whose text, logprobs and continuous usage carry all its tokens."""
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 64, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()
        stream_body = {**body, "stream": True,
                       "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        with http.stream("POST", "/v1/completions", json=stream_body) as r:
            assert r.status_code == 200
            events = _events(r.iter_lines())
            chunks = [next(events)]
            # Stall the server's event loop; the engine thread keeps generating meanwhile.
            loop = server.server.servers[0].get_loop()
            loop.call_soon_threadsafe(time.sleep, 0.5)
            chunks += list(events)
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage == whole["usage"]
    content = [c for c in chunks if c["choices"]]
    assert len(content) < 64  # coalesced
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] == 64
    per_event = [b - a for a, b in zip([0, *counts], counts, strict=False)]
    assert max(per_event) > 1
    # Each event's logprobs list one entry per token it carries; all in order.
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in content] == per_event
    want = whole["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in content) == want["text"]
    def joined(key: str) -> list[Any]:
        return [x for c in content for x in c["choices"][0]["logprobs"][key]]

    assert joined("tokens") == want["logprobs"]["tokens"]
    assert joined("token_logprobs") == pytest.approx(want["logprobs"]["token_logprobs"])
    assert content[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stop", [[], ["no such text"]], ids=["plain", "stop strings"])
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_s_text_follows_include_stop_str_in_output(
    engine: AsyncLLM, llm: LLM, stop: list[str], include: bool,
) -> None:
    # Found by the hunt: a stream decoding its own text (no stop strings) kept the stop token's
    # text even without include_stop_str_in_output, unlike `LLM` and vLLM.
    greedy = dict(temperature=0.0, ignore_eos=True)
    (plain,) = llm.generate(PROMPT, SamplingParams(**greedy, max_tokens=12), use_tqdm=False)
    tokens = plain.outputs[0].token_ids
    texts = [o.outputs[0].text for o in llm.generate(
        [PROMPT] * len(tokens),
        [SamplingParams(**greedy, max_tokens=n) for n in range(1, len(tokens) + 1)],
        use_tqdm=False)]  # texts[i]: the text of tokens[:i + 1]
    # A first occurrence with text of its own (some of the tiny vocabulary decodes to none).
    at = next(i for i in range(1, len(tokens))
              if tokens[i] not in tokens[:i] and texts[i] != texts[i - 1])
    params = SamplingParams(**greedy, max_tokens=12, stop=stop, stop_token_ids=[tokens[at]],
                            include_stop_str_in_output=include)
    (want,) = llm.generate(PROMPT, params, use_tqdm=False)

    async def read() -> Any:
        return [out async for out in engine.generate(PROMPT, params)][-1]

    got = asyncio.run(read()).outputs[0]
    assert got.token_ids == want.outputs[0].token_ids == tokens[:at + 1]
    assert got.text == want.outputs[0].text == texts[at if include else at - 1]


@pytest.mark.parametrize("extra", [{}, {"logprobs": 1}, {"n": 2}, {"stop": ["no such text"]}],
                         ids=["plain", "logprobs", "n=2", "stop strings"])
def test_detokenize_false_leaves_the_text_as_llm_does(engine: AsyncLLM, llm: LLM,
                                                      extra: dict[str, Any]) -> None:
    # Found by the hunt: a stream decoded its text even with detokenize=False, which
    # `LLM.generate` leaves empty (unless stop strings make the engine decode).
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False,
                            **extra)
    (want,) = llm.generate(PROMPT, params, use_tqdm=False)

    async def read() -> Any:
        return [out async for out in engine.generate(PROMPT, params)][-1]

    got = asyncio.run(read())
    assert [o.token_ids for o in got.outputs] == [o.token_ids for o in want.outputs]
    assert [o.text for o in got.outputs] == [o.text for o in want.outputs]
    assert bool(extra.get("stop")) == bool(want.outputs[0].text)


def test_an_old_stream_closed_late_leaves_a_new_request_of_its_id(engine: AsyncLLM) -> None:
    # Found by the hunt: a stream whose last output had come but was not read aborted, as it
    # closed, the new request that had taken its id meanwhile.
    async def run() -> Any:
        old = aiter(engine.add_request(PROMPT, SamplingParams(max_tokens=16, ignore_eos=True),
                                       "reused"))
        assert not (await anext(old)).finished
        deadline = time.monotonic() + 30
        while engine.num_requests:  # its end has come, unread: the id is free
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        new = engine.add_request(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True),
                                 "reused")
        await old.aclose()
        return [out async for out in new][-1]

    out = asyncio.run(run()).outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_vllms_priority_is_taken_at_zero_only_under_fcfs(engine: AsyncLLM) -> None:
    # vLLM's AsyncLLM.generate(..., priority=0) was a TypeError (unexpected keyword argument);
    # under first-come-first-served scheduling vLLM takes only 0 too.
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    async def run() -> Any:
        with pytest.raises(ValueError, match=r"priority=3 needs .*--scheduling-policy priority"):
            engine.add_request(PROMPT, params, priority=3)
        with pytest.raises(TypeError, match="priority must be an int"):
            engine.add_request(PROMPT, params, priority="3")  # type: ignore[arg-type]
        assert engine.num_requests == 0  # the refused request was never queued
        return [out async for out in engine.generate(PROMPT, params, priority=0)][-1]

    assert len(asyncio.run(run()).outputs[0].token_ids) == 2


@pytest.mark.parametrize("extra", [{}, {"n": 2, "logprobs": 1, "stop": ["ritt"]}],
                         ids=["plain", "n=2 logprobs stop"])
def test_output_kind_delta_and_final_only_as_vllm(engine: AsyncLLM, extra: dict[str, Any]
                                                  ) -> None:
    """vLLM's SamplingParams.output_kind was a TypeError (no such argument): a stream is
    cumulative (the default), DELTA (each output holds only what each completion added since
    the last) or FINAL_ONLY (one output, at the end)."""
    def params(kind: RequestOutputKind) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                              output_kind=kind, **extra)

    async def read(kind: RequestOutputKind) -> list[Any]:
        return [copy.deepcopy(out) async for out in engine.generate(PROMPT, params(kind))]

    (*_, want) = asyncio.run(read(RequestOutputKind.CUMULATIVE))
    assert {c.finish_reason for c in want.outputs} == {"stop" if extra else "length"}
    deltas = asyncio.run(read(RequestOutputKind.DELTA))
    assert len(deltas) > 1 and [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [
        True]
    for w in want.outputs:
        mine = [c for d in deltas for c in d.outputs if c.index == w.index]
        assert "".join(c.text for c in mine) == w.text
        assert [t for c in mine for t in c.token_ids] == w.token_ids
        assert sum(len(c.token_ids) for c in mine) == len(w.token_ids)
        if w.logprobs is not None:
            assert [lp for c in mine for lp in c.logprobs] == w.logprobs
            assert mine[-1].cumulative_logprob == pytest.approx(w.cumulative_logprob)
        # Its end comes once, in its last delta; nothing comes after it.
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [w.finish_reason]
    (final,) = asyncio.run(read(RequestOutputKind.FINAL_ONLY))
    assert final.finished
    assert [(c.text, c.token_ids) for c in final.outputs] == [
        (c.text, c.token_ids) for c in want.outputs]
    with pytest.raises(ValueError, match="output_kind must be a RequestOutputKind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]
