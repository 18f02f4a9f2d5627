"""The model runner: turns a `ScheduledBatch` into model inputs, runs the model (eagerly or from a
CUDA graph) and samples. It owns the model, the KV cache and the sampler of one device."""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch

from kvfit.batch_invariant import batch_invariant_mode
from kvfit.distributed import broadcast
from kvfit.engine import sampler as sampler_module
from kvfit.engine.async_output import AsyncModelOutput, PromptLogprobsPart
from kvfit.engine.config import EngineConfig
from kvfit.engine.cuda_graph import CUDAGraphRunner
from kvfit.engine.sampler import Sampler, SamplingMetadata, logprobs_at
from kvfit.engine.sampling_features import WarmupLimits, worst_case_params
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import PENDING_TOKEN, ModelOutput, ScheduledBatch, Sequence
from kvfit.engine.transfer import to_device, to_device_packed, to_host
from kvfit.graphs.buckets import default_buckets
from kvfit.graphs.piecewise import PiecewiseGraphRunner
from kvfit.kv.cache import ExtensibleKVCache
from kvfit.kv_quant import is_fp8
from kvfit.models.loader import load_model
from kvfit.models.weight_arena import WeightArena
from kvfit.ops import small_batch
from kvfit.ops.attention import AttentionMetadata
from kvfit.ops.attention_input import fused_decode_input
from kvfit.ops.sm_count import num_sms
from kvfit.ops.small_batch import SplitKScratch, small_batch_kernels

T = TypeVar("T")

_NUM_COMPUTED = operator.attrgetter("num_computed_tokens")
_TOKEN_IDS = operator.attrgetter("token_ids")
_BLOCK_TABLE = operator.attrgetter("block_table")


def _in_kernel_mode(method: Callable[..., T]) -> Callable[..., T]:
    """A `ModelRunner` method run with the batch-invariant mode on when the engine is
    `deterministic`: every op of the steps it launches or the graphs it captures then runs
    its batch-invariant kernel (`kvfit.batch_invariant`). Likewise the small-batch kernels
    (`kvfit.ops.small_batch`) when `small_batch_kernels` is set, and decode steps' fused
    attention input (`kvfit.ops.attention_input`) when `fused_decode_input` is, outside that
    mode."""
    @functools.wraps(method)
    def wrapped(self: ModelRunner, *args: object, **kwargs: object) -> T:
        config = self.config
        with (batch_invariant_mode(config.deterministic),
              small_batch_kernels(config.runs_small_batch_kernels, self.split_k_scratch),
              fused_decode_input(config.runs_fused_decode_input)):
            return method(self, *args, **kwargs)

    return wrapped


class ModelRunner:
    """Runs one device's model over scheduled batches.

    The KV cache is created by `initialize_kv_cache` (extensible: capacity reserved, minimum
    committed) and grown by `ensure_blocks` / `commit_blocks`; its layer views never move, so
    graphs captured after `initialize_kv_cache` stay valid whatever is committed later.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = config.device
        mc = config.model_config
        self.block_size = config.cache_config.block_size
        self.max_model_len = mc.max_model_len
        self.max_num_blocks_per_seq = math.ceil(self.max_model_len / self.block_size)
        self.model = load_model(mc.hf_config, mc.model, mc.dtype, self.device, mc.load_format)
        # Sleep mode moves the parameters into a VMM arena before anything (graphs) captures
        # their addresses, so sleep can drop the pages and wake restore them in place.
        self.weight_arena = (WeightArena(self.model, self.device) if config.enable_sleep_mode
                             else None)
        self.sampler = Sampler(self.device, mc.seed, config.scheduler_config.max_num_seqs
                               if sampler_module.GREEDY_ARGMAX_KERNEL else 0, mc.logprobs_mode)
        self.eos_token_ids = mc.eos_token_ids
        self.kv_cache: ExtensibleKVCache | None = None
        self.kv_cache_spec = config.kv_cache_spec()
        self.split_tickets = self._split_tickets(config)
        self.split_k_scratch = self._split_k_scratch(config)
        self._num_allocated_blocks = 0
        self._allocated_cache: torch.Tensor | None = None  # without the extensible cache
        self.graphs: CUDAGraphRunner | None = None
        self.piecewise: PiecewiseGraphRunner | None = None  # prefill and mixed steps
        # The last launched step's sampled ids (on the device) and the row of each sequence:
        # where the next step reads the tokens its sequences still hold as PENDING_TOKEN.
        self._last_sampled: tuple[torch.Tensor, dict[int, int]] | None = None
        # `calculate_kv_scales`: the first real step sets the FP8 cache's scales (warmup's
        # dummy steps calculate too, so their memory is measured, then restore 1.0).
        self.kv_scales_pending = config.cache_config.calculate_kv_scales
        self.use_checkpoint_kv_scales()

    def _split_tickets(self, config: EngineConfig) -> torch.Tensor | None:
        """`AttentionMetadata.split_tickets` for the fused decode on CUDA (else None): one
        counter per (sequence, KV head) of the largest decode step, a graph's padded rows
        included; 4 bytes each. Allocated once: graphs capture its address."""
        if not config.runs_fused_decode_input or self.device.type != "cuda":
            return None
        rows = max([config.scheduler_config.max_num_seqs, *config.cuda_graph_sizes])
        return torch.zeros(rows * self.kv_cache_spec.num_kv_heads, dtype=torch.int32,
                           device=self.device)

    def _split_k_scratch(self, config: EngineConfig) -> SplitKScratch | None:
        """The small-batch kernels' scratch on CUDA where `triton_skinny`'s `SPLIT_K_DEFAULT`
        or `small_batch.QKV_EPILOGUE_DEFAULT` is on (else None: no launch splits, no QKV
        epilogue), with a head ticket for each of this rank's q, k and v heads where the
        latter is: allocated here, before warmup measures memory and graphs capture its
        addresses (~0.5 MB)."""
        if not config.runs_small_batch_kernels or self.device.type != "cuda":
            return None
        from kvfit.ops import triton_skinny  # CUDA-only dependency

        if not (triton_skinny.SPLIT_K_DEFAULT or small_batch.QKV_EPILOGUE_DEFAULT):
            return None
        heads = 0
        if small_batch.QKV_EPILOGUE_DEFAULT:
            tp = config.parallel_config.tensor_parallel_size
            heads = (config.model_config.hf_config.num_attention_heads // tp
                     + 2 * self.kv_cache_spec.num_kv_heads)
        return triton_skinny.allocate_split_k_scratch(self.device, heads)

    # -- KV cache -----------------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int, extensible: bool) -> None:
        """Create the cache for `num_blocks` and bind it to the model.

        Extensible: `num_blocks` is the reserved capacity and only the minimum is committed
        (the `allocate()` hook); otherwise `num_blocks` are allocated outright with torch.
        """
        spec = self.kv_cache_spec
        if extensible:
            self.kv_cache = ExtensibleKVCache(spec, num_blocks, self.device)
            self.kv_cache.allocate()
            self.model.bind_kv_cache(self.kv_cache.layer_views())
        else:
            # Zeroed: kernels read whole blocks, and garbage such as NaN in a slot past
            # seq_len would leak through a masked (0 * NaN) product.
            cache = torch.zeros(spec.shape(num_blocks), dtype=spec.dtype, device=self.device)
            self.model.bind_kv_cache(spec.layer_views(cache))
            self._allocated_cache = cache
        self._num_allocated_blocks = num_blocks

    @property
    def num_blocks(self) -> int:
        """Blocks the model may address now: committed (extensible) or allocated."""
        if self.kv_cache is not None:
            return self.kv_cache.committed_blocks
        return self._num_allocated_blocks

    def ensure_blocks(self, num_blocks: int) -> None:
        """Make blocks [0, num_blocks) addressable (commits more of an extensible cache)."""
        if self.kv_cache is not None:
            self.kv_cache.ensure_blocks(num_blocks)
        elif num_blocks > self.num_blocks:
            raise ValueError(f"the KV cache holds {self.num_blocks} blocks, {num_blocks} asked")

    def commit_blocks(self, num_blocks: int, defragment: bool = False,
                      elastic: bool = False) -> None:
        """Commit exactly `num_blocks` of the extensible cache (grow or shrink); same addresses.
        `defragment`: each segment one physical allocation, contents zeroed (for a connector);
        `elastic`: a runtime resize, grown in small chunks (`ExtensibleKVCache.commit`)."""
        if self.kv_cache is None:
            raise RuntimeError("commit_blocks needs the extensible KV cache")
        self.kv_cache.commit(num_blocks, defragment=defragment, elastic=elastic)
        if defragment:  # fresh device pages hold garbage, which a masked product can leak
            for view in self.kv_cache.committed_views():
                view.zero_()

    def kv_cache_views(self) -> list[torch.Tensor]:
        """Per segment `[num_blocks, *block_shape]` over the backed blocks only (each storage
        exactly their bytes under the extensible cache): what a KV connector registers."""
        if self.kv_cache is not None:
            return self.kv_cache.committed_views()
        spec = self.kv_cache_spec
        return list(self._allocated_cache.view(spec.num_segments, self._num_allocated_blocks,
                                               *spec.block_shape))

    def shutdown(self) -> None:
        """Free the graphs and the KV cache (the reservation too); the runner is done."""
        self.graphs = self.piecewise = None
        self.model = self.weight_arena = self._allocated_cache = None
        if self.kv_cache is not None:
            self.kv_cache.free()
            self.kv_cache = None

    # -- inputs -------------------------------------------------------------------------------

    def prepare_inputs(
        self, batch: ScheduledBatch
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """`(input_ids, positions, attn_metadata, logits_indices)` for one step.

        Tokens of all sequences are packed along dim 0; `logits_indices` are the rows of the
        sequences whose chunk reaches their last token (the ones sampled). Vectorized over the
        batch: only the block table and token gathers touch each sequence in Python. A
        `PENDING_TOKEN` is read on the device from the last step's sampled ids.
        """
        bs, num_seqs, seqs = self.block_size, len(batch), batch.seqs
        num_new = np.asarray(batch.num_new_tokens, dtype=np.int64)
        # The per-sequence reads are maps over attrgetters: at hundreds of sequences a step,
        # the host's Python time here sets the pace of small models' steps.
        starts_list = list(map(_NUM_COMPUTED, seqs))
        starts = np.array(starts_list, dtype=np.int64)
        token_lists = list(map(_TOKEN_IDS, seqs))
        seq_lens = starts + num_new
        query_start_loc = np.concatenate([[0], np.cumsum(num_new)])
        num_tokens = int(query_start_loc[-1])
        width = -(-int(seq_lens.max()) // bs)
        pad = [0] * width
        # One flat fromiter over every row: a numpy row assignment per sequence cost ten times
        # as much (~0.5 us each).
        block_table = np.fromiter(
            itertools.chain.from_iterable(
                table[:width] if len(table) >= width else table + pad[len(table):]
                for table in map(_BLOCK_TABLE, seqs)),
            np.int32, num_seqs * width).reshape(num_seqs, width)
        positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - starts, num_new)
        blocks = block_table[np.repeat(np.arange(num_seqs), num_new), positions // bs]
        slot_mapping = blocks.astype(np.int64) * bs + positions % bs
        if num_tokens == num_seqs:  # a decode step: one token each
            input_ids = np.fromiter(map(operator.getitem, token_lists, starts_list), np.int64,
                                    num_tokens)
        else:
            input_ids = np.fromiter(
                itertools.chain.from_iterable(
                    t[a : a + n] for t, a, n in zip(token_lists, starts_list,
                                                    batch.num_new_tokens, strict=True)),
                np.int64, num_tokens)
        pending = np.flatnonzero(input_ids == PENDING_TOKEN)
        input_ids[pending] = 0
        pending_src = self._pending_token_rows(
            [batch.seqs[i] for i in np.searchsorted(query_start_loc, pending, side="right") - 1])
        ends = np.fromiter(map(len, token_lists), np.int64, num_seqs)
        sampled = seq_lens == ends
        num_sampled = int(sampled.sum())
        # Packed at one entry per sequence whatever samples, so that the inputs' size does not
        # depend on it: warmup's largest prefill samples no row, and a real step of the same
        # chunks whose prompts end there held one entry more per row it sampled.
        logits_indices = np.zeros(num_seqs, np.int64)
        logits_indices[:num_sampled] = query_start_loc[1:][sampled] - 1
        order = self._decode_order(seq_lens, num_new)
        (input_ids_t, positions_t, slot_mapping_t, logits_indices_t, pending_t, pending_src_t,
         query_start_loc_t, seq_lens_t, block_table_t, *order_t) = to_device_packed(
            self.device, input_ids, positions, slot_mapping, logits_indices, pending, pending_src,
            query_start_loc.astype(np.int32), seq_lens.astype(np.int32), block_table,
            *([] if order is None else [order]))
        logits_indices_t = logits_indices_t[:num_sampled]
        if len(pending) == num_tokens and np.array_equal(pending_src, np.arange(num_tokens)):
            # Every row pending, in the last step's order (a decode step of the same batch):
            # its sampled ids are the inputs as they lie, without a gather and a scatter.
            input_ids_t = self._last_sampled[0][:num_tokens]
        elif len(pending):
            input_ids_t[pending_t] = self._last_sampled[0][pending_src_t]
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping_t,
            query_start_loc=query_start_loc_t,
            seq_lens=seq_lens_t,
            block_table=block_table_t,
            max_query_len=int(num_new.max()),
            max_seq_len=int(seq_lens.max()),
            split_tickets=self.split_tickets,
            decode_order=order_t[0] if order_t else None,
        )
        return input_ids_t, positions_t, metadata, logits_indices_t

    def _decode_order(self, seq_lens: np.ndarray, num_new: np.ndarray) -> np.ndarray | None:
        """`AttentionMetadata.decode_order` on CUDA, where the split-KV decode kernel runs the
        decode rows (not in the deterministic mode); else None. Every step has one, prefill
        steps too (the decode kernel launches, all programs idle), so one kernel variant
        serves them all: warmup compiles it."""
        if self.device.type != "cuda" or self.config.deterministic:
            return None
        from kvfit.ops.decode_order import decode_order  # triton is a CUDA-only dependency

        spec = self.kv_cache_spec
        return decode_order(seq_lens, num_new, spec.num_kv_heads, spec.head_dim, spec.dtype,
                            num_sms(self.device))

    def _pending_token_rows(self, seqs: list[Sequence]) -> np.ndarray:
        """Rows of the last step's sampled ids holding the pending tokens of `seqs`."""
        rows = self._last_sampled[1] if self._last_sampled is not None else {}
        missing = [seq.seq_id for seq in seqs if seq.seq_id not in rows]
        if missing:
            raise RuntimeError(f"sequences {missing} hold a pending token that the last step "
                               f"did not sample")
        return np.fromiter((rows[seq.seq_id] for seq in seqs), np.int64, len(seqs))

    # -- execution ----------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        """Run one step and wait for its output."""
        return self.launch(batch).result()

    @_in_kernel_mode
    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch) -> AsyncModelOutput:
        """Queue one step: forward, sampling of the sequences whose chunk ends, logprobs as
        asked, and the copies of the results to the host; returns without waiting for them."""
        input_ids, positions, metadata, logits_indices = self.prepare_inputs(batch)
        if self.kv_scales_pending:
            hidden = self._forward_calculating_kv_scales(input_ids, positions, metadata)
        elif self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(input_ids, positions, metadata)
        elif self.piecewise is not None and self.piecewise.can_run(batch.num_tokens):
            hidden = self.piecewise.run(input_ids, positions, metadata)
        else:
            hidden = self.model(input_ids, positions, metadata)
        sampled = [i for i, (s, n) in enumerate(_items(batch)) if _reaches_end(s, n)]
        output = AsyncModelOutput(len(batch), sampled, self._prompt_logprobs(batch, hidden))
        if sampled:
            seqs = [batch.seqs[i] for i in sampled]
            # Every row sampled (a decode step): the rows are the hidden states as they lie.
            rows = hidden if len(sampled) == batch.num_tokens else hidden[logits_indices]
            logits = self.model.compute_logits(rows)
            meta = SamplingMetadata.from_seqs(seqs, logits.shape[-1], self.device,
                                              self.eos_token_ids)
            sampler_output = self.sampler(logits, meta)
            # Every rank samples the same gathered logits; rank 0's ids are made everyone's,
            # so no kernel's rounding can let the ranks' next inputs differ.
            broadcast(sampler_output.sampled_token_ids, src=0)
            self._last_sampled = (sampler_output.sampled_token_ids,
                                  {seq.seq_id: row for row, seq in enumerate(seqs)})
            output.sampler_output, output.num_logprobs = sampler_output.to_host(), meta.num_logprobs
        output.record_event(self.device)
        return output

    def _forward_calculating_kv_scales(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor:
        """An eager forward that first sets every layer's FP8 scales from its K/V; they are
        fixed once it succeeds (a step that raised, e.g. out of memory, calculates again).
        Extra memory over a plain forward, one layer at a time: at most about six float32
        copies of the step's keys (24 x tokens x num_kv_heads x head_dim bytes, `stored_key`),
        which warmup's dummy steps make at `max_num_batched_tokens` and measure."""
        self.model.set_calculate_kv_scales(True)
        try:
            hidden = self.model(input_ids, positions, metadata)
        finally:
            self.model.set_calculate_kv_scales(False)
        self.kv_scales_pending = False
        return hidden

    def use_checkpoint_kv_scales(self) -> None:
        """Make the k/v scales the checkpoint gave (`checkpoint_kv_scales`, as last loaded)
        the FP8 cache's, unless `calculate_kv_scales` sets them: vLLM's semantics (a 16-bit
        cache has no scales)."""
        if is_fp8(self.kv_cache_spec.dtype) and not self.config.cache_config.calculate_kv_scales:
            self.model.use_checkpoint_kv_scales()

    def kv_scales(self) -> list[tuple[float, float]]:
        """Per layer `(k_scale, v_scale)` on the host (reads the device)."""
        return [(float(k), float(v)) for k, v in self.model.kv_scales()]

    def _prompt_logprobs(
        self, batch: ScheduledBatch, hidden: torch.Tensor
    ) -> list[PromptLogprobsPart | None]:
        """Per sequence, the entries to append to its `prompt_logprobs` after this chunk.

        Row r scores token r + 1, so a chunk from `start` scores tokens `start + 1 ..`; token 0
        has no logprob (None). Entries already recorded are not computed again (a preempted
        sequence being recomputed); what is recorded may lag behind the steps in flight, so
        each part says which token it starts at and the scheduler drops what it already has.
        """
        out: list[PromptLogprobsPart | None] = [None] * len(batch)
        starts = np.cumsum([0, *batch.num_new_tokens])  # host copy of query_start_loc
        for i, (seq, n) in enumerate(_items(batch)):
            num = seq.sampling_params.prompt_logprobs
            if num is None:
                continue
            start, done = seq.num_computed_tokens, len(seq.prompt_logprobs)
            last = min(start + n, seq.num_prompt_tokens - 1)
            first = max(start + 1, done)
            with_token_0 = start == 0 and done == 0
            if first > last and not with_token_0:
                continue  # nothing left to score (a decode step)
            part = out[i] = PromptLogprobsPart(first_token=0 if with_token_0 else first,
                                               num_unscored=int(with_token_0))
            if first <= last:
                rows = hidden[starts[i] + first - 1 - start : starts[i] + last - start]
                targets = to_device(torch.tensor(seq.token_ids[first : last + 1]), hidden.device)
                for c, end in _chunks(len(rows), sampler_module.PROMPT_LOGPROBS_CHUNK):
                    # Logits inline, so a chunk's are freed before the next chunk's exist.
                    result = logprobs_at(self.model.compute_logits(rows[c:end]),
                                         targets[c:end], num)
                    part.chunks.append(tuple(to_host(t) for t in result))
        return out

    # -- warmup -------------------------------------------------------------------------------

    @property
    def warmup_params(self) -> SamplingParams:
        """Every sampling feature at its worst case (`worst_case_params`) for this model;
        warmup samples them with `self.sampler`, so in the engine's `logprobs_mode` (the
        processed modes' temporaries are largest with every filter on, as here)."""
        mc = self.config.model_config
        return worst_case_params(WarmupLimits(mc.hf_config.vocab_size, self.max_model_len,
                                              mc.max_logprobs, tuple(self.eos_token_ids)))

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, max_blocks: int, num_decodes: int = 0,
                  params: SamplingParams | None = None, max_context: int | None = None) -> None:
        """One step of `num_tokens` dummy tokens: `num_decodes` decodes (the rows sampled, with
        `params`; greedy when None), the rest prefill chunks of at most `max_model_len - 1`.

        The step is as large as a real one can be in every dimension that allocates: decodes
        attend over `max_model_len` tokens (the decode kernel's most KV splits); each prefill
        chunk is the last of a `max_model_len - 1`-token context (the longest a prefill
        attends over, as a chunked or prefix-cached prompt's later chunk does) inside a prompt
        one token longer, so it scores prompt logprobs at every one of its rows when `params`
        asks (a chunk that ends its prompt scores one fewer) beside the step's live
        activations, and it is not sampled; contexts are distinct tokens (the most penalty
        entries); decodes come in sibling pairs. Block ids wrap at the blocks the prefills
        address (at least one) or `max_blocks`, whichever is fewer, and those are committed
        first: reading a block twice costs no memory. While `calculate_kv_scales` waits for
        the first real step, the dummy step calculates them too (so that memory is measured)
        and leaves them at 1.0. `max_context` caps every context below `max_model_len` (a
        step of short sequences: the decode kernels' variant of one split per sequence).
        """
        params = params or SamplingParams(temperature=0.0, max_tokens=1)
        vocab_size = self.config.model_config.hf_config.vocab_size
        longest = self.max_model_len if max_context is None else min(max_context,
                                                                     self.max_model_len)
        longest_chunk = max(1, longest - 1)
        # Prefills shortest first: the step's last prompt-logprobs chunk is a whole one, made
        # while every other row's results are held, as a real step's can be (`_chunks`).
        lengths = [1] * num_decodes + sorted(_split(num_tokens - num_decodes, longest_chunk))
        contexts = [longest] * num_decodes + [longest_chunk] * (len(lengths) - num_decodes)
        prefill_blocks = sum(-(-c // self.block_size) for c in contexts[num_decodes:])
        num_blocks = min(max_blocks, max(1, prefill_blocks))
        self.ensure_blocks(num_blocks)
        block_ids = itertools.count()
        distinct = (np.arange(max(contexts) + 1) % vocab_size).tolist()
        seqs = []
        for i, (n, context) in enumerate(zip(lengths, contexts, strict=True)):
            decode = i < num_decodes
            # A prefill's prompt holds one token past its chunk: not sampled, every row scored.
            seq = Sequence(distinct[:context + (not decode)], params,
                           num_prompt_tokens=1 if decode else context + 1, sibling_index=i % 2)
            seq.num_computed_tokens = context - n
            seq.block_table = [next(block_ids) % num_blocks
                               for _ in range(-(-context // self.block_size))]
            seqs.append(seq)
        calculating = self.kv_scales_pending
        self.execute(ScheduledBatch(seqs, lengths))
        if calculating:  # dummy K/V must not set the scales: the first real step does
            for k_scale, v_scale in self.model.kv_scales():
                k_scale.fill_(1.0)
                v_scale.fill_(1.0)
            self.kv_scales_pending = True

    @torch.inference_mode()
    def profile_run(self) -> None:
        """The largest step the scheduler can issue, before the KV cache exists: a throwaway
        one-block cache is bound so attention runs (and its workspace is measured) too."""
        spec = self.kv_cache_spec
        scratch = torch.zeros(spec.shape(1), dtype=spec.dtype, device=self.device)
        # The scratch cache stays bound until `initialize_kv_cache` binds the real one.
        self.model.bind_kv_cache(spec.layer_views(scratch))
        self._num_allocated_blocks = 1
        self.dummy_run(self.config.scheduler_config.max_num_batched_tokens, 1,
                       params=self.warmup_params)

    @torch.inference_mode()
    def profile_sampling_run(self) -> None:
        """The most rows one step samples (`max_num_seqs`, within the token budget), every
        sampling feature at its worst case, beside a prefill of the rest of the budget, on
        `profile_run`'s scratch cache (its one block read again for every position): what
        sizing by estimate reads besides `profile_run`, whose prefills sample no row, since it
        sizes the cache before warmup samples anything (vLLM's profiling runs its sampler at
        `max_num_seqs` rows too)."""
        sc = self.config.scheduler_config
        self.dummy_run(sc.max_num_batched_tokens, 1,
                       min(sc.max_num_seqs, sc.max_num_batched_tokens), self.warmup_params)

    @_in_kernel_mode  # the graphs keep the kernels chosen at capture
    def capture_cuda_graphs(self) -> None:
        """Capture the graphs `cudagraph_mode` asks for against the current cache views, into
        one memory pool: piecewise graphs first (their largest bucket, max_num_batched_tokens,
        holds the largest intermediates, which smaller captures reuse), then decode graphs.
        A no-op under enforce_eager."""
        mode = self.config.cudagraph_mode
        if self.config.enforce_eager or mode == "NONE":
            return
        pool = self.piecewise.pool if self.piecewise is not None else (
            self.graphs.pool if self.graphs is not None else torch.cuda.graph_pool_handle())
        if mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
            if self.piecewise is None:
                buckets = default_buckets(self.config.scheduler_config.max_num_batched_tokens)
                self.piecewise = PiecewiseGraphRunner(self.model, buckets, self.device, pool)
            self.piecewise.capture()
        if mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE") and self.config.cuda_graph_sizes:
            if self.graphs is None:
                self.graphs = CUDAGraphRunner(
                    self.model, self.config.cuda_graph_sizes, self.max_num_blocks_per_seq,
                    self.max_model_len, self.device, pool, self.split_tickets,
                )
            self.graphs.capture()

    def drop_cuda_graphs(self) -> None:
        """Free the captured graphs and their pool (after the estimate's throwaway pass)."""
        self.graphs = self.piecewise = None


def _items(batch: ScheduledBatch) -> zip[tuple[Sequence, int]]:
    return zip(batch.seqs, batch.num_new_tokens, strict=True)


def _reaches_end(seq: Sequence, num_new_tokens: int) -> bool:
    return seq.num_computed_tokens + num_new_tokens == len(seq)


def _chunks(total: int, most: int) -> list[tuple[int, int]]:
    """`[start, end)` parts of `total` rows, at most `most` each, the short one first: a
    sequence's largest chunk is its last, computed while the rows before it hold their
    results (device memory on the CPU, where `to_host` copies nothing), which is the order
    warmup's prefills (shortest first) measure; a short chunk last let a real step of two
    prompts hold more than warmup's step of the same tokens."""
    first = total % most or most
    starts = [0, *range(first, total, most)]
    return list(zip(starts, [*starts[1:], total], strict=True))


def _split(total: int, most: int) -> list[int]:
    """`total` as parts of at most `most`, the last one shorter."""
    return [min(most, total - i) for i in range(0, total, most)]
