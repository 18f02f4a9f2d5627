"""`deterministic=True` end to end on the CPU: one request's token ids and logprobs are bit for
bit the same alone, in a batch of 255 others, at another position, after a prefix-cache hit,
after a preemption and across chunk borders, in float32 and bfloat16; and the same harness
finds differences in the default mode, so it can fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.engine.outputs import RequestOutput

PROMPT = torch.randint(3, 512, (45,), generator=torch.Generator().manual_seed(7)).tolist()


def others(count: int, seed: int = 1) -> list[list[int]]:
    """`count` prompts of 3 to 80 tokens, none sharing PROMPT's first block."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 80, (count,), generator=g).tolist()
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def params(sampled: bool) -> SamplingParams:
    """Greedy, or seeded sampling at a temperature; logprobs and prompt logprobs either way."""
    return SamplingParams(temperature=0.8 if sampled else 0.0, seed=11 if sampled else None,
                          max_tokens=10, ignore_eos=True, logprobs=4, prompt_logprobs=3)


def fingerprint(out: RequestOutput) -> tuple:
    """Token ids and every logprob entry (id, value, rank), exactly."""
    def entries(dicts: list | None) -> list | None:
        return None if dicts is None else [
            None if d is None else sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
            for d in dicts]

    completion = out.outputs[0]
    return completion.token_ids, entries(completion.logprobs), entries(out.prompt_logprobs)


def generate(llm: LLM, prompts: list[list[int]], sp: SamplingParams) -> list[tuple]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [fingerprint(o) for o in outs]


def make_llm(folder: Path, dtype: str, deterministic: bool = True, device: str = "cpu",
             **kwargs: object) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 1024)
    kwargs.setdefault("max_num_batched_tokens", 512)
    return LLM(str(folder), device=device, dtype=dtype, deterministic=deterministic, **kwargs)


def cases(folder: Path, dtype: str, sampled: bool, deterministic: bool = True,
          device: str = "cpu", **engine_kwargs: object) -> dict[str, tuple]:
    """PROMPT's fingerprint in each case of the issue, by case name; `engine_kwargs` go to
    every engine made."""
    sp = params(sampled)
    llm = make_llm(folder, dtype, deterministic, device, **engine_kwargs)
    crowd = others(255)
    found = {"alone": generate(llm, [PROMPT], sp)[0]}
    found["in a batch of 255"] = generate(llm, [*crowd[:100], PROMPT, *crowd[100:]], sp)[100]
    found["first of the batch"] = generate(llm, [PROMPT, *crowd[::-1]], sp)[0]
    # A prompt sharing PROMPT's first two blocks fills the prefix cache; PROMPT then hits it.
    # (Prompt logprobs are computed for every token, so that request takes no cache hit.)
    generate(llm, [PROMPT[:32] + [5, 6, 7]], params(False))
    cached = SamplingParams(temperature=sp.temperature, seed=sp.seed, max_tokens=10,
                            ignore_eos=True, logprobs=4)
    seen = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda seq: (seen.append(seq), add(seq))[1]
    found["after a prefix-cache hit"] = generate(llm, [PROMPT], cached)[0][:2]
    assert seen[0].num_cached_tokens >= 32, "the prefix cache was not hit"
    llm.engine.add_request = add
    found["alone, no prompt logprobs"] = generate(llm, [PROMPT], cached)[0][:2]
    llm.shutdown()
    # 12 blocks of 16 tokens cannot hold six sequences of up to 80 tokens: some are preempted.
    small = make_llm(folder, dtype, deterministic, device, **{
        **engine_kwargs, "num_gpu_blocks_override": 12, "max_model_len": 128,
        "enable_prefix_caching": False})
    found["after a preemption"] = generate(small, [*others(5, seed=2), PROMPT], sp)[-1]
    assert small.engine.scheduler.num_preemptions > 0
    small.shutdown()
    chunked = make_llm(folder, dtype, deterministic, device,
                       **{**engine_kwargs, "max_num_batched_tokens": 16})
    found["in chunks of 16"] = generate(chunked, [others(1, seed=3)[0], PROMPT], sp)[-1]
    chunked.shutdown()
    return found


def assert_all_alike(found: dict[str, tuple]) -> None:
    """Every case's fingerprint equals the alone one (the prefix-cache hit: the alone one
    without prompt logprobs, which that request cannot have)."""
    found = dict(found)
    alone = found.pop("alone")
    assert found.pop("after a prefix-cache hit") == found.pop("alone, no prompt logprobs")
    for case, fingerprint_ in found.items():
        assert fingerprint_ == alone, case


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_one_request_is_bit_identical_in_every_case(qwen3: Path, dtype: str,
                                                   sampled: bool) -> None:
    assert_all_alike(cases(qwen3, dtype, sampled))


def test_llama_is_bit_identical_in_every_case(tiny_model) -> None:  # noqa: ANN001
    # q/k/v biases (added after the tiled GEMM), Llama 3 rope scaling, no q/k norms.
    assert_all_alike(cases(tiny_model("llama"), "float32", sampled=False))


def test_an_fp8_kv_cache_is_bit_identical_in_every_case(qwen3: Path) -> None:
    # The CPU attention of the mode refused an e4m3 cache at the first step (GPU took it).
    assert_all_alike(cases(qwen3, "bfloat16", sampled=True, kv_cache_dtype="fp8"))


def test_the_default_mode_differs_so_the_harness_can_fail(qwen3: Path) -> None:
    with pytest.raises(AssertionError):
        assert_all_alike(cases(qwen3, "float32", sampled=False, deterministic=False))


# The GPU: the Triton kernels of the mode, CUDA graphs against eager steps.
GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


@pytest.mark.gpu
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_gpu_bit_identical_in_every_case_graphed_and_eager(gpu_model: Path,
                                                           sampled: bool) -> None:
    graphed = cases(gpu_model, "bfloat16", sampled, device="cuda", cuda_graph_sizes=GRAPH_SIZES)
    eager = cases(gpu_model, "bfloat16", sampled, device="cuda", enforce_eager=True)
    assert_all_alike(graphed)
    assert graphed == eager


@pytest.mark.gpu
def test_gpu_piecewise_graphs_keep_the_mode(gpu_model: Path) -> None:
    """Prefill and mixed steps replayed piecewise (where the engine has `cudagraph_mode`): the
    pieces were captured in the mode, and a padded bucket changes no row."""
    from kvfit.engine.config import EngineArgs

    if "cudagraph_mode" not in EngineArgs.__dataclass_fields__:
        pytest.skip("this engine has no piecewise graphs (cudagraph_mode)")
    piecewise = cases(gpu_model, "bfloat16", False, device="cuda", cuda_graph_sizes=GRAPH_SIZES,
                      cudagraph_mode="FULL_AND_PIECEWISE")
    assert_all_alike(piecewise)
    assert piecewise == cases(gpu_model, "bfloat16", False, device="cuda", enforce_eager=True)


@pytest.mark.gpu
def test_gpu_default_mode_differs_so_the_harness_can_fail(gpu_model: Path) -> None:
    with pytest.raises(AssertionError):
        assert_all_alike(cases(gpu_model, "bfloat16", False, deterministic=False,
                               device="cuda", cuda_graph_sizes=GRAPH_SIZES))


def test_batch_invariant_is_the_same_switch() -> None:
    import argparse

    from kvfit.engine.config import EngineArgs

    assert EngineArgs(batch_invariant=True).create_engine_config().deterministic
    assert EngineArgs(deterministic=True).create_engine_config().deterministic
    assert not EngineArgs().create_engine_config().deterministic
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flags, expected in (([], False), (["--deterministic"], True),
                            (["--batch-invariant"], True)):
        args = EngineArgs.from_cli_args(parser.parse_args(flags))
        assert args.create_engine_config().deterministic is expected


@pytest.mark.gpu
def test_gpu_warm_deterministic_engine_compiles_no_kernel_for_new_shapes(gpu_model: Path) -> None:
    """The mode's kernels specialise on nothing that moves with the batch (M, block-table
    width), or serving would stall on a compile whenever a batch takes a new shape."""
    from kvfit.ops.compiles import triton_compiles

    sp = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
    llm = make_llm(gpu_model, "bfloat16", device="cuda", cuda_graph_sizes=GRAPH_SIZES)
    try:
        generate(llm, others(8, seed=4), sp)
        with triton_compiles() as compiled:
            generate(llm, others(37, seed=5), sp)
        assert compiled == []
    finally:
        llm.shutdown()
