"""Warmup's steps allocate at least what any real step does, fuzzed: seeded random engines
(vocabulary, token budget, batch size, cache size, prefix caching, logprobs mode, KV cache
dtype and its scales, deterministic mode) each serve a full batch of random requests mixing
every sampling option, with prompts up to max_model_len; every real step's peak
(`watch_memory`) must stay within the largest profiling or warmup step of its engine."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvfit import LLM, SamplingParams
from kvfit.engine.sampling_params import MAX_TOKEN_LIST

from .conftest import StepPeaks, one_layer_qwen3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """A vocabulary that dwarfs the hidden size (logits set the peak) and a narrow one
    (attention does)."""
    return {vocab: one_layer_qwen3(tmp_path_factory.mktemp(f"vocab-{vocab}"), vocab)
            for vocab in (512, 8192)}




def _engine(seed: int, r: random.Random) -> dict[str, Any]:
    """Engine settings: those that change warmup itself cycle with `seed` (so ten seeds cover
    each), the rest are drawn from `r`."""
    vocab = (512, 8192)[seed % 2]
    max_model_len = r.choice([64, 256, 512])
    fp8 = seed % 3 == 1
    settings: dict[str, Any] = dict(
        device="cpu", max_num_seqs=r.choice([2, 4, 8, 16]), max_model_len=max_model_len,
        # Small budgets: prompts run as several chunks.
        max_num_batched_tokens=r.choice([16, 64, 128, 600]),
        # -1 (the whole vocabulary) only on the narrow one: its top-n costs seconds at 8k.
        max_logprobs=r.choice([0, 5, 20, -1] if vocab == 512 else [0, 5, 20]),
        enable_prefix_caching=seed % 4 < 2, deterministic=seed % 3 == 2,
        logprobs_mode=("raw_logprobs", "processed_logprobs", "raw_logits",
                       "processed_logits")[seed % 4],
        kv_cache_dtype="fp8" if fp8 else "auto",
        # The first real step calculates the FP8 cache's scales (warmup's steps measure that).
        calculate_kv_scales=fp8 and seed % 2 == 0, enforce_eager=r.random() < 0.5)
    if seed % 2:  # a cache of a few blocks beyond one sequence: preemption
        settings["num_gpu_blocks_override"] = max_model_len // 16 + r.choice([2, 8])
    return {"vocab": vocab, **settings}


def _params(r: random.Random, vocab: int, max_logprobs: int, room: int) -> SamplingParams:
    """A request with each sampling option on at random, at values up to its limits."""
    def maybe(p: float) -> bool:
        return r.random() < p

    def ids(most: int) -> list[int]:
        return r.sample(range(vocab), min(most, vocab))

    def logprobs() -> int:
        whole = -1 if max_logprobs == vocab else max_logprobs
        return r.choice([0, min(1, max_logprobs), max_logprobs, whole])

    max_tokens = r.randint(1, min(room, 12))
    kw: dict[str, Any] = dict(
        temperature=r.choice([0.0, 0.0, 0.7, 1.3]), max_tokens=max_tokens,
        n=r.choice([1, 1, 2, 3]), seed=r.choice([None, r.randrange(1 << 16)]),
        ignore_eos=maybe(0.3), min_tokens=r.randint(0, max_tokens) if maybe(0.3) else 0)
    if maybe(0.4):
        kw.update(top_k=r.choice([1, 5, vocab - 1, vocab + 10]),
                  top_p=r.choice([0.3, 0.95, 1.0]), min_p=r.choice([0.0, 0.05, 1.0]))
    if maybe(0.3):
        kw.update(presence_penalty=r.uniform(-2, 2), frequency_penalty=r.uniform(-2, 2),
                  repetition_penalty=r.choice([0.7, 1.0, 1.5]))
    if maybe(0.3):
        kw["logit_bias"] = {t: r.uniform(-50, 50) for t in ids(r.choice([1, MAX_TOKEN_LIST]))}
    if maybe(0.2):
        kw["allowed_token_ids"] = ids(r.choice([1, 7, MAX_TOKEN_LIST]))
    if maybe(0.3):
        kw["stop_token_ids"] = ids(r.choice([1, MAX_TOKEN_LIST]))
    if maybe(0.2):
        kw["bad_words_token_ids"] = [[r.randrange(vocab) for _ in range(r.choice([1, 2]))]
                                     for _ in range(r.choice([1, MAX_TOKEN_LIST]))]
    if maybe(0.5):
        kw["logprobs"] = logprobs()
    if maybe(0.3):
        kw["prompt_logprobs"] = logprobs()
    return SamplingParams(**kw)


@pytest.mark.parametrize("seed", range(10))
def test_no_real_step_of_a_random_mix_outgrows_warmup(
    models: dict[int, Path], peaks: StepPeaks, seed: int
) -> None:
    r = random.Random(seed)
    settings = _engine(seed, r)
    vocab = settings.pop("vocab")
    max_model_len = settings["max_model_len"]
    llm = LLM(str(models[vocab]), **settings)
    try:
        max_logprobs = llm.config.model_config.max_logprobs
        prompts, params = [], []
        for _ in range(settings["max_num_seqs"] + r.choice([0, 3])):
            # Short prompts and ones near max_model_len; a shared head for prefix hits.
            n = r.choice([1, 5, max_model_len // 2, max_model_len - 8, max_model_len - 2])
            head = [3 + t % (vocab - 3) for t in range(min(n, 32))]
            prompts.append({"prompt_token_ids": head + [r.randrange(vocab)
                                                        for _ in range(n - len(head))]})
            params.append(_params(r, vocab, max_logprobs, max_model_len - n))
        peaks.started = True
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (settings, worst, peaks.warmup)
