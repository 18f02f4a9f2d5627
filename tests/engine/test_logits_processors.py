"""Penalties, logit bias and bans: against a plain dense re-implementation, in place, undone."""

from __future__ import annotations

import pytest
import torch

from kvfit.engine.logits_processors import BannedTokens, LogitBias, Penalties
from kvfit.engine.sampler import Sampler, SamplingMetadata
from kvfit.engine.sampling_params import MAX_TOKEN_LIST, SamplingParams
from kvfit.engine.sequence import PENDING_TOKEN, Sequence
from kvfit.ops.memwatch import watch_memory

VOCAB = 50


def make_seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    seq = Sequence(prompt, SamplingParams(**params))
    seq.token_ids += output
    return seq


def dense_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """vLLM's penalties written the obvious way: dense counts over the vocabulary."""
    out = logits.clone().float()
    for row, seq in enumerate(seqs):
        p = seq.sampling_params
        output = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long),
                                minlength=VOCAB).float()
        seen = torch.bincount(torch.tensor(seq.token_ids, dtype=torch.long),
                              minlength=VOCAB) > 0
        x = out[row]
        scaled = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        x = torch.where(seen, scaled, x)
        out[row] = x - p.frequency_penalty * output - p.presence_penalty * (output > 0)
    return out


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_penalties_match_a_dense_reimplementation_and_undo_exactly(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [
        make_seq(torch.randint(0, VOCAB, (30,), generator=g).tolist(),
                 torch.randint(0, VOCAB, (12,), generator=g).tolist(), repetition_penalty=1.3,
                 presence_penalty=0.7, frequency_penalty=0.4),
        make_seq([1, 2, 3], [3, 3, 4], repetition_penalty=0.8),  # < 1 encourages
        make_seq([5, 6], [7], frequency_penalty=-1.5),
        make_seq([8, 9], [9]),  # no penalty: untouched
    ]
    logits = random_logits(len(seqs)).to(dtype)
    raw = logits.clone()
    penalties = Penalties.from_seqs(seqs, VOCAB, torch.device("cpu"))
    undo = penalties.apply(logits)
    expected = dense_penalties(raw, seqs).to(dtype)
    # Multiplying by the reciprocal rounds like division to within an ulp or two.
    torch.testing.assert_close(logits, expected, atol=1e-6,
                               rtol=1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.equal(logits[3], raw[3])
    undo.restore(logits)
    assert torch.equal(logits, raw)


def test_penalty_counts_are_incremental_and_skip_a_pending_token() -> None:
    seq = make_seq([4, 4, 9], [9, 2])
    tokens, counts = seq.token_counts()
    assert tokens.tolist() == [2, 4, 9] and counts.tolist() == [1, 0, 1]
    seq.token_ids += [4, 11, PENDING_TOKEN]
    tokens, counts = seq.token_counts()
    assert tokens.tolist() == [2, 4, 9, 11] and counts.tolist() == [1, 1, 1, 1]
    seq.resolve_pending_token(11)
    assert seq.token_counts()[1].tolist() == [1, 1, 1, 2]


def test_logit_bias_adds_and_bans_set_minus_infinity_then_both_undo() -> None:
    seqs = [make_seq([1], [], logit_bias={3: 2.5, 7: -100.0}),
            make_seq([1], [], min_tokens=2, stop_token_ids=[5], bad_words_token_ids=[[6]])]
    logits = random_logits(2)
    raw = logits.clone()
    undo = [p.apply(logits) for p in (LogitBias.from_seqs(seqs, VOCAB, torch.device("cpu")),
                                      BannedTokens.from_seqs(seqs, VOCAB, torch.device("cpu"),
                                                             eos_token_ids=[0]))]
    assert logits[0, 3] == raw[0, 3] + 2.5 and logits[0, 7] == raw[0, 7] - 100.0
    assert torch.isinf(logits[1, [0, 5, 6]]).all()
    changed = torch.zeros_like(raw, dtype=torch.bool)
    changed[0, [3, 7]] = changed[1, [0, 5, 6]] = True
    assert torch.equal(logits[~changed], raw[~changed])
    for change in reversed(undo):
        change.restore(logits)
    assert torch.equal(logits, raw)


def test_a_bad_word_is_banned_only_where_the_output_would_complete_it() -> None:
    words = [[6], [10, 11, 12]]
    cases = {(): {6}, (10,): {6}, (10, 11): {6, 12}, (3, 10, 11): {6, 12}, (11,): {6}}
    for output, banned in cases.items():
        seq = make_seq([1, 10, 11], list(output), bad_words_token_ids=words)
        meta = BannedTokens.from_seqs([seq], VOCAB, torch.device("cpu"))
        assert set(meta.index.tolist()) == banned, output  # the prompt never completes one


def test_sampling_applies_processors_yet_logprobs_stay_raw() -> None:
    logits = torch.ones(2, VOCAB)
    logits[:, 4] = 10.0
    seqs = [make_seq([4], [4, 4], temperature=0, repetition_penalty=100.0, logprobs=1),
            make_seq([1], [], temperature=0, logit_bias={9: 20.0}, logprobs=1)]
    meta = SamplingMetadata.from_seqs(seqs, VOCAB, "cpu")
    raw = logits.clone()
    ids, logprobs = Sampler().__call__(logits, meta).to_lists(meta.num_logprobs)
    assert ids[0] != 4 and ids[1] == 9  # the penalty and the bias decided
    assert torch.equal(logits, raw)  # restored in place
    reference = torch.log_softmax(raw, dim=-1)
    for row in range(2):
        assert logprobs[row][ids[row]].logprob == pytest.approx(reference[row, ids[row]].item())
        assert logprobs[row][4].rank == 1  # the raw distribution's favourite


def test_penalties_act_on_the_biased_logits_as_vllm_orders_them() -> None:
    # vLLM applies logit_bias before the penalties: token 4 (in the prompt) scores
    # (2 + 2) / 2 = 2 < 2.9, not 2 / 2 + 2 = 3, so token 5 wins.
    logits = torch.zeros(1, VOCAB)
    logits[0, 4], logits[0, 5] = 2.0, 2.9
    seqs = [make_seq([4], [], temperature=0, repetition_penalty=2.0, logit_bias={4: 2.0})]
    meta = SamplingMetadata.from_seqs(seqs, VOCAB, "cpu")
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [5]


def test_lists_longer_than_warmup_measures_are_rejected_naming_the_field() -> None:
    with pytest.raises(ValueError, match="logit_bias.*1024"):
        SamplingParams(logit_bias={t: 1.0 for t in range(MAX_TOKEN_LIST + 1)})
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=list(range(MAX_TOKEN_LIST + 1)))
    with pytest.raises(ValueError, match="logit_bias.*token ids"):
        SamplingParams(logit_bias={VOCAB: 1.0}).check_token_ids(VOCAB)


def test_penalty_memory_is_a_few_bytes_per_entry_not_rows_by_vocabulary() -> None:
    vocab, rows, context = 151936, 64, 2048
    distinct = list(range(context))
    seqs = [make_seq(distinct[:1], distinct[1:], repetition_penalty=1.2, presence_penalty=0.5,
                     frequency_penalty=0.5) for _ in range(rows)]
    logits = torch.zeros(rows, vocab, dtype=torch.bfloat16)
    penalties = Penalties.from_seqs(seqs, vocab, torch.device("cpu"))
    entries = len(penalties.index)
    assert entries == rows * context
    with watch_memory("cpu") as watch:
        penalties.apply(logits).restore(logits)
    # The docstring's bound, 40 bytes per entry (5 MiB here; the index, rows and counts are
    # built beforehand), where one float32 [rows, V] temporary per feature would be 39 MiB.
    assert watch.peak_bytes <= 40 * entries, watch.peak_bytes / entries
