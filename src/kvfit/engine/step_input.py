"""A step's inputs as the multiprocess executor sends them: what changed since the last step.

Workers in other processes keep a mirror of every sequence they have run. A sequence's
prompt and sampling parameters cross once; afterwards a step carries, per scheduled sequence,
only the tokens its mirror lacks, its computed count and the block ids appended to its table
(the whole table after a preemption freed it). Sending whole `Sequence`s would pickle every
token, block id and logprob of every running sequence at every step.

Cost (bounded by `bench/throughput.py --distributed-executor-backend uni mp`): a few Python
operations per scheduled sequence on each side, and the new tokens and block ids as bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfit.connectors import KVConnectorMetadata
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import PENDING_TOKEN, ScheduledBatch, Sequence


@dataclass(frozen=True)
class NewSequence:
    """What a worker needs once about a sequence it has not seen."""

    params: SamplingParams
    num_prompt_tokens: int
    sibling_index: int


@dataclass(frozen=True)
class StepInput:
    """One step for the workers, column by column (lists of ints pickle in C; an object per
    sequence would cost more than the step's host work). Per scheduled sequence: its id, new
    tokens this step, computed count, its tokens from `token_starts` on (replacing the
    mirror's from there: a token sent while pending is sent again once known), and its block
    ids from `block_starts` on (0: the whole table, after a preemption freed it). `new`: the
    sequences the workers have not seen; `num_prompt_logprobs`: entries recorded so far of
    those that ask; `finished`: sequences to drop from the mirrors; `kv_connector_meta`: the
    KV connector's loads and saves for the worker side, which runs in the worker's process."""

    seq_ids: list[int]
    num_new_tokens: list[int]
    num_computed_tokens: list[int]
    token_starts: list[int]
    tokens: list[list[int]]
    block_starts: list[int]
    blocks: list[list[int]]
    new: dict[int, NewSequence]
    num_prompt_logprobs: dict[int, int]
    finished: list[int]
    kv_connector_meta: KVConnectorMetadata | None = None


class StepEncoder:
    """The engine's side: remembers what the workers' mirrors hold."""

    def __init__(self) -> None:
        # seq_id -> (sequence, tokens the mirror holds resolved, its block table list, blocks sent)
        self._sent: dict[int, tuple[Sequence, int, list[int], int]] = {}

    def encode(self, batch: ScheduledBatch) -> StepInput:
        step = StepInput([], list(batch.num_new_tokens), [], [], [], [], [], {}, {}, [],
                         batch.kv_connector_meta)
        sent = self._sent
        for seq in batch.seqs:
            sid, tokens, table = seq.seq_id, seq.token_ids, seq.block_table
            known = sent.get(sid)
            if known is None:
                step.new[sid] = NewSequence(seq.sampling_params, seq.num_prompt_tokens,
                                            seq.sibling_index)
                token_start = block_start = 0
            else:
                token_start = known[1]
                # The scheduler only appends to a table, or replaces it with a new list on free.
                block_start = known[3] if known[2] is table else 0
            sent[sid] = (seq, len(tokens) - (tokens[-1] == PENDING_TOKEN), table, len(table))
            step.seq_ids.append(sid)
            step.num_computed_tokens.append(seq.num_computed_tokens)
            step.token_starts.append(token_start)
            step.tokens.append(tokens[token_start:])
            step.block_starts.append(block_start)
            step.blocks.append(table[block_start:])
            if seq.sampling_params.prompt_logprobs is not None:
                step.num_prompt_logprobs[sid] = len(seq.prompt_logprobs)
        if len(sent) > len(batch.seqs):
            scheduled = set(step.seq_ids)
            step.finished.extend(sid for sid, (seq, *_) in sent.items()
                                 if seq.is_finished and sid not in scheduled)
            for sid in step.finished:
                del sent[sid]
        return step


class StepDecoder:
    """A worker's side: applies each step to its mirrors and rebuilds the batch."""

    def __init__(self) -> None:
        self.mirrors: dict[int, Sequence] = {}

    def decode(self, step: StepInput) -> ScheduledBatch:
        mirrors = self.mirrors
        for sid in step.finished:
            mirrors.pop(sid, None)
        seqs = []
        for sid, computed, token_start, tokens, block_start, blocks in zip(
                step.seq_ids, step.num_computed_tokens, step.token_starts, step.tokens,
                step.block_starts, step.blocks, strict=True):
            new = step.new.get(sid)
            if new is not None:
                seq = mirrors[sid] = Sequence(tokens, new.params, seq_id=sid,
                                              num_prompt_tokens=new.num_prompt_tokens,
                                              sibling_index=new.sibling_index)
            else:
                seq = mirrors[sid]
                seq.token_ids[token_start:] = tokens
            seq.num_computed_tokens = computed
            seq.block_table[block_start:] = blocks
            seqs.append(seq)
        for sid, n in step.num_prompt_logprobs.items():
            mirrors[sid].prompt_logprobs = [None] * n  # the runner reads only how many
        return ScheduledBatch(seqs, step.num_new_tokens, kv_connector_meta=step.kv_connector_meta)
