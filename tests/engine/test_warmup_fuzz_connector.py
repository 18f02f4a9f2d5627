"""Warmup's bound with a KV connector, fuzzed: seeded random engines with the host tier
(`kv_offloading_size`) or the shared disk store (`kv_connector_path`), with or without prefix
caching, an FP8 cache, a cache of a few blocks (preemption), serve random requests of every
sampling option (n > 1, prompt logprobs) through `llm_engine` stepping with aborts between
steps, then again once the device cache was reset (at some seeds the store too, or a
`load_weights` of the same weights renamed it), so that prefixes load from the connector.
Every real step's peak stays within warmup's; what the connector allocates in a step or
between steps (finish-time saves) stays within what sizing kept for it
(`host_buffer_bytes`); greedy requests' tokens equal a connector-less engine's."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from kvfit import LLM, SamplingParams
from kvfit.connectors import HostConnector, KVConnector, SharedStorageConnector
from kvfit.connectors.base import KVConnectorMetadata
from kvfit.ops.memwatch import watch_memory

from .conftest import StepPeaks, one_layer_qwen3
from .test_warmup_fuzz import _params

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """The warmup fuzz's two vocabularies, with weights whose greedy tokens follow the K/V
    (HF's default init leaves them to the input token's embedding: a connector that loaded
    wrong blocks would pass)."""
    return {vocab: one_layer_qwen3(tmp_path_factory.mktemp(f"vocab-{vocab}"), vocab, 0.3)
            for vocab in (512, 8192)}


class ConnectorPeaks:
    """Per connector call (loads, saves in a step or at a finish): its peak bytes beyond what
    its own buffers held before, and those buffers' bytes then and after."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int]] = []  # (call, held before, peak, after)


def _held(connector: KVConnector) -> int:
    """Bytes of host buffers the worker side holds now."""
    if isinstance(connector, HostConnector):
        return sum(p.nbytes for p in connector._pieces)
    staging = connector._staging
    return 0 if staging is None else staging.nbytes


def _watched(call: Callable[[KVConnector, KVConnectorMetadata], None], name: str,
             record: ConnectorPeaks) -> Callable[[KVConnector, KVConnectorMetadata], None]:
    def watched(self: KVConnector, meta: KVConnectorMetadata) -> None:
        before = _held(self)
        with watch_memory("cpu") as watch:
            try:
                call(self, meta)
            finally:
                record.calls.append((name, before, watch.peak_bytes, _held(self)))
    return watched


@pytest.fixture
def connector_peaks(monkeypatch: pytest.MonkeyPatch) -> Iterator[ConnectorPeaks]:
    record = ConnectorPeaks()
    for cls in (HostConnector, SharedStorageConnector):
        for name in ("start_load_kv", "wait_for_save"):
            monkeypatch.setattr(cls, name, _watched(getattr(cls, name), name, record))
    yield record


def _engine(seed: int, r: random.Random, store: Path) -> dict[str, Any]:
    """Settings: the connector alternates with `seed`; FP8, prefix caching off, a tiny cache
    and the wide vocabulary cycle so that eight seeds cover each with each connector."""
    host = seed % 2 == 0
    max_model_len = r.choice([64, 256])
    fp8 = seed % 3 == 1
    settings: dict[str, Any] = dict(
        device="cpu", max_num_seqs=r.choice([2, 4, 8]), max_model_len=max_model_len,
        max_num_batched_tokens=r.choice([16, 64, 128, 600]),
        max_logprobs=r.choice([0, 5, 20]), enable_prefix_caching=seed // 2 % 4 != 3,
        kv_cache_dtype="fp8" if fp8 else "auto",
        calculate_kv_scales=fp8 and host and seed % 4 == 0, enforce_eager=r.random() < 0.5)
    if host:  # a pool of ~6 to ~50 blocks of the one-layer float32 model: it evicts
        settings["kv_offloading_size"] = r.choice([2.5e-5, 5e-5, 2e-4])
    else:
        settings.update(kv_connector="shared_storage", kv_connector_path=str(store))
    if seed // 2 % 2:  # a cache of a few blocks beyond one sequence: preemption
        settings["num_gpu_blocks_override"] = max_model_len // 16 + r.choice([1, 4])
    return {"vocab": (512, 8192)[seed // 4 % 2], **settings}


def _prompt(r: random.Random, vocab: int, max_model_len: int) -> list[int]:
    """Short prompts and ones near max_model_len; a shared head for prefix hits."""
    n = r.choice([5, 20, max_model_len // 2, max_model_len - 20, max_model_len - 8])
    head = [3 + t % (vocab - 3) for t in range(min(n, 40))]
    return head + [r.randrange(vocab) for _ in range(n - len(head))]


def _stepped(llm: LLM, requests: list[tuple[list[int], SamplingParams]], r: random.Random,
             tag: str) -> dict[str, list[list[int]]]:
    """Run `requests` through `llm.llm_engine`, aborting some between steps; the finished
    ones' token ids per completion, by id."""
    engine, done = llm.llm_engine, {}
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    for request_id, (prompt, params) in zip(ids, requests, strict=True):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    to_abort = set(r.sample(ids, k=1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        if to_abort and r.random() < 0.3:
            engine.abort_request(to_abort.pop())
    return done


def _greedy(requests: list[tuple[list[int], SamplingParams]], outputs: dict[str, list],
            tag: str) -> dict[str, list[list[int]]]:
    """The finished greedy requests' outputs (whatever their other options: deterministic)."""
    return {f"{tag}-{i}": outputs[f"{tag}-{i}"] for i, (_, p) in enumerate(requests)
            if p.temperature == 0.0 and f"{tag}-{i}" in outputs}


@pytest.mark.parametrize("seed", range(8))
def test_connector_engines_stay_within_warmup_and_keep_greedy_tokens(
    models: dict[int, Path], peaks: StepPeaks,
    connector_peaks: ConnectorPeaks, tmp_path: Path, seed: int
) -> None:
    r = random.Random(seed)
    settings = _engine(seed, r, tmp_path / "store")
    vocab = settings.pop("vocab")
    model, max_model_len = str(models[vocab]), settings["max_model_len"]
    reference_settings = {k: v for k, v in settings.items()
                          if k not in ("kv_offloading_size", "kv_connector", "kv_connector_path")}
    llm = LLM(model, **settings)
    try:
        max_logprobs = llm.config.model_config.max_logprobs
        prompts = [_prompt(r, vocab, max_model_len) for _ in range(settings["max_num_seqs"] + 4)]
        rounds = []
        for _ in range(2):  # the second repeats the first's prompts: hits in the connector
            rounds.append([(p, _params(r, vocab, max_logprobs, max_model_len - len(p)))
                           for p in prompts])
        peaks.started = True
        first = _stepped(llm, rounds[0], r, "a")
        # The device cache forgets every prefix; at some seeds the store too, or a weight
        # update (the same weights) renames it.
        assert llm.reset_prefix_cache(reset_connector=seed % 3 == 0)
        if seed % 3 == 2:
            llm.load_weights(load_file(models[vocab] / "model.safetensors"))
        second = _stepped(llm, rounds[1], r, "b")
        cfg = llm.config.kv_connector_config
        bound = type(llm.engine.executor.workers[0].kv_connector).host_buffer_bytes(
            cfg, llm.config.kv_cache_spec())
    finally:
        llm.shutdown()
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (settings, worst, peaks.warmup)
    assert connector_peaks.calls, settings
    for call, before, peak, after in connector_peaks.calls:
        # The staging buffer regrown frees the old one first: its peak alone is then new.
        held = before if after == before else 0
        assert held + peak <= bound and after <= bound, (settings, call, before, peak, after)
    reference = LLM(model, **reference_settings)
    try:
        expected = [reference.generate([{"prompt_token_ids": p} for p, _ in requests],
                                       [params for _, params in requests], use_tqdm=False)
                    for requests in rounds]
    finally:
        reference.shutdown()
    for tag, requests, got, want in zip("ab", rounds, (first, second), expected, strict=True):
        want_ids = {f"{tag}-{i}": [list(c.token_ids) for c in out.outputs]
                    for i, out in enumerate(want)}
        greedy = _greedy(requests, got, tag)
        assert greedy == {k: want_ids[k] for k in greedy}, (settings, tag)
