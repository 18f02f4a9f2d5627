"""Batch-invariant (deterministic) execution: `deterministic=True` / `--deterministic`.

While the mode is on (`batch_invariant_mode`, set by the model runner around every step and
graph capture), every op of the forward pass and of sampling reduces in an order fixed by the
row's own data: GEMMs with one tile shape and no split-K (`matmul`), attention over key tiles at
fixed positions by one kernel for prefill and decode (`ops.fixed_tile_attention`, the Triton
kernel's `batch_invariant`), log-sum-exp per row in fixed pieces (`logsumexp`), ties of top-n
broken by column. A request then gets the same token ids and logprobs alone or in any batch,
at any position, after a prefix-cache hit, a preemption or a chunk border, graphed or eager.
`registry` lists the ops with a self-test each that fails on a batch-dependent path.
"""

from kvfit.batch_invariant.mode import batch_invariant_mode, is_batch_invariant

__all__ = ["batch_invariant_mode", "is_batch_invariant"]
