"""`LLM.llm_engine`, vLLM's manual stepping API: a loop of `add_request` and `step` gives, for
greedy requests, what `generate` gives, and sharing the engine with `generate` (on the same
thread between steps, or on another) changes neither's outputs."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest

from kvfit import LLM, SamplingParams
from kvfit.engine.outputs import RequestOutput
from kvfit.engine.sampling_params import RequestOutputKind

SETTINGS = dict(device="cpu", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=128)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 30 + 5 * i))} for i in range(5)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=8 + 6 * i, ignore_eos=True)
          for i in range(len(PROMPTS))]
PARAMS[1] = SamplingParams(temperature=0.0, max_tokens=12, n=2, logprobs=1)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[RequestOutput]:
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def _result(out: RequestOutput) -> list[tuple[Any, ...]]:
    # Logprobs to 3 places: another batch's composition moves float32 sums in the 7th digit.
    return [(c.token_ids, c.text, c.finish_reason,
             None if c.cumulative_logprob is None else round(c.cumulative_logprob, 3))
            for c in out.outputs]


def _run(engine: Any) -> dict[str, list[RequestOutput]]:
    """vLLM's loop: step until nothing is unfinished; every output, by request id."""
    seen: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def _no_leak(llm: LLM) -> None:
    core = llm.engine
    assert not core.has_unfinished()
    bm = core.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_stepping_loop_gives_generates_outputs(llm: LLM,
                                                 reference: list[RequestOutput]) -> None:
    engine = llm.llm_engine
    assert engine is llm.llm_engine and engine.get_tokenizer() is llm.get_tokenizer()
    # vLLM's examples name requests "0", "1", ...: as `generate` names its own in the engine.
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(str(i), prompt, params)
    final_only = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                output_kind=RequestOutputKind.FINAL_ONLY)
    engine.add_request("final", PROMPTS[0], final_only)
    assert engine.get_num_unfinished_requests() == len(PROMPTS) + 1
    seen = _run(engine)
    assert sorted(seen) == sorted([*map(str, range(len(PROMPTS))), "final"])
    for i, ref in enumerate(reference):
        outs = seen[str(i)]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert len(outs) > 2  # streamed, step by step
        assert _result(outs[-1]) == _result(ref)
        assert outs[-1].prompt_token_ids == ref.prompt_token_ids
        for before, after in itertools.pairwise(outs):  # cumulative, never a placeholder
            for b, a in zip(before.outputs, after.outputs, strict=True):
                assert a.token_ids[:len(b.token_ids)] == b.token_ids and -1 not in b.token_ids
    (only,) = seen["final"]
    assert only.finished and _result(only) == _result(reference[0])
    assert engine.get_num_unfinished_requests() == 0
    _no_leak(llm)


def test_abort_drops_a_request_and_its_id_names_a_new_one(
        llm: LLM, reference: list[RequestOutput]) -> None:
    engine = llm.llm_engine
    engine.add_request("a", PROMPTS[4], PARAMS[4])
    for _ in range(3):
        engine.step()
    with pytest.raises(ValueError, match="'a' is already running"):
        engine.add_request("a", PROMPTS[0], PARAMS[0])
    engine.abort_request(["a", "unknown"])
    assert not engine.has_unfinished_requests()
    engine.add_request("a", PROMPTS[0], PARAMS[0])
    seen = _run(engine)
    assert _result(seen["a"][-1]) == _result(reference[0])
    _no_leak(llm)


def test_generate_between_steps_returns_its_own_and_leaves_the_loops_running(
        llm: LLM, reference: list[RequestOutput]) -> None:
    # `generate`'s last running call drains the engine: it ran the loop's requests to their
    # end (its steps' outputs lost to the loop), however long they were.
    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    [want] = llm.generate(PROMPTS[2], long, use_tqdm=False)
    engine.add_request("long", PROMPTS[2], long)
    engine.step()
    assert [_result(o) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == [
        _result(r) for r in reference]
    seen = _run(engine)
    assert len(seen["long"]) > 1  # reported as it went on, not only finished
    assert _result(seen["long"][-1]) == _result(want)
    _no_leak(llm)


def test_generate_on_another_thread_while_the_loop_steps(
        llm: LLM, reference: list[RequestOutput]) -> None:
    engine = llm.llm_engine
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["out"] = [llm.generate(PROMPTS, PARAMS, use_tqdm=False) for _ in range(2)]
        except BaseException as error:  # the test reads it
            result["out"] = error

    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(str(i), prompt, params)
    thread = threading.Thread(target=run)
    thread.start()
    seen = _run(engine)
    thread.join(120)
    assert not isinstance(result["out"], BaseException), result["out"]
    for outs in result["out"]:
        assert [_result(o) for o in outs] == [_result(r) for r in reference]
    assert [_result(seen[str(i)][-1]) for i in range(len(PROMPTS))] == [
        _result(r) for r in reference]
    llm.llm_engine.step()  # the thread's last step may be in flight
    _no_leak(llm)


def test_a_generate_whose_requests_the_loop_finished_returns_at_once(llm: LLM) -> None:
    # `generate` looked again which of its requests were done only after its own step finished
    # some (or while another `generate` ran): those the loop's steps finished, it stepped on
    # until the loop's long request was done too.
    engine = llm.llm_engine
    long = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    few = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    [want] = llm.generate(PROMPTS[0], few, use_tqdm=False)
    engine.add_request("long", PROMPTS[2], long)
    engine.step()
    stepped, go = threading.Event(), threading.Event()

    class Bar:  # holds `generate` after its first step
        def __init__(self, **_: Any) -> None:
            pass

        def update(self, n: int) -> None:
            stepped.set()
            assert go.wait(60)

        def close(self) -> None:
            pass

    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("out", llm.generate(PROMPTS[0], few, use_tqdm=Bar)))
    thread.start()
    assert stepped.wait(60)
    for _ in range(5):  # the loop's steps finish the generate's request
        engine.step()
    go.set()
    thread.join(60)
    assert _result(result["out"][0]) == _result(want)
    [out] = engine.step()
    assert out.request_id == "long" and not out.finished
    assert _run(engine)["long"][-1].finished
    _no_leak(llm)


def test_a_generate_interrupted_between_steps_leaves_the_loops_requests_running(
        llm: LLM, reference: list[RequestOutput]) -> None:
    # The last `generate` running, interrupted, dropped the step in flight and aborted every
    # request it held: the loop's too.
    engine = llm.llm_engine
    engine.add_request("mine", PROMPTS[3], PARAMS[3])
    engine.step()

    class Interrupted(Exception):
        pass

    class FailingBar:  # between two steps, as a Ctrl-C in a callback
        def __init__(self, **_: Any) -> None:
            pass

        def update(self, n: int) -> None:
            raise Interrupted

        def close(self) -> None:
            pass

    with pytest.raises(Interrupted):
        llm.generate(PROMPTS, PARAMS, use_tqdm=FailingBar)
    assert _result(_run(engine)["mine"][-1]) == _result(reference[3])
    _no_leak(llm)


def test_a_step_that_raises_aborts_the_requests_it_held(
        llm: LLM, reference: list[RequestOutput], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.llm_engine
    engine.add_request("0", PROMPTS[0], PARAMS[0])
    engine.step()
    step = llm.engine.step

    def failing_step() -> Any:
        step()
        raise RuntimeError("a device fault")

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="a device fault"):
        engine.step()
    monkeypatch.setattr(llm.engine, "step", step)
    [out] = engine.step()  # reported, not left unfinished forever
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert out.outputs[0].token_ids == reference[0].outputs[0].token_ids[
        :len(out.outputs[0].token_ids)]
    assert not engine.has_unfinished_requests()
    _no_leak(llm)
