"""Warmup's steps allocate at least what any real step does: each real step of an adversarial
request mix is measured (every torch storage a step creates, `watch_memory`) against the
largest profiling or warmup step of the same engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.ops.memwatch import watch_memory

from .conftest import StepPeaks, one_layer_qwen3


@pytest.fixture(scope="module")
def wide_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Qwen3 whose vocabulary dwarfs its hidden size, as real models' do (152k
    over 1-4k): logits, not activations, set a step's peak."""
    return one_layer_qwen3(tmp_path_factory.mktemp("wide-vocab"), 8192)


@pytest.fixture(scope="module")
def narrow_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with a 512-token vocabulary: attention, not logits, sets a step's peak."""
    return one_layer_qwen3(tmp_path_factory.mktemp("narrow-vocab"), 512)




def prompt(n: int, offset: int = 0) -> dict[str, list[int]]:
    return {"prompt_token_ids": [3 + (offset + i) % 500 for i in range(n)]}


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_a_middle_prompt_logprobs_chunk_is_no_larger_than_warmup(
    wide_vocab: Path, peaks: StepPeaks, max_num_seqs: int
) -> None:
    # With max_num_batched_tokens under PROMPT_LOGPROBS_CHUNK, a prompt's middle chunk scores
    # one prompt logprob per token: one row more than a chunk that ends its prompt.
    llm = LLM(str(wide_vocab), device="cpu", max_num_seqs=max_num_seqs,
              max_num_batched_tokens=128, max_model_len=1024)
    try:
        peaks.started = True
        llm.generate([prompt(900)], SamplingParams(temperature=0, max_tokens=1,
                                                   prompt_logprobs=20), use_tqdm=False)
    finally:
        llm.shutdown()
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (worst, peaks.warmup)


def test_a_whole_prompt_logprobs_chunk_after_another_prompts_is_no_larger_than_warmup(
    wide_vocab: Path, peaks: StepPeaks, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A step's prompt logprobs stay in device memory (on the CPU) until it ends, so its peak is
    # a whole chunk's logits made after every other row's results. Warmup's prefill of the
    # budget cut its one prompt into a whole chunk, then the short rest: a real step of a short
    # prompt and then a whole chunk of a long one held more (46 MB more at 1500 tokens of an
    # 8k vocabulary and the chunk of 1024). The same at a chunk of 64.
    from kvfit.engine import sampler

    monkeypatch.setattr(sampler, "PROMPT_LOGPROBS_CHUNK", 64)
    llm = LLM(str(wide_vocab), device="cpu", max_num_seqs=2, max_num_batched_tokens=100,
              max_model_len=256, max_logprobs=-1)
    try:
        peaks.started = True
        # 37 tokens (36 scored), then 63 of the long prompt's (63 scored): one step.
        llm.generate([prompt(37), prompt(200, 100)],
                     SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=-1),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    assert [37, 63] in [tokens for _, tokens in peaks.real]
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (worst, peaks.warmup)



def test_logprobs_of_some_rows_take_no_more_memory_than_of_every_row() -> None:
    # Warmup asks logprobs of every row; a real batch may ask them of some rows only, whose
    # blocks are then gathered copies of the logits.
    from kvfit.engine.sampler import Sampler

    logits = torch.randn(64, 8192)
    token_ids = torch.zeros(64, dtype=torch.int64)

    def peak(num_logprobs: list[int | None]) -> int:
        with watch_memory("cpu") as watch:
            Sampler._with_logprobs(logits, token_ids, num_logprobs)
        return watch.peak_bytes

    assert peak([5] * 63 + [None]) <= peak([5] * 64)


def test_many_chunks_behind_a_cached_prefix_are_no_larger_than_warmup(
    narrow_vocab: Path, peaks: StepPeaks
) -> None:
    # Requests sharing a long cached prefix (a system prompt) compute only their short tails,
    # all in one step at the longest context: many equal-length chunks, none of which warmup
    # ran together.
    llm = LLM(str(narrow_vocab), device="cpu", max_num_seqs=32, max_num_batched_tokens=512,
              max_model_len=2048)
    try:
        peaks.started = True
        shared = prompt(2032)["prompt_token_ids"]
        greedy = SamplingParams(temperature=0, max_tokens=1)
        llm.generate([{"prompt_token_ids": shared + [5]}], greedy, use_tqdm=False)
        tails = [{"prompt_token_ids": shared + [3 + i] * 15} for i in range(32)]
        llm.generate(tails, greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    assert any(len(tokens) == 32 for _, tokens in peaks.real)  # one step ran every tail
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (worst, peaks.warmup)


def test_a_whole_prefill_that_ends_its_prompt_is_no_larger_than_warmup(
    narrow_vocab: Path, peaks: StepPeaks
) -> None:
    # The profiling step's prefills (the token budget as chunks of max_model_len - 1) sample
    # no row; a real step of the same chunks ends its prompts, and its inputs held one logits
    # index more per row sampled (16 bytes over, at the peak of the forward).
    llm = LLM(str(narrow_vocab), device="cpu", max_num_seqs=8, max_num_batched_tokens=2048,
              max_model_len=2048, enable_prefix_caching=False)
    try:
        peaks.started = True
        llm.generate([prompt(2047), prompt(2032, 7)],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [2047, 1] in [tokens for _, tokens in peaks.real]
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (worst, peaks.warmup)


def test_warmup_launches_every_small_batch_kernel_a_decode_launches(
    narrow_vocab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under `small_batch_kernels` a one-token step runs kernels no larger step does: the norms
    and the SiLU inside the linear layers after them (`FUSED_MAX_ROWS`), and the LM head's
    skinny product for the few rows sampled. Warmup ran a 16-token prefill (the plain skinny
    product, no logits) and steps sampling more than 16 rows, so a GPU compiled the fused
    variants and the LM head's at the first real decode (seconds of latency, and module memory
    sizing never saw). On the CPU the switch's ops are the torch compositions; these tensors
    stand in for CUDA ones, and each (op, weight shape, prologue) is a compiled variant."""
    from kvfit.models import parallel_layers
    from kvfit.ops import small_batch

    launched: set[tuple] = set()

    def recorded(name: str, weight_at: int) -> None:
        fn = getattr(parallel_layers, name)

        def spy(*args, **kwargs):  # noqa: ANN202
            with_residual = name == "rms_norm_linear" and args[1] is not None
            launched.add((name, tuple(args[weight_at].shape), with_residual))
            return fn(*args, **kwargs)

        monkeypatch.setattr(parallel_layers, name, spy)

    recorded("skinny_linear", 1)
    recorded("rms_norm_linear", 4)
    recorded("silu_and_mul_linear", 1)
    monkeypatch.setattr(parallel_layers, "takes_skinny_path", lambda x: (
        small_batch.is_small_batch_enabled() and 0 < x.shape[0] <= small_batch.MAX_ROWS))
    monkeypatch.setattr(parallel_layers, "fuses_prologue", lambda x: (
        small_batch.is_small_batch_enabled() and 0 < x.shape[0] <= small_batch.FUSED_MAX_ROWS))
    llm = LLM(str(narrow_vocab), device="cpu", small_batch_kernels=True, max_num_seqs=32,
              max_model_len=256)
    try:
        warm = set(launched)
        greedy = SamplingParams(temperature=0, max_tokens=4)
        llm.generate([prompt(5)], greedy, use_tqdm=False)  # decodes of one token
        llm.generate([prompt(5), prompt(7, 50)], greedy, use_tqdm=False)
    finally:
        llm.shutdown()
    assert {name for name, _, _ in launched} == {"skinny_linear", "rms_norm_linear",
                                                 "silu_and_mul_linear"}
    assert launched <= warm, sorted(launched - warm)


def test_warmup_runs_the_fused_decode_input(narrow_vocab: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `fused_decode_input` only a step of decodes alone runs `decode_attention`, which
    warmup's mixed steps are not: warmup runs one, so a GPU compiles the fused kernel at
    startup rather than at a user's first decode (on the CPU the op is the unfused pair; the
    call stands in for the launch)."""
    from kvfit.models import llama

    calls: list[int] = []
    real = llama.decode_attention
    monkeypatch.setattr(llama, "decode_attention",
                        lambda *args, **kwargs: (calls.append(args[1].shape[0]),
                                                 real(*args, **kwargs))[1])
    llm = LLM(str(narrow_vocab), device="cpu", fused_decode_input=True, max_num_seqs=32,
              small_batch_kernels=False, max_model_len=256)
    llm.shutdown()
    assert calls and set(calls) == {1}  # one decode row, in every layer


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"])
def test_warmup_samples_in_the_engines_logprobs_mode(
    narrow_vocab: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The processed modes score a float32 copy of each filtered, tempered block of rows
    (`processed_block`): warmup's sampling step, every row asking max_logprobs with every
    filter and a temperature, must run it, so its memory is measured."""
    from kvfit.engine import sampler

    steps: list[tuple[str, int, int]] = []  # (mode, rows, rows asking logprobs)
    blocks: list[tuple[int, bool, bool]] = []  # (rows, filtered, tempered)
    call, block = sampler.Sampler.__call__, sampler.processed_block

    def sample(self: sampler.Sampler, logits: torch.Tensor, meta: object) -> object:
        steps.append((self.logprobs_mode, logits.shape[0],
                      sum(n is not None for n in meta.num_logprobs)))
        return call(self, logits, meta)

    def processed(part: torch.Tensor, rows: slice, divisor: object,
                  thresholds: object) -> torch.Tensor:
        blocks.append((part.shape[0], thresholds is not None, divisor is not None))
        return block(part, rows, divisor, thresholds)

    monkeypatch.setattr(sampler.Sampler, "__call__", sample)
    monkeypatch.setattr(sampler, "processed_block", processed)
    LLM(str(narrow_vocab), device="cpu", max_num_seqs=8, max_model_len=256,
        logprobs_mode=mode).shutdown()
    assert (mode, 8, 8) in steps
    if mode.startswith("processed"):
        assert (8, True, True) in blocks
    else:
        assert not blocks


@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logits"])
def test_steps_in_other_logprobs_modes_are_no_larger_than_warmup(
    wide_vocab: Path, peaks: StepPeaks, mode: str
) -> None:
    # Some rows greedy, some filtered, some without logprobs: no step outgrows warmup's.
    llm = LLM(str(wide_vocab), device="cpu", max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=256, logprobs_mode=mode)
    try:
        peaks.started = True
        params = [SamplingParams(temperature=0, max_tokens=4, logprobs=20),
                  SamplingParams(temperature=0.9, top_k=5, max_tokens=4, logprobs=3),
                  SamplingParams(temperature=0.9, top_p=0.5, max_tokens=4),
                  SamplingParams(temperature=0, max_tokens=4, logit_bias={5: 2.0},
                                 logprobs=0)] * 2
        llm.generate([prompt(20, i) for i in range(8)], params, use_tqdm=False)
    finally:
        llm.shutdown()
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (worst, peaks.warmup)


def test_a_deterministic_step_off_the_row_tile_is_no_larger_than_warmup(
    narrow_vocab: Path, peaks: StepPeaks
) -> None:
    # The deterministic mode's CPU GEMMs run in 16-row tiles; a step of any other token count
    # than a multiple padded a copy of each layer's input (237 KB over warmup's steps of the
    # whole budget, 1024 tokens, at these 1020).
    llm = LLM(str(narrow_vocab), device="cpu", max_num_seqs=4, max_model_len=256,
              deterministic=True, enable_prefix_caching=False)
    try:
        peaks.started = True
        llm.generate([prompt(255, 60 * i) for i in range(4)],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        llm.shutdown()
    assert [255] * 4 in [tokens for _, tokens in peaks.real]
    worst = max(peaks.real)
    assert worst[0] <= max(peaks.warmup), (worst, peaks.warmup)
