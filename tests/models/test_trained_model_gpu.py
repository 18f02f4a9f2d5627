"""kvfit-sotu on a CUDA device in bf16 (CUDA graphs on) against transformers in bf16 from the
same files: each first divergent greedy token is in the other side's top-5, and most greedy
continuations do not diverge at all (a trained model's logits are peaked, so bf16 noise rarely
flips its top-1)."""

from __future__ import annotations

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.models.loader import BUILTIN_DIR

pytestmark = pytest.mark.gpu

PROMPTS = ("The people of the United States", "Congress has passed a law to",
           "The capital of France is", "Our economy", "In the coming year, we will",
           "The Secretary of the Treasury reports that", "Hello, my name is",
           "War and peace")
MAX_TOKENS = 32


def test_bf16_greedy_matches_transformers_within_top5() -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM("kvfit-sotu", device="cuda", gpu_memory_utilization=0.05)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                logprobs=5)
        outputs = llm.generate(list(PROMPTS), params, use_tqdm=False)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(BUILTIN_DIR / "kvfit-sotu",
                                              dtype=torch.bfloat16).cuda().eval()
    identical = 0
    for out in outputs:
        ids, completion = list(out.prompt_token_ids), out.outputs[0]
        for i, token in enumerate(completion.token_ids):
            with torch.no_grad():
                logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            if int(logits.argmax()) != token:
                assert token in logits.topk(5).indices.tolist(), f"{out.prompt!r} step {i}"
                assert int(logits.argmax()) in completion.logprobs[i], f"{out.prompt!r} step {i}"
                break
            ids.append(token)
        else:
            identical += 1
    assert identical >= len(PROMPTS) // 2
