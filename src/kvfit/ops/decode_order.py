"""The order a decode launch starts its sequences in: the longest programs first.

A decode launch runs one program per (sequence, split, KV head): at 256 sequences thousands,
several times what the device holds at once, and the hardware starts them in launch order as
earlier ones finish. A program's time is its split's length, which differs between sequences
(a 300-token sequence is one program of 300 tokens, a 1,100-token one three of ~370). Started
in batch order, the launch's last programs may be long ones that run on while most of the
device idles; started longest first (list scheduling's LPT rule), the short ones fill the end.
The order changes no result: each program writes its own part, reduced in a fixed order.
"""

from __future__ import annotations

import numpy as np
import torch

from kvfit.ops.sm_count import DEFAULT_SMS
from kvfit.ops.triton_attention import MAX_SPLITS, decode_block_n, decode_split_tokens


def decode_order(seq_lens: np.ndarray, query_lens: np.ndarray, num_kv_heads: int,
                 head_dim: int, kv_dtype: torch.dtype, sms: int = DEFAULT_SMS,
                 split_tokens: int | None = None) -> np.ndarray:
    """`AttentionMetadata.decode_order` for a step: its rows (int32), those whose programs
    read the most tiles first, ties in batch order; rows that are not decode rows (query
    length other than 1: the decode kernel skips them) last.

    The split layout is the kernel's (`decode_split_tokens` for this launch's size, at most
    `MAX_SPLITS` parts of whole BLOCK_N tiles), so the key is exact for eager launches and
    for a CUDA graph's padded batch alike (both split alike: `MAX_SPLITS`'s note). Host time:
    a few numpy passes over the rows, ~10 us at 256. A launch of fewer rows times KV heads
    than SMs gets the batch order: it starts at once (its splits are shortened to fill the
    device, `decode_split_tokens`), so no order helps, and the host's time weighs most
    there. `split_tokens`: a launch's override of the kernel's (benches)."""
    num_seqs = len(seq_lens)
    if num_seqs * num_kv_heads < sms and split_tokens is None:
        return np.arange(num_seqs, dtype=np.int32)
    if split_tokens is None:
        split_tokens = decode_split_tokens(kv_dtype, num_seqs, num_kv_heads, sms)
    block_n = decode_block_n(head_dim)
    splits = np.minimum(np.maximum((seq_lens + split_tokens - 1) // split_tokens, 1),
                        MAX_SPLITS)
    tiles_per_split = ((seq_lens + block_n - 1) // block_n + splits - 1) // splits
    tiles_per_split[query_lens != 1] = 0
    return np.argsort(-tiles_per_split, kind="stable").astype(np.int32)
