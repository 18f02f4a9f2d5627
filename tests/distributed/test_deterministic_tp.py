"""The deterministic mode under tensor parallelism on the CPU (gloo): the row-parallel sums
are all-gathered and added in rank order, and a request's tokens and logprobs stay the same
alone, in a batch and at another position, with the tokens one rank gives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 42, 9], [7, 8], list(range(20, 57))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def run(llm: LLM, prompts: list[list[int]]) -> list[tuple]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def test_tp2_deterministic_is_batch_invariant(tiny_model: Callable[[str], Path]) -> None:
    settings = dict(device="cpu", max_model_len=128, max_num_seqs=4,
                    max_num_batched_tokens=128, deterministic=True)
    one = LLM(str(tiny_model("qwen3")), **settings)
    try:
        expected = run(one, PROMPTS)
    finally:
        one.shutdown()
    llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2, **settings)
    try:
        alone = [run(llm, [p])[0] for p in PROMPTS]
        assert run(llm, PROMPTS) == alone
        assert run(llm, PROMPTS[::-1]) == alone[::-1]
        # One rank's GEMM sums in another order than two ranks' halves: tokens agree,
        # logprobs within float32 rounding.
        assert [tokens for tokens, _ in alone] == [tokens for tokens, _ in expected]
        for (_, got), (_, want) in zip(alone, expected, strict=True):
            assert [{t: lp.logprob for t, lp in e.items()} for e in got] == [
                {t: pytest.approx(lp.logprob, abs=1e-4) for t, lp in e.items()} for e in want]
    finally:
        llm.shutdown()
