"""Tensor parallelism on the CPU (gloo) against one rank, feature by feature: on the same
float32 weights TP=2 must give the tokens, texts and finish reasons TP=1 gives, and logprobs
within float32 rounding (the ranks' partial sums add in another order). Engines are shared
within the module: each TP start costs seconds on two cores."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvfit import LLM, SamplingParams

HERE = Path(__file__).parent
LIMITS = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128)
PROMPTS = [[5, 17, 300, 42, 9], [7, 8], list(range(20, 57)), list(range(100, 160))]
TEXTS = ["Hello there, how", "The quick brown fox", "abc def ghi"]
TOL = 1e-4  # float32 logprobs summed in another order
MiB = 1 << 20

FEATURES = {
    "greedy_logprobs": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                      logprobs=3, prompt_logprobs=2),
    "seeded_top_p_top_k_min_p": SamplingParams(temperature=0.8, top_p=0.9, top_k=50,
                                               min_p=0.02, seed=7, max_tokens=12,
                                               ignore_eos=True, logprobs=2),
    "n_3": SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True),
    "penalties": SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3,
                                repetition_penalty=1.3, max_tokens=12, ignore_eos=True,
                                logprobs=1),
    "seeded_penalties": SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5,
                                       repetition_penalty=1.2, top_k=5, max_tokens=12,
                                       ignore_eos=True),
    "bias_allowed_bad_words": SamplingParams(temperature=0.9, seed=5, max_tokens=10,
                                             ignore_eos=True, logit_bias={400: 2.0},
                                             allowed_token_ids=[1, 50, 400, 508],
                                             bad_words_token_ids=[[50, 50]], logprobs=2),
}


@pytest.fixture(autouse=True)
def hooks_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Spawned workers get this process's sys.path: they can import `tp_hooks`."""
    monkeypatch.syspath_prepend(str(HERE))
    yield


@pytest.fixture(scope="module")
def tp1(tiny_model: Callable[[str], Path]) -> Iterator[LLM]:
    llm = LLM(str(tiny_model("qwen3")), **LIMITS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tp2(tiny_model: Callable[[str], Path]) -> Iterator[LLM]:
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(HERE))
        llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2, enable_sleep_mode=True,
                  worker_init_fn="tp_hooks:probes", **LIMITS)
    yield llm
    llm.shutdown()


def as_ids(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts]


def results(outputs: list[Any]) -> list[tuple]:
    """What a user reads of each request: every completion's tokens, text, finish and stop
    reason and logprobs ({token: logprob}), and the prompt logprobs."""
    def logprobs(entries: list | None) -> list | None:
        if entries is None:
            return None
        return [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]

    return [([(c.token_ids, c.text, c.finish_reason, c.stop_reason, logprobs(c.logprobs))
              for c in o.outputs], logprobs(o.prompt_logprobs)) for o in outputs]


def assert_same(got: Any, expected: Any) -> None:
    """Equal, floats within `TOL` (so a token that differs fails as itself, not as a float)."""
    if isinstance(expected, float):
        assert got == pytest.approx(expected, abs=TOL)
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), (got, expected)
        for g, e in zip(got, expected, strict=True):
            assert_same(g, e)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_same(got[key], expected[key])
    else:
        assert got == expected


@pytest.mark.parametrize("feature", FEATURES)
def test_sampling_features_match_tp1(tp1: LLM, tp2: LLM, feature: str) -> None:
    params = FEATURES[feature]
    expected = results(tp1.generate(as_ids(PROMPTS), params, use_tqdm=False))
    assert_same(results(tp2.generate(as_ids(PROMPTS), params, use_tqdm=False)), expected)


def test_stop_strings_match_tp1(tp1: LLM, tp2: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    stops = [o.outputs[0].text[4:7] for o in tp1.generate(TEXTS, greedy, use_tqdm=False)]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[s])
              for s in stops]
    expected = results(tp1.generate(TEXTS, params, use_tqdm=False))
    assert all(c[2] == "stop" for completions, _ in expected for c in completions)
    assert_same(results(tp2.generate(TEXTS, params, use_tqdm=False)), expected)


def test_prefix_cache_hits_give_the_same_outputs(tp1: LLM, tp2: LLM) -> None:
    # (no prompt logprobs: a request that asks for them computes its whole prompt)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    longer = as_ids([p + [11, 12, 13] for p in PROMPTS])
    expected = results(tp1.generate(longer, params, use_tqdm=False))
    tp2.generate(as_ids(PROMPTS), params, use_tqdm=False)  # fills the prefix cache
    hits = tp2.engine.stats().prefix_cache_hit_tokens
    assert_same(results(tp2.generate(longer, params, use_tqdm=False)), expected)
    assert tp2.engine.stats().prefix_cache_hit_tokens > hits


def test_abort_mid_generation_leaves_the_others_and_the_cache(tp1: LLM, tp2: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    expected = results(tp1.generate(as_ids(PROMPTS), params, use_tqdm=False))
    seqs = [s for i, p in enumerate(as_ids(PROMPTS))
            for s in tp2.make_request(p, params, str(i))]
    for seq in seqs:
        tp2.engine.add_request(seq)
    for step in range(100):
        if not tp2.engine.has_unfinished():
            break
        tp2.engine.step()
        if step == 5:  # one step in flight
            tp2.engine.abort_request("1")
            tp2.engine.abort_request("3")
    assert [list(seqs[i].output_token_ids) for i in (0, 2)] == [
        list(expected[i][0][0][0]) for i in (0, 2)]
    assert all(len(seqs[i].output_token_ids) < 30 for i in (1, 3))
    stats = tp2.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert_same(results(tp2.generate(as_ids(PROMPTS), params, use_tqdm=False)), expected)


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_outputs(tp1: LLM, tp2: LLM, level: int) -> None:
    params = FEATURES["greedy_logprobs"]
    expected = results(tp1.generate(as_ids(PROMPTS), params, use_tqdm=False))
    report = tp2.sleep(level)
    assert tp2.engine.executor.collective_rpc("sleep_state")[1].weights_asleep
    # The engine's report covers every rank: a level-1 sleep puts every rank's part of the
    # weights on the host, the whole model at least (the ranks hold copies of the norms).
    weights = sum(p.numel() * p.element_size()
                  for p in tp1.engine.executor.workers[0].runner.model.parameters())
    assert report.host_bytes >= weights if level == 1 else report.host_bytes == 0
    with pytest.raises(RuntimeError, match="call LLM.wake_up"):
        tp2.generate(as_ids(PROMPTS), params, use_tqdm=False)
    tp2.wake_up()
    assert_same(results(tp2.generate(as_ids(PROMPTS), params, use_tqdm=False)), expected)


def test_level_2_weights_loaded_by_the_user_reach_every_rank(
    tp1: LLM, tp2: LLM, tiny_model: Callable[[str], Path]
) -> None:
    from safetensors.torch import load_file

    params = FEATURES["greedy_logprobs"]
    expected = results(tp1.generate(as_ids(PROMPTS), params, use_tqdm=False))
    tp2.sleep(2)
    tp2.wake_up(reload_weights=False)
    with pytest.raises(RuntimeError, match="LLM.load_weights"):
        tp2.generate(as_ids(PROMPTS), params, use_tqdm=False)
    tp2.load_weights(load_file(str(tiny_model("qwen3") / "model.safetensors")))
    assert_same(results(tp2.generate(as_ids(PROMPTS), params, use_tqdm=False)), expected)


def test_resize_under_load_keeps_outputs_and_ranks_agree(tp1: LLM, tp2: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids)
                for o in tp1.generate(as_ids(PROMPTS), params, use_tqdm=False)]
    resizer, rpc = tp2.engine.kv_resizer, tp2.engine.executor.collective_rpc
    full = resizer.num_blocks
    seqs = [s for i, p in enumerate(as_ids(PROMPTS)) for s in tp2.make_request(p, params, str(i))]
    for seq in seqs:
        tp2.engine.add_request(seq)
    preemptions, step = tp2.engine.stats().num_preemptions, 0
    while tp2.engine.has_unfinished():
        tp2.engine.step()
        step += 1
        if step in (3, 12):  # shrink with every sequence running, grow back with some waiting
            tp2.resize_kv_cache(resizer.floor if step == 3 else full)
            assert rpc("probe_committed_blocks") == [resizer.num_blocks] * 2
    assert [list(s.output_token_ids) for s in seqs] == expected
    assert tp2.engine.stats().num_preemptions > preemptions
    assert resizer.num_blocks == full


def test_chunked_prefill_and_preemption_match_tp1(
    tp1: LLM, tiny_model: Callable[[str], Path]
) -> None:
    # 16-token chunks; 9 blocks of 16 tokens, where the four greedy sequences need 12.
    features = ("greedy_logprobs", "seeded_top_p_top_k_min_p", "n_3")
    expected = [results(tp1.generate(as_ids(PROMPTS), FEATURES[f], use_tqdm=False))
                for f in features]
    llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2,
              **{**LIMITS, "max_num_batched_tokens": 16, "num_gpu_blocks_override": 9})
    try:
        for feature, want in zip(features, expected, strict=True):
            assert_same(results(llm.generate(as_ids(PROMPTS), FEATURES[feature],
                                             use_tqdm=False)), want)
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.shutdown()


def test_calculated_fp8_scales_are_the_layers_on_every_rank(
    tiny_model: Callable[[str], Path]
) -> None:
    # Each rank projects only its KV heads; a layer's scale is the amax over all of them (what
    # one rank computes), or the ranks quantize the same K/V differently than TP=1 does.
    folder = str(tiny_model("qwen3"))
    settings = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, **LIMITS)
    params = FEATURES["greedy_logprobs"]
    one = LLM(folder, **settings)
    try:
        expected = results(one.generate(as_ids(PROMPTS), params, use_tqdm=False))
        scales = one.engine.executor.workers[0].runner.kv_scales()
    finally:
        one.shutdown()
    two = LLM(folder, tensor_parallel_size=2, worker_init_fn="tp_hooks:probes", **settings)
    try:
        assert_same(results(two.generate(as_ids(PROMPTS), params, use_tqdm=False)), expected)
        for rank_scales in two.engine.executor.collective_rpc("probe_kv_scales"):
            assert rank_scales == [pytest.approx(s, rel=1e-5) for s in scales]
    finally:
        two.shutdown()


def test_the_governor_follows_the_tightest_rank(tiny_model: Callable[[str], Path]) -> None:
    """A co-tenant on rank 1's device only: the elastic cache shrinks on every rank to give
    it room, grows back once it frees, and generation goes on unchanged meanwhile."""
    from tp_hooks import CO_TENANT_DEVICE_BYTES

    llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2, device="cpu",
              max_model_len=512, max_num_seqs=64, max_num_batched_tokens=256,
              elastic_kv_cache=True, elastic_low_watermark="4MiB",
              elastic_high_watermark="10MiB", elastic_min_interval=0.2, elastic_idle_s=0,
              worker_init_fn="tp_hooks:co_tenant_on_rank_1")
    try:
        rpc, bm = llm.engine.executor.collective_rpc, llm.engine.scheduler.block_manager
        prompts = as_ids([list(range(1 + i, 1 + i + n)) for i, n in enumerate((1, 40, 150))])
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

        def generate() -> list[list[int]]:
            return [list(o.outputs[0].token_ids)
                    for o in llm.generate(prompts, params, use_tqdm=False)]

        def serve_until(done: Callable[[], bool]) -> None:
            deadline = time.monotonic() + 60
            while not done():
                assert time.monotonic() < deadline, "the governor did not get there in time"
                assert generate() == expected

        expected, start = generate(), bm.num_blocks
        in_band = CO_TENANT_DEVICE_BYTES - rpc("kv_cache_bytes")[1][0] - 7 * MiB  # 7 MiB free
        rpc("probe_set_co_tenant", in_band + 16 * MiB)
        serve_until(lambda: 4 * MiB <= rpc("device_memory")[1][0] <= 10 * MiB)
        assert bm.num_blocks < start
        assert rpc("probe_committed_blocks") == [bm.num_blocks] * 2
        rpc("probe_set_co_tenant", in_band)
        serve_until(lambda: bm.num_blocks == start)
        assert rpc("probe_committed_blocks") == [start] * 2
    finally:
        llm.shutdown()


def _uneven_llama(folder: Path, vocab_size: int, num_kv_heads: int) -> Path:
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=num_kv_heads,
                         num_hidden_layers=2, max_position_embeddings=512,
                         initializer_range=0.1, attention_bias=True, tie_word_embeddings=False,
                         eos_token_id=2)
    with torch.random.fork_rng():
        torch.manual_seed(2)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("tp, num_kv_heads", [
    (2, 2),
    # Four processes on two cores: 20 s alone, a minute beside other work.
    pytest.param(4, 1, marks=pytest.mark.slow),  # each rank a copy of the one KV head
])
def test_a_vocabulary_the_ranks_do_not_divide_matches_tp1(
    tmp_path: Path, tp: int, num_kv_heads: int
) -> None:
    # 509 rows: the last rank's part of the embedding and the head is padded with zero rows,
    # which the gathered logits must drop (logprobs over the whole vocabulary show them).
    folder = str(_uneven_llama(tmp_path, 509, num_kv_heads))
    features = ("greedy_logprobs", "bias_allowed_bad_words")
    whole = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=509,
                           prompt_logprobs=509)
    outputs = {}
    for size in (1, tp):
        llm = LLM(folder, tensor_parallel_size=size, max_logprobs=509, **LIMITS)
        try:
            outputs[size] = [results(llm.generate(as_ids(PROMPTS), FEATURES[f], use_tqdm=False))
                             for f in features]
            outputs[size].append(results(llm.generate(as_ids(PROMPTS[:2]), whole,
                                                      use_tqdm=False)))
        finally:
            llm.shutdown()
    assert len(outputs[1][-1][0][0][0][4][0]) == 509
    assert_same(outputs[tp], outputs[1])
