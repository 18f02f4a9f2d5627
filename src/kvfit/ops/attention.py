"""Paged attention and KV-cache writes: one entry point each, dispatched by device.

CONTRACT (filled in by the ops work; signatures are fixed because models and engine use them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every attention layer of the model.

    Tokens of all sequences are packed along dim 0: sequence i owns query rows
    `query_start_loc[i]:query_start_loc[i + 1]`, which are the *last* rows of its context of
    `seq_lens[i]` tokens (cached prefix first, then these new tokens; causal, lower-right aligned).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset; -1 = skip
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int  # host-side upper bounds: no device sync needed to launch
    max_seq_len: int


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any strides
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    raise NotImplementedError


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    raise NotImplementedError
