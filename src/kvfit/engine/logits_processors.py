"""Sparse, in-place, undoable changes to a step's logits: penalties, logit bias, bans, and
allowed tokens.

Each processor but `AllowedTokens` touches only the entries its rows name (E of them), so its
device memory is O(E), never an `[N, V]` temporary: a flat int64 index per entry plus a few
values. `apply`
returns an `Undo` holding the entries' original values, so that after sampling the sampler puts
the raw logits back for logprobs (vLLM's default: logprobs of the raw distribution).
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import numpy as np
import torch

from kvfit.engine.sequence import Sequence
from kvfit.engine.transfer import to_device


@dataclass
class Undo:
    """The original values at `index` (flat positions of the logits)."""

    index: torch.Tensor
    values: torch.Tensor

    def restore(self, logits: torch.Tensor) -> None:
        logits.view(-1).index_put_((self.index,), self.values)


@dataclass
class RowsUndo:
    """The original `rows` of the logits, whole."""

    rows: torch.Tensor
    values: torch.Tensor

    def restore(self, logits: torch.Tensor) -> None:
        logits.index_copy_(0, self.rows, self.values)


class AllowedTokens:
    """Rows limited to their `allowed_token_ids`: every other token set to -inf. Its undo is
    the only dense one: the R rows that set it, whole (R x V in the logits' dtype), plus 8
    bytes per allowed entry."""

    def __init__(self, rows: torch.Tensor, index: torch.Tensor) -> None:
        self.rows, self.index = rows, index

    @classmethod
    def from_seqs(cls, seqs: SequenceOf[Sequence], vocab_size: int,
                  device: torch.device) -> AllowedTokens | None:
        parts = [(row, seq.sampling_params.allowed_token_ids) for row, seq in enumerate(seqs)
                 if seq.sampling_params.allowed_token_ids is not None]
        if not parts:
            return None
        index = np.concatenate([row * vocab_size + np.asarray(ids, np.int64)
                                for row, ids in parts])
        rows = np.array([row for row, _ in parts], np.int64)
        return cls(to_device(torch.from_numpy(rows), device),
                   to_device(torch.from_numpy(index), device))

    def apply(self, logits: torch.Tensor) -> RowsUndo:
        original = logits.index_select(0, self.rows)
        flat = logits.view(-1)
        allowed = flat[self.index]
        logits.index_fill_(0, self.rows, float("-inf"))
        flat.index_put_((self.index,), allowed)
        return RowsUndo(self.rows, original)


class Penalties:
    """Repetition, presence and frequency penalties on each row's distinct context tokens.

    Entries are the distinct tokens of prompt and output (E <= rows x min(context, V)), each
    with its count in the output. Device memory: 20 bytes per entry held for the step (int64
    index and row, int32 count) and at most 40 more while `apply` runs (the original values, a
    float32 working copy and its temporaries); 23 measured on the CPU.
    """

    def __init__(self, index: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor,
                 penalties: torch.Tensor) -> None:
        self.index, self.rows, self.counts = index, rows, counts
        self.penalties = penalties  # [N, 3]: repetition, presence, frequency

    @classmethod
    def from_seqs(cls, seqs: SequenceOf[Sequence], vocab_size: int,
                  device: torch.device) -> Penalties | None:
        penalized = [(row, seq) for row, seq in enumerate(seqs)
                     if seq.sampling_params.has_penalties]
        if not penalized:
            return None
        tokens, counts = zip(*(seq.token_counts() for _, seq in penalized), strict=True)
        rows = np.repeat(np.array([row for row, _ in penalized], np.int64),
                         [len(t) for t in tokens])
        penalties = torch.tensor(
            [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
             for p in (seq.sampling_params for seq in seqs)], dtype=torch.float32)
        index = rows * vocab_size + np.concatenate(tokens)
        return cls(*(to_device(torch.from_numpy(a), device)
                     for a in (index, rows, np.concatenate(counts))),
                   to_device(penalties, device))

    def apply(self, logits: torch.Tensor) -> Undo:
        flat = logits.view(-1)
        original = flat[self.index]
        repetition, presence, frequency = self.penalties.unbind(dim=1)
        x = original.to(torch.float32, copy=True)  # `original` is kept for the undo
        # vLLM's (and CTRL's) rule: divide positive logits, multiply negative ones.
        rep = repetition[self.rows]
        x.mul_(torch.where(x > 0, rep.reciprocal(), rep))
        counts = self.counts.float()
        x.sub_(frequency[self.rows] * counts).sub_(presence[self.rows] * (counts > 0))
        flat.index_put_((self.index,), x.to(logits.dtype))
        return Undo(self.index, original)


class LogitBias:
    """`logit_bias` added at its token ids (E <= rows x MAX_TOKEN_LIST entries)."""

    def __init__(self, index: torch.Tensor, bias: torch.Tensor) -> None:
        self.index, self.bias = index, bias

    @classmethod
    def from_seqs(cls, seqs: SequenceOf[Sequence], vocab_size: int,
                  device: torch.device) -> LogitBias | None:
        parts = [(row, *seq.sampling_params.logit_bias_arrays) for row, seq in enumerate(seqs)
                 if seq.sampling_params.logit_bias]
        if not parts:
            return None
        index = np.concatenate([row * vocab_size + ids for row, ids, _ in parts])
        bias = np.concatenate([values for _, _, values in parts])
        return cls(to_device(torch.from_numpy(index), device),
                   to_device(torch.from_numpy(bias), device))

    def apply(self, logits: torch.Tensor) -> Undo:
        flat = logits.view(-1)
        original = flat[self.index]
        flat.index_put_((self.index,), (original.float() + self.bias).to(logits.dtype))
        return Undo(self.index, original)


class BannedTokens:
    """Token ids set to -inf: below `min_tokens` the stop ids (and EOS unless `ignore_eos`);
    always the bad words that the output is about to complete (E <= rows x (2 x
    MAX_TOKEN_LIST + EOS ids))."""

    def __init__(self, index: torch.Tensor) -> None:
        self.index = index

    @classmethod
    def from_seqs(cls, seqs: SequenceOf[Sequence], vocab_size: int, device: torch.device,
                  eos_token_ids: Iterable[int] = ()) -> BannedTokens | None:
        eos = set(eos_token_ids)
        parts = []
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            if p.bad_words_token_ids or seq.num_output_tokens < p.min_tokens:
                banned = banned_token_ids(seq, eos)
                parts.append(row * vocab_size + np.fromiter(banned, np.int64, len(banned)))
        index = np.concatenate(parts) if parts else np.empty(0, np.int64)
        if not len(index):
            return None
        return cls(to_device(torch.from_numpy(index), device))

    def apply(self, logits: torch.Tensor) -> Undo:
        flat = logits.view(-1)
        original = flat[self.index]
        flat.index_fill_(0, self.index, float("-inf"))
        return Undo(self.index, original)


def banned_token_ids(seq: Sequence, eos_token_ids: set[int]) -> set[int]:
    """The tokens `seq` must not sample next."""
    p = seq.sampling_params
    banned = set(p.single_token_bad_words)
    if seq.num_output_tokens < p.min_tokens:
        banned.update(p.stop_token_ids)
        if not p.ignore_eos:
            banned.update(eos_token_ids)
    n = seq.num_output_tokens
    for word in p.multi_token_bad_words:
        k = len(word) - 1
        if k <= n and seq.token_ids[len(seq) - k:] == word[:-1]:
            banned.add(word[-1])
    return banned
