"""A request's tokens and its place in the KV cache, as the scheduler and model runner see it."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import TYPE_CHECKING

import numpy as np

from kvfit.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvfit.connectors import KVConnectorMetadata

_seq_counter = itertools.count()

PENDING_TOKEN = -1
"""Stands for a sampled token whose value is still on the device: the engine schedules the next
step before the last one's tokens reach the host, and the model runner reads the value there."""


@dataclass
class Logprob:
    """One token's log-probability, its rank in the distribution (1 = most likely) and its
    text, as vLLM returns them."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


Logprobs = dict[int, Logprob]


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One request being generated.

    `num_computed_tokens` counts the tokens whose K/V are in the cache (prefix-cache hits
    included); the next step computes `token_ids[num_computed_tokens:num_computed_tokens + n]`.
    `block_table` lists the cache block ids holding the sequence, in order. The last token may
    be `PENDING_TOKEN` while the step that sampled it is in flight (`has_pending_token`).
    Completion `sibling_index` of a request with `n` > 1 shares its prompt with `parent` (the
    first one), which it waits for so that the prompt's full blocks become prefix-cache hits.
    """

    token_ids: list[int]
    sampling_params: SamplingParams
    request_id: str = ""
    prompt: str | None = None
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    sibling_index: int = 0
    parent: Sequence | None = None
    # Under the "priority" scheduling policy, lower runs first (vLLM's); ties go by seq_id,
    # the order of arrival.
    priority: int = 0
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    # The prompt tokens whose K/V came from a cache (the prefix cache or the KV connector)
    # when the sequence was first scheduled, as vLLM reports them; -1 until then. Kept across
    # preemption: hits on its own earlier blocks after one are no saving to report.
    num_cached_tokens: int = -1
    # When the scheduler queued it, first scheduled it, resolved its first sampled token and
    # finished it (time.monotonic(); 0.0 until then; a preemption changes none, so vLLM's
    # prefill, decode and inference times include it as its queue time does not).
    queued_time: float = 0.0
    scheduled_time: float = 0.0
    first_token_time: float = 0.0
    finished_time: float = 0.0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Filled by the model runner's sampler, one entry per generated token / prompt token.
    logprobs: list[Logprobs] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    output_text: str = ""
    # `token_counts` cache: distinct context tokens, their output counts, tokens consumed.
    _counts: tuple[np.ndarray, np.ndarray, int] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    def token_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """`(token_ids, output_counts)`: the distinct tokens of prompt and output (sorted,
        int64) and how often each occurs in the output (int32); a pending token is not counted.

        Kept up to date incrementally, so a step costs O(distinct tokens) in numpy, not a pass
        over the whole context in Python.
        """
        if self._counts is None:
            prompt = np.unique(np.asarray(self.prompt_token_ids, dtype=np.int64))
            self._counts = (prompt, np.zeros(len(prompt), np.int32), self.num_prompt_tokens)
        tokens, counts, seen = self._counts
        end = len(self) - self.has_pending_token
        if end > seen:
            new, times = np.unique(np.asarray(self.token_ids[seen:end], dtype=np.int64),
                                   return_counts=True)
            at = np.searchsorted(tokens, new)
            unseen = (at == len(tokens)) | (tokens[np.minimum(at, len(tokens) - 1)] != new)
            if unseen.any():  # a decode step usually brings none, so no O(distinct) copy
                tokens = np.insert(tokens, at[unseen], new[unseen])
                counts = np.insert(counts, at[unseen], 0)
                at = np.searchsorted(tokens, new)
            counts[at] += times
            self._counts = (tokens, counts, end)
        return tokens, counts

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def has_pending_token(self) -> bool:
        return self.token_ids[-1] == PENDING_TOKEN

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def resolve_pending_token(self, token_id: int) -> None:
        """Put the sampled value in place of the `PENDING_TOKEN` the sequence ends with."""
        if not self.has_pending_token:
            raise RuntimeError(f"sequence {self.seq_id} has no pending token to resolve")
        self.token_ids[-1] = token_id


@dataclass
class ScheduledBatch:
    """One engine step: which sequences run and how many new tokens each computes.

    For sequence i the step computes `seqs[i].token_ids[start:start + num_new_tokens[i]]`
    with `start = seqs[i].num_computed_tokens` (not yet advanced). A sequence is sampled iff
    the chunk reaches its last token (`start + n == len(seq)`); an earlier prefill chunk is not.
    Block tables already cover `start + n` tokens when the batch is handed out.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    # The KV connector's loads and saves for this step (`KVConnectorMetadata`), if any.
    kv_connector_meta: KVConnectorMetadata | None = None

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


@dataclass
class ModelOutput:
    """What the model runner returns for a `ScheduledBatch`, aligned with its `seqs`.

    `sampled_token_ids[i]` is None when sequence i ran a non-final prefill chunk.
    `logprobs[i]` maps token id -> `Logprob` (top-n plus the sampled token) when requested.
    `prompt_logprobs[i]` holds prompt-logprob entries (None for the first prompt token) from
    prompt token `prompt_logprobs_first[i]` on (None: from the first one not yet recorded);
    entries already in `seq.prompt_logprobs` are skipped when applied.
    """

    sampled_token_ids: list[int | None]
    logprobs: list[Logprobs | None]
    prompt_logprobs: list[list[Logprobs | None] | None]
    prompt_logprobs_first: list[int] | None = None
