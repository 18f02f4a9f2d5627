"""Piecewise graphs on the CPU: the model's pieces with attention between them are its forward;
the runner pads steps to buckets without storing padded rows; the engine's steps through it
give the eager tokens. (The CPU has no CUDA graphs: `replay` runs each piece eagerly, through
the same buffers and padding the GPU replays; `test_piecewise_gpu.py` captures for real.)"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvfit import LLM, SamplingParams
from kvfit.engine.config import EngineArgs
from kvfit.engine.model_runner import ModelRunner
from kvfit.engine.sequence import ScheduledBatch, Sequence
from kvfit.graphs.buckets import default_buckets
from kvfit.graphs.piecewise import PiecewiseGraphRunner

BLOCK_SIZE = 4


def eager_replay(fn: Callable[[], None], pool: object) -> Callable[[], None]:
    """Stands in for `capture_graph` on the CPU: the piece itself is its replay."""
    fn()
    return fn


@pytest.fixture(scope="module")
def runner(qwen3: Path) -> Iterator[ModelRunner]:
    config = EngineArgs(model=str(qwen3), device="cpu", block_size=BLOCK_SIZE, max_model_len=64,
                        max_num_batched_tokens=64).create_engine_config()
    runner = ModelRunner(config)
    runner.initialize_kv_cache(64, extensible=True)
    runner.ensure_blocks(64)
    yield runner
    runner.shutdown()


def seq(num_tokens: int, num_computed: int, first_block: int) -> Sequence:
    s = Sequence([(7 * i + first_block) % 500 + 3 for i in range(num_tokens)],
                 SamplingParams(temperature=0.0, max_tokens=1))
    s.num_computed_tokens = num_computed
    s.block_table = list(range(first_block, first_block + -(-num_tokens // BLOCK_SIZE)))
    return s


def mixed_batch(first_block: int, prefill: int) -> ScheduledBatch:
    """A prompt of `prefill` tokens, a chunk after a 6-token prefix, and a decode."""
    seqs = [seq(prefill, 0, first_block), seq(11, 6, first_block + 16), seq(9, 8, first_block + 20)]
    return ScheduledBatch(seqs, [prefill, 5, 1])


@torch.inference_mode()  # as the runner's launch runs the model
def test_pieces_with_attention_between_them_are_the_forward(runner: ModelRunner) -> None:
    input_ids, positions, metadata, _ = runner.prepare_inputs(mixed_batch(0, 17))
    expected = runner.model(input_ids, positions, metadata)
    model, x, residual = runner.model, input_ids, None
    assert model.num_pieces == runner.config.model_config.num_layers + 1
    for i in range(model.num_pieces):
        x, residual = model.piece(i, x, residual, positions, metadata.slot_mapping)
        if residual is not None:
            x = model.attend(i, x, metadata)
    assert residual is None and torch.equal(x, expected)


def kv_caches(runner: ModelRunner) -> list[torch.Tensor]:
    return [t for layer in runner.model.model.layers
            for t in (layer.self_attn.k_cache, layer.self_attn.v_cache)]


@torch.inference_mode()
def test_padded_steps_equal_eager_and_store_only_their_own_tokens(runner: ModelRunner) -> None:
    pw = PiecewiseGraphRunner(runner.model, [16, 32, 64], runner.device, capture=eager_replay)
    pw.capture()
    assert sorted(pw.replays) == [16, 32, 64] and pw.num_capture_passes == 1
    # A 40-token step (bucket 64) leaves its slots in the buffer's rows 23..39 ...
    large = runner.prepare_inputs(mixed_batch(24, 34))
    pw.run(*large[:3])
    for cache in kv_caches(runner):
        cache.zero_()
    # ... then a 23-token step pads to 32: its padded rows 23..31 must store nothing.
    input_ids, positions, metadata, _ = runner.prepare_inputs(mixed_batch(0, 17))
    hidden = pw.run(input_ids, positions, metadata)
    stored = [cache.flatten(0, 1).abs().sum((1, 2)).nonzero().flatten().tolist()
              for cache in kv_caches(runner)]
    assert all(s == sorted(metadata.slot_mapping.tolist()) for s in stored)
    expected = runner.model(input_ids, positions, metadata)  # same K/V stored again
    assert hidden.shape == expected.shape == (23, expected.shape[1])
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        pw.run(torch.zeros(65, dtype=torch.int64), torch.zeros(65, dtype=torch.int64),
               metadata)


def test_engine_steps_through_piecewise_pieces_give_the_eager_tokens(qwen3: Path) -> None:
    llm = LLM(str(qwen3), device="cpu", max_model_len=128, max_num_batched_tokens=48,
              cudagraph_mode="full_and_piecewise")
    runner = llm.engine.executor.workers[0].runner
    assert runner.piecewise is None  # the CPU is always eager: no capture
    assert llm.config.cudagraph_mode == "FULL_AND_PIECEWISE"
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=g).tolist()}
               for n in (5, 30, 61, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.reset_prefix_cache()
    pw = PiecewiseGraphRunner(runner.model, default_buckets(48), runner.device,
                              capture=eager_replay)
    pw.capture()
    steps: list[int] = []
    run = pw.run

    def counting_run(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        steps.append(input_ids.shape[0])
        return run(input_ids, *args)

    pw.run = counting_run  # type: ignore[method-assign]
    runner.piecewise = pw
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert max(steps) == 48 and len(steps) >= 8  # full prefill steps, then decodes
    llm.shutdown()


@pytest.mark.parametrize(("mode", "decode", "piecewise"), [
    ("NONE", False, False), ("PIECEWISE", False, True), ("FULL_DECODE_ONLY", True, False),
    ("FULL_AND_PIECEWISE", True, True)])
def test_cudagraph_mode_picks_the_runners_which_share_one_pool(
        qwen3: Path, monkeypatch: pytest.MonkeyPatch, mode: str, decode: bool,
        piecewise: bool) -> None:
    """The capture pass as on a GPU, with the CUDA calls replaced (the CPU has no graphs)."""
    import kvfit.engine.model_runner as model_runner
    from kvfit.engine.cuda_graph import CUDAGraphRunner
    from kvfit.graphs import piecewise as piecewise_module

    pool = object()
    monkeypatch.setattr(model_runner.torch.cuda, "graph_pool_handle", lambda: pool)
    monkeypatch.setattr(piecewise_module, "capture_graph", eager_replay)
    monkeypatch.setattr(CUDAGraphRunner, "capture", lambda self: None)
    config = EngineArgs(model=str(qwen3), device="cpu", block_size=BLOCK_SIZE, max_model_len=64,
                        max_num_batched_tokens=64, max_num_seqs=8,
                        cudagraph_mode=mode).create_engine_config()
    config.enforce_eager = False  # as on a GPU
    r = ModelRunner(config)
    r.initialize_kv_cache(64, extensible=True)
    r.capture_cuda_graphs()
    assert (r.graphs is not None) == decode and (r.piecewise is not None) == piecewise
    if piecewise:
        assert r.piecewise.buckets == default_buckets(64) and r.piecewise.pool is pool
        assert r.piecewise.num_capture_passes == 1
    if decode:
        assert r.graphs.pool is pool
    r.drop_cuda_graphs()
    assert r.graphs is None and r.piecewise is None
    r.shutdown()


def test_piecewise_capture_runs_the_small_batch_kernels_under_the_switch(
        qwen3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph replays the kernels chosen while it was captured: with `small_batch_kernels`
    the 16-token bucket's pieces must be captured with the switch on (the skinny products),
    and without it never, whatever the caller's state. Nothing else checked this: greedy
    tokens are the same either way, so graphs captured outside the switch only lose speed."""
    import kvfit.engine.model_runner as model_runner
    from kvfit.engine.cuda_graph import CUDAGraphRunner
    from kvfit.graphs import piecewise as piecewise_module
    from kvfit.models import parallel_layers
    from kvfit.ops import small_batch

    monkeypatch.setattr(model_runner.torch.cuda, "graph_pool_handle", object)
    monkeypatch.setattr(piecewise_module, "capture_graph", eager_replay)
    monkeypatch.setattr(CUDAGraphRunner, "capture", lambda self: None)
    # The CPU tensors stand in for CUDA ones: the row bound decides.
    monkeypatch.setattr(parallel_layers, "takes_skinny_path", lambda x: (
        small_batch.is_small_batch_enabled() and 0 < x.shape[0] <= small_batch.MAX_ROWS))
    skinny_rows: list[int] = []
    skinny_linear = parallel_layers.skinny_linear

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        skinny_rows.append(x.shape[0])
        return skinny_linear(x, *args)

    monkeypatch.setattr(parallel_layers, "skinny_linear", spy)
    for enabled in (True, False):
        config = EngineArgs(model=str(qwen3), device="cpu", block_size=BLOCK_SIZE,
                            max_model_len=64, max_num_batched_tokens=64,
                            cudagraph_mode="PIECEWISE",
                            small_batch_kernels=enabled).create_engine_config()
        config.enforce_eager = False  # as on a GPU
        r = ModelRunner(config)
        r.initialize_kv_cache(64, extensible=True)
        skinny_rows.clear()
        with small_batch.small_batch_kernels(not enabled):  # the caller's state is no guide
            r.capture_cuda_graphs()
        r.shutdown()
        assert bool(skinny_rows) == enabled and set(skinny_rows) <= {16}, (enabled, skinny_rows)
