"""Token sampling from logits: penalties, bias, bans, temperature, filters, seeds, logprobs.

The step's logits are the sampler's own (the model runner computes them for the sampled rows
only), so every change is made in place and sparse, and undone before logprobs are read: the
memory of sampling is the logits plus O(rows + entries) (see `Sampler`).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from kvfit.batch_invariant.functional import logsumexp, topk_indices
from kvfit.engine.logits_processors import AllowedTokens, BannedTokens, LogitBias, Penalties
from kvfit.engine.sequence import Logprob, Logprobs, Sequence
from kvfit.engine.transfer import to_device, to_host
from kvfit.ops import argmax_scratch, filter_thresholds, greedy_argmax, gumbel_sample
from kvfit.ops.sampling import temperature_divisor

# Rows of prompt positions pushed through the logits head and the top-n scorer at once; warmup
# runs one chunk of exactly this width so its memory is measured before the cache is sized.
PROMPT_LOGPROBS_CHUNK = 1024
# Bytes of float32 logits normalised at once: bounds log-sum-exp's and the rank count's
# [rows, V] temporaries (26 rows of a 152k vocabulary), small next to one chunk's logits.
_LOGSUMEXP_BYTES = 16 << 20
_FLOAT32_MAX = torch.finfo(torch.float32).max

LogitsProcessor = AllowedTokens | BannedTokens | LogitBias | Penalties

GREEDY_ARGMAX_KERNEL = True
"""Whether the model runner builds its sampler with the one-launch greedy argmax
(`kvfit.ops.greedy_argmax`, scratch for `max_num_seqs` rows). On since its GPU tests passed
(H100, 2026-12-07: `tests/ops/test_triton_argmax.py`, `tests/engine/test_sampling_gpu.py`, the
engine's `test_greedy_argmax_kernel_gives_torchs_tokens`) and `bench/sampling.py` timed it
against torch's argmax over a 152k vocabulary: 6.5 against 12.0 us at one row, 7.3 / 13.2 at
4, 17.9 / 29.2 at 64, 50.8 / 63.2 at 256. Off, torch's argmax gives the same ids."""


@dataclass
class SamplingMetadata:
    """Per-row sampling settings of one step as tensors, built once per step by `from_seqs`."""

    temperature: torch.Tensor | None  # [N] float32, 0.0 on greedy rows; None if all are
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int32, vocab size where off; None when no row filters
    top_p: torch.Tensor | None  # [N] float32, 1.0 where off
    min_p: torch.Tensor | None  # [N] float32, 0.0 where off
    token_seeds: list[tuple[int, int]]  # (row, seed of this row's current token)
    processors: list[LogitsProcessor]  # applied in this order, undone in reverse
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
        device = torch.device(device)
        params = [seq.sampling_params for seq in seqs]
        # Built at every step for every sampled row: one pass over the rows gathers each
        # setting, list.count (C) tells a setting that no row uses, and the logits processors
        # are built only where some row asks for one.
        temperature, top_k, top_p, min_p = map(list, zip(
            *[(p.temperature, p.top_k, p.top_p, p.min_p) for p in params], strict=True)
        ) if params else ([], [], [], [])
        num_rows = len(params)

        def tensor(values: list, dtype: torch.dtype, off: float) -> torch.Tensor | None:
            if values.count(off) == num_rows:
                return None
            return to_device(torch.tensor(values, dtype=dtype), device)

        if top_k.count(-1) != num_rows:  # -1 (off) is the common value; others clamp
            top_k = [k if 0 < k < vocab_size else vocab_size for k in top_k]
        else:
            top_k = [vocab_size] * num_rows
        processors = []
        if any(p.allowed_token_ids is not None or p.logit_bias or p.bad_words_token_ids
               or p.min_tokens or p.has_penalties for p in params):
            # vLLM's order: the penalties act on the biased logits ((x + bias) / penalty, not
            # x / penalty + bias); bans and the allowed mask are -inf whatever comes after.
            processors = [
                AllowedTokens.from_seqs(seqs, vocab_size, device),
                BannedTokens.from_seqs(seqs, vocab_size, device, eos_token_ids),
                LogitBias.from_seqs(seqs, vocab_size, device),
                Penalties.from_seqs(seqs, vocab_size, device),
            ]
        all_greedy = temperature.count(0.0) == num_rows
        return cls(
            # An all-greedy step takes the argmax: no copy to make (a pinned staging buffer
            # and a host-to-device copy, at every decode step of a greedy batch).
            # Clamped to float32's largest: a temperature past it (1e39 is a finite float)
            # would be inf, whose T x ln(min_p) = inf x 0 (NaN) turned min_p=1 off and whose
            # -inf / T made a filtered token's processed logprob NaN.
            temperature=None if all_greedy else to_device(
                torch.tensor(temperature, dtype=torch.float32).clamp_(max=_FLOAT32_MAX), device),
            all_greedy=all_greedy,
            top_k=tensor(top_k, torch.int32, vocab_size),
            top_p=tensor(top_p, torch.float32, 1.0),
            min_p=tensor(min_p, torch.float32, 0.0),
            token_seeds=[
                (row, token_seed(p.seed, seq.num_output_tokens, seq.sibling_index))
                for row, (seq, p) in enumerate(zip(seqs, params, strict=True))
                if p.seed is not None and not p.greedy
            ],
            processors=[p for p in processors if p is not None],
            num_logprobs=[p.logprobs for p in params],
        )

    @property
    def filters(self) -> bool:
        return any(t is not None for t in (self.top_k, self.top_p, self.min_p))


def token_seed(seed: int, index: int, sibling: int = 0) -> int:
    """Seed for output token `index` of completion `sibling` of a request seeded with `seed`.

    Drawing each token from its own generator seeded this way makes a seeded request's samples
    depend only on its seed and logits: not on batch mates, preemption, or which worker ran it;
    the `n` completions of one request draw apart.
    """
    key = f"{seed}:{index}" if sibling == 0 else f"{seed}:{sibling}:{index}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)  # an int64, as the kernels take it


@dataclass
class SamplerOutput:
    """Sampled ids, plus for the rows that asked, the sampled token's logprob and rank and the
    top-n."""

    sampled_token_ids: torch.Tensor  # [N] int64
    logprob_rows: list[int]  # rows of the batch that asked for logprobs
    logprob_token_ids: torch.Tensor | None  # [R, 1 + max_n]: sampled token, then top-n
    logprobs: torch.Tensor | None  # [R, 1 + max_n]
    ranks: torch.Tensor | None = None  # [R]: the sampled token's rank

    def to_host(self) -> SamplerOutput:
        """The same output with its tensors being copied to pinned host memory (no wait)."""
        return SamplerOutput(
            to_host(self.sampled_token_ids), self.logprob_rows,
            *(None if t is None else to_host(t)
              for t in (self.logprob_token_ids, self.logprobs, self.ranks)),
        )

    def to_lists(self, num_logprobs: list[int | None]) -> tuple[list[int], list[Logprobs | None]]:
        """Host-side ids and per-row {token id: Logprob} dicts (None where not requested)."""
        token_ids = self.sampled_token_ids.tolist()
        dicts: list[Logprobs | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            nums = [num_logprobs[row] for row in self.logprob_rows]
            entries = logprob_dicts(self.logprob_token_ids, self.logprobs, self.ranks, nums)
            for entry, row in zip(entries, self.logprob_rows, strict=True):
                dicts[row] = entry
        return token_ids, dicts


class Sampler:
    """Samples one token per logits row; runs outside CUDA graphs, batched over rows.

    Order (vLLM's): the allowed-tokens mask, bans (bad words, stops below `min_tokens`), logit
    bias, then penalties change the logits in place; greedy rows take the argmax of the result;
    the others take the Gumbel-max draw of `kvfit.ops.gumbel_sample` at their temperature,
    over the tokens that pass their top-k / top-p / min-p threshold
    (`kvfit.ops.filter_thresholds`, no sort). Each row's noise comes from its own 64-bit seed:
    the engine's generator for unseeded rows, `token_seed` for seeded ones. The changes are
    then undone.

    Logprobs follow the engine's `logprobs_mode` (vLLM's): "raw_logprobs" (the default) is the
    log-softmax of the raw logits, "raw_logits" those logits; "processed_logits" are the logits
    as sampled: after the processors, divided by the temperature, tokens below the row's
    top-k / top-p / min-p threshold -inf (greedy rows: the processors only, as vLLM's, whose
    greedy requests take no temperature or filters), read before the undo;
    "processed_logprobs" their log-softmax. Ranks and top-n are of the values returned.

    Device memory beyond the `[N, V]` logits: a float32 copy of 16-bit logits in a step with
    logit bias or penalties (vLLM's float32 arithmetic), the processors' entries (see each),
    the filter thresholds' O(N) and one `_LOGSUMEXP_BYTES` block of float32 for logprobs (the
    processed modes: `processed_block`'s float32 block and mask besides); on CUDA with
    `max_num_seqs`, the greedy argmax's scratch (`kvfit.ops.argmax_scratch`, ~9 KB at 256
    rows), allocated here, once. The mode is the engine's, so warmup's sampling step runs it
    at its largest.
    """

    def __init__(self, device: torch.device | str = "cpu", seed: int = 0,
                 max_num_seqs: int = 0, logprobs_mode: str = "raw_logprobs") -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(self.device).manual_seed(seed)
        # Steps of up to `max_num_seqs` all-greedy rows take the one-launch argmax.
        self.argmax_scratch = argmax_scratch(max_num_seqs, self.device)
        self.logprobs_mode = logprobs_mode
        self.processed = logprobs_mode.startswith("processed")

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` `[N, V]` (any float dtype; changed and restored in place, or
        not touched where a float32 copy is sampled) with `meta` built for the same N rows."""
        logits = logits.contiguous()
        if logits.element_size() < 4 and any(isinstance(p, LogitBias | Penalties)
                                             for p in meta.processors):
            # Bias and penalties are arithmetic, and their results stored back in 16 bits lose
            # the logits' differences (at 100 + x, bf16 steps by 0.5: `logit_bias` of +100 on
            # a set of tokens made near ones tie, and greedy took the lowest id). vLLM's sampler
            # works in float32; so does a step that carries them. Warmup's step carries both,
            # so this [N, V] float32 copy is measured.
            logits = logits.float()
        undo = [processor.apply(logits) for processor in meta.processors]
        thresholds = None
        if meta.all_greedy:
            token_ids = greedy_argmax(logits, self.argmax_scratch)
        else:
            token_ids, thresholds = self._sample(logits, meta)
        if self.processed:  # the logits as sampled: before the undo
            output = self._with_logprobs(logits, token_ids, meta.num_logprobs,
                                         self.logprobs_mode, meta.temperature, thresholds)
        for change in reversed(undo):
            change.restore(logits)
        if not self.processed:
            output = self._with_logprobs(logits, token_ids, meta.num_logprobs,
                                         self.logprobs_mode)
        return output

    def _sample(self, logits: torch.Tensor,
                meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampled ids and the filters' thresholds (None when no row filters)."""
        thresholds = None
        if meta.filters:
            thresholds = filter_thresholds(logits, meta.temperature, meta.top_k, meta.top_p,
                                           meta.min_p)
        return gumbel_sample(logits, meta.temperature, self._seeds(meta, logits.shape[0]),
                             thresholds), thresholds

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
        logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None],
        mode: str = "raw_logprobs", temperature: torch.Tensor | None = None,
        thresholds: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """Logprobs in `mode` of the rows that ask; the processed modes read `logits` as
        sampled, with each row's `temperature` and filter `thresholds` (None: none)."""
        rows = [row for row, n in enumerate(num_logprobs) if n is not None]
        if not rows:
            return SamplerOutput(token_ids, rows, None, None)
        max_n = max(num_logprobs[row] for row in rows)
        # Always by index, even when every row asks: a subset's blocks are gathered copies
        # (at most `_LOGSUMEXP_BYTES` / 4 x the logits' element size), and warmup, where
        # every row asks, must make that copy at its largest.
        index = to_device(torch.tensor(rows), logits.device)
        process = None
        if mode.startswith("processed"):
            process = functools.partial(
                processed_block,
                divisor=None if temperature is None else temperature_divisor(temperature)[index],
                thresholds=None if thresholds is None else thresholds[index])
        ids, values, ranks = logprobs_at(logits, token_ids[index], max_n, index,
                                         normalize=mode.endswith("logprobs"), process=process)
        return SamplerOutput(token_ids, rows, ids, values, ranks)


def processed_block(part: torch.Tensor, block: slice, divisor: torch.Tensor | None,
                    thresholds: torch.Tensor | None) -> torch.Tensor:
    """Rows `block` of the logprob rows, `part` `[B, V]` (a gathered copy, changed in place
    where float32), as the sampler draws from them, in float32: -inf below each row's filter
    threshold (`thresholds` `[R]`, compared before the temperature, as `gumbel_sample` does),
    then divided by its `divisor` (`[R]`, `temperature_divisor`); None skips either. Extra
    memory: the float32 copy of a 16-bit block and a `[B, V]` bool mask, at most 1.25 x
    `_LOGSUMEXP_BYTES` at `logprobs_at`'s block size (and in the batch-invariant mode,
    `topk_indices` sorts float32 values, not 16-bit ones: 2 bytes more per logit of a block).
    Warmup's sampling step runs this at every row with every filter (its largest)."""
    x = part.to(torch.float32)
    if thresholds is not None:
        x.masked_fill_(x < thresholds[block, None], float("-inf"))
    if divisor is not None:
        x.div_(divisor[block, None])
    return x


def logprobs_at(
    logits: torch.Tensor, token_ids: torch.Tensor, n: int, rows: torch.Tensor | None = None,
    normalize: bool = True,
    process: Callable[[torch.Tensor, slice], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(ids, logprobs, ranks)` for rows `rows` of `logits` `[N, V]` (all rows when None), left
    on the device: `ids` and `logprobs` `[R, 1 + n]` hold the log-softmax at `token_ids[r]`
    (`token_ids` has one id per selected row), then at the row's top-`n`; `ranks` `[R]` is
    `token_ids[r]`'s rank (1 + the number of larger logits). An `n` above the vocabulary
    size gives the whole vocabulary.

    No [R, V] float32 log-softmax (and no gathered copy of the selected rows) is made: rows are
    taken a `_LOGSUMEXP_BYTES` block at a time, and only the returned entries are normalised.
    A float32 copy of the logits would be the largest transient of a step (0.6 GiB for 1024 rows
    over a 152k vocabulary), and measured sizing keeps 1.5x the largest transient free. The
    top-n of the logits are the top-n of the logprobs (one shift per row). With `rows`, each
    block is a gathered copy: at most `_LOGSUMEXP_BYTES` / 4 x the logits' element size bytes
    (16 MiB for float32 logits) beyond the path without it.

    `normalize` False gives the logits themselves (no log-sum-exp). `process` (only with
    `rows`, whose blocks are copies it may change) maps each block and the slice of `rows`
    it holds to the values to score instead (`processed_block`).
    """
    num_rows = logits.shape[0] if rows is None else rows.shape[0]
    n = min(n, logits.shape[-1])
    block = max(1, _LOGSUMEXP_BYTES // (4 * logits.shape[-1]))
    token_ids = token_ids.to(logits.device, torch.int64)
    parts = []
    for start in range(0, num_rows, block):
        end = min(start + block, num_rows)
        part = logits[start:end] if rows is None else logits[rows[start:end]]
        if process is not None:
            part = process(part, slice(start, end))
        ids = token_ids[start:end, None]
        if n:
            ids = torch.cat([ids, topk_indices(part, n)], dim=1)
        picked = part.gather(1, ids)
        rank = 1 + (part > picked[:, :1]).sum(dim=-1)
        if normalize:
            lse = logsumexp(part)
            parts.append((ids, picked.float() - lse[:, None], rank))
        else:
            parts.append((ids, picked.float(), rank))
    ids, values, ranks = (torch.cat(t) for t in zip(*parts, strict=True))
    return ids, values, ranks


def logprob_dicts(ids: torch.Tensor, values: torch.Tensor, ranks: torch.Tensor | None = None,
                  nums: list[int] | None = None) -> list[Logprobs]:
    """One {token id: Logprob} dict per row of `logprobs_at`'s output (waits for its device):
    the token of column 0 with `ranks[r]`, then the top-`nums[r]` (all columns when None) with
    ranks 1, 2, ..."""
    first_ranks = [None] * len(ids) if ranks is None else ranks.tolist()
    nums = nums or [ids.shape[1] - 1] * len(ids)
    dicts = []
    for row_ids, row_values, rank, n in zip(ids.tolist(), values.tolist(), first_ranks, nums,
                                            strict=True):
        entry = {row_ids[0]: Logprob(row_values[0], rank)}
        for i in range(1, 1 + min(n, len(row_ids) - 1)):  # fewer columns: the whole vocab
            entry.setdefault(row_ids[i], Logprob(row_values[i], i))
        dicts.append(entry)
    return dicts
