"""The sampling options end to end through `LLM`, against transformers on the same weights."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfit import LLM, SamplingParams
from kvfit.engine.sampling_params import MAX_N


@cache
def hf_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy_penalized(folder: Path, prompt: list[int], max_tokens: int,
                        params: SamplingParams) -> list[int]:
    """Greedy decoding with vLLM's penalties and logit bias written out densely."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = hf_model(folder)(torch.tensor([ids])).logits[0, -1]
        vocab = logits.shape[0]
        output = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long),
                                minlength=vocab).float()
        seen = torch.bincount(torch.tensor(ids), minlength=vocab) > 0
        for token, bias in (params.logit_bias or {}).items():  # before the penalties, as vLLM
            logits[token] += bias
        rp = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
        logits = logits - params.frequency_penalty * output - params.presence_penalty * (output > 0)
        ids.append(int(logits.argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def llm(qwen3: Path) -> LLM:
    llm = LLM(str(qwen3), device="cpu", num_gpu_blocks_override=256, max_num_batched_tokens=256,
              max_num_seqs=16)
    yield llm
    llm.shutdown()


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, repetition_penalty=1.8),
    SamplingParams(temperature=0, presence_penalty=1.5, frequency_penalty=0.8),
    SamplingParams(temperature=0, repetition_penalty=0.7, frequency_penalty=-0.5),
    SamplingParams(temperature=0, logit_bias={7: 3.0, 9: -50.0}, frequency_penalty=2.0),
    SamplingParams(temperature=0, logit_bias={t: 4.0 for t in range(3, 512, 7)},
                   repetition_penalty=3.0),
], ids=["repetition", "presence+frequency", "encouraging", "bias", "bias+repetition"])
def test_penalties_and_bias_match_a_dense_reference(llm: LLM, qwen3: Path,
                                                    params: SamplingParams) -> None:
    # Penalties read each step's previous token, which the overlapped engine would otherwise
    # still hold on the device: any stale count changes the greedy path.
    batch = prompts(5, 23, 40)
    params.max_tokens, params.ignore_eos = 16, True
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    for prompt, out in zip(batch, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy_penalized(qwen3, prompt, 16, params)


def test_n_completions_share_the_prompts_blocks_and_sample_apart(llm: LLM) -> None:
    [prompt] = prompts(70, seed=2)
    bm = llm.engine.scheduler.block_manager
    seen: list = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda seq: (seen.append(seq), add(seq))[1]
    try:
        params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
        [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        [again] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    finally:
        del llm.engine.add_request
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # siblings draw apart
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
    # Each sibling found the parent's full prompt blocks in the prefix cache.
    full_blocks = (len(prompt) - 1) // bm.block_size * bm.block_size
    assert [s.num_cached_tokens for s in seen[1:4]] == [full_blocks] * 3
    assert bm.num_free_blocks == bm.num_blocks


def test_greedy_n_gives_n_equal_completions(llm: LLM) -> None:
    [out] = llm.generate({"prompt_token_ids": prompts(9)[0]},
                         SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 1


def test_bad_words_are_never_generated(llm: LLM) -> None:
    batch = prompts(12, 30, seed=4)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = llm.generate([{"prompt_token_ids": p} for p in batch], greedy, use_tqdm=False)
    first = plain[0].outputs[0].token_ids[0]
    pair = plain[1].outputs[0].token_ids[3:5]
    banned = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                            bad_words_token_ids=[[first], pair])
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], banned, use_tqdm=False)
    for out in outs:
        tokens = out.outputs[0].token_ids
        assert first not in tokens
        assert all(tokens[i:i + 2] != pair for i in range(len(tokens) - 1))
    text = llm.get_tokenizer().decode([first])
    by_text = llm.generate({"prompt_token_ids": batch[0]},
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                          bad_words=[text]), use_tqdm=False)
    assert by_text[0].outputs[0].token_ids[0] != first


def test_a_sampling_params_changed_between_calls_is_read_afresh(llm: LLM) -> None:
    # The sampler caches arrays derived from logit_bias and bad words on the params object; a
    # user who reuses one SamplingParams with new settings (reassigned or changed in place)
    # got the first call's bias and bans again.
    prompt = {"prompt_token_ids": prompts(7, seed=5)[0]}
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={77: 100.0})
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == [77] * 4
    params.logit_bias = {88: 100.0}
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == [88] * 4
    params.logit_bias[99] = 200.0
    assert llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == [99] * 4
    params.bad_words_token_ids = [[99]]
    assert 99 not in llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    params.temperature = -1.0  # checked again, as a new SamplingParams would be
    with pytest.raises(ValueError, match="temperature"):
        llm.generate(prompt, params, use_tqdm=False)


def test_stop_strings_are_cut_or_kept_as_asked(llm: LLM) -> None:
    [prompt] = prompts(15, seed=5)
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    [plain] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy),
                           use_tqdm=False)
    text = plain.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert stop.strip()
    for include in (False, True):
        [out] = llm.generate({"prompt_token_ids": prompt},
                             SamplingParams(**greedy, stop=[stop],
                                            include_stop_str_in_output=include),
                             use_tqdm=False)
        cut = text.index(stop) + (len(stop) if include else 0)
        assert out.outputs[0].text == text[:cut]
        assert out.outputs[0].stop_reason == stop


def test_a_stop_token_s_text_is_kept_only_with_include_stop_str_in_output(llm: LLM) -> None:
    # Found by the hunt: the stop token's text was left out even when asked for (vLLM keeps
    # it with include_stop_str_in_output).
    [prompt] = prompts(15, seed=7)
    greedy = dict(temperature=0, ignore_eos=True)
    [plain] = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy, max_tokens=12),
                           use_tqdm=False)
    tokens = plain.outputs[0].token_ids
    texts = [o.outputs[0].text for o in llm.generate(
        [{"prompt_token_ids": prompt}] * len(tokens),
        [SamplingParams(**greedy, max_tokens=n) for n in range(1, len(tokens) + 1)],
        use_tqdm=False)]  # texts[i]: the text of tokens[:i + 1]
    # A first occurrence with text of its own (some of the tiny vocabulary decodes to none).
    at = next(i for i in range(1, len(tokens))
              if tokens[i] not in tokens[:i] and texts[i] != texts[i - 1])
    before, through = texts[at - 1], texts[at]
    for include, text in ((False, before), (True, through)):
        [out] = llm.generate({"prompt_token_ids": prompt},
                             SamplingParams(**greedy, max_tokens=12, stop_token_ids=[tokens[at]],
                                            include_stop_str_in_output=include),
                             use_tqdm=False)
        got = out.outputs[0]
        assert got.token_ids == tokens[:at + 1] and got.stop_reason == tokens[at]
        assert got.text == text


@pytest.mark.parametrize(("params", "setting"), [
    (SamplingParams(logit_bias={512: 1.0}), "logit_bias"),
    (SamplingParams(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_requests_the_engine_cannot_serve_are_rejected_naming_the_setting(
    llm: LLM, params: SamplingParams, setting: str,
) -> None:
    with pytest.raises(ValueError, match=setting):
        llm.generate([{"prompt_token_ids": [5]}], params, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_max_tokens_none_generates_to_the_end_of_the_context(qwen3: Path) -> None:
    llm = LLM(str(qwen3), device="cpu", num_gpu_blocks_override=16, max_model_len=40,
              max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True, min_tokens=5)
    # The last prompt leaves less room than min_tokens: it runs to the end of the context, as
    # with a max_tokens beyond that room.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(3, 30, 37)], params,
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [37, 10, 3]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert params.max_tokens is None  # the caller's params are left as given
    llm.shutdown()


def test_allowed_token_ids_limit_sampling_and_leave_logprobs_raw(llm: LLM) -> None:
    allowed = [7, 40, 300]
    prompt = {"prompt_token_ids": prompts(6)[0]}
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    limited = [SamplingParams(temperature=t, max_tokens=6, ignore_eos=True, logprobs=2,
                              allowed_token_ids=allowed, seed=1, top_k=2)
               for t in (0, 1.5)]
    outs = llm.generate([prompt] * 3, [free, *limited], use_tqdm=False)
    assert all(set(o.outputs[0].token_ids) <= set(allowed) for o in outs[1:])
    # Its neighbour in the batch is untouched, and logprobs are of the raw distribution.
    [alone] = llm.generate([prompt], free, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    raw = alone.outputs[0].logprobs[0]
    first = outs[1].outputs[0].logprobs[0]
    # Equal to float32 rounding: the row's logits come from a GEMM of 3 rows against one of 1,
    # which a CPU BLAS may sum in another order. Logprobs renormalised over the 3 allowed
    # tokens would be ~1 nat higher, so the tolerance still tells the two apart.
    assert {t: e.logprob for t, e in first.items() if t in raw} == pytest.approx({
        t: e.logprob for t, e in raw.items() if t in first}, abs=1e-4)
    assert any(t not in allowed for t in first)  # the raw top-2 come along


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"allowed_token_ids": []}, "allowed_token_ids must name at least one token"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids must hold integers"),
])
def test_bad_allowed_token_ids_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_allowed_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids must be in \[0, 512\)"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(allowed_token_ids=[3, 512]),
                     use_tqdm=False)


def test_logprobs_above_the_vocabulary_size_give_the_whole_vocabulary(qwen3: Path) -> None:
    # Warmup measures max_logprobs (600) top entries over a 512-token vocabulary too.
    llm = LLM(str(qwen3), device="cpu", num_gpu_blocks_override=16, max_model_len=64,
              max_num_batched_tokens=64, max_logprobs=600)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=600, prompt_logprobs=513)
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert all(sorted(e) == list(range(512)) for e in entries)
    assert all(sorted(x.rank for x in e.values()) == list(range(1, 513)) for e in entries)
    llm.shutdown()


def test_minus_one_logprobs_give_the_whole_vocabulary_as_vllm(qwen3: Path) -> None:
    # vLLM's -1: every token's logprob, within max_logprobs (-1 there: no cap); both were
    # refused as below 0.
    llm = LLM(str(qwen3), device="cpu", num_gpu_blocks_override=16, max_model_len=64,
              max_num_batched_tokens=64, max_logprobs=-1)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=-1, prompt_logprobs=-1)
    [out] = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert len(entries) == 4 and all(sorted(e) == list(range(512)) for e in entries)
    llm.shutdown()


def test_minus_one_logprobs_above_max_logprobs_are_refused_naming_the_vocabulary(
        llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"logprobs=-1 \(the whole vocabulary, 512\) is above "
                                         r"max_logprobs=20"):
        llm.generate([{"prompt_token_ids": [5]}], SamplingParams(logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs must be >= 0, -1"):
        SamplingParams(prompt_logprobs=-2)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_n_above_max_num_seqs_queues_the_siblings(qwen3: Path, prefix_caching: bool) -> None:
    """vLLM takes any n: completions past max_num_seqs wait for a free slot, and each is what
    it would be with room for all (greedy: the same text; seeded: the same per-sibling draws)."""
    kwargs = dict(device="cpu", num_gpu_blocks_override=64, max_num_batched_tokens=64,
                  enable_prefix_caching=prefix_caching)
    prompt = [{"prompt_token_ids": prompts(9)[0]}]
    greedy, seeded = (SamplingParams(n=5, temperature=0, max_tokens=6),
                      SamplingParams(n=5, temperature=1.0, seed=7, max_tokens=6))
    narrow = LLM(str(qwen3), max_num_seqs=2, **kwargs)
    try:
        [g], [s] = (narrow.generate(prompt, p, use_tqdm=False) for p in (greedy, seeded))
    finally:
        narrow.shutdown()
    wide = LLM(str(qwen3), max_num_seqs=8, **kwargs)
    try:
        [g_ref], [s_ref] = (wide.generate(prompt, p, use_tqdm=False) for p in (greedy, seeded))
    finally:
        wide.shutdown()
    assert [c.index for c in g.outputs] == list(range(5)) and g.finished
    assert {tuple(c.token_ids) for c in g.outputs} == {tuple(g_ref.outputs[0].token_ids)}
    assert [c.token_ids for c in s.outputs] == [c.token_ids for c in s_ref.outputs]
    assert len({tuple(c.token_ids) for c in s.outputs}) > 1  # the seeds do differ


@pytest.mark.parametrize(("field", "value"), [
    ("allowed_token_ids", list(range(512)) * 3),
    ("stop_token_ids", list(range(512)) * 3),
    ("bad_words_token_ids", [[t] for t in range(512)] * 3),
    ("n", MAX_N + 1),
    ("logprobs", -5),
])
def test_a_params_object_changed_after_construction_is_held_to_warmups_bounds(
    llm: LLM, field: str, value: object,
) -> None:
    # The async engine queues a shallow copy of the caller's params (no constructor run):
    # a list grown past MAX_TOKEN_LIST after construction reached the sampler with more
    # entries than warmup measured; an n past MAX_N built that many sequences.
    params = SamplingParams(max_tokens=1)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        llm.make_request({"prompt_token_ids": [5, 6]}, params, "changed")


def test_bad_words_past_the_token_sequence_bound_are_refused_naming_bad_words(llm: LLM) -> None:
    # 600 words pass SamplingParams' bound on their number (MAX_TOKEN_LIST), but each is
    # banned as written and after a space: 1200 token sequences were refused as
    # "SamplingParams.bad_words_token_ids holds at most 1024 entries", a field never set.
    words = [f"w{i}x" for i in range(600)]
    with pytest.raises(ValueError, match=r"SamplingParams.bad_words: its 600 words tokenize "
                                         r"to 1200 token sequences .* at most 1024"):
        llm.generate("hello", SamplingParams(max_tokens=1, bad_words=words), use_tqdm=False)
    with pytest.raises(ValueError, match=r"1200 token sequences .*\(1201 with "
                                         r"bad_words_token_ids\)"):
        llm.make_request("hello", SamplingParams(max_tokens=1, bad_words=words,
                                                 bad_words_token_ids=[[7, 8, 9]]), "r")
    assert not llm.engine.has_unfinished()


def test_seed_minus_one_is_no_seed_as_in_vllm(llm: LLM) -> None:
    # vLLM (and OpenAI's API) take seed -1 as "no seed"; chat front ends send it for "random".
    # As a seed of its own, every regenerate of such a client gave the same completion.
    assert SamplingParams(seed=-1).seed is None
    prompt = {"prompt_token_ids": prompts(9, seed=8)[0]}

    def twice(seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.5, seed=seed, max_tokens=12, ignore_eos=True)
        return [llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
                for _ in range(2)]

    first, second = twice(-1)
    assert first != second  # the engine's generator draws anew at each try
    first, second = twice(-2)
    assert first == second  # any other negative seed is a seed


@pytest.fixture(scope="module")
def logprobs_by_mode(qwen3: Path) -> dict[str, list]:
    """Per logprobs_mode, one step's outputs of a batch of a filtered sampled request and a
    greedy one, both with logit bias and a repetition penalty, every token's logprob asked."""
    prompt = {"prompt_token_ids": prompts(7, seed=3)[0]}
    common = dict(max_tokens=1, logprobs=-1, prompt_logprobs=3, logit_bias={7: 3.0},
                  repetition_penalty=1.3)
    params = [SamplingParams(temperature=0.7, top_k=20, min_p=0.05, seed=5, **common),
              SamplingParams(temperature=0, top_k=2, **common)]
    outputs = {}
    for mode in ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"):
        llm = LLM(str(qwen3), device="cpu", num_gpu_blocks_override=16, max_model_len=64,
                  max_num_batched_tokens=64, max_num_seqs=4, max_logprobs=-1,
                  logprobs_mode=mode)
        try:
            outputs[mode] = llm.generate([prompt, prompt], params, use_tqdm=False)
        finally:
            llm.shutdown()
    return outputs


def values(entries: dict) -> torch.Tensor:
    """A whole-vocabulary logprobs dict as a [512] float64 tensor."""
    assert sorted(entries) == list(range(512))
    return torch.tensor([entries[t].logprob for t in range(512)], dtype=torch.float64)


def test_each_logprobs_mode_gives_vllms_values(logprobs_by_mode: dict[str, list],
                                               qwen3: Path) -> None:
    # vLLM's logprobs_mode was refused but for its default: raw_logits, processed_logprobs
    # and processed_logits each checked against torch on the model's logits.
    outs = {mode: [o.outputs[0] for o in outputs] for mode, outputs in logprobs_by_mode.items()}
    prompt = logprobs_by_mode["raw_logits"][0].prompt_token_ids
    logits = values(outs["raw_logits"][0].logprobs[0])
    assert torch.allclose(logits, hf_model(qwen3)(torch.tensor([prompt])).logits[0, -1].double(),
                          atol=1e-4)
    for mode, (sampled, greedy) in outs.items():
        assert sampled.token_ids == outs["raw_logprobs"][0].token_ids  # the mode draws alike
        assert greedy.token_ids == outs["raw_logprobs"][1].token_ids
        if mode.startswith("raw"):  # the same prompt: the same raw values, however sampled
            assert values(greedy.logprobs[0]).tolist() == values(sampled.logprobs[0]).tolist()
    assert torch.allclose(values(outs["raw_logprobs"][0].logprobs[0]), logits.log_softmax(-1),
                          atol=1e-5)
    # vLLM's order: bias, penalties; a sampled request then temperature, min-p, top-k; a
    # greedy one stops there (vLLM turns its temperature and filters off).
    x = logits.clone()
    x[7] += 3.0
    seen = torch.tensor(sorted(set(prompt)))
    x[seen] = torch.where(x[seen] > 0, x[seen] / 1.3, x[seen] * 1.3)
    tempered = x / 0.7
    tempered[tempered.softmax(-1) < 0.05 * tempered.softmax(-1).max()] = float("-inf")
    tempered[tempered < tempered.topk(20).values[-1]] = float("-inf")
    assert 1 < tempered.isfinite().sum() < 512  # the filters cut
    for got, expected in ((outs["processed_logits"][0], tempered),
                          (outs["processed_logits"][1], x),
                          (outs["processed_logprobs"][0], tempered.log_softmax(-1)),
                          (outs["processed_logprobs"][1], x.log_softmax(-1))):
        entries, token = got.logprobs[0], got.token_ids[0]
        assert values(entries).isinf().tolist() == expected.isinf().tolist()
        assert torch.allclose(values(entries), expected, atol=1e-4)
        assert expected[token] > float("-inf")
        assert entries[token].rank == 1 + int((expected > expected[token]).sum())
    # prompt_logprobs stay raw_logprobs in every mode, as vLLM's.
    raw_prompt = logprobs_by_mode["raw_logprobs"][0].prompt_logprobs
    for outputs in logprobs_by_mode.values():
        for got, want in zip(outputs[0].prompt_logprobs[1:], raw_prompt[1:], strict=True):
            assert {t: e.logprob for t, e in got.items()} == pytest.approx(
                {t: e.logprob for t, e in want.items()}, abs=1e-6)


@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 1e-3, 0.0099])
def test_a_temperature_below_a_hundredth_is_raised_to_it_with_a_warning_as_vllm(
    temperature: float, caplog: pytest.LogCaptureFixture,
) -> None:
    # vLLM raises (0, 0.01) to 0.01: smaller ones overflow logits / temperature.
    with caplog.at_level("WARNING", logger="kvfit.engine.sampling_params"):
        assert SamplingParams(temperature=temperature).temperature == 0.01
    assert "temperature" in caplog.text and "0.01" in caplog.text


@pytest.mark.parametrize("temperature", [0, 0.0, 0.01, 0.5, 1e6])
def test_greedy_and_temperatures_from_a_hundredth_are_kept_without_a_warning(
    temperature: float, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level("WARNING", logger="kvfit.engine.sampling_params"):
        assert SamplingParams(temperature=temperature).temperature == temperature
    assert not caplog.text


def test_tiny_and_huge_temperatures_sample_without_nan_beside_filters(qwen3: Path) -> None:
    """A temperature of 1e-6 samples as 0.01 does (the processed logits it reports are the
    logits over 0.01, not over 1e-6: 1e4 times larger); 1e6 and either with top-p / min-p /
    top-k give finite logprobs and no error."""
    llm = LLM(str(qwen3), device="cpu", num_gpu_blocks_override=32, max_model_len=64,
              max_num_batched_tokens=64, max_num_seqs=8, logprobs_mode="processed_logits")
    try:
        batch = [{"prompt_token_ids": p} for p in prompts(5, 9, 3, seed=11)]

        def run(temperature: float, **filters: float) -> list:
            params = SamplingParams(temperature=temperature, seed=3, max_tokens=8,
                                    ignore_eos=True, logprobs=4, **filters)
            return [o.outputs[0] for o in llm.generate(batch, params, use_tqdm=False)]

        def logprobs(outs: list) -> list[list[float]]:
            return [[lp.logprob for step in out.logprobs for lp in step.values()]
                    for out in outs]

        hundredth = run(0.01)
        tiny = run(1e-6)
        assert [o.token_ids for o in tiny] == [o.token_ids for o in hundredth]
        assert logprobs(tiny) == logprobs(hundredth)
        for temperature in (1e-30, 1e-6, 1e-3, 1e6):
            for filters in ({"top_p": 0.5}, {"min_p": 0.5}, {"top_k": 3, "top_p": 0.9,
                                                            "min_p": 0.1}):
                outs = run(temperature, **filters)
                values = [v for row in logprobs(outs) for v in row]
                assert all(len(o.token_ids) == 8 for o in outs)
                assert not any(math.isnan(v) for v in values), (temperature, filters)
                # The sampled tokens' processed logits (a filtered one is -inf, never drawn).
                sampled = [o.logprobs[i][t].logprob for o in outs
                           for i, t in enumerate(o.token_ids)]
                assert all(math.isfinite(v) for v in sampled), (temperature, filters)
    finally:
        llm.shutdown()


def test_logit_bias_on_a_bf16_model_keeps_the_logits_order_as_vllm(qwen3: Path) -> None:
    # +100 on every token but the specials (a forced choice among many): in bf16, 100 + x
    # steps by 0.5, and the biased logits stored back in bf16 tied, so greedy took the lowest
    # tied id, not the largest logit. vLLM's sampler adds the bias in float32.
    llm = LLM(str(qwen3), device="cpu", dtype="bfloat16", num_gpu_blocks_override=32,
              max_model_len=64, max_num_batched_tokens=64, max_num_seqs=2, max_logprobs=-1,
              logprobs_mode="raw_logits")
    prompt = {"prompt_token_ids": [5, 17, 99, 200, 33, 7]}
    [raw] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=-1),
                         use_tqdm=False)[0].outputs[0].logprobs
    logits = {t: entry.logprob for t, entry in raw.items()}  # kvfit's own bf16 logits
    bias = {t: 100.0 for t in range(3, 512)}
    expected = max(bias, key=lambda t: (logits[t], -t))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logit_bias=bias),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [expected]
    llm.shutdown()
