"""The deterministic mode under tensor parallelism on the CPU (gloo): the row-parallel sums
are all-gathered and added in rank order, and a request's tokens and logprobs stay the same
alone, in a batch and at another position."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvfit import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 42, 9], [7, 8], list(range(20, 57))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


def test_tp2_deterministic_is_batch_invariant(tiny_model: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model("qwen3")), device="cpu", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=128, tensor_parallel_size=2, deterministic=True)
    try:
        def run(prompts: list[list[int]]) -> list[tuple]:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS,
                                   use_tqdm=False)
            return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]

        alone = [run([p])[0] for p in PROMPTS]
        assert run(PROMPTS) == alone
        assert run(PROMPTS[::-1]) == alone[::-1]
    finally:
        llm.shutdown()
