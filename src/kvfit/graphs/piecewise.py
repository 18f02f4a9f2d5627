"""Prefill and mixed steps from CUDA graphs of the model's dense pieces.

A step of any composition is, between its attention calls, the same work per token: norms,
the QKV projection with rope and the K/V store, o_proj and the MLP. Those pieces are captured
once per token-count bucket; a step of n tokens pads to the smallest bucket >= n, replays
piece 0, runs layer 0's attention eagerly on its n real rows (its launch shape depends on the
batch's lengths), replays piece 1, and so on. Padded rows store no K/V (slot -1) and nothing
reads them back: every op of a piece is row-wise.

Pieces talk through static buffers (input ids, positions, slots, q, residual, attention output,
hidden): each piece copies its outputs into them, so all graphs of all buckets share the same
few buffers and one memory pool holds only the largest piece's intermediates. The model
provides `num_pieces`, `piece(i, x, residual, positions, slot_mapping)` and
`attend(i, q, metadata, out)` (see `LlamaModel.piece`).

Device memory: the static buffers, (4 x hidden-or-q width + 3 int64) x the largest bucket
elements, plus the pool (the intermediates of the largest piece at the largest bucket, the
same as an eager step of that size holds), all allocated by `capture`, which the engine runs
before it measures memory for the KV cache.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvfit.graphs.buckets import bucket_for
from kvfit.ops.attention import AttentionMetadata

Replay = Callable[[], None]


@contextlib.contextmanager
def _without_per_capture_cleanup() -> Iterator[None]:
    """`torch.cuda.graph` runs `empty_cache()` (and, in older torch or under
    `force_cudagraph_gc`, `gc.collect()`) before every capture: with a thousand pieces
    (buckets x layers) that hands each eager warm call's blocks back to the driver only for
    the next one to cudaMalloc them again, and a collection can take tens of milliseconds.
    The pieces leave nothing to free between captures: collect once, then skip both."""
    gc.collect()
    saved = gc.collect, torch.cuda.empty_cache
    gc.collect, torch.cuda.empty_cache = (lambda *args: 0), (lambda: None)
    try:
        yield
    finally:
        gc.collect, torch.cuda.empty_cache = saved


def capture_graph(fn: Callable[[], None], pool: Any) -> Replay:
    """`fn` captured into a CUDA graph in `pool` (after one eager call that compiles and
    warms what it launches); returns the graph's replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        fn()
    return graph.replay


class PiecewiseGraphRunner:
    """Replays steps of up to `buckets[-1]` tokens piecewise (see the module docstring).

    `capture` may run again (a new pass over every bucket into the same buffers and pool);
    `num_capture_passes` counts passes.
    """

    def __init__(self, model: torch.nn.Module, buckets: list[int], device: torch.device,
                 pool: Any = None, capture: Callable[[Replay, Any], Replay] | None = None
                 ) -> None:
        self.model = model
        self.buckets = sorted(buckets)
        self.pool = pool
        # `capture_graph` unless given: the CPU tests replay eagerly through the same plumbing.
        self._capture = capture or capture_graph
        size = self.buckets[-1]
        self.input_ids = torch.zeros(size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((size,), -1, dtype=torch.int64, device=device)
        self.q = self.attn_out = self.residual = self.hidden = torch.empty(0)
        self.replays: dict[int, list[Replay]] = {}
        self.num_capture_passes = 0

    @property
    def max_num_tokens(self) -> int:
        return self.buckets[-1]

    def can_run(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` has captured pieces to replay."""
        return bool(self.replays) and 0 < num_tokens <= self.max_num_tokens

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every piece at every bucket, largest first (smaller ones reuse its pool
        blocks); padded rows (all of them here) store no K/V."""
        self.slot_mapping.fill_(-1)
        self._allocate_buffers()
        with _without_per_capture_cleanup():
            for size in reversed(self.buckets):
                self.replays[size] = [self._capture(self._piece_fn(i, size), self.pool)
                                      for i in range(self.model.num_pieces)]
        if self.input_ids.is_cuda:
            torch.cuda.synchronize()
        self.num_capture_passes += 1

    def _allocate_buffers(self) -> None:
        """q / attention output / residual / hidden buffers at the largest bucket, shaped as
        piece 0 returns them (one eager call, nothing stored: every slot is -1)."""
        if self.q.numel():
            return
        size = self.max_num_tokens
        q, residual = self.model.piece(0, self.input_ids, None, self.positions,
                                       self.slot_mapping)
        def zeros(shape: torch.Size) -> torch.Tensor:  # contiguous, whatever q's strides
            return torch.zeros(shape, dtype=residual.dtype, device=residual.device)

        self.q = zeros(q.shape)
        self.attn_out = zeros(q.shape)  # zeros: padded rows read it, finite is enough
        self.residual, self.hidden = zeros(residual.shape), zeros((size, residual.shape[-1]))

    def _piece_fn(self, i: int, size: int) -> Callable[[], None]:
        """Piece `i` over the first `size` rows of the buffers, outputs copied into them."""
        def run() -> None:
            x = self.input_ids[:size] if i == 0 else self.attn_out[:size]
            residual = None if i == 0 else self.residual[:size]
            out, residual = self.model.piece(i, x, residual, self.positions[:size],
                                             self.slot_mapping[:size])
            if residual is None:  # the last piece: final hidden states
                self.hidden[:size].copy_(out)
            else:
                self.q[:size].copy_(out)
                self.residual[:size].copy_(residual)
        return run

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor:
        """One step: inputs into the buffers, padded to its bucket; each piece replayed with
        the attention of its layer run eagerly after it; returns `hidden[:n]` (a view of a
        buffer the next step overwrites). Allocates only what the eager attention does (its
        scratch, at most that of warmup's eager step at max_num_batched_tokens)."""
        n = input_ids.shape[0]
        size = bucket_for(self.buckets, n)
        if size is None or not self.replays:
            raise ValueError(f"a step of {n} tokens: piecewise graphs hold at most "
                             f"{self.max_num_tokens} (max_num_batched_tokens)")
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        if n < size:
            self.slot_mapping[n:size].fill_(-1)  # padded rows store nothing
        q, out = self.q[:n], self.attn_out[:n]
        replays = self.replays[size]
        for i, replay in enumerate(replays):
            replay()
            if i < len(replays) - 1:
                self.model.attend(i, q, metadata, out)
        return self.hidden[:n]

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the static buffers (the pool is on top)."""
        return sum(t.numel() * t.element_size() for t in (
            self.input_ids, self.positions, self.slot_mapping, self.q, self.attn_out,
            self.residual, self.hidden))
