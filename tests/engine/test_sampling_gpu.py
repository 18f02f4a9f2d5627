"""Sampling on a CUDA device: the same rules as on the CPU, and no allocation that warmup did
not measure, with every feature on at a full batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.engine.sampler import Sampler, SamplingMetadata
from kvfit.engine.sequence import Sequence

pytestmark = pytest.mark.gpu

VOCAB = 512


def everything(**overrides: object) -> SamplingParams:
    """A request with every sampling option on, as a chat client might send it."""
    kwargs = dict(
        n=2, temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, presence_penalty=0.3,
        frequency_penalty=0.2, repetition_penalty=1.1, logit_bias={t: 0.5 for t in range(64)},
        seed=3, min_tokens=4, stop_token_ids=[5, 6], bad_words_token_ids=[[9], [10, 11]],
        logprobs=20, prompt_logprobs=20, max_tokens=24, ignore_eos=True,
    )
    return SamplingParams(**{**kwargs, **overrides})


def test_gpu_processors_and_greedy_match_the_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    seqs = []
    for i in range(16):
        seq = Sequence(torch.randint(0, VOCAB, (40,), generator=g).tolist(),
                       everything(temperature=0.0))
        seq.token_ids += torch.randint(0, VOCAB, (i,), generator=g).tolist()
        seqs.append(seq)
    logits = torch.randn(16, VOCAB, generator=g) * 3
    results = []
    for device in ("cpu", "cuda"):
        meta = SamplingMetadata.from_seqs(seqs, VOCAB, device, [2])
        # On CUDA through the one-launch greedy argmax (scratch for the 16 rows).
        results.append(Sampler(device, max_num_seqs=16).__call__(logits.to(device), meta)
                       .to_lists(meta.num_logprobs))
    (cpu_ids, cpu_lps), (gpu_ids, gpu_lps) = results
    assert cpu_ids == gpu_ids
    for a, b in zip(cpu_lps, gpu_lps, strict=True):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_gpu_every_feature_at_a_full_batch_needs_no_more_than_sizing_kept(
    gpu_model: Path,
) -> None:
    llm = LLM(str(gpu_model), device="cuda", gpu_memory_utilization=0.05, max_num_seqs=64,
              max_model_len=1024, max_num_batched_tokens=1024)
    try:
        device = llm.config.device
        g = torch.Generator().manual_seed(1)
        prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (int(n),), generator=g).tolist()}
                   for n in torch.randint(8, 900, (48,), generator=g)]
        torch.cuda.synchronize(device)
        ready = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        outputs = llm.generate(prompts, everything(), use_tqdm=False)
        torch.cuda.synchronize(device)
        need = torch.cuda.max_memory_reserved(device) - ready
        report = llm.kv_cache_report
        assert all(len(o.outputs) == 2 and o.finished for o in outputs)
        assert need <= report.transient + report.margin, (need, report.transient)
        # The warmup's worst case is the true worst case: a real full batch needs no more than
        # the transient it measured (allocator rounding aside).
        assert need <= report.transient + (8 << 20), (need, report.transient)
    finally:
        llm.shutdown()


def test_gpu_sampling_memory_beyond_the_logits_is_entries_and_one_block() -> None:
    from kvfit.engine import sampler as sampler_module
    from kvfit.engine.sampling_features import WarmupLimits, worst_case_params
    from kvfit.ops.memwatch import watch_memory

    vocab, rows, context = 151936, 256, 1024
    params = worst_case_params(WarmupLimits(vocab, context, 20))
    distinct = list(range(context))
    seqs = [Sequence(distinct, params, num_prompt_tokens=1, sibling_index=i % 2)
            for i in range(rows)]
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    sampler = Sampler("cuda")
    meta = SamplingMetadata.from_seqs(seqs, vocab, "cuda", [2])
    sampler(logits, meta)  # compile
    entries = sum(len(p.index) for p in meta.processors)
    with watch_memory("cuda") as watch:
        sampler(logits, meta)
    # The processors' working copies, one log-sum-exp block (its float32 copy and the
    # temporaries of logsumexp and the rank count) and O(rows), besides two [N, V] terms: the
    # float32 copy of the bf16 logits that a step with bias or penalties samples (156 MiB
    # here; the worst case carries both) and allowed_token_ids' undo, the one dense processor
    # (`AllowedTokens`: its rows whole, in the copy's float32).
    assert any(isinstance(p, sampler_module.LogitBias) for p in meta.processors)
    allowed_rows = sum(seq.sampling_params.allowed_token_ids is not None for seq in seqs)
    bound = (40 * entries + 4 * sampler_module._LOGSUMEXP_BYTES + 64 * rows * 8
             + rows * vocab * 4 + allowed_rows * vocab * 4)
    assert watch.peak_bytes <= bound, (watch.peak_bytes, bound)


def test_gpu_greedy_batch_allocates_only_its_ids() -> None:
    """An all-greedy step of `max_num_seqs` rows takes the one-launch argmax, whose scratch
    the sampler allocated when it was built (before warmup measures memory): the step itself
    allocates the [N] int64 ids and nothing else, and they are torch's argmax's."""
    from kvfit.ops.memwatch import watch_memory

    vocab, rows = 151936, 256
    logits = torch.randn(rows, vocab, device="cuda").to(torch.bfloat16)
    sampler = Sampler("cuda", max_num_seqs=rows)
    assert sampler.argmax_scratch is not None and sampler.argmax_scratch.max_rows == rows
    seqs = [Sequence([1, 2, 3], SamplingParams(temperature=0.0)) for _ in range(rows)]
    meta = SamplingMetadata.from_seqs(seqs, vocab, "cuda")
    assert meta.all_greedy
    first = sampler(logits, meta).sampled_token_ids  # compile
    with watch_memory("cuda") as watch:
        ids = sampler(logits, meta).sampled_token_ids
    assert watch.peak_bytes <= 512 * -(-rows * 8 // 512), watch.peak_bytes  # one allocator block
    assert torch.equal(ids, first)
    assert torch.equal(ids, logits.argmax(dim=-1))
