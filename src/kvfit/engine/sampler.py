"""Token sampling from logits: greedy, temperature, top-k, top-p, seeds and logprobs."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kvfit.engine.sequence import Sequence
from kvfit.engine.transfer import to_device, to_host
from kvfit.ops import gumbel_sample

# Rows of prompt positions pushed through the logits head and the top-n scorer at once; warmup
# runs one chunk of exactly this width so its memory is measured before the cache is sized.
PROMPT_LOGPROBS_CHUNK = 1024
# Bytes of float32 logits normalised at once: bounds log-sum-exp's [rows, V] temporaries
# (26 rows of a 152k vocabulary), small next to one chunk's logits.
_LOGSUMEXP_BYTES = 16 << 20

Logprobs = dict[int, float]


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step as tensors, built once per step by `from_seqs`."""

    temperature: torch.Tensor  # [N] float32, 1.0 on greedy rows so division is safe
    greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int64, vocab size where off; None when no row filters
    top_p: torch.Tensor | None  # [N] float32, 1.0 where off; None when no row filters
    token_seeds: list[tuple[int, int]]  # (row, seed of this row's current token)
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) that must not be sampled
    num_logprobs: list[int | None]  # per row, None = not requested

    @classmethod
    def from_seqs(
        cls,
        seqs: SequenceOf[Sequence],
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Iterable[int] = (),
    ) -> SamplingMetadata:
        """Settings for sampling the next token of each of `seqs` (one logits row each).

        Below `min_tokens`, the stop token ids (and `eos_token_ids` unless `ignore_eos`) are
        banned so generation cannot end early.
        """
        params = [seq.sampling_params for seq in seqs]
        greedy = [p.greedy for p in params]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        banned_rows, banned_ids = [], []
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            if seq.num_output_tokens < p.min_tokens:
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
                banned_rows += [row] * len(stop_ids)
                banned_ids += sorted(stop_ids)

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype), device)

        return cls(
            temperature=tensor([p.temperature or 1.0 for p in params], torch.float32),
            greedy=tensor(greedy, torch.bool),
            all_greedy=all(greedy),
            top_k=tensor(top_k, torch.int64) if any(k < vocab_size for k in top_k) else None,
            top_p=tensor(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
            token_seeds=[
                (row, token_seed(p.seed, seq.num_output_tokens))
                for row, (seq, p) in enumerate(zip(seqs, params, strict=True))
                if p.seed is not None and not p.greedy
            ],
            banned=(tensor(banned_rows, torch.int64), tensor(banned_ids, torch.int64))
            if banned_rows
            else None,
            num_logprobs=[p.logprobs for p in params],
        )


def token_seed(seed: int, index: int) -> int:
    """Seed for output token `index` of a request seeded with `seed`.

    Drawing each token from its own generator seeded this way makes a seeded request's samples
    depend only on its seed and logits: not on batch mates, preemption, or which worker ran it.
    """
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)  # an int64, as the kernels take it


@dataclass
class SamplerOutput:
    """Sampled ids, plus for the rows that asked, the sampled token's logprob and the top-n."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprob_rows: list[int]  # rows of the batch that asked for logprobs
    logprob_token_ids: torch.Tensor | None  # [R, 1 + max_n]: sampled token, then top-n
    logprobs: torch.Tensor | None  # [R, 1 + max_n]

    def to_host(self) -> SamplerOutput:
        """The same output with its tensors being copied to pinned host memory (no wait)."""
        return SamplerOutput(
            to_host(self.sampled_token_ids), self.logprob_rows,
            None if self.logprob_token_ids is None else to_host(self.logprob_token_ids),
            None if self.logprobs is None else to_host(self.logprobs),
        )

    def to_lists(self, num_logprobs: list[int | None]) -> tuple[list[int], list[Logprobs | None]]:
        """Host-side ids and per-row {token id: logprob} dicts (None where not requested)."""
        token_ids = self.sampled_token_ids.tolist()
        dicts: list[Logprobs | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            ids, values = self.logprob_token_ids.tolist(), self.logprobs.tolist()
            for r, row in enumerate(self.logprob_rows):
                n = 1 + num_logprobs[row]
                dicts[row] = dict(zip(ids[r][:n], values[r][:n], strict=True))
        return token_ids, dicts


class Sampler:
    """Samples one token per logits row; runs outside CUDA graphs, batched over rows.

    Greedy rows take the argmax. Others take the Gumbel-max draw of `kvfit.ops.gumbel_sample`
    (the argmax of logits / T plus Gumbel noise, which is a sample from softmax(logits / T)), one
    pass over the logits with no per-row Python. Each row's noise comes from its own 64-bit seed:
    drawn from the engine's generator for unseeded rows, `token_seed` for seeded ones. Logprobs
    are the log-softmax of the raw logits (before temperature and filters), as vLLM returns by
    default.
    """

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` `[N, V]` (any float dtype) with `meta` built for the same N
        rows."""
        raw_logits = logits
        if meta.banned is not None:
            neg_inf = torch.full((), float("-inf"), dtype=logits.dtype, device=logits.device)
            logits = logits.index_put(meta.banned, neg_inf)
        token_ids = logits.argmax(dim=-1) if meta.all_greedy else self._sample(logits, meta)
        return self._with_logprobs(raw_logits, token_ids, meta.num_logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        temperature = meta.temperature
        if meta.top_k is not None or meta.top_p is not None:
            # The filters act on the tempered distribution: temper first, then draw at T = 1.
            logits = apply_top_k_top_p(logits.float() / temperature[:, None], meta.top_k,
                                       meta.top_p)
            temperature = torch.ones_like(temperature)
        temperature = temperature.masked_fill(meta.greedy, 0.0)  # T <= 0: the plain argmax
        return gumbel_sample(logits, temperature, self._seeds(meta, logits.shape[0]))

    def _seeds(self, meta: SamplingMetadata, num_rows: int) -> torch.Tensor:
        """One int64 seed per row: the generator's, or the row's `token_seed`."""
        seeds = torch.randint(-(2**63), 2**63 - 1, (num_rows,), dtype=torch.int64,
                              generator=self.generator, device=self.device)
        if meta.token_seeds:
            rows, values = zip(*meta.token_seeds, strict=True)
            seeds[to_device(torch.tensor(rows), self.device)] = to_device(
                torch.tensor(values, dtype=torch.int64), self.device)
        return seeds

    @staticmethod
    def _with_logprobs(
        raw_logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
    ) -> SamplerOutput:
        rows = [row for row, n in enumerate(num_logprobs) if n is not None]
        if not rows:
            return SamplerOutput(token_ids, rows, None, None)
        max_n = max(num_logprobs[row] for row in rows)
        if len(rows) == len(num_logprobs):  # every row: no gathered copy of the logits
            ids, values = logprobs_at(raw_logits, token_ids, max_n)
        else:
            index = to_device(torch.tensor(rows), raw_logits.device)
            ids, values = logprobs_at(raw_logits[index], token_ids[index], max_n)
        return SamplerOutput(token_ids, rows, ids, values)


def logprobs_at(
    logits: torch.Tensor, token_ids: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, logprobs)` `[R, 1 + n]`: per row of `logits` `[R, V]`, the log-softmax at
    `token_ids[r]`, then at the row's top-`n`, left on the device.

    No [R, V] float32 log-softmax is made: each row's log-sum-exp is taken in float32 a few
    rows at a time and only the returned entries are normalised. A float32 copy of the logits
    would be the largest transient of a step (0.6 GiB for 1024 rows over a 152k vocabulary), and
    measured sizing keeps 1.5x the largest transient free. The top-n of the logits are the top-n
    of the logprobs (one shift per row).
    """
    block = max(1, _LOGSUMEXP_BYTES // (4 * logits.shape[-1]))
    lse = torch.cat([rows.float().logsumexp(dim=-1) for rows in logits.split(block)])
    ids = token_ids.to(logits.device, torch.int64)[:, None]
    if n:
        ids = torch.cat([ids, logits.topk(n, dim=-1).indices], dim=1)
    return ids, logits.gather(1, ids).float() - lse[:, None]


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and outside its top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probability reaches top_p
    (computed after top-k). One sort serves every row; rows with filters off pass unchanged.
    """
    if top_k is None and top_p is None:
        return logits
    sorted_logits, order = logits.sort(dim=-1)  # ascending: the most likely token is last
    vocab_size = logits.shape[-1]
    if top_k is not None:
        below_k = torch.arange(vocab_size, device=logits.device) < (vocab_size - top_k)[:, None]
        sorted_logits.masked_fill_(below_k, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        outside = cumulative <= (1 - top_p)[:, None]
        outside[:, -1] = False
        sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def logprob_dicts(ids: torch.Tensor, values: torch.Tensor) -> list[Logprobs]:
    """One {token id: logprob} dict per row of `logprobs_at`'s output (waits for its device)."""
    rows = zip(ids.tolist(), values.tolist(), strict=True)
    return [dict(zip(i, v, strict=True)) for i, v in rows]

