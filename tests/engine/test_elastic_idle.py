"""The idle give-back (`elastic_idle_s`) on the CPU: an engine whose cache stays unused for
`idle_s` shrinks to one `max_model_len` sequence, so device free memory rises; busy again, it
grows back (free memory above the high watermark, the cache short) and serves the same greedy
tokens as before."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams
from kvfit.elastic import DemandBoard, KVUsage

from .test_elastic_governor import (
    ENGINE,
    HIGH,
    LOW,
    MIN_INTERVAL,
    PARAMS,
    PROMPTS,
    CoTenantDevice,
    serve_until,
    tokens,
)
from .test_oom_guard import assert_nothing_leaked, make_prompts, runner

IDLE_S = 0.3


def poll_idle_until(llm: LLM, done: object, deadline_s: float = 30.0) -> None:
    """Step an engine with nothing to do (the governor polls on each step) until `done()`."""
    deadline = time.monotonic() + deadline_s
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, "the idle engine did not shrink in time"
        llm.engine.step()
        time.sleep(0.01)


def test_an_idle_engine_gives_its_cache_back_and_serves_identically_after_regrowing(
    qwen3: Path,
) -> None:
    llm = LLM(str(qwen3), device="cpu", **{**ENGINE, "elastic_idle_s": IDLE_S})
    try:
        device = CoTenantDevice(llm)
        llm.engine.executor.workers[0].monitor = device
        cache, resizer = runner(llm).kv_cache, llm.engine.kv_resizer
        start_blocks, free_before = cache.committed_blocks, device.free()
        expected = tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
        assert LOW <= free_before <= HIGH

        # The last steps of the generate may have started the idle clock (little in use), and
        # on loaded cores its tail may even outlast idle_s: then the shrink came inside it,
        # and the governor's unit tests carry the timing.
        generated = time.monotonic()
        low_since = llm.engine.kv_cache_governor.low_since or generated
        poll_idle_until(llm, lambda: llm.engine.stats().kv_cache_idle_shrinks == 1)
        [shrink] = [e for e in resizer.events if e.cause == "idle"]
        if shrink.time >= generated:
            assert shrink.time - low_since >= IDLE_S  # not before idle_s of low use
        assert shrink.num_blocks_after == resizer.floor == cache.committed_blocks
        assert device.free() > HIGH  # the memory is the co-tenant's to take
        # Idle at the floor, free memory above the high watermark: it does not take it back.
        end = time.monotonic() + 3 * MIN_INTERVAL
        poll_idle_until(llm, lambda: time.monotonic() > end)
        assert cache.committed_blocks == resizer.floor and resizer.num_grows == 0

        serve_until(llm, expected, lambda: resizer.num_grows >= 1)
        grow = next(e for e in resizer.events if e.num_blocks_after > e.num_blocks_before)
        assert grow.cause == "governor" and grow.time - shrink.time >= MIN_INTERVAL
        assert grow.num_blocks_after == start_blocks  # takes back what it gave
        stats = llm.engine.stats()
        assert stats.kv_cache_shrinks >= stats.kv_cache_idle_shrinks >= 1
        metrics = {m.name: m.value for m in llm.get_metrics()}
        assert metrics["kvfit:kv_cache_idle_shrinks"] == stats.kv_cache_idle_shrinks
        assert_nothing_leaked(llm)
    finally:
        llm.shutdown()


def test_young_sequences_count_what_they_will_hold_so_a_busy_cache_is_not_idle(
    qwen3: Path,
) -> None:
    """Right after prefill a burst uses a fraction of the blocks it will take: the governor's
    demand is what the running sequences hold at prompt + max_tokens, so an idle shrink does
    not take back blocks the burst needs a few steps later."""
    llm = LLM(str(qwen3), device="cpu", **{**ENGINE, "elastic_idle_s": IDLE_S})
    try:
        bm = llm.engine.scheduler.block_manager
        max_tokens = llm.config.scheduler_config.max_model_len - 8
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        [seq] = llm.make_request({"prompt_token_ids": [1, 2, 3, 4]}, params, "young")
        llm.engine.add_request(seq)
        llm.engine.step()
        usage = llm.engine._kv_usage()
        assert usage.used_blocks == bm.blocks_for(len(seq.token_ids)) < usage.need_blocks
        assert usage.need_blocks == bm.blocks_for(4 + max_tokens)
        assert usage.idle_target == max(usage.floor, 2 * usage.need_blocks)
        assert replace(usage, need_blocks=0).idle_target < usage.idle_target
        llm.engine.abort_request("young")
        assert llm.engine._kv_usage().need_blocks == 0
    finally:
        llm.shutdown()


def test_a_burst_still_waiting_counts_up_to_a_full_batch(qwen3: Path) -> None:
    """A burst that arrives at a small cache mostly waits: its demand is what the next full
    batch (max_num_seqs sequences, running first) holds at prompt + max_tokens, so a cache just
    grown for it is not read as idle; requests queued behind a full batch add nothing."""
    max_num_seqs = 3
    llm = LLM(str(qwen3), device="cpu",
              **{**ENGINE, "elastic_idle_s": IDLE_S, "max_num_seqs": max_num_seqs})
    try:
        bm = llm.engine.scheduler.block_manager
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        each = bm.blocks_for(4 + 24)
        for i in range(max_num_seqs + 2):
            [seq] = llm.make_request({"prompt_token_ids": [1, 2, 3, 4]}, params, f"r{i}")
            llm.engine.add_request(seq)
            if i == 0:  # one running, the rest waiting
                llm.engine.step()
        scheduler = llm.engine.scheduler
        assert len(scheduler.running) == 1 and len(scheduler.waiting) == max_num_seqs + 1
        usage = llm.engine._kv_usage()
        assert usage.need_blocks == max_num_seqs * each
        assert usage.used_blocks < usage.need_blocks
    finally:
        llm.shutdown()


def test_an_idle_engine_gives_a_peer_what_it_lacks_and_keeps_the_rest(
    qwen3: Path, tmp_path: Path
) -> None:
    """With a demand board (`elastic_demand_dir`) an idle engine whose peer lacks nothing
    keeps its whole cache past idle_s; once the peer publishes a want it gives that much back
    at the next poll (less what free memory already holds for the peer, to its chunks'
    granule), not down to one sequence, and it publishes what it lacks itself: nothing while
    idle. A further want is answered at the next poll too (not idle_s after the first give),
    and a want the freed memory already holds is not given twice."""
    llm = LLM(str(qwen3), device="cpu",
              **{**ENGINE, "elastic_idle_s": IDLE_S, "elastic_demand_dir": str(tmp_path)})
    try:
        device = CoTenantDevice(llm)
        llm.engine.executor.workers[0].monitor = device
        resizer, board = llm.engine.kv_resizer, llm.engine.demand_board
        peer = DemandBoard(tmp_path, board.folder.name)  # a second engine on the device
        peer.publish(0)
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        start = resizer.num_blocks
        end = time.monotonic() + 4 * IDLE_S
        poll_idle_until(llm, lambda: time.monotonic() > end)
        assert resizer.num_blocks == start and llm.engine.stats().kv_cache_idle_shrinks == 0
        assert peer.peers_short_bytes() == 0  # the idle engine asks for nothing

        block_bytes = llm.config.kv_cache_spec().block_bytes
        want = start // 4 * block_bytes
        # What the peer takes from free memory by itself is not given (the band's floor).
        spare = llm.engine.kv_cache_governor.spare_bytes(device.free(), device.budget_bytes)
        assert 0 < spare < want
        peer.publish(want)
        poll_idle_until(llm, lambda: llm.engine.stats().kv_cache_idle_shrinks == 1,
                        deadline_s=5.0)
        kept = resizer.num_blocks
        gave = (start - kept) * block_bytes
        assert resizer.floor < kept  # gave the want, kept the rest
        assert want - spare <= gave < want - spare + (2 << 20)  # at most a granule more

        # It took it at once and wants as much again (its burst admitted): answered at the
        # next poll, the idle clock still running, not idle_s after the first give.
        device.other += gave
        peer.publish(want + 1)
        poll_idle_until(llm, lambda: llm.engine.stats().kv_cache_idle_shrinks == 2,
                        deadline_s=5.0)
        first, second = list(resizer.events)[-2:]
        assert second.time - first.time < IDLE_S
        assert (kept - resizer.num_blocks) * block_bytes >= want - spare
        # Until the peer takes that, free memory holds it: the same want gives no more.
        end = time.monotonic() + 2 * IDLE_S
        poll_idle_until(llm, lambda: time.monotonic() > end)
        assert llm.engine.stats().kv_cache_idle_shrinks == 2
    finally:
        llm.shutdown()
    assert not list(tmp_path.rglob(f"{board.name}"))  # shutdown took its entry off the board


@pytest.mark.parametrize("packed", [True, False])
def test_a_busy_engine_gives_its_free_tail_to_a_peer_and_preempts_nothing(
    qwen3: Path, tmp_path: Path, packed: bool
) -> None:
    """A busy engine holding far more than its batch needs, whose peer on the board lacks
    blocks, gives it the free tail beyond its demand plus one sequence (`share_shrink`,
    cause `share`) after idle_s while it serves: no sequence is preempted, its greedy tokens
    are the ones it gives alone, it keeps what its batch needs to finish, and it does not take
    the memory back while the peer holds it. Not `packed` (the prefix cache from the first run
    kept, so new blocks come from the never-used tail first), its live blocks reach the tail:
    it gives less or nothing, and still preempts nothing."""
    prompts = make_prompts((200,) * 40, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    llm = LLM(str(qwen3), device="cpu",
              **{**ENGINE, "elastic_idle_s": IDLE_S, "elastic_demand_dir": str(tmp_path)})
    try:
        expected = tokens(llm.generate(prompts, params, use_tqdm=False))
        if packed:
            llm.reset_prefix_cache()  # the second run's blocks pack at the front, as fresh ones
        device = CoTenantDevice(llm)
        llm.engine.executor.workers[0].monitor = device
        resizer, board = llm.engine.kv_resizer, llm.engine.demand_board
        peer = DemandBoard(tmp_path, board.folder.name)
        start, block_bytes = resizer.num_blocks, llm.config.kv_cache_spec().block_bytes
        demand = 40 * -(-500 // llm.config.cache_config.block_size)  # 40 x (200 + 300) tokens
        assert 4 * demand > start > demand + resizer.floor  # busy, with a tail to spare
        seqs = [seq for i, p in enumerate(prompts)
                for seq in llm.make_request(p, params, f"share-{i}")]
        for seq in seqs:
            llm.engine.add_request(seq)
        while min(len(seq.output_token_ids) for seq in seqs) < 150:  # half way
            llm.engine.step()
        live_end = resizer._live_end()
        assert (live_end < start * 3 // 4) == packed  # unpacked: live blocks reach the tail
        peer.publish(start // 4 * block_bytes)
        gave_at: int | None = None
        while llm.engine.has_unfinished():
            llm.engine.step()
            if gave_at is None and llm.engine.stats().kv_cache_share_shrinks:
                gave_at = resizer.num_blocks
                device.other += (start - gave_at) * block_bytes  # the peer takes it
                peer.publish(0)  # and lacks nothing more
        shares = [e for e in resizer.events if e.cause == "share"]
        assert all(e.num_preempted == 0 for e in shares)
        assert llm.engine.scheduler.num_preemptions == 0
        assert [list(seq.output_token_ids) for seq in seqs] == expected
        assert llm.engine.stats().kv_cache_idle_shrinks == 0
        assert all(e.num_blocks_after >= live_end for e in shares)
        if packed:
            [share] = shares
            assert gave_at == share.num_blocks_after < start
            assert share.num_blocks_after >= demand + resizer.floor
            assert resizer.num_blocks == gave_at  # nothing taken back while the peer holds it
    finally:
        llm.shutdown()


def test_a_preemption_between_polls_reaches_the_next_poll(qwen3: Path) -> None:
    """`KVUsage.short` says sequences were preempted since the governor's last poll: steps
    between polls (shorter than the poll interval) must not consume the preemption, or a
    cache short of blocks reads as not short and neither grows nor asks its peers."""
    import math

    llm = LLM(str(qwen3), device="cpu", **{**ENGINE, "elastic_idle_s": IDLE_S})
    try:
        core, resizer = llm.engine, llm.engine.kv_resizer
        governor = core.kv_cache_governor
        governor.config = replace(governor.config, poll_interval_s=math.inf)  # no poll due
        polled: list[KVUsage] = []  # the usage each poll decided on
        decide = governor.decide

        def spy(free: int, total: int, now: float, usage: KVUsage | None = None) -> int:
            polled.append(usage)
            return decide(free, total, now, usage)

        governor.decide = spy  # type: ignore[method-assign]
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        for i, prompt in enumerate(make_prompts((200,) * 3)):
            [seq] = llm.make_request(prompt, params, str(i))
            core.add_request(seq)
        for _ in range(4):  # prefilled: they hold more than one max_model_len sequence
            core.step()  # the first polls; the next poll is never due
        polled.clear()
        preemptions = core.scheduler.num_preemptions
        core.resize_kv_cache(resizer.floor)  # preempts the sequence holding the tail
        assert core.scheduler.num_preemptions > preemptions
        core.abort_request("0")  # room for it again: the step between polls readmits it
        core.step()
        assert not polled and not core.scheduler.waiting
        governor.last_poll = -math.inf  # the next step polls
        core.step()
        assert len(polled) == 1 and polled[0].short
    finally:
        llm.shutdown()
