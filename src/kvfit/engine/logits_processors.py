"""Sparse, in-place, undoable changes to a step's logits: penalties, logit bias, bans.

Each processor touches only the entries its rows name (E of them), so its device memory is
O(E), never an `[N, V]` temporary: a flat int64 index per entry plus a few values. `apply`
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


def _flat(rows: np.ndarray, token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    return rows.astype(np.int64) * vocab_size + token_ids


class Penalties:
    """Repetition, presence and frequency penalties on each row's distinct context tokens.

    Entries are the distinct tokens of prompt and output (E <= rows x min(context, V)), each
    with its count in the output. Device memory: about 40 bytes per entry (index, row and count,
    the original values, a float32 working copy and two float32 temporaries).
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
        parts = [(row, *seq.token_counts()) for row, seq in penalized]
        rows = np.concatenate([np.full(len(t), row, np.int32) for row, t, _ in parts])
        tokens = np.concatenate([t for _, t, _ in parts])
        counts = np.concatenate([c for _, _, c in parts])
        penalties = torch.tensor(
            [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
             for p in (seq.sampling_params for seq in seqs)], dtype=torch.float32)
        return cls(to_device(torch.from_numpy(_flat(rows, tokens, vocab_size)), device),
                   to_device(torch.from_numpy(rows).long(), device),
                   to_device(torch.from_numpy(counts), device), to_device(penalties, device))

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
        index, bias = [], []
        for row, seq in enumerate(seqs):
            for token_id, value in (seq.sampling_params.logit_bias or {}).items():
                index.append(row * vocab_size + token_id)
                bias.append(value)
        if not index:
            return None
        return cls(to_device(torch.tensor(index, dtype=torch.int64), device),
                   to_device(torch.tensor(bias, dtype=torch.float32), device))

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
        index: list[int] = []
        for row, seq in enumerate(seqs):
            banned = banned_token_ids(seq, eos)
            index += [row * vocab_size + t for t in sorted(banned)]
        if not index:
            return None
        return cls(to_device(torch.tensor(index, dtype=torch.int64), device))

    def apply(self, logits: torch.Tensor) -> Undo:
        flat = logits.view(-1)
        original = flat[self.index]
        flat.index_fill_(0, self.index, float("-inf"))
        return Undo(self.index, original)


def banned_token_ids(seq: Sequence, eos_token_ids: set[int]) -> set[int]:
    """The tokens `seq` must not sample next."""
    p = seq.sampling_params
    banned: set[int] = set()
    if seq.num_output_tokens < p.min_tokens:
        banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
    if p.bad_words_token_ids:
        output = seq.output_token_ids
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if not prefix or (len(prefix) <= len(output) and output[-len(prefix):] == prefix):
                banned.add(word[-1])
    return banned
