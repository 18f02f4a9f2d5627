"""`kv_cache_layout`: every layout gives the default layout's greedy outputs, with the
segments the layout implies."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(3, 60))}, {"prompt_token_ids": list(range(3, 40))}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def run(model: Path, layout: str) -> tuple[list[list[int]], int]:
    llm = LLM(str(model), device="cpu", max_num_seqs=4, max_model_len=128,
              kv_cache_layout=layout)
    try:
        # Twice each: the second pair hits the first's blocks in the prefix cache.
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False)]
        return out, llm.engine.executor.workers[0].runner.kv_cache.tensor.num_segments
    finally:
        llm.shutdown()


@pytest.mark.parametrize("layout, segments", [("layer_outer", 2), ("head_major", 2 * 2 * 2)])
def test_layouts_give_the_default_outputs(qwen3, layout, segments) -> None:
    reference, one = run(qwen3, "block_outer")
    assert one == 1
    assert run(qwen3, layout) == (reference, segments)


def test_an_unknown_layout_names_the_setting(qwen3) -> None:
    with pytest.raises(ValueError, match="kv_cache_layout must be one of"):
        LLM(str(qwen3), device="cpu", kv_cache_layout="slot_outer")
