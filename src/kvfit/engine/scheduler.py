"""Continuous batching: chunked prefills mixed with decodes under a token budget."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterable

from kvfit.connectors import KVConnector, KVLoadError
from kvfit.engine.block_manager import BlockManager
from kvfit.engine.config import SCHEDULING_POLICIES
from kvfit.engine.detokenizer import Detokenizer
from kvfit.engine.metrics import ITERATION_TOKENS_BUCKETS
from kvfit.engine.sequence import (
    PENDING_TOKEN,
    ModelOutput,
    ScheduledBatch,
    Sequence,
    SequenceStatus,
)


class Scheduler:
    """Decides which sequences run each step and applies the step's results.

    Each step, running decodes go first, then continuing and new prefills share the remaining
    `max_num_batched_tokens`, cut into chunks at the budget (and at
    `long_prefill_token_threshold` when set, so one long prompt cannot take a whole step).
    When blocks run out, the newest running sequence is preempted: its blocks are freed and it
    goes back to the front of the waiting queue, to be recomputed with its generated tokens as
    prompt (its full blocks usually come back as prefix-cache hits).

    `scheduling_policy="priority"` (vLLM's) orders by `(priority, seq_id)` instead of arrival
    alone: the waiting queue is kept in that order, running sequences are scheduled in it
    (decodes before prefills within a priority), and the preempted one is the last in it.
    A waiting request never preempts a running one, whatever their priorities, as in vLLM:
    preemption only makes room for sequences already running.

    A step's results are applied in two parts, so the next step can be scheduled while this one
    runs: `advance` when it is launched (tokens computed, a `PENDING_TOKEN` per sampled
    sequence), `update` when its output arrives (tokens, logprobs, stop checks).

    With a KV connector (its scheduler side), a starting sequence also takes the blocks an
    external store holds past its local prefix hit: they count as computed, and the step's
    `kv_connector_meta` has the worker load them before the forward (and save what it fills).
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_manager: BlockManager,
        eos_token_id: int | Iterable[int] | None,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        detokenizer: Detokenizer | None = None,
        kv_connector: KVConnector | None = None,
    ) -> None:
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_model_len", max_model_len),
        ):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0 = off), "
                f"got {long_prefill_token_threshold}"
            )
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        if eos_token_id is None:
            eos_token_id = ()
        elif isinstance(eos_token_id, int):
            eos_token_id = (eos_token_id,)
        self.eos_token_ids = frozenset(eos_token_id)
        # The first is the model's EOS (stop_reason None); vLLM adds the others (a chat
        # model's end-of-turn ids in generation_config.json) to a request's stop tokens, so a
        # completion they end reports the id as its stop_reason.
        self.primary_eos = next(iter(eos_token_id), None)
        if scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}; got {scheduling_policy!r}")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.by_priority = scheduling_policy == "priority"
        self.detokenizer = detokenizer or Detokenizer(None)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is last
        # While `paused`, requests added are held here, in the order they came, and join
        # `waiting` at `resume`: outside it, nothing counts them as work to step or drain.
        self.paused = False
        self.held: list[Sequence] = []
        self.num_preemptions = 0
        # Steps launched, the tokens they computed, and the decode-only ones (one token per
        # sequence: what a decode graph runs): the batch's shape over a run, e.g. a served
        # load's against offline `generate`'s.
        self.num_steps = self.num_step_tokens = self.num_decode_steps = 0
        # Steps by the tokens they computed: one count per `ITERATION_TOKENS_BUCKETS` bound
        # (a step counts in the first that holds it), then those past the last.
        self.step_token_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        # Tokens sampled, and prompt tokens of sequences that got their first (vLLM's prompt
        # and generation throughput: a prompt counts once it is prefilled, cached or not).
        self.num_generated_tokens = self.num_prefilled_tokens = 0
        self.kv_connector = kv_connector
        # Prompt tokens whose K/V came from the connector's store (not the local prefix cache).
        self.num_external_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        """Queue `seq`; a request that could never run raises ValueError and changes nothing."""
        self._check_fits(seq)
        seq.status = SequenceStatus.WAITING
        seq.queued_time = time.monotonic()
        if self.paused:
            self.held.append(seq)
        else:
            self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=_priority_order)
        else:
            self.waiting.append(seq)

    def pause(self) -> None:
        """Hold every request added from now on (`held`) until `resume`; those queued or
        running already are the caller's to drain."""
        self.paused = True

    def resume(self) -> None:
        """Queue the held requests, as though they were added now in the order they came (their
        queue time counts from their `add`)."""
        self.paused = False
        held, self.held = self.held, []
        for seq in held:
            self._enqueue(seq)

    def has_unfinished(self) -> bool:
        """Whether any sequence is queued or running (held ones wait for `resume`, not a step)."""
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        """Pick the next step's sequences and token counts; None when nothing can run."""
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch(seqs=[], num_new_tokens=[])
        num_preempted = self.num_preemptions
        # This loop runs for every running sequence at every step: its checks are written
        # out (`_chunk_size`, `append_slots`), and a sequence whose blocks already hold its
        # chunk (a decode, most steps) takes none.
        RUNNING = SequenceStatus.RUNNING  # noqa: N806
        block_size, max_model_len = self.block_manager.block_size, self.max_model_len
        threshold = self.long_prefill_token_threshold
        seqs, num_new_tokens = batch.seqs, batch.num_new_tokens
        # Stable sort: decodes first, each group in admission order (by priority, first).
        for seq in sorted(self.running, key=_priority_then_kind if self.by_priority
                          else _is_prefill):
            if budget == 0:
                break
            if seq.status is not RUNNING:  # preempted earlier in this loop
                continue
            tokens = seq.token_ids
            num_tokens = len(tokens)
            if tokens[-1] == PENDING_TOKEN and (  # its pending token is its last (by length)
                    num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
                    or num_tokens >= max_model_len):
                continue
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            if threshold and num_new > 1:
                num_new = min(num_new, threshold)
            if (seq.num_computed_tokens + num_new <= len(seq.block_table) * block_size
                    or self._reserve_slots(seq, num_new, batch)):
                seqs.append(seq)
                num_new_tokens.append(num_new)
                budget -= num_new
        # After a preemption the cache is full: admitting new work would only thrash.
        if self.num_preemptions == num_preempted:
            i = 0
            while i < len(self.waiting) and budget and len(self.running) < self.max_num_seqs:
                seq = self.waiting[i]
                if self._waits_for_parent(seq):
                    i += 1
                    continue
                first_start = seq.num_cached_tokens < 0
                self.block_manager.allocate(seq)
                num_local_hits = seq.num_computed_tokens
                num_external = self._take_external_hits(seq)
                num_new = self._chunk_size(seq, budget)
                if not self.block_manager.append_slots(seq, num_new):
                    self._release(seq)
                    if first_start:  # not started after all
                        seq.num_cached_tokens = -1
                    break
                if first_start:
                    seq.num_cached_tokens += num_external
                    seq.scheduled_time = time.monotonic()
                    self.block_manager.record_prefix_lookup(len(seq), num_local_hits)
                if num_external:
                    self.kv_connector.update_state_after_alloc(seq, num_external)
                    self.num_external_hit_tokens += num_external
                del self.waiting[i]
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
        if not batch.seqs:
            return None
        if self.kv_connector is not None:
            batch.kv_connector_meta = self.kv_connector.build_connector_meta(
                batch.seqs, batch.num_new_tokens)
        return batch

    def _take_external_hits(self, seq: Sequence) -> int:
        """Count the tokens the connector's store holds past `seq`'s local hit as computed;
        how many. Like local hits, none for a request that wants prompt logprobs."""
        if self.kv_connector is None or seq.sampling_params.prompt_logprobs is not None:
            return 0
        num_external = self.kv_connector.get_num_new_matched_tokens(seq)
        seq.num_computed_tokens += num_external
        return num_external

    def recompute_lost_blocks(self, error: KVLoadError) -> None:
        """A launch could not load some external blocks (and ran nothing): each sequence they
        belong to computes again from its first lost token; the store stops offering them."""
        for seq in self.running:
            first = error.first_lost_token.get(seq.seq_id)
            if first is not None and first < seq.num_computed_tokens:
                self.num_external_hit_tokens -= seq.num_computed_tokens - first
                seq.num_computed_tokens = first
                seq.num_cached_tokens = min(seq.num_cached_tokens, first)
        self.kv_connector.loads_failed(error)

    def postprocess(self, batch: ScheduledBatch, output: ModelOutput) -> list[Sequence]:
        """Apply a step's model output to its sequences; returns those that finished."""
        self.advance(batch)
        return self.update(batch, output)

    def advance(self, batch: ScheduledBatch) -> None:
        """Account for a launched step: its chunks are computed (their full blocks become
        prefix-cache hits) and each sequence it samples ends with a `PENDING_TOKEN`. (The
        engine tells a KV connector the step launched as soon as it did: `launched`.)"""
        num_tokens = batch.num_tokens
        self.num_steps += 1
        self.num_step_tokens += num_tokens
        self.step_token_counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self.num_decode_steps += num_tokens == len(batch)  # no sequence computed more
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq.status is not SequenceStatus.RUNNING:  # finished or aborted meanwhile
                continue
            seq.num_computed_tokens += num_new
            self.block_manager.cache_computed_blocks(seq)
            if seq.num_computed_tokens == len(seq):
                seq.append_token(PENDING_TOKEN)

    def update(self, batch: ScheduledBatch, output: ModelOutput) -> list[Sequence]:
        """Apply an advanced step's output: sampled tokens in place of the pending ones,
        logprobs, stop checks. Returns the sequences that finished."""
        finished = []
        num_sampled = 0
        FINISHED = SequenceStatus.FINISHED  # noqa: N806
        for i, (seq, token_id, logprobs, prompt_logprobs) in enumerate(zip(
                batch.seqs, output.sampled_token_ids, output.logprobs, output.prompt_logprobs,
                strict=True)):
            if seq.status is FINISHED:  # aborted, or stopped by an earlier step's token
                continue
            if prompt_logprobs is not None:
                self._record_prompt_logprobs(seq, output, i)
            if token_id is None:
                continue
            # A sequence preempted while this step ran is waiting: it keeps the token.
            seq.resolve_pending_token(token_id)
            num_sampled += 1
            if not seq.first_token_time:  # one clock read per sequence, not per token
                seq.first_token_time = time.monotonic()
                self.num_prefilled_tokens += seq.num_prompt_tokens
            if logprobs is not None:
                seq.logprobs.append(self.detokenizer.annotate(logprobs))
            if self._check_stop(seq, token_id):
                self._finish(seq)
                finished.append(seq)
        self.num_generated_tokens += num_sampled
        if finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
            if any(seq.is_finished for seq in self.waiting):
                self.waiting = deque(seq for seq in self.waiting if not seq.is_finished)
        return finished

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of the request `request_id` now (finish_reason "abort"): all
        of its `n` completions that are queued, running or held."""
        aborted = []
        for queue in (self.waiting, self.running, self.held):
            mine = [seq for seq in queue if seq.request_id == request_id]
            for seq in mine:
                queue.remove(seq)
            aborted += mine
        for seq in aborted:
            if seq.has_pending_token:  # the step in flight samples it, and `update` skips it:
                seq.token_ids.pop()  # the output would end with the placeholder
            seq.finish_reason = "abort"
            self._finish(seq)
        return aborted

    def _waits_for_parent(self, seq: Sequence) -> bool:
        """Whether a sibling completion should wait for its parent to compute the shared
        prompt, whose full blocks then become its prefix-cache hits (rather than computing
        the same prompt twice in one step)."""
        parent = seq.parent
        return (parent is not None and not parent.is_finished
                and self.block_manager.enable_prefix_caching
                and seq.sampling_params.prompt_logprobs is None
                and parent.num_computed_tokens < parent.num_prompt_tokens - 1)

    def preempt_tail_holders(self, num_blocks: int) -> list[Sequence]:
        """Preempt every running sequence holding a block id >= `num_blocks`, so the cache can
        shrink to `num_blocks`; returns them. They are recomputed like any preempted sequence,
        and keep their admission order at the front of the waiting queue."""
        victims = [seq for seq in reversed(self.running)
                   if any(block_id >= num_blocks for block_id in seq.block_table)]
        for seq in victims:
            self._preempt(seq)
        return victims

    def _record_prompt_logprobs(self, seq: Sequence, output: ModelOutput, i: int) -> None:
        done = len(seq.prompt_logprobs)
        first = done if output.prompt_logprobs_first is None else output.prompt_logprobs_first[i]
        if first > done:
            raise RuntimeError(f"sequence {seq.seq_id}: prompt logprobs from token {first} "
                               f"arrived with only {done} recorded")
        seq.prompt_logprobs.extend(None if entry is None else self.detokenizer.annotate(entry)
                                   for entry in output.prompt_logprobs[i][done - first :])

    def _check_fits(self, seq: Sequence) -> None:
        num_prompt = seq.num_prompt_tokens
        if num_prompt < 1:
            raise ValueError("the prompt is empty: a request needs at least one prompt token")
        if num_prompt + 1 > self.max_model_len:
            raise ValueError(
                f"prompt of {num_prompt} tokens leaves no room to generate within "
                f"max_model_len={self.max_model_len}; shorten the prompt or raise max_model_len"
            )
        # The last token is sampled, never computed, so it needs no cache slot.
        max_len = min(num_prompt + seq.sampling_params.max_tokens, self.max_model_len)
        bm = self.block_manager
        num_blocks = bm.blocks_for(max_len - 1)
        if num_blocks > bm.num_blocks:
            raise ValueError(
                f"request needs up to {num_blocks} KV cache blocks ({max_len} tokens) but the "
                f"cache size is {bm.num_blocks} blocks of {bm.block_size} tokens; lower "
                f"max_tokens or max_model_len, or give the KV cache more memory"
            )
        if seq.sampling_params.stop and self.detokenizer.tokenizer is None:
            raise ValueError(
                "SamplingParams.stop needs a tokenizer and the model has none; "
                "use stop_token_ids instead"
            )

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        num_new = min(seq.num_uncomputed_tokens, budget)
        if self.long_prefill_token_threshold and num_new > 1:
            num_new = min(num_new, self.long_prefill_token_threshold)
        return num_new

    def _reserve_slots(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> bool:
        """Make room for `seq`'s chunk, preempting the newest sequences not in `batch` (by
        priority, the last in `(priority, seq_id)` order)."""
        while not self.block_manager.append_slots(seq, num_new):
            unscheduled = (s for s in reversed(self.running) if s not in batch.seqs)
            victim = (max(unscheduled, key=_priority_order) if self.by_priority
                      else next(unscheduled))
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        if self.by_priority:  # before every later arrival of its priority
            bisect.insort(self.waiting, seq, key=_priority_order)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _check_stop(self, seq: Sequence, token_id: int) -> bool:
        params = seq.sampling_params
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        may_stop = num_output >= params.min_tokens
        eos = may_stop and not params.ignore_eos and token_id in self.eos_token_ids
        if eos or may_stop and token_id in params.stop_token_ids:
            # As in vLLM, the stop token's text (EOS's too, where skip_special_tokens keeps
            # it) is in the output only with include_stop_str_in_output.
            if params.include_stop_str_in_output and (params.detokenize or params.stop):
                self.detokenizer.step(seq, check_stop=False)
            seq.finish_reason = "stop"
            seq.stop_reason = None if eos and token_id == self.primary_eos else token_id
            return True
        stop = None
        if params.detokenize or params.stop:
            # Stop strings only in the text of tokens past the first min_tokens (vLLM's `>`):
            # that text is kept, as EOS and stop ids keep it (banned from sampling below
            # min_tokens, they end the output at token min_tokens + 1 at the earliest). At
            # `>=`, the min_tokens-th token's text could end it and be cut away with the stop
            # string: min_tokens=1 did not keep a one-token stop string from ending at once.
            stop = self.detokenizer.step(seq, check_stop=num_output > params.min_tokens)
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
            return True
        if num_output >= params.max_tokens or num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            return True
        return False

    def _finish(self, seq: Sequence) -> None:
        if self.kv_connector is not None:
            self.kv_connector.request_finished(seq)
        self.block_manager.free(seq)
        self.detokenizer.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finished_time = time.monotonic()


def _is_prefill(seq: Sequence) -> bool:
    """Whether `seq` computes more than one token next (`schedule` orders decodes first)."""
    return len(seq.token_ids) - seq.num_computed_tokens > 1


def _priority_order(seq: Sequence) -> tuple[int, int]:
    return seq.priority, seq.seq_id


def _priority_then_kind(seq: Sequence) -> tuple[int, bool, int]:
    return seq.priority, _is_prefill(seq), seq.seq_id
