"""Every op the batch-invariant mode runs, each with a self-test that fails on a batch-dependent
path: the op's output for a row alone is compared bit for bit with the same row inside batches
of other sizes and at other positions.

`check_all(device, dtype)` runs them all (the tests do, on the CPU and on the GPU); `check_rows`
checks any row-wise function, so a test can show that it catches a batch-dependent kernel (plain
`F.linear` in float32 on an MKL CPU, cuBLAS on a GPU).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfit.batch_invariant import functional
from kvfit.batch_invariant.mode import batch_invariant_mode
from kvfit.ops import layers
from kvfit.ops.attention import AttentionMetadata
from kvfit.ops.sampling import filter_thresholds, gumbel_sample

BATCH_SIZES = (2, 3, 7, 16, 17, 33, 64, 100, 255, 300)
"""Batch sizes a row is checked in: tile borders and the sizes where libraries switch paths."""
NUM_ROWS = max(BATCH_SIZES) + 5  # the batches start at row 0 and at row 5


@dataclass(frozen=True)
class Check:
    """One op of the mode and its self-test: `run(device, dtype, generator)` returns a list of
    mismatch descriptions, empty when the op is batch invariant."""

    name: str
    run: Callable[[torch.device, torch.dtype, torch.Generator], list[str]]


def check_rows(op: Callable[[int, int], torch.Tensor], num_rows: int,
               sizes: tuple[int, ...] = BATCH_SIZES) -> list[str]:
    """Mismatches between row i of `op(i, i + 1)` (rows i..i+1 of the op's input alone) and
    row i of `op(a, b)` over batches of each size, starting at row 0 and at row 5 (so each
    row sits at several positions)."""
    alone = torch.cat([op(i, i + 1) for i in range(num_rows)])
    failures = []
    for size in sizes:
        for start in (0, 5):
            end = min(start + size, num_rows)
            if not torch.equal(op(start, end), alone[start:end]):
                failures.append(f"rows {start}:{end} differ from the same rows alone")
    return failures


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor
            ) -> Callable[[int, int], torch.Tensor]:
    """`fn` applied to rows a..b of `x`, in `check_rows`' form."""
    return lambda a, b: fn(x[a:b])


def _randn(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype,
           g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g) * scale).to(device, dtype)


PREFILL_ROWS = 1029
"""Rows of a prefill-sized GEMM: past `triton_matmul.LARGE_M` (1024), where the CUDA GEMM takes
its big tiles."""


def _linear(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    # Widths for each of the CUDA GEMM's narrow tile configs (narrow, middle, LM-head wide); at
    # 255 and 300 rows the widest takes the big tiles, and every width does at PREFILL_ROWS.
    x = _randn((PREFILL_ROWS, 256), device, dtype, g)
    failures = []
    for width in (384, 3000, 9000):
        w, b = _randn((width, 256), device, dtype, g, 0.06), _randn((width,), device, dtype, g)
        linear = functools.partial(functional.linear, weight=w, bias=b)
        failures += check_rows(rowwise(linear, x), NUM_ROWS)
        full = linear(x)
        failures += [f"rows {a}:{a + n} of a {PREFILL_ROWS}-row product, width {width}"
                     for n in (1, 3, 255) for a in (0, 5, PREFILL_ROWS - n)
                     if not torch.equal(linear(x[a:a + n]), full[a:a + n])]
    return failures


def _silu_and_mul(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    # Rows of 2 x 200: not a multiple of any vector width, so vector lanes and leftovers mix.
    x = _randn((NUM_ROWS, 400), device, dtype, g, 4)
    return check_rows(rowwise(functional.silu_and_mul, x), NUM_ROWS)


def _rms_norms(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    n = NUM_ROWS
    w = _randn((128,), device, dtype, g)
    x, r = _randn((n, 128), device, dtype, g), _randn((n, 128), device, dtype, g)
    heads = _randn((n, 4, 128), device, dtype, g)  # q/k norms: one per head
    return (check_rows(rowwise(lambda t: layers.rms_norm(t, w, 1e-6), x), n)
            + check_rows(rowwise(lambda t: layers.rms_norm(t, w, 1e-6), heads), n)
            + check_rows(lambda a, b: torch.cat(layers.add_rms_norm(x[a:b], r[a:b], w, 1e-6), 1),
                         n))


def _rotary(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    n = NUM_ROWS
    rope = layers.RotaryEmbedding(64, 4096, 10000.0).to(device)
    positions = torch.randint(0, 4096, (n,), generator=g).to(device)
    q, k = _randn((n, 4, 64), device, dtype, g), _randn((n, 2, 64), device, dtype, g)
    return check_rows(lambda a, b: torch.cat(rope(positions[a:b], q[a:b], k[a:b]), 1), n)


def _logsumexp(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    # A vocabulary past torch's 32k-element split point, so a lone row is split across threads.
    x = _randn((40, 151_936), device, dtype, g, 3)
    return check_rows(rowwise(functional.logsumexp, x), 40, (2, 3, 17, 35))


def _topk(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    # Few distinct values: most of the top-8 are ties.
    x = torch.randint(0, 6, (40, 4096), generator=g).to(device, dtype)
    return check_rows(rowwise(lambda t: functional.topk_indices(t, 8), x), 40, (2, 3, 17, 35))


def _gumbel(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    logits = _randn((40, 4096), device, dtype, g, 2)
    temperature = (torch.rand(40, generator=g) + 0.5).to(device)
    seeds = torch.randint(-(2**62), 2**62, (40,), generator=g).to(device)
    # Rows keep their own temperature and seed: both move with the rows.
    return check_rows(lambda a, b: gumbel_sample(logits[a:b], temperature[a:b], seeds[a:b]),
                      40, (2, 3, 17, 35))


def _filters(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    n = 24
    logits = _randn((n, 2048), device, dtype, g, 2)
    temperature = (torch.rand(n, generator=g) + 0.5).to(device)
    top_k = torch.randint(1, 2049, (n,), generator=g).to(device, torch.int32)
    top_p = (torch.rand(n, generator=g) * 0.9 + 0.1).to(device)
    min_p = (torch.rand(n, generator=g) * 0.2).to(device)
    return check_rows(lambda a, b: filter_thresholds(logits[a:b], temperature[a:b], top_k[a:b],
                                                     top_p[a:b], min_p[a:b]), n, (2, 3, 17))


def _attention(device: torch.device, dtype: torch.dtype, g: torch.Generator) -> list[str]:
    """Each sequence alone as a prefill, then: all sequences in one batch, each with its
    prefix cached at several cut points (chunk borders, prefix-cache hits), and each row as a
    decode; every row must match bit for bit."""
    block_size, kv_heads, heads, head_dim = 16, 2, 8, 64
    # The longest spans three of the CUDA decode kernel's split-KV parts (512 tokens each,
    # `ops.triton_attention.SPLIT_TOKENS`, which needs Triton to import): outside the mode a
    # decode of it reduces in parts, which is what the check must be able to see.
    lengths = [1, 15, 33, 64, 97, 130, 1101]
    blocks_per_seq = -(-max(lengths) // block_size)
    num_blocks = blocks_per_seq * len(lengths)
    k_cache = _randn((num_blocks, block_size, kv_heads, head_dim), device, dtype, g)
    v_cache = _randn((num_blocks, block_size, kv_heads, head_dim), device, dtype, g)
    # Shuffled pages: a sequence's blocks are not contiguous.
    perm = torch.randperm(num_blocks, generator=g).view(len(lengths), blocks_per_seq)
    queries = [_randn((n, heads, head_dim), device, dtype, g) for n in lengths]

    def run(seqs: list[tuple[int, int]]) -> torch.Tensor:
        """Rows `cut..len` of each (sequence, cut) in one call."""
        q = torch.cat([queries[s][cut:] for s, cut in seqs])
        q_lens = [lengths[s] - cut for s, cut in seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.full((q.shape[0],), -1, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                         dtype=torch.int32, device=device),
            seq_lens=torch.tensor([lengths[s] for s, _ in seqs], dtype=torch.int32,
                                  device=device),
            block_table=perm[[s for s, _ in seqs]].to(device, torch.int32),
            max_query_len=max(q_lens), max_seq_len=max(lengths[s] for s, _ in seqs),
        )
        return functional.paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)

    alone = [run([(s, 0)]) for s in range(len(lengths))]
    failures = []
    together = run([(s, 0) for s in range(len(lengths))]).split(lengths)
    failures += [f"sequence {s} in a batch" for s in range(len(lengths))
                 if not torch.equal(together[s], alone[s])]
    for s, n in enumerate(lengths):
        for cut in sorted({n // 3, n // 2, n - 1} - {0}):
            if not torch.equal(run([(s, cut)]), alone[s][cut:]):
                failures.append(f"sequence {s} with {cut} of {n} tokens cached")
    decodes = run([(s, n - 1) for s, n in enumerate(lengths)])
    failures += [f"sequence {s}'s last token as a decode" for s in range(len(lengths))
                 if not torch.equal(decodes[s], alone[s][-1])]
    return failures


CHECKS = (
    Check("linear", _linear),
    Check("silu_and_mul", _silu_and_mul),
    Check("rms_norm", _rms_norms),
    Check("rotary", _rotary),
    Check("paged_attention", _attention),
    Check("logsumexp", _logsumexp),
    Check("topk_indices", _topk),
    Check("filter_thresholds", _filters),
    Check("gumbel_sample", _gumbel),
)
"""The ops of the mode's forward pass and sampling (argmax, gather and comparisons are exact
and need no check)."""


def check_all(device: torch.device | str, dtype: torch.dtype, seed: int = 0
              ) -> dict[str, list[str]]:
    """Run every check in the mode: {op name: mismatches} for the ops that failed."""
    device = torch.device(device)
    failures = {}
    with batch_invariant_mode(True), torch.inference_mode():
        for check in CHECKS:
            found = check.run(device, dtype, torch.Generator().manual_seed(seed))
            if found:
                failures[check.name] = found
    return failures
