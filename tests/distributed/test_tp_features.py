"""Tensor parallelism on the CPU (gloo) against one rank, feature by feature: on the same
weights in float32, TP=2 must give the tokens TP=1 gives (and logprobs within float32
rounding: the ranks' partial sums add in another order)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams

HERE = Path(__file__).parent
LIMITS = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128)
PROMPTS = [[5, 17, 300, 42, 9], [7, 8], list(range(20, 57)), list(range(100, 160))]
TOL = 1e-4  # float32 logprobs summed in another order


@pytest.fixture(autouse=True)
def hooks_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Spawned workers get this process's sys.path: they can import `tp_hooks`."""
    monkeypatch.syspath_prepend(str(HERE))
    yield


def run(llm: LLM, params: SamplingParams,
        prompts: list[list[int]] = PROMPTS) -> list[tuple[list[int], list[float]]]:
    """Per prompt: its first sequence's tokens, and each prompt token's logprob (teacher
    forced, where `params` asks for them)."""
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [entry[token].logprob for entry, token in zip(o.prompt_logprobs[1:],
                                                           o.prompt_token_ids[1:], strict=True)]
             if o.prompt_logprobs else [])
            for o in outputs]


def assert_same(two: list, one: list) -> None:
    assert [tokens for tokens, _ in two] == [tokens for tokens, _ in one]
    for (_, a), (_, b) in zip(two, one, strict=True):
        assert a == pytest.approx(b, abs=TOL)


def test_calculated_fp8_scales_are_the_layers_on_every_rank(
    tiny_model: Callable[[str], Path]
) -> None:
    # Each rank projects only its KV heads; a layer's scale is the amax over all of them (what
    # one rank computes), or the ranks quantize the same K/V differently than TP=1 does.
    folder = str(tiny_model("qwen3"))
    settings = dict(kv_cache_dtype="fp8", calculate_kv_scales=True, **LIMITS)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    one = LLM(folder, **settings)
    try:
        expected = run(one, params)
        scales = one.engine.executor.workers[0].runner.kv_scales()
    finally:
        one.shutdown()
    two = LLM(folder, tensor_parallel_size=2, worker_init_fn="tp_hooks:probes", **settings)
    try:
        assert_same(run(two, params), expected)
        for rank_scales in two.engine.executor.collective_rpc("probe_kv_scales"):
            assert rank_scales == [pytest.approx(s, rel=1e-5) for s in scales]
    finally:
        two.shutdown()
