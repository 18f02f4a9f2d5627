"""`EngineCore.pause` / `resume` (vLLM's pause_generation) on the CPU: requests in flight are
aborted or finished, requests added while paused are held (not refused, not run) and run at
resume with the outputs they would have had; the held ones survive a sleep and a weight load,
and abort like any other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kvfit import LLM, SamplingParams
from kvfit.engine.sequence import Sequence

SETTINGS = dict(device="cpu", enable_sleep_mode=True, max_num_seqs=8, max_model_len=256,
                max_num_batched_tokens=256)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(autouse=True)
def resumed(llm: LLM) -> Iterator[None]:
    """Every test leaves the shared engine resumed, awake and empty."""
    yield
    if llm.is_sleeping:
        llm.wake_up()
    llm.engine.resume()
    while llm.engine.has_unfinished():
        llm.engine.step()


def _add(llm: LLM, tag: str) -> list[Sequence]:
    seqs = [s for i, p in enumerate(PROMPTS) for s in llm.make_request(p, GREEDY, f"{tag}-{i}")]
    for seq in seqs:
        llm.engine.add_request(seq)
    return seqs


def _run(llm: LLM) -> set[Sequence]:
    finished: set[Sequence] = set()
    for _ in range(200):
        if not llm.engine.has_unfinished():
            return finished
        finished.update(llm.engine.step())
    raise AssertionError("the engine never went idle")


@pytest.mark.parametrize("mode", ["abort", "wait"])
def test_pause_ends_the_requests_in_flight_and_holds_later_ones_until_resume(
        llm: LLM, reference: list[list[int]], mode: str) -> None:
    running = _add(llm, "running")
    llm.engine.step()
    llm.engine.step()
    llm.engine.pause(mode=mode)
    assert llm.engine.is_paused
    if mode == "abort":
        assert all(s.finish_reason == "abort" for s in running)
    else:
        assert [s.output_token_ids for s in running] == reference
    assert _run(llm) == set(running)  # the next step returns them, as after a sleep
    held = _add(llm, "held")  # taken, not refused
    stats = llm.engine.stats()
    assert stats.paused and stats.num_waiting == len(held) and stats.num_running == 0
    assert not llm.engine.has_unfinished()  # nothing to step: a front end's loop idles
    assert _run(llm) == set() and all(s.output_token_ids == [] for s in held)
    llm.engine.resume()
    assert not llm.engine.is_paused
    assert _run(llm) == set(held)
    assert [s.output_token_ids for s in held] == reference


def test_pause_clears_the_prefix_cache_unless_asked_not_to(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert bm.hash_to_block
    llm.engine.pause(clear_cache=False)
    assert bm.hash_to_block
    llm.engine.pause()  # again: nothing to drain, the cache cleared now
    assert not bm.hash_to_block and llm.engine.is_paused


def test_held_requests_abort_and_survive_a_sleep_and_a_weight_load(
        llm: LLM, reference: list[list[int]], qwen3: Path) -> None:
    """vLLM's RL order: pause, sleep, wake, load the new weights, resume; requests that came
    meanwhile run on the new weights (here the same ones), one aborted while held ends then."""
    llm.engine.pause()
    held = _add(llm, "held")
    llm.engine.abort_request("held-1")
    assert held[1].finish_reason == "abort"
    assert llm.engine.stats().num_waiting == len(held) - 1
    llm.sleep(level=2)  # its drain waits for nothing held
    llm.wake_up(reload_weights=False)
    llm.load_weights(load_file(qwen3 / "model.safetensors"))  # no request counts as running
    llm.engine.resume()
    assert _run(llm) == {held[0], held[2], held[3]}
    assert [s.output_token_ids for s in held] == [reference[0], [], *reference[2:]]


def test_generate_on_a_paused_engine_is_refused_and_holds_nothing(llm: LLM) -> None:
    """Offline `generate` steps only until its requests finish, and held ones never would:
    it returned them unfinished, with no tokens, and left them held to run inside a later
    call after a resume."""
    llm.engine.pause()
    with pytest.raises(RuntimeError, match=r"paused.*resume"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert llm.engine.stats().num_waiting == 0
    llm.engine.resume()
    assert not llm.engine.has_unfinished()


def test_a_bad_mode_names_the_choices(llm: LLM) -> None:
    for mode in ("keep", "later"):
        with pytest.raises(ValueError, match=r"pause_generation\(mode=.*'abort'.*'wait'"):
            llm.engine.pause(mode=mode)
    assert not llm.engine.is_paused
