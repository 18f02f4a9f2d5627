"""Warmup covers every sampling feature at its worst case, structurally: a new option of
`SamplingParams` fails these tests until it declares its warmup and warmup exercises it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest

import kvfit.engine.model_runner as model_runner
from kvfit import LLM
from kvfit.engine import sampling_features as features
from kvfit.engine.logits_processors import AllowedTokens, BannedTokens, LogitBias, Penalties
from kvfit.engine.sampler import SamplingMetadata
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import ScheduledBatch, Sequence

Step = tuple[ScheduledBatch, list[Sequence], SamplingMetadata]


def test_every_sampling_field_belongs_to_exactly_one_feature_or_is_host_only() -> None:
    owners: dict[str, str] = {}
    for feature in features.SAMPLING_FEATURES:
        for name in feature.fields:
            assert name not in owners, f"{name} is claimed by {owners[name]} and {feature}"
            owners[name] = feature.__name__
    assert not set(owners) & features.HOST_ONLY_FIELDS
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    assert fields == set(owners) | features.HOST_ONLY_FIELDS, (
        "a SamplingParams field without a SamplingFeature: declare its worst case so warmup "
        "measures it, or list it in HOST_ONLY_FIELDS if it never reaches the device")


def test_the_worst_case_request_turns_every_feature_on() -> None:
    limits = features.WarmupLimits(vocab_size=151936, max_model_len=32768, max_logprobs=20)
    params = features.worst_case_params(limits)
    for feature in features.SAMPLING_FEATURES:
        assert feature.active(params), feature.__name__
    assert not any(feature.active(SamplingParams(temperature=0))
                   for feature in features.SAMPLING_FEATURES
                   if feature is not features.Temperature)


def _entries(meta: SamplingMetadata, kind: type) -> int:
    return sum(len(p.index) for p in meta.processors if isinstance(p, kind))


@pytest.fixture(scope="module")
def warmup_steps(qwen3: Path) -> tuple[LLM, list[Step]]:
    """The sampled steps of one engine's startup, with the metadata each built."""
    steps: list[Step] = []
    original_from_seqs = SamplingMetadata.from_seqs
    original_launch = model_runner.ModelRunner.launch
    batches: list[ScheduledBatch] = []

    def from_seqs(seqs: list[Sequence], *args: object) -> SamplingMetadata:
        meta = original_from_seqs(seqs, *args)
        steps.append((batches[-1], list(seqs), meta))
        return meta

    def launch(self: model_runner.ModelRunner, batch: ScheduledBatch) -> object:
        batches.append(batch)
        return original_launch(self, batch)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(SamplingMetadata, "from_seqs", staticmethod(from_seqs))
        mp.setattr(model_runner.ModelRunner, "launch", launch)
        llm = LLM(str(qwen3), device="cpu", max_num_seqs=32, max_num_batched_tokens=256)
    yield llm, steps
    llm.shutdown()


def _processor_rows(meta: SamplingMetadata, kind: type) -> int:
    return sum(len(p.rows) for p in meta.processors if isinstance(p, kind))


# What it means, in a warmup step's sampling metadata, that a feature ran at its worst case.
CHECKS: dict[type[features.SamplingFeature], Callable[[LLM, Step], bool]] = {
    features.Temperature: lambda llm, s: not s[2].all_greedy
    and bool((s[2].temperature > 0).all()),
    features.Filters: lambda llm, s: all(t is not None for t in (s[2].top_k, s[2].top_p,
                                                                 s[2].min_p)),
    features.Seed: lambda llm, s: len(s[2].token_seeds) == len(s[1]),
    features.Siblings: lambda llm, s: {seq.sibling_index for seq in s[1]} == {0, 1},
    features.Logprobs: lambda llm, s: s[2].num_logprobs
    == [llm.config.model_config.max_logprobs] * len(s[1]),
    features.PromptLogprobs: lambda llm, s: all(
        seq.sampling_params.prompt_logprobs == llm.config.model_config.max_logprobs
        for seq in s[1]),
    # Distinct context tokens: the most entries a row can have.
    features.Penalties: lambda llm, s: _entries(s[2], Penalties) == sum(
        min(len(seq), llm.config.model_config.hf_config.vocab_size) for seq in s[1]),
    features.LogitBias: lambda llm, s: _entries(s[2], LogitBias) == sum(
        len(seq.sampling_params.logit_bias) for seq in s[1]) > 0,
    # Every row's undo copies the row whole.
    features.AllowedTokens: lambda llm, s: _processor_rows(s[2], AllowedTokens) == len(s[1]),
    features.BannedTokens: lambda llm, s: _entries(s[2], BannedTokens) >= sum(
        len(seq.sampling_params.stop_token_ids) + len(seq.sampling_params.bad_words_token_ids)
        for seq in s[1]) > 0,
}


def test_every_feature_has_a_warmup_check() -> None:
    assert set(CHECKS) == set(features.SAMPLING_FEATURES)


@pytest.mark.parametrize("feature", features.SAMPLING_FEATURES, ids=lambda f: f.__name__)
def test_warmup_samples_the_most_rows_with_every_feature_at_its_worst(
    warmup_steps: tuple[LLM, list[Step]], feature: type[features.SamplingFeature],
) -> None:
    llm, steps = warmup_steps
    sc = llm.config.scheduler_config
    mixed = [s for s in steps if s[0].num_tokens == sc.max_num_batched_tokens
             and not s[0].is_decode_only and 1 in s[0].num_new_tokens]
    full_rows = [s for s in mixed if len(s[1]) == sc.max_num_seqs]
    assert full_rows and mixed, ("warmup must sample max_num_seqs rows and run a full mixed "
                                 "step, both at max_num_batched_tokens")
    for step in (full_rows[0], mixed[0]):
        assert CHECKS[feature](llm, step), f"{feature.__name__} not at its worst case"


def test_warmup_decodes_attend_over_max_model_len(
    warmup_steps: tuple[LLM, list[Step]],
) -> None:
    llm, steps = warmup_steps
    sampled = next(s for s in steps if len(s[1]) > 1)
    assert {len(seq) for seq in sampled[1]} == {llm.config.model_config.max_model_len}


@pytest.mark.parametrize("vocab_size", [512, 1009, 2500, 151936])
def test_warmup_token_lists_are_as_long_as_any_request_may_name(vocab_size: int) -> None:
    # Each list's entries are device memory (an index per entry, the values they replace):
    # a small vocabulary's requests may still name up to MAX_TOKEN_LIST ids in each list.
    from kvfit.engine.sampling_params import MAX_TOKEN_LIST

    most = min(MAX_TOKEN_LIST, vocab_size)
    ids = list(range(vocab_size))
    largest = SamplingParams(
        # Ids named twice: a small vocabulary's request may name MAX_TOKEN_LIST all the same.
        logit_bias={t: 1.0 for t in ids[:most]},
        allowed_token_ids=(ids[-most:] * MAX_TOKEN_LIST)[:MAX_TOKEN_LIST],
        # Stop ids that miss EOS (2), which min_tokens bans besides them.
        min_tokens=1, max_tokens=1, stop_token_ids=ids[3:most + 3],
        bad_words_token_ids=[[t] for t in ids[most + 3:2 * most + 3]])
    limits = features.WarmupLimits(vocab_size, max_model_len=64, max_logprobs=20,
                                   eos_token_ids=(2,))

    def entries(params: SamplingParams) -> dict[type, int]:
        meta = SamplingMetadata.from_seqs([Sequence([0], params)], vocab_size, "cpu", [2])
        return {kind: _entries(meta, kind) for kind in (LogitBias, AllowedTokens, BannedTokens)}

    warm, real = entries(features.worst_case_params(limits)), entries(largest)
    assert warm[LogitBias] == real[LogitBias] and warm[AllowedTokens] == real[AllowedTokens]
    # One token stays unbanned so that no warmup row is left without a token to sample.
    assert warm[BannedTokens] >= min(real[BannedTokens], vocab_size - 1)


def test_allowed_token_ids_changed_after_construction_are_queued_distinct(
    warmup_steps: tuple[LLM, list[Step]],
) -> None:
    # Each allowed id is device memory at every step and warmup measures distinct ones; the
    # constructor makes the list distinct, but a front end may queue a params object changed
    # since (the async engine queues a shallow copy).
    llm, _ = warmup_steps
    params = SamplingParams(max_tokens=1)
    params.allowed_token_ids = [7, 5, 7, 5, 9]
    [seq] = llm.input_processor.make_request({"prompt_token_ids": [5, 6]}, params, "r")
    assert seq.sampling_params.allowed_token_ids == [7, 5, 9]


def test_vllms_structured_output_params_are_refused_by_name() -> None:
    # vLLM scripts pass structured_outputs= (or the older guided_decoding=): a bare TypeError
    # ("unexpected keyword argument") said neither that kvfit lacks it nor what to do.
    for name in ("structured_outputs", "guided_decoding"):
        assert getattr(SamplingParams(**{name: None}), name) is None
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name} is not supported: "
                                             r"kvfit has no structured output"):
            SamplingParams(**{name: {"json": {"type": "object"}}})
