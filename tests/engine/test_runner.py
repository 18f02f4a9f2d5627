"""ModelRunner: input preparation from a ScheduledBatch, warmup dummy runs, cache binding."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvfit.engine.config import EngineArgs
from kvfit.engine.model_runner import ModelRunner
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import PENDING_TOKEN, ScheduledBatch, Sequence

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def runner() -> Iterator[ModelRunner]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model on a shared machine: threads only spin
    config = EngineArgs(
        model="kvfit-tiny", device="cpu", block_size=BLOCK_SIZE, max_model_len=64,
        max_num_batched_tokens=32,
    ).create_engine_config()
    runner = ModelRunner(config)
    runner.initialize_kv_cache(64, extensible=True)
    yield runner
    torch.set_num_threads(threads)


def seq(num_tokens: int, num_computed: int, block_table: list[int], **params: object) -> Sequence:
    s = Sequence(list(range(100, 100 + num_tokens)), SamplingParams(**params))
    s.num_computed_tokens = num_computed
    s.block_table = block_table
    return s


def test_prepare_inputs_packs_a_mixed_batch(runner: ModelRunner) -> None:
    prefill = seq(6, 0, [7, 3])  # whole prompt, crosses a block border
    chunk = seq(10, 2, [5, 9])  # a middle chunk: tokens 2..6, not sampled
    decode = seq(9, 8, [2, 4, 8])  # one new token at position 8 (block 2, offset 0)
    batch = ScheduledBatch([prefill, chunk, decode], [6, 5, 1])
    input_ids, positions, md, logits_indices = runner.prepare_inputs(batch)
    assert input_ids.tolist() == [*range(100, 106), *range(102, 107), 108]
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 6, 8]
    b = BLOCK_SIZE
    assert md.slot_mapping.tolist() == [
        7 * b, 7 * b + 1, 7 * b + 2, 7 * b + 3, 3 * b, 3 * b + 1,
        5 * b + 2, 5 * b + 3, 9 * b, 9 * b + 1, 9 * b + 2,
        8 * b,
    ]
    assert md.query_start_loc.tolist() == [0, 6, 11, 12]
    assert md.seq_lens.tolist() == [6, 7, 9]
    assert md.block_table.tolist() == [[7, 3, 0], [5, 9, 0], [2, 4, 8]]
    assert (md.max_query_len, md.max_seq_len) == (6, 9)
    assert logits_indices.tolist() == [5, 11]  # the chunk is not sampled
    # One packed copy, viewed back with each input's dtype.
    assert input_ids.dtype == positions.dtype == md.slot_mapping.dtype == torch.int64
    assert md.query_start_loc.dtype == md.seq_lens.dtype == md.block_table.dtype == torch.int32


def test_prepare_inputs_reads_pending_tokens_from_the_last_sampled_ids(
    runner: ModelRunner,
) -> None:
    waiting, decoding = seq(5, 4, [1, 2]), seq(7, 6, [3, 4])
    decoding.token_ids[-1] = PENDING_TOKEN  # sampled by a step whose output is not back yet
    runner._last_sampled = (torch.tensor([41, 42]), {decoding.seq_id: 1, waiting.seq_id: 0})
    input_ids, *_ = runner.prepare_inputs(ScheduledBatch([waiting, decoding], [1, 1]))
    assert input_ids.tolist() == [104, 42]
    runner._last_sampled = (torch.tensor([41]), {waiting.seq_id: 0})
    with pytest.raises(RuntimeError, match="pending token"):
        runner.prepare_inputs(ScheduledBatch([decoding], [1]))


def test_a_decode_step_of_the_last_steps_batch_reads_its_sampled_ids_as_they_lie(
    runner: ModelRunner,
) -> None:
    """Every row pending, in the order the last step sampled them (the last step's first rows
    when others have finished): the inputs are those ids without a gather; in any other order
    each row still reads its own sequence's id."""
    a, b, c = seq(5, 4, [1, 2]), seq(7, 6, [3, 4]), seq(3, 2, [5])
    for s in (a, b, c):
        s.token_ids[-1] = PENDING_TOKEN
    sampled = torch.tensor([41, 42, 43])
    runner._last_sampled = (sampled, {a.seq_id: 0, b.seq_id: 1, c.seq_id: 2})
    input_ids, *_ = runner.prepare_inputs(ScheduledBatch([a, b], [1, 1]))
    assert input_ids.tolist() == [41, 42]
    assert input_ids.data_ptr() == sampled.data_ptr()
    input_ids, *_ = runner.prepare_inputs(ScheduledBatch([c, a], [1, 1]))
    assert input_ids.tolist() == [43, 41]
    input_ids, *_ = runner.prepare_inputs(ScheduledBatch([b, c], [1, 1]))
    assert input_ids.tolist() == [42, 43]


def test_execute_samples_only_sequences_whose_chunk_ends(runner: ModelRunner) -> None:
    runner.ensure_blocks(8)
    first = seq(7, 0, [0, 1], temperature=0.0)
    second = seq(7, 0, [2, 3], temperature=0.0)
    out = runner.execute(ScheduledBatch([first, second], [7, 3]))
    assert isinstance(out.sampled_token_ids[0], int)
    assert out.sampled_token_ids[1] is None
    # The second sequence's next chunk continues from its cached prefix; greedy agrees with a
    # single pass over the whole prompt (same tokens, other blocks).
    second.num_computed_tokens = 3
    rest = runner.execute(ScheduledBatch([second], [4]))
    assert rest.sampled_token_ids == [out.sampled_token_ids[0]]


def test_prompt_logprobs_across_chunks_have_one_entry_per_prompt_token(
    runner: ModelRunner,
) -> None:
    runner.ensure_blocks(8)
    params = dict(temperature=0.0, prompt_logprobs=1)
    whole = seq(7, 0, [0, 1], **params)
    [entries] = runner.execute(ScheduledBatch([whole], [7])).prompt_logprobs
    chunked = seq(7, 0, [2, 3], **params)
    recorded: list = []
    for n in (3, 4):
        chunked.prompt_logprobs = recorded
        [part] = runner.execute(ScheduledBatch([chunked], [n])).prompt_logprobs
        recorded = recorded + part
        chunked.num_computed_tokens += n
    assert len(entries) == len(recorded) == 7
    assert entries[0] is None and recorded[0] is None
    for a, b in zip(entries[1:], recorded[1:], strict=True):
        assert a.keys() == b.keys()
        assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
        assert all(a[t].rank == b[t].rank for t in a)
    # A recomputed (preempted) sequence that has them all gets no duplicates.
    chunked.num_computed_tokens, chunked.prompt_logprobs = 0, recorded
    assert runner.execute(ScheduledBatch([chunked], [7])).prompt_logprobs == [None]


def test_prompt_logprobs_say_where_they_start_when_the_record_lags(runner: ModelRunner) -> None:
    # The engine launches a chunk before the previous chunk's entries are recorded.
    runner.ensure_blocks(8)
    params = dict(temperature=0.0, prompt_logprobs=1)
    [entries] = runner.execute(ScheduledBatch([seq(7, 0, [0, 1], **params)], [7])).prompt_logprobs
    lagging = seq(7, 0, [2, 3], **params)
    first_part = runner.execute(ScheduledBatch([lagging], [3]))
    lagging.num_computed_tokens = 3  # nothing recorded yet
    second_part = runner.execute(ScheduledBatch([lagging], [4]))
    assert first_part.prompt_logprobs_first == [0] and second_part.prompt_logprobs_first == [4]
    [part] = second_part.prompt_logprobs
    assert [e.keys() for e in part] == [e.keys() for e in entries[4:]]


def test_dummy_run_addresses_only_blocks_below_the_bound(runner: ModelRunner) -> None:
    cache = runner.kv_cache
    runner.commit_blocks(1)
    seen: list = []
    original = runner.prepare_inputs

    def spy(batch: ScheduledBatch) -> tuple:
        inputs = original(batch)
        seen.append(inputs[2])
        return inputs

    runner.prepare_inputs = spy  # type: ignore[method-assign]
    try:
        # The prefill chunk ends a max_model_len - 1 context of many blocks; the bound allows 3.
        runner.dummy_run(32, 3, num_decodes=5)
        runner.dummy_run(32, 1, num_decodes=5)
    finally:
        del runner.prepare_inputs
    wide, narrow = seen
    assert cache.committed_blocks == 3  # warmup commits the prefix it addresses
    assert int(wide.slot_mapping.max()) < 3 * BLOCK_SIZE
    assert int(narrow.slot_mapping.max()) < BLOCK_SIZE  # ids wrap at the bound
    assert len(wide.slot_mapping) == 32
    # Decodes attend over max_model_len (the decode kernel's most splits) within those blocks.
    assert wide.seq_lens[:5].tolist() == [runner.max_model_len] * 5
    assert int(wide.block_table.max()) < 3


def test_commit_grows_and_shrinks_in_place(runner: ModelRunner) -> None:
    address = runner.kv_cache.layer_views()[0][0].data_ptr()
    runner.commit_blocks(40)
    runner.commit_blocks(10)
    assert runner.num_blocks == 10
    assert runner.kv_cache.layer_views()[0][0].data_ptr() == address
    out = runner.execute(ScheduledBatch([seq(5, 0, [9, 8], temperature=0.0)], [5]))
    assert isinstance(out.sampled_token_ids[0], int)
