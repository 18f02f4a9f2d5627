"""The out-of-memory guard: a device OOM in any phase of a step shrinks the KV cache from its
tail and re-runs the step, losing no request and changing no greedy output. On the CPU through
the host VMM driver, with failures injected at stable seams of the model runner (the model's
forward and compute_logits, the runner's sampler as a callable); the GPU essentials under `gpu`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.engine.block_manager import BlockManager
from kvfit.engine.oom_guard import (
    KVCacheOutOfMemoryError,
    OOMGuardEvent,
    is_device_oom,
    requested_bytes,
)
from kvfit.vmm import VmmOutOfMemoryError

MiB = 1 << 20
MAX_TOKENS = 8
# 16 sequences of 512 tokens bound the host cache: 512 blocks of 16 KiB, four 2 MiB granules.
LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=256)
REQUESTED = 2 * MiB
OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of "
               "139.81 GiB of which 1.19 MiB is free.")
PROMPT_LENGTHS = (1, 17, 40, 100)
LONG_LENGTHS = tuple(range(380, 392))  # twelve requests of ~24 blocks: ~290 of the 512


def make_prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
            for n in lengths]


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


PARAMS = {
    "greedy": greedy(),
    "logprobs": greedy(logprobs=3),
    "prompt_logprobs": greedy(prompt_logprobs=2),
}


class Fault:
    """Wraps `fn`: the first `times` calls for which `when(*args)` holds raise `error`."""

    def __init__(self, fn: Callable[..., Any], when: Callable[..., bool] = lambda *a: True,
                 error: BaseException | None = None, times: float = 1) -> None:
        self.fn, self.when, self.times = fn, when, times
        self.error = error or torch.OutOfMemoryError(OOM_MESSAGE)
        self.fired = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fired < self.times and self.when(*args):
            self.fired += 1
            raise self.error
        return self.fn(*args, **kwargs)


def on_call(n: int) -> Callable[..., bool]:
    """A `Fault.when` that holds on the n-th call (1-based) only."""
    calls = [0]

    def when(*args: Any) -> bool:
        calls[0] += 1
        return calls[0] == n

    return when


def runner(llm: LLM) -> Any:
    return llm.engine.executor.workers[0].runner


def inject(llm: LLM, phase: str, **kwargs: Any) -> Fault:
    """Make `phase` of a step fail (see `Fault`); returns the fault to count its firings."""
    r = runner(llm)
    model = r.model
    if phase == "prefill_forward":
        model.forward = fault = Fault(model.forward, lambda ids, pos, meta: meta.max_query_len > 1,
                                      **kwargs)
    elif phase == "decode_forward":
        model.forward = fault = Fault(model.forward,
                                      lambda ids, pos, meta: meta.max_query_len == 1, **kwargs)
    elif phase == "compute_logits":
        # The second step's: a decode, launched while the first step is in flight.
        model.compute_logits = fault = Fault(model.compute_logits, on_call(2), **kwargs)
    elif phase == "prompt_logprobs":
        # Sampling scores at most one row per sequence: more rows are prompt logprobs.
        model.compute_logits = fault = Fault(
            model.compute_logits, lambda hidden: len(hidden) > len(PROMPT_LENGTHS), **kwargs)
    elif phase == "sampler":
        r.sampler = fault = Fault(r.sampler, on_call(2), **kwargs)
    else:
        raise ValueError(phase)
    return fault


def generate(llm: LLM, params: SamplingParams, lengths: tuple[int, ...] = PROMPT_LENGTHS,
             ) -> list[Any]:
    return llm.generate(make_prompts(lengths), params, use_tqdm=False)


def completions(outputs: list[Any]) -> list[tuple]:
    """What a run produced, per request: tokens, logprobs and prompt logprobs."""
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outputs]


def assert_same(got: list[Any], expected: list[Any]) -> None:
    for (tokens, logprobs, prompt_logprobs), (e_tokens, e_logprobs, e_prompt) in zip(
        completions(got), completions(expected), strict=True
    ):
        assert tokens == e_tokens
        for entries, e_entries in ((logprobs, e_logprobs), (prompt_logprobs, e_prompt)):
            assert (entries is None) == (e_entries is None)
            for entry, e_entry in zip(entries or [], e_entries or [], strict=True):
                assert (entry is None) == (e_entry is None)
                if entry is not None:
                    assert entry.keys() == e_entry.keys()
                    assert [e.logprob for e in entry.values()] == pytest.approx(
                        [e.logprob for e in e_entry.values()], abs=1e-5)
                    assert [e.rank for e in entry.values()] == [
                        e.rank for e in e_entry.values()]


def assert_nothing_leaked(llm: LLM) -> None:
    """Every block free, no ref counts, heaps and hash table consistent, nothing queued."""
    engine = llm.engine
    bm: BlockManager = engine.scheduler.block_manager
    assert not engine.has_unfinished()
    assert bm.num_free_blocks == bm.num_blocks == len(bm.blocks) == len(bm._in_heap)
    assert all(b.ref_count == 0 for b in bm.blocks)
    in_heaps = [i for heap in bm._free_heaps for i in heap]
    assert len(in_heaps) == len(set(in_heaps)) and set(in_heaps) == set(range(bm.num_blocks))
    assert all(bm._in_heap)
    for h, block_id in bm.hash_to_block.items():
        assert block_id < bm.num_blocks and bm.blocks[block_id].hash == h


@pytest.fixture
def make_llm(qwen3: Path) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(**kwargs: object) -> LLM:
        llm = LLM(str(qwen3), device="cpu", **{**LIMITS, **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


@pytest.fixture(scope="module")
def reference(qwen3: Path) -> Callable[..., list[Any]]:
    """Outputs without any injected failure, per (params name, prompt lengths)."""
    llm = LLM(str(qwen3), device="cpu", **LIMITS)
    done: dict[tuple, list[Any]] = {}

    def get(name: str, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> list[Any]:
        if (name, lengths) not in done:
            done[name, lengths] = generate(llm, PARAMS[name], lengths)
        return done[name, lengths]

    yield get
    llm.shutdown()


def expected_cut(llm: LLM, granules: int = 1) -> int:
    """Where the guard cuts the cache now: past the request and `granules` granules, down to a
    physical chunk's start (cutting a chunk would need memory for a copy)."""
    cache = runner(llm).kv_cache
    fits = cache.blocks_that_fit(cache.physical_bytes - REQUESTED - granules * cache.granularity)
    return cache.uncut_blocks(fits)


def spy_resizes(llm: LLM) -> list[tuple[int, bool]]:
    """Record each worker commit (the guard's shrinks, the API's resizes): (blocks, whether a
    step was in flight then)."""
    calls: list[tuple[int, bool]] = []
    worker = llm.engine.executor.workers[0]
    original = worker.resize_kv_cache

    def spy(num_blocks: int) -> int:
        calls.append((num_blocks, llm.engine._in_flight is not None))
        return original(num_blocks)

    worker.resize_kv_cache = spy  # type: ignore[method-assign]
    return calls


# --- every phase of a step -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("phase", "params"),
    [
        ("prefill_forward", "greedy"),
        ("decode_forward", "greedy"),
        ("compute_logits", "greedy"),
        ("sampler", "greedy"),
        ("sampler", "logprobs"),  # the sampler computes the sampled tokens' logprobs
        ("prompt_logprobs", "prompt_logprobs"),
    ],
)
def test_an_oom_in_any_phase_shrinks_the_tail_and_reruns_the_step(
    make_llm: Callable[..., LLM], reference: Callable[..., list[Any]],
    caplog: pytest.LogCaptureFixture, phase: str, params: str,
) -> None:
    llm = make_llm()
    shrinks = spy_resizes(llm)
    cache, report = runner(llm).kv_cache, llm.kv_cache_report
    base, physical_before = cache.tensor.base_ptr, cache.physical_bytes
    before = report.num_blocks
    expected_after = expected_cut(llm)
    fault = inject(llm, phase)
    with caplog.at_level(logging.WARNING, logger="kvfit.engine.oom_guard"):
        outputs = generate(llm, PARAMS[params])

    assert fault.fired == 1
    assert_same(outputs, reference(params))
    assert all(o.finished for o in outputs)
    [event] = llm.engine.oom_guard.events
    assert event == OOMGuardEvent(
        requested_bytes=REQUESTED,
        num_blocks_before=before,
        num_blocks_after=expected_after,
        freed_bytes=physical_before - cache.physical_bytes,
        num_preempted=0,  # short requests hold the lowest ids: the tail was free
        implied_margin_bytes=report.margin + physical_before - cache.physical_bytes,
        message=OOM_MESSAGE,
    )
    assert 0 < event.num_blocks_after < before and event.freed_bytes >= REQUESTED
    assert llm.engine.oom_guard.num_events == 1
    # Shrunk everywhere: the cache, the block manager, the config; the base never moves.
    bm = llm.engine.scheduler.block_manager
    assert cache.committed_blocks == bm.num_blocks == llm.config.cache_config.num_gpu_blocks
    assert cache.committed_blocks == expected_after
    assert cache.physical_bytes == cache.footprint_bytes(expected_after) < physical_before
    assert cache.tensor.base_ptr == base
    assert shrinks == [(expected_after, False)]  # never under a running step
    # The report still describes startup, and counts the shrink.
    assert llm.kv_cache_report.num_blocks == before
    assert llm.kv_cache_report.oom_guard_shrinks == 1
    assert llm.kv_cache_report.format_table().splitlines()[-1].split()[-1] == "1"
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{before} -> {expected_after} blocks" in warning.getMessage()
    assert "Tried to allocate" in warning.getMessage()
    assert_nothing_leaked(llm)
    # The engine keeps serving from the smaller cache.
    assert_same(generate(llm, PARAMS[params]), reference(params))
    assert_nothing_leaked(llm)


def test_the_guard_gives_back_one_small_chunk_a_segment_beyond_its_need(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch,
    reference: Callable[..., list[Any]],
) -> None:
    """Startup maps the cache's last `TAIL_BYTES` in small chunks, so the guard, which must
    not copy (out of memory), gives back at most one of them a segment beyond the request and
    its granule; with startup's large chunks only, a whole chunk a segment goes back."""
    from kvfit.kv import cache as cache_module

    freed = {}
    for tail in (0, 1 << 30):
        monkeypatch.setattr(cache_module, "TAIL_BYTES", tail)
        monkeypatch.setattr(cache_module, "ELASTIC_CHUNK_BYTES", 1)  # a granule a segment
        llm = make_llm()
        cache = runner(llm).kv_cache
        inject(llm, "decode_forward")
        assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
        [event] = llm.engine.oom_guard.events
        freed[tail] = event.freed_bytes
        segments, granule = cache.spec.num_segments, cache.granularity
        llm.shutdown()
    assert REQUESTED <= freed[1 << 30] <= REQUESTED + granule + segments * granule
    assert freed[0] > freed[1 << 30]  # the test cache is small: 6 MiB against 4


def test_tail_in_use_preempts_its_holders_and_they_are_recomputed(
    make_llm: Callable[..., LLM], reference: Callable[..., list[Any]],
) -> None:
    # Twelve ~380-token requests take ~290 of the 512 blocks: the cut lands inside the blocks
    # of the last admitted ones when decoding starts.
    lengths = LONG_LENGTHS
    llm = make_llm()
    cut = expected_cut(llm)
    shrinks = spy_resizes(llm)
    scheduler = llm.engine.scheduler
    holders: list[int] = []

    def tail_holders(*args: Any) -> bool:
        if args[2].max_query_len > 1:
            return False
        holders.append(sum(max(s.block_table) >= cut for s in scheduler.running))
        return True

    runner(llm).model.forward = Fault(runner(llm).model.forward, tail_holders)
    outputs = generate(llm, PARAMS["greedy"], lengths)
    assert_same(outputs, reference("greedy", lengths))
    [event] = llm.engine.oom_guard.events
    assert event.num_blocks_after == cut < event.num_blocks_before == 512
    assert event.num_preempted == holders[0] > 0
    assert shrinks == [(cut, False)]
    assert scheduler.num_preemptions >= event.num_preempted
    assert_nothing_leaked(llm)


def test_prefix_hits_in_the_tail_are_preempted_and_evicted(
    make_llm: Callable[..., LLM], reference: Callable[..., list[Any]],
) -> None:
    llm = make_llm()
    cut = expected_cut(llm)
    generate(llm, PARAMS["greedy"], LONG_LENGTHS)  # leaves ~290 blocks cached, all free
    bm = llm.engine.scheduler.block_manager
    assert max(bm.hash_to_block.values()) >= cut
    hits: list[int] = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda seq: (hits.append(seq), add(seq))[1]  # type: ignore[method-assign]
    inject(llm, "prefill_forward")  # the first step of the rerun: its hits hold the tail
    assert_same(generate(llm, PARAMS["greedy"], LONG_LENGTHS), reference("greedy", LONG_LENGTHS))
    [event] = llm.engine.oom_guard.events
    assert event.num_blocks_after == cut and event.num_preempted > 0
    assert max(bm.hash_to_block.values()) < cut
    assert sum(seq.num_cached_tokens for seq in hits) > 0  # the entries below the cut still hit
    assert_nothing_leaked(llm)


# --- when the guard gives up ----------------------------------------------------------------


def test_a_cache_at_one_max_model_len_sequence_raises_naming_the_settings(
    make_llm: Callable[..., LLM],
) -> None:
    llm = make_llm()
    cut = expected_cut(llm)
    fault = inject(llm, "decode_forward", times=float("inf"))
    with pytest.raises(KVCacheOutOfMemoryError) as error:
        generate(llm, PARAMS["greedy"])
    message = str(error.value)
    for setting in ("max_num_seqs (16)", "max_model_len (512)", "kv_cache_margin_floor_bytes",
                    "kv_cache_margin_fraction", "cannot shrink", "Tried to allocate 2.00 MiB"):
        assert setting in message
    events = llm.engine.oom_guard.events
    # 512 -> the first cut, then down to the 32 one max_model_len sequence needs, no further.
    assert [(e.num_blocks_before, e.num_blocks_after) for e in events] == [(512, cut), (cut, 32)]
    assert fault.fired == 3
    assert runner(llm).kv_cache.committed_blocks == 32
    assert events[-1].implied_margin_bytes == llm.kv_cache_report.margin + sum(
        e.freed_bytes for e in events)


def test_retries_of_one_step_are_bounded(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    llm.engine.oom_guard.max_shrinks_per_step = 1
    inject(llm, "prefill_forward", times=float("inf"))
    with pytest.raises(KVCacheOutOfMemoryError, match="max_shrinks_per_step=1.*max_num_seqs"):
        generate(llm, PARAMS["greedy"])
    assert llm.engine.oom_guard.num_events == 1


@pytest.mark.parametrize(("kwargs", "method", "knob"), [
    ({"enable_extensible_kv_cache": False}, "estimate", "cpu_kv_cache_space_bytes"),
    ({"num_gpu_blocks_override": 512}, "override", "num_gpu_blocks_override"),
])
def test_a_cache_that_cannot_shrink_empties_torchs_cache_and_retries_once(
    make_llm: Callable[..., LLM], reference: Callable[..., list[Any]], kwargs: dict,
    method: str, knob: str,
) -> None:
    llm = make_llm(**kwargs)
    assert llm.kv_cache_report.method == method
    num_blocks = llm.kv_cache_report.num_blocks
    empties: list[int] = []
    worker = llm.engine.executor.workers[0]
    worker.empty_cache = lambda: empties.append(1)  # type: ignore[method-assign]
    inject(llm, "decode_forward")
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    [event] = llm.engine.oom_guard.events
    assert (event.num_blocks_before, event.num_blocks_after) == (num_blocks, num_blocks)
    assert (event.freed_bytes, event.num_preempted) == (0, 0)
    assert empties == [1] and llm.engine.oom_guard.num_shrinks == 0
    assert llm.kv_cache_report.oom_guard_shrinks == 0
    assert_nothing_leaked(llm)
    # A second failure of the same step is one too many.
    inject(llm, "decode_forward", times=2)
    with pytest.raises(KVCacheOutOfMemoryError) as error:
        generate(llm, PARAMS["greedy"])
    message = str(error.value)
    for text in (f"sized by {method} cannot shrink", knob, "max_num_seqs (16)",
                 "max_model_len (512)", "kv_cache_margin_floor_bytes"):
        assert text in message


def test_a_shrink_that_runs_out_of_memory_itself_raises_a_clear_error(
    make_llm: Callable[..., LLM],
) -> None:
    llm = make_llm()
    worker = llm.engine.executor.workers[0]

    def failing_shrink(num_blocks: int) -> int:
        raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")

    worker.resize_kv_cache = failing_shrink  # type: ignore[method-assign]
    inject(llm, "decode_forward")
    with pytest.raises(KVCacheOutOfMemoryError, match="shrinking the KV cache did too.*"
                       "max_num_seqs.*cuMemCreate"):
        generate(llm, PARAMS["greedy"])


def test_other_errors_are_not_absorbed(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    inject(llm, "compute_logits", error=RuntimeError("an unrelated failure"))
    with pytest.raises(RuntimeError, match="an unrelated failure"):
        generate(llm, PARAMS["greedy"])
    assert llm.engine.oom_guard.num_events == 0


def test_a_generate_that_raises_ends_its_requests(
        make_llm: Callable[..., LLM], reference: Callable[..., list[Any]]) -> None:
    """The caller of a `generate` that raised never gets its outputs: its requests must not
    stay queued, to be run (or fail again) under the next call."""
    llm = make_llm()
    inject(llm, "compute_logits", error=RuntimeError("an unrelated failure"))
    with pytest.raises(RuntimeError, match="an unrelated failure"):
        generate(llm, PARAMS["greedy"], LONG_LENGTHS)
    assert_nothing_leaked(llm)
    steps = llm.engine.stats().num_steps
    assert_same(generate(llm, PARAMS["greedy"]), reference("greedy"))
    assert llm.engine.stats().num_steps - steps == MAX_TOKENS  # one prefill, no long prompts


@pytest.mark.parametrize(("error", "oom"), [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"), True),
    (RuntimeError("CUDA error: out of memory"), True),
    (RuntimeError("HIP out of memory. Tried to allocate 2.00 MiB"), True),
    (RuntimeError("CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
    (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
    (ValueError("out of memory"), False),
    (KVCacheOutOfMemoryError("out of memory"), False),
])
def test_device_oom_is_recognised(error: BaseException, oom: bool) -> None:
    assert is_device_oom(error) is oom


@pytest.mark.parametrize(("message", "nbytes"), [
    ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 ...", 20 * MiB),
    ("Tried to allocate 1.50 GiB", 3 << 29),
    ("Tried to allocate 512 bytes", 512),
    ("Tried to allocate 1.01 KiB", 1035),  # rounded up
    ("CUBLAS_STATUS_ALLOC_FAILED", 0),
])
def test_requested_bytes_are_read_from_the_message(message: str, nbytes: int) -> None:
    assert requested_bytes(message) == nbytes


# --- GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_oom_in_a_graph_replayed_decode_keeps_graphs_and_outputs(
    gpu_model: Path,
) -> None:
    def make() -> LLM:
        return LLM(str(gpu_model), device="cuda", max_num_seqs=32, max_model_len=1024,
                   cuda_graph_sizes=[1, 2, 4, 8])

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = make_prompts((1, 7, 16, 33, 64, 100))
    reference = make()
    expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params,
                                                                     use_tqdm=False)]
    reference.shutdown()
    llm = make()
    shrinks = spy_resizes(llm)
    r = runner(llm)
    assert r.graphs is not None
    cache = r.kv_cache
    base, physical, views = cache.tensor.base_ptr, cache.physical_bytes, bound_views(r)
    replays: list[int] = []
    replay = r.graphs.run
    r.graphs.run = Fault(lambda *a: (replays.append(1), replay(*a))[1],  # type: ignore[method-assign]
                         error=torch.OutOfMemoryError(
                             "CUDA out of memory. Tried to allocate 64.00 MiB."))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert r.graphs.run.fired == 1
    assert got == expected
    assert len(replays) >= params.max_tokens - 1  # graphs captured at startup still replay
    assert r.graphs.num_capture_passes == 1  # and were never recaptured
    [event] = llm.engine.oom_guard.events
    assert event.requested_bytes == 64 * MiB and event.freed_bytes >= 64 * MiB
    assert cache.committed_blocks == event.num_blocks_after < event.num_blocks_before
    assert cache.physical_bytes == physical - event.freed_bytes
    assert cache.tensor.base_ptr == base and bound_views(r) == views
    assert [in_flight for _, in_flight in shrinks] == [False]
    assert_nothing_leaked(llm)
    llm.shutdown()


def bound_views(r: Any) -> list[int]:
    """Addresses of the K/V views the model's layers read (what a captured graph bakes in)."""
    return [t.data_ptr() for layer in r.model.model.layers
            for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
