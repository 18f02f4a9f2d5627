"""A step's inputs as the multiprocess executor sends them: what changed since the last step.

Workers in other processes keep a mirror of every sequence they have run. A sequence's
prompt and sampling parameters cross once; afterwards a step carries, per scheduled sequence,
only the tokens its mirror lacks, its computed count and the block ids appended to its table
(the whole table after a preemption freed it). Sending whole `Sequence`s would pickle every
token, block id and logprob of every running sequence at every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import PENDING_TOKEN, ScheduledBatch, Sequence


@dataclass(frozen=True)
class NewSequence:
    """What a worker needs once about a sequence it has not seen."""

    params: SamplingParams
    num_prompt_tokens: int
    sibling_index: int


@dataclass(frozen=True)
class SequenceDelta:
    """One scheduled sequence: its tokens from `token_start` on (replacing the mirror's from
    there: a token sent while pending is sent again once known), its computed count, and its
    block ids from `block_start` on (0: the whole table), plus the prompt-logprob entries
    recorded so far (-1: none asked)."""

    seq_id: int
    new: NewSequence | None
    token_start: int
    tokens: list[int]
    num_computed_tokens: int
    block_start: int
    blocks: list[int]
    num_prompt_logprobs: int


@dataclass(frozen=True)
class StepInput:
    """One step for the workers: the scheduled sequences' deltas, their new-token counts, and
    the sequences finished since the last step (dropped from the mirrors)."""

    deltas: list[SequenceDelta]
    num_new_tokens: list[int]
    finished: list[int]


class StepEncoder:
    """The engine's side: remembers what the workers' mirrors hold."""

    def __init__(self) -> None:
        # seq_id -> (sequence, tokens the mirror holds resolved, its block table list, blocks sent)
        self._sent: dict[int, tuple[Sequence, int, list[int], int]] = {}

    def encode(self, batch: ScheduledBatch) -> StepInput:
        deltas = [self._delta(seq) for seq in batch.seqs]
        scheduled = {seq.seq_id for seq in batch.seqs}
        finished = [sid for sid, (seq, *_) in self._sent.items()
                    if seq.is_finished and sid not in scheduled]
        for sid in finished:
            del self._sent[sid]
        return StepInput(deltas, list(batch.num_new_tokens), finished)

    def _delta(self, seq: Sequence) -> SequenceDelta:
        sent = self._sent.get(seq.seq_id)
        new = None
        if sent is None:
            new = NewSequence(seq.sampling_params, seq.num_prompt_tokens, seq.sibling_index)
            token_start, table, block_start = 0, None, 0
        else:
            _, token_start, table, num_blocks = sent
            # The scheduler only appends to a table, or replaces it with a new list on free.
            block_start = num_blocks if table is seq.block_table else 0
        resolved = len(seq) - (seq.token_ids[-1] == PENDING_TOKEN)
        self._sent[seq.seq_id] = (seq, resolved, seq.block_table, len(seq.block_table))
        num_prompt_logprobs = (-1 if seq.sampling_params.prompt_logprobs is None
                               else len(seq.prompt_logprobs))
        return SequenceDelta(seq.seq_id, new, token_start, seq.token_ids[token_start:],
                             seq.num_computed_tokens, block_start, seq.block_table[block_start:],
                             num_prompt_logprobs)


class StepDecoder:
    """A worker's side: applies each step's deltas to its mirrors and rebuilds the batch."""

    def __init__(self) -> None:
        self.mirrors: dict[int, Sequence] = {}

    def decode(self, step: StepInput) -> ScheduledBatch:
        for sid in step.finished:
            self.mirrors.pop(sid, None)
        return ScheduledBatch([self._apply(d) for d in step.deltas], step.num_new_tokens)

    def _apply(self, d: SequenceDelta) -> Sequence:
        if d.new is not None:
            seq = self.mirrors[d.seq_id] = Sequence(
                d.tokens, d.new.params, seq_id=d.seq_id,
                num_prompt_tokens=d.new.num_prompt_tokens, sibling_index=d.new.sibling_index)
        else:
            seq = self.mirrors[d.seq_id]
            seq.token_ids[d.token_start:] = d.tokens
        seq.num_computed_tokens = d.num_computed_tokens
        seq.block_table[d.block_start:] = d.blocks
        if d.num_prompt_logprobs >= 0:
            # The runner reads only how many are recorded.
            seq.prompt_logprobs = [None] * d.num_prompt_logprobs
        return seq
