"""`kv_cache_dtype="fp8"` on a CUDA device: twice the blocks under measured sizing, graphs that
replay what eager computes (also with scales calculated after capture), transformers' top-5 at
the first divergence, and no kernel compiled by a warm engine.

PYTHONPATH=src python3 -m pytest -m gpu tests/engine/test_kv_cache_dtype_gpu.py -q
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.ops.compiles import triton_compiles

pytestmark = pytest.mark.gpu

MAX_TOKENS = 24
UTILIZATION = 0.05  # a small share keeps the block manager small for a tiny model
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def prompts() -> list[dict[str, list[int]]]:
    g = torch.Generator().manual_seed(0)
    return [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
            for n in (1, 7, 16, 33, 64, 100, 150, 200)]


@pytest.fixture
def make_llm(gpu_model: Path) -> Iterator:
    made: list[LLM] = []

    def make(**kwargs: object) -> LLM:
        llm = LLM(str(gpu_model), **{"device": "cuda", "gpu_memory_utilization": UTILIZATION,
                                     "kv_cache_dtype": "fp8", **kwargs})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def test_gpu_measured_sizing_gives_fp8_at_least_1_9x_the_blocks_of_bf16() -> None:
    """The 0.6B shape on the whole device (measured sizing's defaults), one engine at a time."""
    blocks = {}
    for dtype in ("auto", "fp8"):
        llm = LLM("qwen3-0.6b-shape", device="cuda", kv_cache_dtype=dtype, enforce_eager=True,
                  max_num_seqs=16, max_model_len=2048)
        report = llm.kv_cache_report
        assert report.method == "measured" and report.num_blocks < report.max_blocks
        blocks[dtype] = (report.num_blocks, report.block_bytes, report.dtype)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    (bf16, bf16_bytes, bf16_name), (fp8, fp8_bytes, fp8_name) = blocks["auto"], blocks["fp8"]
    assert (bf16_name, fp8_name) == ("bfloat16", "float8_e4m3fn")
    assert bf16_bytes == 2 * fp8_bytes
    assert fp8 >= 1.9 * bf16, blocks


@pytest.mark.parametrize("calculate", [False, True])
def test_gpu_fp8_graphs_replay_what_eager_computes(make_llm, calculate: bool) -> None:
    """With calculate_kv_scales the graphs are captured before the first step sets the scales:
    they must read the values set later, as eager does."""
    eager = make_llm(enforce_eager=True, calculate_kv_scales=calculate)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts(), GREEDY, use_tqdm=False)]
    eager_scales = eager.engine.executor.workers[0].runner.kv_scales()
    eager.shutdown()
    graphed = make_llm(cuda_graph_sizes=[1, 2, 4, 8], calculate_kv_scales=calculate)
    runner = graphed.engine.executor.workers[0].runner
    assert runner.graphs is not None
    got = [o.outputs[0].token_ids for o in graphed.generate(prompts(), GREEDY, use_tqdm=False)]
    assert runner.kv_scales() == eager_scales
    assert (eager_scales[0] != (1.0, 1.0)) == calculate
    assert got == expected


def test_gpu_fp8_first_divergence_is_within_transformers_top5(gpu_model: Path, make_llm) -> None:
    from transformers import AutoModelForCausalLM

    llm = make_llm(enforce_eager=True)
    outputs = llm.generate(prompts(), GREEDY, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(gpu_model, dtype=torch.bfloat16).cuda().eval()
    for prompt, out in zip(prompts(), outputs, strict=True):
        ids = list(prompt["prompt_token_ids"])
        completion = out.outputs[0]
        for i, token in enumerate(completion.token_ids):
            with torch.no_grad():
                logits = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float()
            hf_token = int(logits.argmax())
            if hf_token != token:
                assert token in logits.topk(5).indices.tolist(), f"step {i}"
                assert hf_token in completion.logprobs[i], f"step {i}"
                break
            ids.append(token)


def test_gpu_a_warm_fp8_engine_compiles_no_kernel(make_llm) -> None:
    llm = make_llm(calculate_kv_scales=True)
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate(prompts(), params, use_tqdm=False)
    g = torch.Generator().manual_seed(1)
    lengths = (2, 5, 9, 17, 31, 47, 80, 129, 255)
    other = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
             for n in lengths]
    with triton_compiles() as compiled:
        llm.generate(other, params, use_tqdm=False)
    assert compiled == []
