"""Measured KV cache sizing end to end: configuration, the startup order, the fallback
and the report, on the CPU through the host VMM driver; the GPU essentials under `gpu`."""

from __future__ import annotations

import gc
import json
import logging
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

import kvfit.engine.model_runner as model_runner
import kvfit.engine.sampler as sampler
import kvfit.engine.worker as worker_module
from kvfit import LLM, SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.engine.engine_core import EngineCore
from kvfit.engine.model_runner import ModelRunner
from kvfit.engine.sequence import ScheduledBatch
from kvfit.engine.worker import Worker
from kvfit.kv.monitor import MemoryMonitor
from kvfit.kv.sizing import MemorySnapshot, StepPeak, kv_margin

MiB = 1 << 20
MAX_TOKENS = 8
# Small limits keep every engine here quick: 16 sequences of 512 tokens bound the cache.
LIMITS = dict(max_num_seqs=16, max_num_batched_tokens=256)


@pytest.fixture
def make_llm(qwen3: Path) -> Iterator[Callable[..., LLM]]:
    """LLMs on the CPU with `LIMITS` unless overridden; each shut down after the test."""
    made: list[LLM] = []

    def make(**kwargs: object) -> LLM:
        llm = LLM(str(qwen3), device="cpu", **{**LIMITS, **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def prompts() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
            for n in (1, 17, 40, 100)]


def greedy_tokens(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def estimate_tokens(qwen3: Path) -> list[list[int]]:
    """Greedy outputs of an estimate-sized engine: what every other sizing must reproduce."""
    llm = LLM(str(qwen3), device="cpu", enable_extensible_kv_cache=False, **LIMITS)
    try:
        return greedy_tokens(llm)
    finally:
        llm.shutdown()


def worker(llm: LLM) -> Worker:
    return llm.engine.executor.workers[0]


def bound_views(runner: ModelRunner) -> list[int]:
    """Addresses of the K/V views the model's layers read (what a captured graph bakes in)."""
    return [t.data_ptr() for layer in runner.model.model.layers
            for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]


def rss_shmem() -> int:
    """Resident shared memory of this process: where the host driver's KV pages live once
    touched."""
    with open("/proc/self/status") as f:
        return int(re.search(r"^RssShmem:\s+(\d+) kB", f.read(), re.MULTILINE)[1]) * 1024


def mapped_kv_bytes() -> int:
    """Bytes of host-driver pages (memfd `kvfit-vmm`) mapped into this process now."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "kvfit-vmm" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                total += end - start
    return total


def spy_extend(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Record the cache's base, bound views and committed blocks as the final commit starts."""
    before: dict[str, object] = {}
    original = Worker.extend_kv_cache

    def spy(self: Worker, num_blocks: int) -> None:
        cache = self.runner.kv_cache
        before.update(base=cache.tensor.base_ptr, views=bound_views(self.runner),
                      committed=cache.committed_blocks, physical=cache.physical_bytes)
        original(self, num_blocks)

    monkeypatch.setattr(Worker, "extend_kv_cache", spy)
    return before


# --- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "method", "utilization"),
    [
        ({}, "measured", 1.0),
        ({"enable_extensible_kv_cache": True}, "measured", 1.0),
        ({"gpu_memory_utilization": 0.5}, "measured", 0.5),
        ({"enable_extensible_kv_cache": False}, "estimate", 0.92),
        ({"enable_extensible_kv_cache": False, "gpu_memory_utilization": 0.5}, "estimate", 0.5),
        ({"num_gpu_blocks_override": 64}, "override", 0.92),
        ({"kv_cache_memory_bytes": 32 * MiB}, "override", 0.92),
    ],
)
def test_each_configuration_sizes_by_its_method_and_budget(
    make_llm: Callable[..., LLM], kwargs: dict, method: str, utilization: float,
    estimate_tokens: list[list[int]],
) -> None:
    llm = make_llm(**kwargs)
    report, cc = llm.kv_cache_report, llm.config.cache_config
    assert report.method == method
    assert cc.enable_extensible_kv_cache is (method == "measured")
    assert report.total == cc.cpu_kv_cache_space_bytes  # the host budget stands for the device
    assert report.on_host and "host budget" in report.format_table()
    # The host's "torch" figures are the process's private memory: no graph split there.
    assert report.graphs_and_buffers is None and "graphs" not in report.format_table()
    # ... but the process's own memory (Python, torch), which the budget counts, has a row:
    # without it a budget of 600 MiB left an 8 MiB cache with ~300 MiB shown nowhere.
    assert report.host_process is not None and report.host_process > 0
    assert "process, other" in report.format_table()
    if method == "measured":
        shown = (report.weights + report.host_process + report.non_torch + report.transient
                 + report.margin + report.committed_bytes)
        assert shown <= report.budget
    assert report.budget == int(cc.cpu_kv_cache_space_bytes * utilization)
    assert (report.margin > 0) == (method == "measured")  # only measured sizing keeps one
    assert report.num_blocks == cc.num_gpu_blocks == llm.engine.scheduler.block_manager.num_blocks
    if "num_gpu_blocks_override" in kwargs:
        assert report.num_blocks == kwargs["num_gpu_blocks_override"]
    if "kv_cache_memory_bytes" in kwargs:
        block_bytes = llm.config.kv_cache_spec().block_bytes
        assert report.num_blocks == kwargs["kv_cache_memory_bytes"] // block_bytes
    assert greedy_tokens(llm) == estimate_tokens


@pytest.mark.parametrize("extensible", [None, False])
def test_host_cache_stops_at_what_max_num_seqs_of_max_model_len_use_and_says_so(
    make_llm: Callable[..., LLM], extensible: bool | None
) -> None:
    llm = make_llm(enable_extensible_kv_cache=extensible, max_model_len=256)
    report, sc = llm.kv_cache_report, llm.config.scheduler_config
    cap = sc.max_num_seqs * -(-sc.max_model_len // llm.config.cache_config.block_size)
    assert report.estimate_num_blocks > cap  # the default budget would hold more
    assert report.num_blocks == report.max_blocks == cap
    assert f"{cap:,}" in report.format_table().splitlines()[-1]  # the table names the cap


def test_cpu_budget_is_a_modest_share_of_the_host_changed_by_its_flag(
    make_llm: Callable[..., LLM],
) -> None:
    host = psutil.virtual_memory().total
    default = EngineArgs(model="kvfit-tiny", device="cpu").create_engine_config()
    assert default.cache_config.cpu_kv_cache_space_bytes == min(8 << 30, host // 3)
    # Above what this process already holds: measured sizing counts the whole process's
    # private memory against the budget, and a long test session's grows past 1 GiB.
    budget = psutil.Process().memory_info().rss + (1 << 30)
    llm = make_llm(cpu_kv_cache_space_bytes=budget)
    assert llm.kv_cache_report.total == llm.kv_cache_report.budget == budget


@pytest.mark.parametrize("name", ["kv_cache_memory_bytes", "num_gpu_blocks_override"])
def test_extensible_cache_with_a_manual_size_is_a_config_error(
    qwen3: Path, name: str
) -> None:
    with pytest.raises(ValueError, match=f"enable_extensible_kv_cache=True conflicts with {name}"):
        LLM(str(qwen3), device="cpu", enable_extensible_kv_cache=True, **{name: 64})


def test_extensible_cache_asked_where_vmm_is_unusable_is_a_config_error(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvfit.vmm

    monkeypatch.setattr(kvfit.vmm, "vmm_unavailable_reason", lambda device: "no VMM here")
    with pytest.raises(ValueError, match="enable_extensible_kv_cache=True .*no VMM here"):
        LLM(str(qwen3), device="cpu", enable_extensible_kv_cache=True)


def test_budget_above_free_memory_is_tolerated_only_by_measured_sizing(
    make_llm: Callable[..., LLM],
) -> None:
    beyond = 4 * psutil.virtual_memory().total
    llm = make_llm(cpu_kv_cache_space_bytes=beyond)  # only over-reserves address space
    assert llm.kv_cache_report.method == "measured"
    assert llm.kv_cache_report.budget == beyond
    with pytest.raises(ValueError, match="needs its whole budget free.*cpu_kv_cache_space_bytes"):
        make_llm(cpu_kv_cache_space_bytes=beyond, enable_extensible_kv_cache=False)


def test_margin_knobs_set_the_margin_kept(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(kv_cache_margin_floor_bytes=8 * MiB, kv_cache_margin_fraction=3.0)
    report = llm.kv_cache_report
    assert report.margin == kv_margin(report.transient, 8 * MiB, 3.0)
    assert report.margin >= 8 * MiB


# --- startup order -------------------------------------------------------------------------


def test_startup_stages_are_reported_in_order_within_the_total(
    make_llm: Callable[..., LLM],
) -> None:
    for sizing in (None, False):  # measured, then the estimate
        stages = make_llm(enable_extensible_kv_cache=sizing).startup_stages
        # The CPU is eager: no graphs are captured, so that stage is absent.
        assert list(stages) == ["start_workers", "load_weights", "profile", "allocate_kv_cache",
                                "warm_up", "size_kv_cache", "total"]
        assert all(s > 0 for s in stages.values())
        total = stages.pop("total")
        assert sum(stages.values()) <= total


@pytest.mark.parametrize(("small_batch_kernels", "fused_decode_input"),
                         [(False, False), (True, False), (False, True)])
def test_startup_order_commits_only_what_warmup_addresses(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch, small_batch_kernels: bool,
    fused_decode_input: bool,
) -> None:
    events: list[tuple] = []

    def spy(cls: type, name: str, record: Callable[..., tuple]) -> None:
        original = getattr(cls, name)

        def wrapped(self: object, *args: object) -> object:
            events.append(record(self, *args))
            return original(self, *args)

        monkeypatch.setattr(cls, name, wrapped)

    def committed(runner: ModelRunner) -> int | None:
        return runner.kv_cache.committed_blocks if runner.kv_cache is not None else None

    spy(Worker, "warm_up", lambda w, n: ("warm_up", n, committed(w.runner),
                                         w.runner.kv_cache.capacity_blocks))
    spy(ModelRunner, "execute", lambda r, b: (
        "step", sum(b.num_new_tokens), sum(n == 1 for n in b.num_new_tokens),
        max(max(s.block_table) for s in b.seqs), committed(r)))
    spy(ModelRunner, "capture_cuda_graphs", lambda r: ("capture", committed(r)))
    spy(Worker, "extend_kv_cache", lambda w, n: ("extend", n))
    llm = make_llm(small_batch_kernels=small_batch_kernels,
                   fused_decode_input=fused_decode_input)

    # Under the small-batch kernels (their fused variants) or the fused decode input (a step of
    # decodes alone) warmup also samples one decode token; always a short prefill and a short
    # decode (the decode kernels' unsplit variant).
    one_decode = small_batch_kernels or fused_decode_input
    warmup_steps = 6 if one_decode else 5
    names = [e[0] for e in events]
    assert names == ["step", "warm_up", *["step"] * warmup_steps, "capture", "extend"]
    _, committable, committed_at_warmup, capacity = events[1]
    assert committed_at_warmup == 1  # capacity reserved, only the minimum committed
    assert capacity == llm.engine.executor.workers[0].runner.kv_cache.capacity_blocks
    steps = [e for e in events[2:] if e[0] == "step"]
    for _, _, _, max_block_id, committed_now in steps:
        # Dummy ids stay within what the step committed, and within the engine's bound.
        assert max_block_id < committed_now <= committable
    if one_decode:
        assert steps[1][1:3] == (1, 1)  # one token, a decode
    # Sequences of one block: a prefill of two tokens and a decode, each one split a sequence.
    assert [s[1:4] for s in steps[-4:-2]] == [(2, 0, 0), (1, 1, 0)]
    mixed, full_rows = steps[-2], steps[-1]
    assert mixed[1] == LIMITS["max_num_batched_tokens"] and mixed[2] > 0  # prefill + decodes
    # The most rows a step samples, beside the activations of the whole token budget.
    assert full_rows[1] == LIMITS["max_num_batched_tokens"]
    assert full_rows[2] == LIMITS["max_num_seqs"]
    assert events[-2][1] == steps[-1][4]  # captured with what warmup committed, nothing more
    assert events[-1][1] == llm.kv_cache_report.num_blocks


@pytest.mark.parametrize("max_logprobs", [0, 20])
def test_the_mixed_warmup_step_runs_a_whole_prompt_logprobs_chunk(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch, max_logprobs: int
) -> None:
    # The chunk's logits must be measured beside the step's activations, as real steps make
    # them, so it is part of the mixed step and not a step of its own. A chunk narrower than
    # the tiny model's max_model_len (512) shows that warmup's chunk is a whole one, even
    # when decodes would take most of the token budget (max_num_seqs of 256); prompt logprobs
    # of 0 are allowed whatever max_logprobs is, so the chunk always runs.
    chunk = 128
    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_CHUNK", chunk)
    chunks: list[int] = []
    steps: list[ScheduledBatch] = []
    original_step, original_chunk = ModelRunner.execute, sampler.logprobs_at
    monkeypatch.setattr(ModelRunner, "execute",
                        lambda self, b: (steps.append(b), original_step(self, b))[1])
    monkeypatch.setattr(model_runner, "logprobs_at",
                        lambda logits, *a: (chunks.append(len(logits)),
                                            original_chunk(logits, *a))[1])
    budget = chunk + 64
    make_llm(max_logprobs=max_logprobs, max_num_seqs=256, max_num_batched_tokens=budget)
    mixed = steps[-2]
    assert mixed.num_tokens == budget and not mixed.is_decode_only
    assert all(s.sampling_params.prompt_logprobs == max_logprobs for s in mixed.seqs)
    assert max(chunks) == chunk


def test_the_estimate_reads_a_step_that_samples_the_most_rows_with_every_feature(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Sizing by estimate reads the profiling steps alone, before warmup runs: the profiling
    # prefill samples no row, so the sampler's memory at max_num_seqs rows (the logits, the
    # allowed tokens' undo, the draw's temporaries: 5x the prefill's peak at 64 rows of an 8k
    # vocabulary, watch_memory) was in no estimate.
    from kvfit.engine.sampler import SamplingMetadata
    from kvfit.engine.sampling_features import SAMPLING_FEATURES

    profiling, sampled = [False], []
    profile, from_seqs = Worker.profile, SamplingMetadata.from_seqs

    def spy_profile(self: Worker, measure_graphs: bool = False) -> int:
        profiling[0] = True
        try:
            return profile(self, measure_graphs)
        finally:
            profiling[0] = False

    def spy_from_seqs(seqs: list, *args: object) -> SamplingMetadata:
        if profiling[0]:
            sampled.append([seq.sampling_params for seq in seqs])
        return from_seqs(seqs, *args)

    monkeypatch.setattr(Worker, "profile", spy_profile)
    monkeypatch.setattr(SamplingMetadata, "from_seqs", staticmethod(spy_from_seqs))
    make_llm(enable_extensible_kv_cache=False)
    assert sampled and max(map(len, sampled)) == LIMITS["max_num_seqs"]
    widest = max(sampled, key=len)
    assert all(feature.active(params) for params in widest for feature in SAMPLING_FEATURES)
    sampled.clear()
    make_llm()  # the measured path: its warmup samples them, measured before sizing
    assert not sampled


@pytest.mark.parametrize(("extensible", "passes"), [(None, 1), (False, 2)])
def test_measured_sizing_captures_once_the_estimate_adds_a_throwaway_pass(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch, extensible: bool | None,
    passes: int,
) -> None:
    calls: list[int] = []
    original = ModelRunner.capture_cuda_graphs
    monkeypatch.setattr(ModelRunner, "capture_cuda_graphs",
                        lambda self: (calls.append(1), original(self))[1])
    make_llm(enable_extensible_kv_cache=extensible)
    assert len(calls) == passes


def test_extend_keeps_the_base_and_every_bound_view(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = spy_extend(monkeypatch)
    llm = make_llm()
    runner = worker(llm).runner
    cache = runner.kv_cache
    assert cache.committed_blocks == llm.kv_cache_report.num_blocks > before["committed"]
    assert cache.tensor.base_ptr == before["base"] == bound_views(runner)[0]
    assert bound_views(runner) == before["views"]
    [view] = cache.committed_views()
    assert view.data_ptr() == cache.tensor.base_ptr
    assert view.untyped_storage().nbytes() == cache.tensor.committed_bytes
    assert llm.kv_cache_report.committed_bytes == cache.physical_bytes
    assert cache.physical_bytes % cache.granularity == 0


def test_final_commit_shrinks_below_what_warmup_used(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch,
    estimate_tokens: list[list[int]],
) -> None:
    # One granule is all that is measured free: fewer blocks than the full-size warmup used.
    monkeypatch.setattr(worker_module, "available_kv_bytes", lambda profile, *args: 2 * MiB)
    before = spy_extend(monkeypatch)
    llm = make_llm(max_num_seqs=256, max_num_batched_tokens=4096)
    cache = worker(llm).runner.kv_cache
    fits = cache.blocks_that_fit(2 * MiB)
    assert before["committed"] > fits == cache.committed_blocks == llm.kv_cache_report.num_blocks
    assert cache.physical_bytes == cache.footprint_bytes(fits) < before["physical"]
    assert cache.tensor.base_ptr == before["base"]
    assert bound_views(worker(llm).runner) == before["views"]
    assert llm.engine.scheduler.block_manager.num_blocks == fits
    assert greedy_tokens(llm) == estimate_tokens


def test_max_model_len_that_does_not_fit_points_at_max_model_len_and_max_num_seqs(
    qwen3: Path,
) -> None:
    budget = 1 << 30
    with pytest.raises(ValueError) as error:
        # A margin as large as the budget leaves nothing for the cache.
        LLM(str(qwen3), device="cpu", cpu_kv_cache_space_bytes=budget,
            kv_cache_margin_floor_bytes=budget, **LIMITS)
    message = str(error.value)
    assert "max_model_len (512)" in message
    assert "lower max_model_len or max_num_seqs" in message
    assert "gpu_memory_utilization" not in message
    gc.collect()
    assert mapped_kv_bytes() == 0  # the failed startup released what warmup committed


@pytest.mark.parametrize("auto", ["auto", -1])
def test_max_model_len_auto_is_lowered_to_what_the_measured_cache_holds(
    qwen3: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, auto: str | int,
) -> None:
    """vLLM's `--max-model-len auto`: where one sequence of the model's whole context does not
    fit what sizing measured, the engine serves the longest that does (with a warning) rather
    than refusing to start; requests are then held to it."""
    model = tmp_path / "long-context"
    shutil.copytree(qwen3, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    # One granule is all that is measured free: 2,048 tokens of this model.
    monkeypatch.setattr(worker_module, "available_kv_bytes", lambda profile, *args: 2 * MiB)
    with caplog.at_level(logging.WARNING, logger="kvfit.engine.engine_core"):
        llm = LLM(str(model), device="cpu", max_model_len=auto, **LIMITS)
    try:
        fits = llm.kv_cache_report.num_blocks * llm.config.cache_config.block_size
        assert fits < 8192
        assert llm.config.model_config.max_model_len == llm.engine.scheduler.max_model_len == fits
        assert f"serving with max_model_len={fits}" in caplog.text
        out = llm.generate([{"prompt_token_ids": [5] * (fits - 4)}],
                           SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4
        with pytest.raises(ValueError, match=f"max_model_len is {fits}"):
            llm.generate([{"prompt_token_ids": [5] * fits}], use_tqdm=False)
    finally:
        llm.shutdown()


def test_max_model_len_auto_under_a_fixed_cache_size(make_llm: Callable[..., LLM]) -> None:
    """The model's whole context where it fits; else what `num_gpu_blocks_override` holds,
    known before warmup."""
    llm = make_llm(max_model_len="auto", num_gpu_blocks_override=4096)
    hf = llm.config.model_config.hf_config
    assert llm.engine.scheduler.max_model_len == hf.max_position_embeddings
    llm = make_llm(max_model_len="auto", num_gpu_blocks_override=8)
    assert llm.engine.scheduler.max_model_len == llm.config.model_config.max_model_len == 128
    out = llm.generate([{"prompt_token_ids": [5] * 120}],
                       SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8


def test_engine_takes_the_minimum_over_workers(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts: dict[str, list[int]] = {"initialize_kv_cache": [], "measure_kv_cache_blocks": []}
    for name, answers in counts.items():
        original = getattr(Worker, name)

        def lower_on_rank_1(self: Worker, *args: object, _original=original,
                            _answers=answers) -> int:
            n = _original(self, *args) - 3 * self.rank  # rank 1 has less memory free
            _answers.append(n)
            return n

        monkeypatch.setattr(Worker, name, lower_on_rank_1)
    warmed: list[int] = []
    warm_up = Worker.warm_up
    monkeypatch.setattr(Worker, "warm_up", lambda self, n: (warmed.append(n), warm_up(self, n))[1])
    config = EngineArgs(model=str(qwen3), device="cpu", **LIMITS).create_engine_config()
    engine = EngineCore(config, num_workers=2)
    try:
        assert warmed == [min(counts["initialize_kv_cache"])] * 2
        final = min(counts["measure_kv_cache_blocks"])
        assert engine.kv_cache_report.num_blocks == final
        assert [w.runner.kv_cache.committed_blocks for w in engine.executor.workers] == [final] * 2
    finally:
        engine.shutdown()


class FakeMonitor(MemoryMonitor):
    """A device whose readings the test sets: `free`, torch's `reserved` and `allocated`."""

    def __init__(self, total: int) -> None:
        self.total, self.free, self.reserved, self.allocated = total, total, 0, 0

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(self.total, self.free, self.reserved, self.allocated)

    def reset_peak(self) -> None:
        pass

    def step_peak(self) -> StepPeak:
        return StepPeak(reserved_peak=self.reserved, live_allocated=self.allocated)


def fake_worker(monitor: FakeMonitor, engine_args: dict[str, object] | None = None,
                **runner: object) -> Worker:
    """A worker over `monitor` and a stand-in runner: sizing arithmetic without a model."""
    config = EngineArgs(model="kvfit-tiny", device="cpu",
                        **(engine_args or {})).create_engine_config()
    w = Worker(config)
    w.monitor = monitor
    w.baseline = monitor.snapshot()
    w.runner = SimpleNamespace(kv_cache=None, weight_arena=None,
                               kv_cache_spec=config.kv_cache_spec(), **runner)
    return w


def test_memory_torch_holds_idle_counts_as_free_in_the_measurement() -> None:
    monitor = FakeMonitor(total=10 << 30)
    w = fake_worker(monitor)
    # Torch reserved 3 GiB of which 1 GiB is live: the idle 2 GiB is reusable, not used.
    monitor.free, monitor.reserved, monitor.allocated = 7 << 30, 3 << 30, 1 << 30
    profile = w.memory_profile()
    assert profile.free == 9 << 30
    assert profile.non_kv_use == 1 << 30


class MiBBlockCache:
    """Stands in for the extensible cache: one block per MiB, so block counts are exact."""

    capacity_blocks = 1 << 30
    physical_bytes = 0

    def blocks_that_fit(self, nbytes: int) -> int:
        return nbytes // MiB


@pytest.mark.parametrize(("floor", "fraction", "margin"), [
    pytest.param(0, 0.25, 512 * MiB, id="quarter"),
    pytest.param(0, 0.5, 1024 * MiB, id="half"),
    pytest.param(0, 1.5, 3072 * MiB, id="one-and-a-half"),
    # The floor wins over a small share of the transient.
    pytest.param(1536 * MiB, 0.5, 1536 * MiB, id="floor"),
])
def test_measured_block_count_keeps_the_configured_margin(
    floor: int, fraction: float, margin: int
) -> None:
    # Through the worker, not the pure function: the knobs must reach the sizing itself.
    monitor = FakeMonitor(total=16 << 30)
    w = fake_worker(monitor, {"kv_cache_margin_floor_bytes": floor,
                              "kv_cache_margin_fraction": fraction})
    w.runner.kv_cache = MiBBlockCache()
    w.step_peaks = [StepPeak(reserved_peak=3 << 30, live_allocated=1 << 30)]  # transient 2 GiB
    # After warmup: 1 GiB of weights in torch, 3 GiB taken outside torch, 12 GiB free.
    monitor.free, monitor.reserved, monitor.allocated = 12 << 30, 1 << 30, 1 << 30
    usable = (16 << 30) - (4 << 30)  # min(budget - non-KV use, free + committed KV)
    assert w.measure_kv_cache_blocks() == (usable - (2 << 30) - margin) // MiB


def test_a_default_token_budget_no_step_fills_costs_no_blocks() -> None:
    """With max_num_seqs 1 and max_model_len 64 no step holds more than 64 tokens, yet the
    default budget (2048 on the CPU) stayed: warmup profiled a 2048-token step and measured
    sizing kept its transient (and a margin on it) free, fewer blocks than the 64-token step
    leaves. Warmup steps here take 1 MiB per token."""

    def blocks(**budget: object) -> int:
        monitor = FakeMonitor(total=16 << 30)
        w = fake_worker(monitor, {"max_num_seqs": 1, "max_model_len": 64, **budget})

        def dummy_run(num_tokens: int, *args: object) -> None:
            monitor.reserved = monitor.allocated + num_tokens * MiB

        w.runner.dummy_run, w.runner.warmup_params = dummy_run, None
        w.runner.kv_cache = MiBBlockCache()
        w.step_peaks = []
        w.warm_up(num_committable_blocks=4)
        monitor.free, monitor.reserved = 12 << 30, monitor.allocated
        return w.measure_kv_cache_blocks()

    assert blocks() == blocks(max_num_batched_tokens=64)


def test_estimate_subtracts_what_its_throwaway_capture_took() -> None:
    monitor = FakeMonitor(total=10 << 30)
    graph_bytes = 512 * MiB

    def capture() -> None:
        monitor.free -= graph_bytes

    def drop() -> None:
        monitor.free += graph_bytes

    w = fake_worker(monitor, profile_run=lambda: None, profile_sampling_run=lambda: None,
                    capture_cuda_graphs=capture, drop_cuda_graphs=drop)
    without = w.profile(measure_graphs=False)
    with_graphs = w.profile(measure_graphs=True)
    assert monitor.free == monitor.total  # the throwaway graphs are gone
    assert without - with_graphs == graph_bytes // w.runner.kv_cache_spec.block_bytes


# --- fallback and report -------------------------------------------------------------------


@pytest.mark.parametrize(("utilization", "expected"), [(None, 0.92), (0.5, 0.5)])
def test_vmm_unavailable_at_startup_warns_and_sizes_by_estimate(
    make_llm: Callable[..., LLM], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, estimate_tokens: list[list[int]],
    utilization: float | None, expected: float,
) -> None:
    monkeypatch.setattr(Worker, "vmm_unavailable_reason", lambda self: "no VMM in this test")
    with caplog.at_level(logging.WARNING):
        llm = make_llm(gpu_memory_utilization=utilization)
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "no VMM in this test" in warning.getMessage()
    report = llm.kv_cache_report
    assert report.method == "estimate"
    assert report.budget == int(report.total * expected)
    assert worker(llm).runner.kv_cache is None  # a plain torch cache
    assert greedy_tokens(llm) == estimate_tokens


def test_one_rank_without_vmm_sizes_every_rank_by_estimate(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Ranks must agree on one sizing and one cache kind: rank 0 could back the cache, but
    # rank 1 cannot, so both fall back.
    monkeypatch.setattr(Worker, "vmm_unavailable_reason",
                        lambda self: "no VMM on rank 1" if self.rank == 1 else None)
    profiled: list[tuple[int, bool]] = []
    profile = Worker.profile
    monkeypatch.setattr(Worker, "profile", lambda self, measure_graphs=False: (
        profiled.append((self.rank, measure_graphs)), profile(self, measure_graphs))[1])
    config = EngineArgs(model=str(qwen3), device="cpu", **LIMITS).create_engine_config()
    with caplog.at_level(logging.WARNING):
        engine = EngineCore(config, num_workers=2)
    try:
        [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "no VMM on rank 1" in warning.getMessage()
        report = engine.kv_cache_report
        assert report.method == "estimate"
        assert report.budget == int(report.total * 0.92)  # the estimate's utilization
        assert profiled == [(0, True), (1, True)]  # each with its throwaway graph capture
        workers = engine.executor.workers
        assert [w.runner.kv_cache for w in workers] == [None, None]  # plain torch caches
        assert [w.runner.num_blocks for w in workers] == [report.num_blocks] * 2
    finally:
        engine.shutdown()


def test_report_is_logged_as_a_table_at_startup(
    make_llm: Callable[..., LLM], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvfit.engine.engine_core"):
        llm = make_llm()
    assert llm.kv_cache_report.format_table() in caplog.text
    assert re.search(r"KV cache blocks\s+[\d,]+", caplog.text)


# --- engines one after another -------------------------------------------------------------


@pytest.mark.parametrize("release", ["shutdown", "drop"])
def test_engines_created_in_sequence_do_not_accumulate_memory(qwen3: Path, release: str) -> None:
    gc.collect()
    baseline = rss_shmem()
    committed = []
    for _ in range(3):
        llm = LLM(str(qwen3), device="cpu", **LIMITS)
        cache = worker(llm).runner.kv_cache
        committed.append(cache.physical_bytes)
        assert mapped_kv_bytes() == committed[-1]
        cache.committed_views()[0].fill_(1)  # memfd pages become resident once touched
        assert rss_shmem() - baseline >= committed[-1]
        if release == "shutdown":
            llm.shutdown()
        del llm, cache
        gc.collect()
        assert mapped_kv_bytes() == 0
        assert rss_shmem() - baseline < 2 * MiB  # every KV page returned
    assert min(committed) > 0 and len(set(committed)) == 1


# --- GPU -----------------------------------------------------------------------------------


def gpu_llm(folder: Path, **kwargs: object) -> LLM:
    # The full default budget: the engine's prefix-cache cap bounds a tiny model's cache.
    return LLM(str(folder), device="cuda", max_num_seqs=32, max_model_len=1024,
               cuda_graph_sizes=[1, 2, 4, 8], **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("enforce_eager", [True, False])
def test_gpu_measured_and_estimate_sizing_agree_and_capture_passes_are_counted(
    gpu_model: Path, monkeypatch: pytest.MonkeyPatch, enforce_eager: bool
) -> None:
    from kvfit.engine.cuda_graph import CUDAGraphRunner

    passes: list[int] = []
    capture = CUDAGraphRunner.capture
    monkeypatch.setattr(CUDAGraphRunner, "capture",
                        lambda self: (passes.append(1), capture(self))[1])
    tokens = {}
    for extensible in (None, False):
        passes.clear()
        llm = gpu_llm(gpu_model, enforce_eager=enforce_eager,
                      enable_extensible_kv_cache=extensible)
        method = llm.kv_cache_report.method
        assert method == ("measured" if extensible is None else "estimate")
        # One real pass; the estimate adds its throwaway pass before the cache exists.
        assert len(passes) == (0 if enforce_eager else 1 if method == "measured" else 2)
        tokens[method] = greedy_tokens(llm)
        llm.shutdown()
    assert tokens["measured"] == tokens["estimate"]


@pytest.mark.gpu
def test_gpu_extend_keeps_graphs_valid_and_sizes_from_measured_memory(
    gpu_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    eager = gpu_llm(gpu_model, enforce_eager=True)
    expected = greedy_tokens(eager)
    eager.shutdown()
    before = spy_extend(monkeypatch)
    llm = gpu_llm(gpu_model)
    runner, report = worker(llm).runner, llm.kv_cache_report
    assert report.method == "measured" and report.budget == report.total  # utilization 1.0
    assert runner.kv_cache.committed_blocks == report.num_blocks > before["committed"]
    assert runner.kv_cache.tensor.base_ptr == before["base"]
    assert bound_views(runner) == before["views"]
    assert report.committed_bytes == runner.kv_cache.physical_bytes
    replays: list[int] = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: (replays.append(1), run(*a))[1]  # type: ignore[method-assign]
    assert greedy_tokens(llm) == expected  # graphs captured before the extend still hold
    assert len(replays) >= MAX_TOKENS - 1
    llm.shutdown()


@pytest.mark.gpu
def test_gpu_shrink_below_warmup_keeps_graphs_and_outputs(
    gpu_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = gpu_llm(gpu_model)
    expected = greedy_tokens(reference)
    reference.shutdown()
    before = spy_extend(monkeypatch)
    monkeypatch.setattr(worker_module, "available_kv_bytes", lambda profile, *args: 2 * MiB)
    llm = gpu_llm(gpu_model, max_num_batched_tokens=4096)
    cache = worker(llm).runner.kv_cache
    fits = cache.blocks_that_fit(2 * MiB)
    assert before["committed"] > fits == cache.committed_blocks == llm.kv_cache_report.num_blocks
    assert cache.physical_bytes < before["physical"]
    assert cache.tensor.base_ptr == before["base"]
    assert greedy_tokens(llm) == expected
    llm.shutdown()


@pytest.mark.gpu
def test_gpu_max_model_len_error_and_engines_in_sequence_do_not_accumulate(
    gpu_model: Path,
) -> None:
    free_after = []
    for _ in range(3):
        gpu_llm(gpu_model).shutdown()
        with pytest.raises(ValueError, match="lower max_model_len or max_num_seqs") as error:
            gpu_llm(gpu_model, kv_cache_margin_floor_bytes=torch.cuda.mem_get_info()[1])
        assert "gpu_memory_utilization" not in str(error.value)
        del error
        gc.collect()
        torch.cuda.empty_cache()
        free_after.append(torch.cuda.mem_get_info()[0])
    # The first round loads kernels for good; later rounds must give back all they take.
    assert free_after[2] >= free_after[1] - 64 * MiB


@pytest.mark.parametrize(("name", "value"), [
    ("num_gpu_blocks_override", 10**12),  # 32 PB: "DefaultCPUAllocator: can't allocate memory"
    ("kv_cache_memory_bytes", 10**20),  # "Storage size calculation overflowed"
])
def test_a_manual_cache_size_beyond_free_memory_names_the_setting(
    qwen3: Path, name: str, value: int,
) -> None:
    # Found by the hunt: the allocation failed with torch's words, naming no setting.
    with pytest.raises(ValueError, match=rf"{name} asks for a KV cache of \d+ blocks \(\d+ "
                                         rf"bytes\), but \d+ bytes are free on cpu; lower {name}"):
        LLM(str(qwen3), device="cpu", **{name: value}, **LIMITS)
    gc.collect()
    assert mapped_kv_bytes() == 0
