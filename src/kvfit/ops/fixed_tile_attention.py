"""Paged attention that reduces every query row over its keys in fixed tiles: the torch path
of the batch-invariant mode.

Row r of a sequence, at position p, attends to keys 0..p. Its softmax and weighted sum run over
key tiles [0, KV_TILE), [KV_TILE, 2 KV_TILE), ... in that order with an online softmax, each
tile's dot products and sums taken over fixed-size axes. Nothing depends on how many rows the
call has, where the sequence's query starts (a cached prefix or a recomputed one, a chunk
border, a decode) or how long the other sequences are: tiles past p are masked to exactly zero
weight and change nothing (max unchanged, rescale by exp(0) = 1, zero added). The SDPA path of
`reference.py` gives no such promise: its key blocking follows the context length.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvfit.kv_quant import dequantize_fp8, is_fp8
from kvfit.ops.reference import _gather_context

if TYPE_CHECKING:
    from kvfit.ops.attention import AttentionMetadata

KV_TILE = 32
"""Keys per tile. A multiple of the CPU's vector width, so every row's exp runs vectorised."""
ROWS_BYTES = 16 << 20
"""Float32 bytes of one tile's products ([rows, heads, KV_TILE, head_dim]) computed at once."""


def paged_attention_fixed_tiles(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` with each row reduced over key tiles at fixed positions (see module).

    Sequence by sequence, rows in blocks of at most `ROWS_BYTES` of products per tile. Extra
    memory: the sequence's gathered K and V (float32) plus about 3 x `ROWS_BYTES`. Reads the
    metadata on the host: the CPU path, not CUDA-graph safe. An FP8 cache's pages are read
    as `value * scale` in float32 (`k_scale`, `v_scale`: its [1] float32 scales), elementwise,
    so the mode's invariance holds for it too.
    """
    starts = metadata.query_start_loc.long().tolist()
    seq_lens = metadata.seq_lens.long().tolist()
    num_heads, head_dim = query.shape[1:]
    step = max(1, ROWS_BYTES // (num_heads * KV_TILE * head_dim * 4))
    for seq, seq_len in enumerate(seq_lens):
        q_start, q_end = starts[seq], starts[seq + 1]
        if q_end == q_start:
            continue
        tiles = -(-seq_len // KV_TILE)
        table = metadata.block_table[seq : seq + 1]
        k = _padded_context(k_cache, table, seq_len, tiles * KV_TILE, k_scale)
        v = _padded_context(v_cache, table, seq_len, tiles * KV_TILE, v_scale)
        first_pos = seq_len - (q_end - q_start)
        for a in range(q_start, q_end, step):
            b = min(a + step, q_end)
            positions = torch.arange(first_pos + a - q_start, first_pos + b - q_start)
            out[a:b] = _attend_rows(query[a:b], k, v, positions.to(query.device), scale)
    return out


def _padded_context(cache: torch.Tensor, table: torch.Tensor, seq_len: int,
                    padded_len: int, scale: torch.Tensor | None) -> torch.Tensor:
    """[kv_heads, padded_len, head_dim] float32 keys (or values) of one sequence, an FP8
    cache's dequantised with `scale`; zeros past seq_len (slots never written may hold
    anything, and 0 x NaN is NaN)."""
    tokens = _gather_context(cache, table, seq_len)[0]
    tokens = (dequantize_fp8(tokens, scale, torch.float32) if is_fp8(cache.dtype)
              else tokens.float())
    return torch.nn.functional.pad(tokens, (0, 0, 0, padded_len - seq_len))


def _attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Rows `q` [R, heads, d] at `positions` [R] over keys `k`, `v` [kv_heads, L, d] (L a
    multiple of KV_TILE): [R, heads, d] float32."""
    rows, num_heads, head_dim = q.shape
    kv_heads = k.shape[0]
    q = q.float().view(rows, kv_heads, num_heads // kv_heads, 1, head_dim)
    m = torch.full((rows, kv_heads, num_heads // kv_heads), float("-inf"), device=q.device)
    l_sum = torch.zeros_like(m)
    acc = torch.zeros(rows, kv_heads, num_heads // kv_heads, head_dim, device=q.device)
    offsets = torch.arange(KV_TILE, device=q.device)
    last_tile = int(positions.max()) // KV_TILE
    for t0 in range(0, (last_tile + 1) * KV_TILE, KV_TILE):
        k_tile = k[None, :, None, t0 : t0 + KV_TILE]  # [1, kv_heads, 1, T, d]
        v_tile = v[None, :, None, t0 : t0 + KV_TILE]
        # Products summed over head_dim (a fixed-length axis), not a GEMM whose blocking
        # follows the number of rows.
        s = (q * k_tile).sum(-1).mul_(scale)  # [R, kv_heads, group, T]
        hidden = (t0 + offsets)[None, :] > positions[:, None]  # [R, T]
        s.masked_fill_(hidden[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        p = (s - m_new[..., None]).exp_()
        alpha = (m - m_new).exp_()
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + (p[..., None] * v_tile).sum(-2)
        m = m_new
    return (acc / l_sum[..., None]).view(rows, num_heads, head_dim)
