"""The multiprocess executor's step deltas: a worker's mirrors rebuild what the runner reads
from each scheduled sequence, step after step, through pending tokens and preemption."""

from __future__ import annotations

import pickle

from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import PENDING_TOKEN, ScheduledBatch, Sequence
from kvfit.engine.step_input import StepDecoder, StepEncoder


def seen_by_runner(seq: Sequence) -> tuple:
    return (seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.num_computed_tokens,
            seq.block_table, seq.sibling_index, seq.sampling_params,
            len(seq.prompt_logprobs), seq.num_output_tokens, tuple(map(list, seq.token_counts())))


def roundtrip(encoder: StepEncoder, decoder: StepDecoder, batch: ScheduledBatch) -> int:
    step = pickle.loads(pickle.dumps(encoder.encode(batch)))  # as the pipe carries it
    mirrored = decoder.decode(step)
    assert mirrored.num_new_tokens == batch.num_new_tokens
    assert [seen_by_runner(s) for s in mirrored.seqs] == [seen_by_runner(s) for s in batch.seqs]
    return len(pickle.dumps(step))


def test_mirrors_follow_prefill_decode_pending_tokens_and_preemption() -> None:
    encoder, decoder = StepEncoder(), StepDecoder()
    params = SamplingParams(prompt_logprobs=1, presence_penalty=0.5)
    a = Sequence([i % 500 for i in range(1000)], params)
    b = Sequence([7] * 5, SamplingParams(), sibling_index=1)
    a.block_table, b.block_table = list(range(3, 66)), [9]
    first = roundtrip(encoder, decoder, ScheduledBatch([a, b], [992, 5]))
    # Next step: a's last chunk, b decodes a token still on the device.
    a.num_computed_tokens, b.num_computed_tokens = 992, 5
    a.prompt_logprobs = [None] * 992
    b.append_token(PENDING_TOKEN)
    roundtrip(encoder, decoder, ScheduledBatch([a, b], [8, 1]))
    # The pending token resolved on the host and a new one pending: both reach the mirror.
    b.resolve_pending_token(11)
    b.append_token(PENDING_TOKEN)
    b.num_computed_tokens, a.num_computed_tokens = 6, 1000
    a.append_token(13)
    b.block_table.append(10)
    decode = roundtrip(encoder, decoder, ScheduledBatch([a, b], [1, 1]))
    assert decode < first / 4  # a decode step carries deltas, not the prompt and table
    # Preempted: the table is freed (a new list) and the sequence recomputed from scratch.
    b.resolve_pending_token(12)
    b.block_table, b.num_computed_tokens = [1, 2], 0
    roundtrip(encoder, decoder, ScheduledBatch([b], [len(b)]))


def test_finished_sequences_leave_the_mirrors() -> None:
    encoder, decoder = StepEncoder(), StepDecoder()
    a, b = Sequence([1, 2], SamplingParams()), Sequence([3], SamplingParams())
    roundtrip(encoder, decoder, ScheduledBatch([a, b], [2, 1]))
    a.status = a.status.FINISHED
    b.num_computed_tokens = 1
    b.append_token(4)
    roundtrip(encoder, decoder, ScheduledBatch([b], [1]))
    assert set(decoder.mirrors) == {b.seq_id}
