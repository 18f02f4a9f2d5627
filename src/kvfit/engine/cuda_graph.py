"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

Graphs read static input buffers and the KV cache views bound when they were captured. The
extensible cache never moves its base address, so graphs captured while only its minimum is
committed stay valid after it grows (or shrinks, as long as replayed block ids stay committed).
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from kvfit.engine.sequence import ScheduledBatch
from kvfit.ops.attention import AttentionMetadata


class CUDAGraphRunner:
    """Captures `model.forward` for decode batches of each size in `capture_sizes`.

    A batch of n decodes replays the graph of the smallest captured size >= n; the padded rows
    write nothing (slot -1) and attend to one token of block 0, which is always committed.
    All graphs share one memory pool (`pool`: the runner's, shared with its piecewise graphs).
    `num_capture_passes` counts `capture()` calls.
    """

    def __init__(
        self,
        model: nn.Module,
        capture_sizes: list[int],
        max_num_blocks_per_seq: int,
        max_model_len: int,
        device: torch.device,
        pool: object = None,
        split_tickets: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.split_tickets = split_tickets  # `AttentionMetadata.split_tickets`
        self.capture_sizes = sorted(capture_sizes)
        self.max_model_len = max_model_len
        max_bs = self.capture_sizes[-1]
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, **i32)
        self.query_start_loc = torch.arange(max_bs + 1, **i32)
        self.block_table = torch.zeros(max_bs, max_num_blocks_per_seq, **i32)
        # The rows in batch order: where a step brings no `decode_order`, and for padded rows.
        self.rows = torch.arange(max_bs, **i32)
        self.decode_order = self.rows.clone()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        self.num_capture_passes = 0

    @property
    def max_batch_size(self) -> int:
        return self.capture_sizes[-1]

    def _metadata(self, bs: int) -> AttentionMetadata:
        # max_seq_len is the host bound the kernels size their launch from: it must cover any
        # sequence a replay may see, so it is max_model_len, not the capture batch's length.
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            split_tickets=self.split_tickets,
            decode_order=self.decode_order[:bs],
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first so smaller graphs reuse the pool's blocks."""
        self.slot_mapping.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_table.zero_()
        for bs in reversed(self.capture_sizes):
            args = (self.input_ids[:bs], self.positions[:bs], self._metadata(bs))
            self.model(*args)  # warm up outside the graph (lazy init, autotuning)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[bs] = self.model(*args)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        self.num_capture_passes += 1

    def can_run(self, batch: ScheduledBatch) -> bool:
        """Decode-only batches no larger than the largest captured size."""
        return bool(self.graphs) and batch.is_decode_only and len(batch) <= self.max_batch_size

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Copy the step's inputs into the static buffers, replay, return `hidden[:n]`."""
        n = input_ids.shape[0]
        bs = self.capture_sizes[bisect.bisect_left(self.capture_sizes, n)]
        width = metadata.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        self.block_table[:n, :width].copy_(metadata.block_table)
        # A permutation of the padded batch's rows: the step's own, then the padding's.
        order = metadata.decode_order
        self.decode_order[:n].copy_(self.rows[:n] if order is None else order)
        if n < bs:  # padded rows: nothing written, one token of block 0 read
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
            self.block_table[n:bs, 0].zero_()
            self.decode_order[n:bs].copy_(self.rows[n:bs])
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
