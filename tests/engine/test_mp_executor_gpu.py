"""The multiprocess executor on a CUDA device: one rank in its own process gives what the
in-process worker gives (the same kernels, graphs and sampling, across a pipe)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def test_mp_at_tp1_matches_in_process(gpu_model: Path) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
               for n in (1, 7, 33, 100, 200)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=24,
                             ignore_eos=True, frequency_penalty=0.3, prompt_logprobs=2)]
    results = {}
    for backend in ("uni", "mp"):
        llm = LLM(str(gpu_model), device="cuda", gpu_memory_utilization=0.05,
                  distributed_executor_backend=backend)
        try:
            assert llm.kv_cache_report.method == "measured"
            results[backend] = [llm.generate(prompts, p, use_tqdm=False) for p in params]
        finally:
            llm.shutdown()
    for uni, mp in zip(results["uni"], results["mp"], strict=True):
        for a, b in zip(uni, mp, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [],
                            strict=True):
                assert x.keys() == y.keys()
                assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 for t in x)
