"""The engine's hooks for front ends that queue requests themselves (the async server)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(qwen3: Path) -> Iterator[LLM]:
    llm = LLM(str(qwen3), device="cpu", num_gpu_blocks_override=64, max_model_len=128,
              max_num_batched_tokens=128, max_num_seqs=8)
    yield llm
    llm.shutdown()


def run(llm: LLM) -> None:
    while llm.engine.has_unfinished():
        llm.engine.step()


def test_make_request_validates_and_names_the_request(llm: LLM) -> None:
    seqs = llm.make_request("Hello", SamplingParams(n=2, max_tokens=3), "abc")
    assert [s.request_id for s in seqs] == ["abc", "abc"] and seqs[1].parent is seqs[0]
    with pytest.raises(ValueError, match=r"^the prompt has \d+ tokens, max_model_len"):
        llm.make_request("word " * 200, SamplingParams(), "long")
    assert len(llm.make_request("x", SamplingParams(n=9), "wide")) == 9  # n > max_num_seqs


def test_detokenize_false_leaves_text_to_the_caller_unless_stop_strings(llm: LLM) -> None:
    (plain,) = llm.make_request("Hello", SamplingParams(temperature=0, max_tokens=4,
                                                        detokenize=False), "a")
    (stop,) = llm.make_request("Hello", SamplingParams(temperature=0, max_tokens=4,
                                                       detokenize=False, stop=["never"]), "b")
    (ref,) = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.engine.add_request(plain)
    llm.engine.add_request(stop)
    run(llm)
    assert plain.output_token_ids == stop.output_token_ids == ref.outputs[0].token_ids
    assert plain.output_text == "" and stop.output_text == ref.outputs[0].text


def test_stats_and_fail_step(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    core = llm.engine
    stats = core.stats()
    assert stats.num_blocks == stats.num_free_blocks == 64
    assert stats.committed_kv_bytes == core.kv_cache_report.committed_bytes
    queried = stats.prefix_cache_queried_tokens
    prompt = {"prompt_token_ids": list(range(3, 40))}  # two full blocks
    for _ in range(2):  # the second one hits the first one's blocks
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    stats = core.stats()
    assert stats.prefix_cache_queried_tokens > queried and stats.prefix_cache_hit_tokens >= 32

    running = llm.make_request("run", SamplingParams(max_tokens=50, ignore_eos=True), "run")
    core.add_request(running[0])
    core.step()  # now running, with a step in flight
    monkeypatch.setattr(core.executor, "launch", lambda batch: 1 / 0)
    waiting = llm.make_request("wait", SamplingParams(max_tokens=2), "wait")
    with pytest.raises(ZeroDivisionError):
        core.step()
    core.add_request(waiting[0])
    assert core.fail_step() == ["run"]
    assert running[0].finish_reason == "abort" and not waiting[0].is_finished
    monkeypatch.undo()
    run(llm)
    assert waiting[0].finish_reason == "length"
    assert core.stats().num_free_blocks == 64


def test_updated_seqs_hold_every_sequence_a_step_changed(llm: LLM) -> None:
    # Four requests, two running at a time behind a 2-sequence cap: the waiting ones must
    # never be reported, and every token, finish or logprob a step makes ready must be.
    llm.engine.scheduler.max_num_seqs = 2
    try:
        seqs = [seq for i in range(4) for seq in llm.make_request(
            {"prompt_token_ids": list(range(10 + i, 30 + i))},
            SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True, logprobs=1),
            f"r{i}")]
        for seq in seqs:
            llm.engine.add_request(seq)

        def state(seq: object) -> tuple[object, ...]:
            ready = [t for t in seq.output_token_ids if t >= 0]  # a pending token is < 0
            return len(ready), seq.is_finished, len(seq.logprobs)

        while llm.engine.has_unfinished():
            before = {seq.seq_id: state(seq) for seq in seqs}
            llm.engine.step()
            changed = {seq.seq_id for seq in seqs if state(seq) != before[seq.seq_id]}
            updated = {seq.seq_id for seq in llm.engine.updated_seqs}
            assert changed <= updated
            waiting = {seq.seq_id for seq in llm.engine.scheduler.waiting
                       if seq.num_computed_tokens == 0}
            assert not updated & waiting
        assert [len(seq.output_token_ids) for seq in seqs] == [3, 4, 5, 6]
    finally:
        llm.engine.scheduler.max_num_seqs = 8


def test_a_failed_step_reports_what_it_applied_before_it_raised(
        llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    # A sequence that reads its output history (a penalty) has the step in flight applied
    # before the next launch: when that launch raises, a request the applied step finished
    # must reach the front end, else its stream waits for a step an idle engine never takes.
    from kvfit.server.engine_core_loop import EngineCoreLoop

    sent: list = []
    loop = EngineCoreLoop(llm, sent.append)

    def turn() -> None:
        loop._apply_commands()
        loop._step()
        loop._publish(scan=loop._stepped())

    penalized = SamplingParams(max_tokens=30, ignore_eos=True, repetition_penalty=1.2)
    loop.submit(("add", "long", [5, 6, 7, 8], None, penalized, 0))
    turn()
    turn()
    loop.submit(("add", "one", [9, 10, 11], None, SamplingParams(max_tokens=1), 0))
    turn()  # launches the prefill that gives "one" its only token
    monkeypatch.setattr(llm.engine.executor, "launch", lambda batch: 1 / 0)
    turn()  # applies it ("one" finishes), then the launch raises
    ended = {delta[0]: delta[1][0][3] for out in sent for delta in out.outputs if delta[2]}
    failed = [request_id for out in sent for request_id, _ in out.errors]
    assert ended == {"one": "length"} and failed == ["long"]
    assert not loop._tracked and not llm.engine.has_unfinished()
