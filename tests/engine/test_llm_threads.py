"""One `LLM` used from several threads: `generate` on two threads, and lifecycle calls
(`sleep`, `resize_kv_cache`, `reset_prefix_cache`, `shutdown`) made while another thread's
`generate` runs. Each takes its turn between two engine steps: outputs are those of an
uninterrupted run, nothing crashes and no block leaks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvfit import LLM, SamplingParams

SETTINGS = dict(device="cpu", enable_sleep_mode=True, max_num_seqs=8, max_model_len=256,
                max_num_batched_tokens=128)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(6)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return outputs(llm)


def outputs(llm: LLM, **kwargs: Any) -> list[list[int]]:
    kwargs.setdefault("use_tqdm", False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, **kwargs)]


class _Bar:
    """A progress bar (`use_tqdm`'s factory) that says when `generate` has stepped."""

    def __init__(self, stepped: threading.Event, **_: Any) -> None:
        self.stepped = stepped

    def update(self, n: int) -> None:
        self.stepped.set()

    def close(self) -> None:
        self.stepped.set()


def _generate_in_thread(llm: LLM) -> tuple[threading.Thread, dict[str, Any], threading.Event]:
    """Start `generate` on a thread; its result (or error) lands in the dict's "out"."""
    result: dict[str, Any] = {}
    stepped = threading.Event()

    def run() -> None:
        try:
            result["out"] = outputs(llm, use_tqdm=lambda **kw: _Bar(stepped, **kw))
        except BaseException as error:  # the test reads it
            result["out"] = error

    thread = threading.Thread(target=run)
    thread.start()
    assert stepped.wait(60)
    return thread, result, stepped


def _no_leak(llm: LLM) -> None:
    core = llm.engine
    assert not core.has_unfinished()
    bm = core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_generate_on_two_threads_gives_each_its_own_outputs(llm, reference) -> None:
    results: list[Any] = [None] * 4

    def run(i: int) -> None:
        try:
            results[i] = [outputs(llm) for _ in range(2)]
        except BaseException as error:  # the test reads it
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(results))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert results == [[reference, reference]] * len(results)
    _no_leak(llm)
    assert outputs(llm) == reference


@pytest.mark.parametrize("call", [
    lambda llm: llm.sleep(level=1, mode="wait"),
    lambda llm: llm.resize_kv_cache(llm.engine.kv_resizer.floor),
    lambda llm: llm.reset_prefix_cache(reset_running_requests=True),
], ids=["sleep-wait", "resize-to-floor", "reset-prefix-cache"])
def test_a_lifecycle_call_during_generate_changes_no_output(
        llm, reference, call: Callable[[LLM], Any]) -> None:
    num_blocks = llm.engine.scheduler.block_manager.num_blocks
    thread, result, _ = _generate_in_thread(llm)
    call(llm)
    thread.join(120)
    assert result["out"] == reference
    if llm.is_sleeping:
        llm.wake_up()
    llm.resize_kv_cache(num_blocks)
    _no_leak(llm)
    assert outputs(llm) == reference


def test_sleep_abort_during_generate_ends_its_requests_as_aborted(llm, reference) -> None:
    thread, result, _ = _generate_in_thread(llm)
    llm.sleep(level=2, mode="abort")
    thread.join(120)
    out = result["out"]
    assert not isinstance(out, BaseException), out
    assert all(len(o) <= len(r) and o == r[:len(o)] for o, r in zip(out, reference, strict=True))
    llm.wake_up()
    _no_leak(llm)
    assert outputs(llm) == reference


def test_shutdown_during_generate_fails_it_and_does_not_crash(qwen3: Path) -> None:
    llm = LLM(str(qwen3), **SETTINGS)
    thread, result, _ = _generate_in_thread(llm)
    llm.shutdown()
    thread.join(120)
    out = result["out"]
    assert isinstance(out, RuntimeError) and "shutdown()" in str(out), out
    with pytest.raises(RuntimeError, match="shutdown"):
        outputs(llm)


def test_a_generate_interrupted_between_steps_leaves_another_threads_requests_running(
        llm, reference) -> None:
    stepped = threading.Event()

    class Interrupted(Exception):
        pass

    class FailingBar(_Bar):
        def update(self, n: int) -> None:  # between two steps, as a Ctrl-C in a callback
            super().update(n)
            raise Interrupted

    thread, result, _ = _generate_in_thread(llm)
    with pytest.raises(Interrupted):
        outputs(llm, use_tqdm=lambda **kw: FailingBar(stepped, **kw))
    thread.join(120)
    assert result["out"] == reference
def test_a_request_aborted_with_a_step_in_flight_ends_with_no_placeholder(llm,
                                                                        reference) -> None:
    core = llm.engine
    seqs = [llm.make_request(p, GREEDY, f"in-flight-{i}")[0] for i, p in enumerate(PROMPTS)]
    for seq in seqs:
        core.add_request(seq)
    for _ in range(4):  # prefill, then decodes: each step leaves the next one in flight
        core.step()
    assert any(seq.has_pending_token for seq in seqs)
    for seq in seqs:
        core.abort_request(seq.request_id)
    while core.has_unfinished():
        core.step()
    for seq, ref in zip(seqs, reference, strict=True):
        out = seq.output_token_ids
        assert seq.finish_reason == "abort" and out and out == ref[:len(out)], (out, ref)
    _no_leak(llm)


def test_a_generate_whose_requests_another_thread_finished_returns_at_once(
        llm, monkeypatch) -> None:
    """Thread B's steps finish this thread's short request (added before this thread's first
    step): this `generate` returns then, not once B's long batch has drained the engine."""
    short = [{"prompt_token_ids": list(range(5, 30))}]
    few = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(short, few, use_tqdm=False)]
    long_run: dict[str, Any] = {}
    some_finished = threading.Event()
    step = llm.engine.step

    def counting_step() -> list[Any]:
        done = step()
        if done:  # the short request: the long batch's run 150 tokens
            some_finished.set()
        return done

    def long_generate() -> None:
        long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
        long_run["out"] = llm.generate(PROMPTS, long, use_tqdm=lambda **kw: _Bar(started, **kw))

    def bar_after_b_finished_it(**kw: Any) -> _Bar:  # this call's requests are queued by now
        assert some_finished.wait(60)
        return _Bar(threading.Event(), **kw)

    monkeypatch.setattr(llm.engine, "step", counting_step)
    started = threading.Event()
    thread = threading.Thread(target=long_generate)
    thread.start()
    assert started.wait(60)
    out = llm.generate(short, few, use_tqdm=bar_after_b_finished_it)
    assert llm.engine.has_unfinished()  # B's batch is still running
    assert [o.outputs[0].token_ids for o in out] == expected
    thread.join(120)
    assert [len(o.outputs[0].token_ids) for o in long_run["out"]] == [150] * len(PROMPTS)
    _no_leak(llm)
