"""Sampler: greedy is argmax, filters keep the right tokens, seeds reproduce, logprobs are raw
(or as the engine's logprobs_mode asks)."""

from __future__ import annotations

import math

import pytest
import torch

import kvfit.engine.sampler as sampler
from kvfit.engine.config import LOGPROBS_MODES
from kvfit.engine.sampler import (
    PROMPT_LOGPROBS_CHUNK,
    Sampler,
    SamplingMetadata,
    logprob_dicts,
    logprobs_at,
)
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import Sequence

VOCAB = 64


def seqs_for(*params: SamplingParams, num_output_tokens: int = 0) -> list[Sequence]:
    seqs = []
    for p in params:
        seq = Sequence([1, 2, 3], p)
        seq.token_ids += [4] * num_output_tokens
        seqs.append(seq)
    return seqs


def sample(
    logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler | None = None, eos: tuple = ()
) -> tuple[list[int], list]:
    meta = SamplingMetadata.from_seqs(seqs, logits.shape[-1], logits.device, eos)
    sampler = sampler or Sampler(seed=0)
    return sampler(logits, meta).to_lists(meta.num_logprobs)


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows() -> None:
    logits = random_logits(6)
    params = [SamplingParams(temperature=0 if i % 2 else 1.5, top_k=5) for i in range(6)]
    ids, _ = sample(logits, seqs_for(*params))
    expected = logits.argmax(dim=-1).tolist()
    assert [ids[i] for i in (1, 3, 5)] == [expected[i] for i in (1, 3, 5)]


def test_sampled_tokens_stay_inside_each_rows_filters() -> None:
    logits = random_logits(1).expand(300, VOCAB).contiguous()
    params = [SamplingParams(top_k=3), SamplingParams(top_p=0.3), SamplingParams(min_p=0.5),
              SamplingParams()] * 75
    ids, _ = sample(logits, seqs_for(*params))
    probs = torch.softmax(logits[0], dim=0)
    order = probs.argsort(descending=True).tolist()
    nucleus = order[: 1 + int((probs[order].cumsum(0) < 0.3).sum())]
    assert set(ids[0::4]) <= set(order[:3])
    assert set(ids[1::4]) <= set(nucleus)
    assert set(ids[2::4]) <= set((probs >= 0.5 * probs.max()).nonzero().flatten().tolist())
    assert len(set(ids[3::4])) > len(nucleus)  # unfiltered rows reach further


def test_sampling_frequencies_follow_the_tempered_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20_000, 4).contiguous()
    temperature = 2.0
    ids, _ = sample(logits, seqs_for(*[SamplingParams(temperature=temperature)] * 20_000))
    counts = torch.bincount(torch.tensor(ids), minlength=4).float() / 20_000
    expected = torch.softmax(logits[0] / temperature, dim=0)
    assert torch.allclose(counts, expected, atol=0.015)


def vllm_probs(row: torch.Tensor, prompt: list[int], output: list[int],
               p: SamplingParams) -> torch.Tensor:
    """vLLM's sampling distribution written out densely (`vllm_processed_logits`)."""
    return vllm_processed_logits(row, prompt, output, p).softmax(-1)


def vllm_processed_logits(row: torch.Tensor, prompt: list[int], output: list[int],
                          p: SamplingParams) -> torch.Tensor:
    """vLLM's processed logits written out densely, in its order: logit bias, penalties,
    temperature, min-p, top-k, then top-p over what is left (sorted, as vLLM does); a greedy
    request stops after the penalties (vLLM turns its temperature and filters off)."""
    x = row.double().clone()
    vocab = x.shape[0]
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    out = torch.bincount(torch.tensor(output), minlength=vocab).double()
    seen = torch.bincount(torch.tensor(prompt + output), minlength=vocab) > 0
    rp = p.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    x = x - p.frequency_penalty * out - p.presence_penalty * (out > 0)
    if p.temperature == 0:
        return x
    x = x / p.temperature
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    ascending, order = x.sort()
    if 0 < p.top_k < vocab:
        ascending = ascending.masked_fill(ascending < ascending[vocab - p.top_k], float("-inf"))
    if p.top_p < 1:
        drop = ascending.softmax(-1).cumsum(-1) <= 1 - p.top_p
        drop[-1] = False
        ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(x).index_put_((order,), ascending)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_k=10, top_p=0.85, min_p=0.05, repetition_penalty=1.5,
                   presence_penalty=0.4, frequency_penalty=0.3, logit_bias={6: 1.5, 19: -0.5}),
    SamplingParams(temperature=1.7, top_p=0.7),
    SamplingParams(temperature=0.5, min_p=0.2, top_k=5),
], ids=["everything", "top_p", "min_p+top_k"])
def test_the_sampler_draws_from_vllms_distribution(params: SamplingParams) -> None:
    """20,000 draws (a fixed engine seed: deterministic) against vLLM's pipeline: none outside
    its support and a chi-square p-value that a wrong order or filter would sink."""
    vocab, draws, prompt, output = 24, 20_000, [1, 6, 19, 5], [5, 6, 6]
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    seqs = [Sequence(list(prompt), params) for _ in range(draws)]
    for seq in seqs:
        seq.token_ids += output
    meta = SamplingMetadata.from_seqs(seqs, vocab, "cpu")
    ids = Sampler(seed=1)(row.expand(draws, vocab).contiguous(), meta).sampled_token_ids
    counts = torch.bincount(ids, minlength=vocab).double()
    probs = vllm_probs(row, prompt, output, params)
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * draws
    chi2 = ((counts[probs > 0] - expected) ** 2 / expected).sum()
    df = torch.tensor(len(expected) - 1, dtype=torch.float64)
    assert float(torch.special.gammaincc(df / 2, chi2 / 2)) > 1e-3


@pytest.mark.parametrize("block_rows", [None, 1])
@pytest.mark.parametrize("mode", LOGPROBS_MODES)
def test_logprobs_modes_give_vllms_values(mode: str, block_rows: int | None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Each logprobs_mode against a hand computation on the same float32 logits: raw ones
    (before bias, penalties, temperature, filters), or the processed ones vLLM samples from
    (filtered tokens -inf; a greedy row's with no temperature or filters), alone or beside
    other rows, in one block of rows or one block a row."""
    if block_rows:
        monkeypatch.setattr(sampler, "_LOGSUMEXP_BYTES", block_rows * 4 * VOCAB)
    prompt, output = [1, 6, 19, 5], [5, 6, 6]
    params = [
        SamplingParams(temperature=0.8, top_k=10, top_p=0.85, min_p=0.05, repetition_penalty=1.5,
                       presence_penalty=0.4, frequency_penalty=0.3, logit_bias={6: 1.5},
                       logprobs=VOCAB),
        SamplingParams(temperature=0, top_k=2, logit_bias={3: 4.0}, repetition_penalty=1.5,
                       logprobs=VOCAB),
        SamplingParams(temperature=1.7, top_p=0.7, logprobs=5),
        SamplingParams(temperature=0.5, top_k=3),  # no logprobs: gathered rows around it
        SamplingParams(temperature=0.5, min_p=0.2, seed=4, logprobs=VOCAB),
    ]
    logits = random_logits(len(params), seed=2)
    for rows in (range(len(params)), [1]):  # [1]: an all-greedy step, the argmax's path
        seqs = [Sequence(list(prompt), params[r]) for r in rows]
        for seq in seqs:
            seq.token_ids += output
        given = logits[list(rows)].clone()
        ids, dicts = sample(given, seqs, Sampler(seed=1, logprobs_mode=mode))
        assert torch.equal(given, logits[list(rows)])  # the processors' changes undone
        for i, r in enumerate(rows):
            p = params[r]
            raw = mode.startswith("raw")
            x = logits[r].double() if raw else vllm_processed_logits(logits[r], prompt, output, p)
            expected = x.log_softmax(-1) if mode.endswith("logprobs") else x
            if p.logprobs is None:
                assert dicts[i] is None
                continue
            assert expected[ids[i]] > float("-inf")  # the sampled token passed the filters
            top = expected.topk(p.logprobs).indices.tolist()
            assert set(dicts[i]) == {ids[i], *top} or expected[top[-1]] == float("-inf")
            for token, entry in dicts[i].items():
                assert entry.logprob == pytest.approx(expected[token].item(), abs=1e-5)
                if expected[token] > float("-inf"):
                    assert entry.rank == 1 + int((expected > expected[token]).sum())


def test_seeded_requests_reproduce_regardless_of_batch_mates() -> None:
    logits = random_logits(3)
    seeded = SamplingParams(seed=1234)
    alone, _ = sample(logits[1:2], seqs_for(seeded), Sampler(seed=0))
    batched, _ = sample(
        logits, seqs_for(SamplingParams(), seeded, SamplingParams()), Sampler(seed=9)
    )
    assert batched[1] == alone[0]
    # Successive tokens draw fresh noise, and another seed gives other samples.
    flat = torch.zeros(1, VOCAB)
    draws = [sample(flat, seqs_for(seeded, num_output_tokens=i))[0][0] for i in range(8)]
    other = [
        sample(flat, seqs_for(SamplingParams(seed=99), num_output_tokens=i))[0][0] for i in range(8)
    ]
    assert len(set(draws)) > 1
    assert draws != other


def test_unseeded_rows_follow_the_engine_seed() -> None:
    logits = random_logits(16)
    params = [SamplingParams()] * 16
    first, _ = sample(logits, seqs_for(*params), Sampler(seed=5))
    again, _ = sample(logits, seqs_for(*params), Sampler(seed=5))
    other, _ = sample(logits, seqs_for(*params), Sampler(seed=6))
    assert first == again
    assert first != other


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = random_logits(3)
    params = [
        SamplingParams(temperature=0.3, top_k=2, logprobs=4),
        SamplingParams(),
        SamplingParams(temperature=0, logprobs=0),
    ]
    ids, logprobs = sample(logits, seqs_for(*params))
    reference = torch.log_softmax(logits, dim=-1)
    assert logprobs[1] is None
    top4 = reference[0].topk(4).indices.tolist()
    assert set(logprobs[0]) == {ids[0], *top4}
    for row in (0, 2):
        for token, entry in logprobs[row].items():
            assert entry.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
            assert entry.rank == 1 + int((logits[row] > logits[row, token]).sum())
    assert list(logprobs[2]) == [ids[2]]
    # Every row asking: the logits are read in place, not gathered.
    ids, logprobs = sample(logits, seqs_for(*[SamplingParams(temperature=0, logprobs=2)] * 3))
    for row in range(3):
        assert set(logprobs[row]) == {ids[row], *reference[row].topk(2).indices.tolist()}
        for token, entry in logprobs[row].items():
            assert entry.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)


def test_min_tokens_bans_stop_tokens_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 7] = 50.0  # EOS dominates
    logits[:, 9] = 40.0  # then a stop token id
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9])
    early, _ = sample(logits, seqs_for(params, params, num_output_tokens=1), eos=(7,))
    assert early == [logits[0, :7].argmax().item()] * 2
    done, _ = sample(logits[:1], seqs_for(params, num_output_tokens=3), eos=(7,))
    assert done == [7]
    ignore = SamplingParams(temperature=0, min_tokens=3, ignore_eos=True)
    assert sample(logits[:1], seqs_for(ignore), eos=(7,))[0] == [7]


def test_prompt_logprobs_match_log_softmax() -> None:
    logits = random_logits(5)
    targets = torch.tensor([3, 1, 4, 1, 5])
    reference = torch.log_softmax(logits, dim=-1)
    entries = logprob_dicts(*logprobs_at(logits, targets, n=2))
    for row, entry in enumerate(entries):
        expected_ids = {targets[row].item(), *reference[row].topk(2).indices.tolist()}
        assert set(entry) == expected_ids
        for token, value in entry.items():
            assert value.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)
    assert [list(e) for e in logprob_dicts(*logprobs_at(logits, targets, n=0))] == [
        [t] for t in targets.tolist()
    ]


@pytest.mark.gpu
def test_cuda_sampling_matches_the_cpu_rules() -> None:
    logits = random_logits(8).cuda()
    params = [SamplingParams(temperature=0, logprobs=3)] * 4 + [SamplingParams(top_k=2)] * 4
    ids, logprobs = sample(logits, seqs_for(*params), Sampler("cuda", seed=0))
    assert ids[:4] == logits[:4].argmax(dim=-1).tolist()
    for row in range(4, 8):
        assert ids[row] in logits[row].topk(2).indices.tolist()
    reference = torch.log_softmax(logits, dim=-1)
    for row in range(4):
        for token, value in logprobs[row].items():
            assert value.logprob == pytest.approx(reference[row, token].item(), abs=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_logprobs_over_many_row_blocks_match_log_softmax(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Many normalisation blocks, the last one short, and bf16 logits normalised in float32.
    monkeypatch.setattr(sampler, "_LOGSUMEXP_BYTES", 7 * 4 * VOCAB)
    logits = random_logits(PROMPT_LOGPROBS_CHUNK // 4 + 3, seed=1).to(dtype)
    targets = torch.randint(0, logits.shape[1], (logits.shape[0],))
    reference = torch.log_softmax(logits.float(), dim=-1)
    entries = logprob_dicts(*logprobs_at(logits, targets, n=3))
    for row, entry in enumerate(entries):
        assert set(entry) == {targets[row].item(), *reference[row].topk(3).indices.tolist()}
        for token, value in entry.items():
            assert value.logprob == pytest.approx(reference[row, token].item(), abs=1e-5)


@pytest.mark.parametrize("temperature", [1e39, 1e300])
def test_a_temperature_past_float32s_range_keeps_filters_and_gives_no_nan(
    temperature: float,
) -> None:
    """A finite temperature float32 cannot hold (it became inf): min_p=1 kept every token (inf
    x ln 1 is NaN) and a filtered token's processed logprob was -inf / inf = NaN. As at 3e38,
    min_p=1 keeps only the top token, and the processed logprobs are finite or -inf."""
    logits = random_logits(4, seed=7)
    ids, _ = sample(logits, seqs_for(*[SamplingParams(temperature=temperature, min_p=1.0)] * 4))
    assert ids == logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=temperature, logprobs=VOCAB, **f)
              for f in ({"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.5}, {})]
    for mode in ("processed_logprobs", "processed_logits"):
        ids, dicts = sample(logits, seqs_for(*params), Sampler(seed=1, logprobs_mode=mode))
        values = torch.tensor([[d[t].logprob for t in range(VOCAB)] for d in dicts])
        assert not values.isnan().any(), mode
        assert (values[0] > float("-inf")).sum() == 3  # top-k's three, the rest -inf
        assert all(values[row, token] > float("-inf") for row, token in enumerate(ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_and_penalties_on_16_bit_logits_are_computed_in_float32(dtype: torch.dtype) -> None:
    # +100 on a set of tokens (forcing a choice among labels): stored back in 16 bits the
    # biased logits step by 0.5 (bf16) and near ones tie, so greedy took the lowest id where
    # vLLM, which samples in float32, takes the largest.
    logits = torch.tensor([[1.1, 1.0, 1.05, 1.2, 66.0, 70.0] + [0.0] * (VOCAB - 6)]).to(dtype)
    biased = SamplingParams(temperature=0, logit_bias={t: 100.0 for t in range(4)}, logprobs=2)
    ids, logprobs = sample(logits.clone(), seqs_for(biased))
    assert ids == [int((logits[0, :4].float() + 100).argmax())] == [3]
    assert all(math.isfinite(e.logprob) for e in logprobs[0].values())
    # Repetition penalty 1e-3 scales seen positive logits by 1000: 66 and 70 (seen: the
    # output's 4 and 5) past float16's range, where both were inf and the lower id won.
    penalized = SamplingParams(temperature=0, repetition_penalty=1e-3, logprobs=2)
    [seq] = seqs_for(penalized, num_output_tokens=1)
    seq.token_ids.append(5)
    ids, logprobs = sample(logits.clone(), [seq])
    assert ids == [5]
    assert all(math.isfinite(e.logprob) for e in logprobs[0].values())
