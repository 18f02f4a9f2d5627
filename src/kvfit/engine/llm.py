"""`LLM`: offline generation over the engine, with vLLM's names."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as SequenceOf
from typing import Any

import torch
from tqdm.auto import tqdm

from kvfit.engine.config import EngineArgs
from kvfit.engine.engine_core import EngineCore
from kvfit.engine.input_processor import InputProcessor
from kvfit.engine.kv_resize import KVCacheResize
from kvfit.engine.llm_engine import LLMEngine
from kvfit.engine.metrics import Metric, RequestCounts, engine_metrics
from kvfit.engine.outputs import RequestOutput
from kvfit.engine.prompts import (
    Prompt,
    batch_args,
    check_vllm_request_args,
    describe,
    priorities,
    template_call_args,
)
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import Sequence
from kvfit.engine.sleep import SleepReport
from kvfit.engine.turn_lock import TurnLock
from kvfit.engine.vllm_compat import (
    VLLM_DEFAULT_VALUES,
    VLLM_NOOP_FLAGS,
    VLLM_NOOP_VALUES,
    VLLM_UNSUPPORTED_FLAGS,
)
from kvfit.kv.report import KVCacheReport
from kvfit.models.loader import load_tokenizer

logger = logging.getLogger(__name__)

Message = dict[str, str]
_NO_PROFILER = ("{call}: kvfit's engine has no profiler to start or stop; run LLM.generate "
                "under torch.profiler.profile() in your process, or "
                "kvfit.benchmarks.profiling.profile_run(run, llm, device), which annotates each "
                "engine step")
_NO_POOLING = ("LLM.{call}(): kvfit runs generative text models only, with no pooling runner "
               "(embeddings, classification, scores, rewards); use LLM.generate or LLM.chat, "
               "or their logprobs")
_NO_BEAM_SEARCH = ("LLM.beam_search(): kvfit has no beam search; sample several completions "
                   "(SamplingParams(n=..., logprobs=0)) and rank them by cumulative_logprob")
# Whether to show a progress bar, or (vLLM's) a tqdm class or factory that makes it.
UseTqdm = bool | Callable[..., tqdm]


class LLM:
    """An engine for offline batch generation.

    Keyword arguments beyond the named ones are `EngineArgs` fields (e.g.
    `gpu_memory_utilization`, `num_gpu_blocks_override`, `enable_extensible_kv_cache`).

    A batch is validated as a whole before any request is queued: one bad request raises a
    `ValueError` naming it and the setting to change, and nothing runs, so no other request is
    disturbed (vLLM raises at add time too).

    Thread-safe: calls from several threads take turns between engine steps, so `generate`
    calls on two threads share steps, and `sleep`, `resize_kv_cache`, `reset_prefix_cache`,
    `load_weights` or `shutdown` from another thread act between two steps of a running
    `generate` as they would between two calls (its requests finish first, are aborted or
    preempted as each call says; after `shutdown` it raises).
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        load_format: str = "auto",
        seed: int | None = 0,
        generation_config: str = "auto",
        **kwargs: Any,
    ) -> None:
        kwargs = _without_vllm_noops(kwargs)
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {', '.join(sorted(unknown))}")
        args = EngineArgs(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, load_format=load_format, seed=seed,
            generation_config=generation_config, **kwargs,
        )
        self.config = args.create_engine_config()
        try:
            self.tokenizer = load_tokenizer(args.tokenizer or model)
        except FileNotFoundError as e:
            if not args.tokenizer:
                raise
            raise ValueError(f"tokenizer={args.tokenizer!r} is neither a folder nor a built-in "
                             f"model; pass a folder holding tokenizer files (tokenizer.json, "
                             f"...)") from e
        if args.tokenizer and self.tokenizer is None:
            raise ValueError(f"tokenizer={args.tokenizer!r} holds no tokenizer files "
                             f"(tokenizer.json, tokenizer_config.json, ...)")
        mc = self.config.model_config
        # vLLM's first EOS is the tokenizer's, which a chat fine-tune may set to its
        # end-of-turn token without touching config.json or generation_config.json. First
        # here too: the others end a completion as stop tokens, which report their id.
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and 0 <= eos < mc.hf_config.vocab_size:
            mc.eos_token_ids[:] = [eos, *(i for i in mc.eos_token_ids if i != eos)]
        self.input_processor = InputProcessor(self.config, self.tokenizer)
        self.engine = EngineCore(self.config, self.tokenizer)
        self._request_counts = RequestCounts()
        # Held around every engine call, a step at a time: the engine is not thread-safe (two
        # threads stepping it corrupt its batches; a shutdown or sleep under a running step
        # unmaps the memory it reads, a segfault). Reentrant: `chat` calls `generate`, and a
        # front end's loop calls `sleep` from the thread that steps. Granted in turn, so that
        # a call from another thread does not wait out a whole `generate`.
        self._lock = TurnLock()
        self._num_runs = 0  # `_run` calls in progress, on any thread
        self._num_steps = 0  # engine steps taken by `_run` and `llm_engine` (`_step`)
        self._llm_engine: LLMEngine | None = None

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's stepping API over this engine, for scripts that add requests and step
        themselves: `add_request(request_id, prompt, params)`, `step() -> list[RequestOutput]`,
        `has_unfinished_requests()`, `abort_request(ids)` (see `LLMEngine`). Its requests share
        steps with `generate` calls on other threads; a `generate` returns its own results and
        leaves this loop's requests running."""
        with self._lock:
            if self._llm_engine is None:
                self._llm_engine = LLMEngine(self)
            return self._llm_engine

    @property
    def kv_cache_report(self) -> KVCacheReport:
        """How the KV cache was sized (method, blocks, the memory figures behind them)."""
        return self.engine.kv_cache_report

    @property
    def startup_stages(self) -> dict[str, float]:
        """Seconds each startup stage of the engine took, in the order they ran, then "total"
        (from the engine's start to ready, the tokenizer excluded). Stages: start_workers,
        load_weights, profile, allocate_kv_cache, warm_up, capture_graphs (absent when eager),
        size_kv_cache. A stage run twice adds its times into one entry; stages do not nest, so
        they sum to at most the total (the rest is the work between them)."""
        return dict(self.engine.startup_stages)

    def shutdown(self) -> None:
        """Free the model and the KV cache now rather than at garbage collection (to start
        another engine in the same process)."""
        with self._lock:
            self.engine.shutdown()

    # -- sleep mode (needs enable_sleep_mode=True) ---------------------------------------------

    def sleep(self, level: int = 1, mode: str = "wait") -> SleepReport:
        """Hand the device's memory back while keeping the engine: the KV cache's pages are
        released (its reservation and every view stay) and the weights' too, level 1 after a
        copy to pinned host memory, level 2 discarded. Buffers (rotary tables) and captured
        graphs stay, so `wake_up` recaptures nothing; torch's idle cache is returned.

        Requests still running are finished first (`mode="wait"`) or aborted (`"abort"`);
        no step touches released memory. Returns what was released and what stays resident,
        by kind (`SleepReport`, summed over the tensor-parallel ranks). Generating while
        asleep raises `RuntimeError`.
        """
        with self._lock:
            return self.engine.sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None, reload_weights: bool = True) -> None:
        """Restore what `tags` names (`"weights"`, `"kv_cache"`; None: everything asleep), each
        on its own if asked, at the addresses the graphs captured. The KV cache comes back
        zeroed for the same block count (the prefix cache was invalidated), or for fewer,
        with a warning, where the device no longer has the memory (`resize_kv_cache` grows it
        back); weights from their host copy, or after level 2 reloaded from the model's
        source, unless `reload_weights=False`: then `load_weights` must fill them before
        generating, which refuses to run until it has. Raises `RuntimeError` when a tag is not
        asleep, `KVCacheResizeError` when not even one max_model_len sequence's KV cache fits
        (it stays asleep: free memory and call it again)."""
        with self._lock:
            self.engine.wake_up(tags, reload_weights)

    @property
    def is_sleeping(self) -> bool:
        """Whether `sleep` released the weights or the KV cache and they are not all awake."""
        return self.engine.is_sleeping

    def load_weights(
        self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> None:
        """Replace weights in place from a state dict or `(name, tensor)` pairs with Hugging
        Face checkpoint names (e.g. from an RL trainer); any subset may be given. Asleep
        weights are woken for it (the KV cache is not), so after `sleep(level=2)` nothing is
        reloaded from disk. Graphs stay valid; the prefix cache is invalidated, and a KV
        connector's store (kv_connector_path, kv_offloading_size) serves nothing the old
        weights computed: it names the new weights' blocks anew and goes on with them."""
        if isinstance(weights, Mapping):
            weights = weights.items()
        with self._lock:
            self.engine.load_weights(weights)

    update_weights = load_weights

    # -- resizing the KV cache at runtime (the extensible cache) -------------------------------

    def resize_kv_cache(self, num_blocks: int) -> KVCacheResize:
        """Grow or shrink the committed KV cache to `num_blocks` now, without restarting and at
        the same addresses (captured graphs stay valid); returns what changed.

        A shrink evicts the tail's prefix-cache entries, then preempts the sequences holding
        tail blocks: they are recomputed later, no output changes. From another thread while a
        `generate` runs, it acts between two of its steps (`AsyncLLM.resize_kv_cache` runs it
        on the engine thread). Raises `ValueError` below one `max_model_len` sequence or above
        the capacity reserved at startup or the memory budget, `KVCacheResizeError` when a
        grow finds no memory (the cache stays as it was) or while a failed resize left the
        cache released (until the engine backs it again by itself). With `elastic_kv_cache` the
        governor may change the size again later.
        """
        with self._lock:
            return self.engine.resize_kv_cache(num_blocks)

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget every cached prefix (vLLM's name), e.g. to time prefills from cold or after
        changing what a prefix means; later prompts recompute theirs. Returns False and
        changes nothing while requests hold blocks (never the case between `generate` calls),
        unless `reset_running_requests`: they are then preempted and recomputed (no output
        changes). A KV connector's store (kv_connector_path, kv_offloading_size) keeps its
        blocks unless `reset_connector`: then it serves nothing it held or was saving at the
        reset, and goes on saving and serving what is computed from then on. Pass it after
        changing weights through `apply_model` or `collective_rpc` (`load_weights` does this
        itself), or the store goes on serving the old weights' K/V. Without a connector,
        `reset_connector` only logs a warning and the answer is False (vLLM's)."""
        with self._lock:
            return self.engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None,
                       args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """vLLM's: call a `Worker` method by name, or `method(worker, *args, **kwargs)`, on
        every worker (tensor-parallel ranks); their answers in rank order, between two steps.
        With worker processes (`distributed_executor_backend="mp"`) a callable, its arguments
        and its answer must pickle (a module-level function). `timeout` is refused: a call
        runs to its end here. A call that changes weights in place (`"load_weights"`) should
        be followed by `reset_prefix_cache(reset_connector=True)`."""
        if timeout is not None:
            raise ValueError(f"collective_rpc(timeout={timeout!r}) is not supported: a call "
                             f"runs to its end; leave timeout None")
        with self._lock:
            return self.engine.worker_rpc("collective_rpc()", "run_rpc", method, tuple(args),
                                          dict(kwargs or {}))

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """vLLM's: `func(model)` on each worker's model (kvfit's modules, Hugging Face names
        for the weights), between two steps; the answers in rank order. A `func` that changes
        weights in place should be followed by `reset_prefix_cache(reset_connector=True)`
        (`load_weights` does that itself). `RuntimeError` while the weights are asleep."""
        with self._lock:
            return self.engine.worker_rpc("apply_model()", "apply_model", func)

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """vLLM's: refused (NotImplementedError): the engine has no profiler of its own. Its
        steps run in this process: wrap the calls in `torch.profiler.profile()`, or use
        `kvfit.benchmarks.profiling.profile_run(run, llm, device)` (steps annotated)."""
        raise NotImplementedError(_NO_PROFILER.format(call="LLM.start_profile()"))

    def stop_profile(self) -> None:
        """vLLM's: refused, as `start_profile`."""
        raise NotImplementedError(_NO_PROFILER.format(call="LLM.stop_profile()"))

    def beam_search(self, *args: Any, **kwargs: Any) -> list[Any]:
        """vLLM's: refused (NotImplementedError), naming what to do instead."""
        raise NotImplementedError(_NO_BEAM_SEARCH)

    def encode(self, *args: Any, **kwargs: Any) -> list[Any]:
        """vLLM's pooling call: refused (NotImplementedError); no pooling runner here."""
        raise NotImplementedError(_NO_POOLING.format(call="encode"))

    def embed(self, *args: Any, **kwargs: Any) -> list[Any]:
        """vLLM's: refused, as `encode`."""
        raise NotImplementedError(_NO_POOLING.format(call="embed"))

    def classify(self, *args: Any, **kwargs: Any) -> list[Any]:
        """vLLM's: refused, as `encode`."""
        raise NotImplementedError(_NO_POOLING.format(call="classify"))

    def score(self, *args: Any, **kwargs: Any) -> list[Any]:
        """vLLM's: refused, as `encode`."""
        raise NotImplementedError(_NO_POOLING.format(call="score"))

    def reward(self, *args: Any, **kwargs: Any) -> list[Any]:
        """vLLM's: refused, as `encode`."""
        raise NotImplementedError(_NO_POOLING.format(call="reward"))

    def get_metrics(self) -> list[Metric]:
        """The engine's figures now, vLLM's `get_metrics()` loosely: a list of `Metric`
        (`name`, `kind` "gauge" or "counter", `value`, `labels`, `help`), the same figures the
        server exposes at `/metrics` (see `kvfit.engine.metrics`), and the request counters
        of this object's `generate` and `chat` calls (prompt and generated tokens, completions
        by finish reason; the server's latency histograms have no offline counterpart)."""
        with self._lock:
            return [*engine_metrics(self.engine.stats(), self.kv_cache_report),
                    *self._request_counts.metrics()]

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no `sampling_params`: the sampling fields
        of the model's generation_config.json over SamplingParams' defaults, as vLLM's
        `generation_config="auto"`; `SamplingParams()` with `generation_config="vllm"`."""
        return SamplingParams(**self.config.model_config.sampling_defaults)

    def get_tokenizer(self) -> Any | None:
        """The model's tokenizer, or None for a folder without one (token-id prompts only)."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        priority: SequenceOf[int] | None = None,
        *,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, `{"prompt": "text"}` or
        `{"prompt_token_ids": [...]}`, vLLM's forms); results in input order.
        `sampling_params` is one for all prompts or one per prompt; None takes
        `get_default_sampling_params()`. `priority` (vLLM's, one int per prompt; lower
        runs first) needs `scheduling_policy="priority"` unless every value is 0. vLLM's
        `lora_request` and `tokenization_kwargs` are taken where they ask for nothing (None),
        else refused (ValueError)."""
        check_vllm_request_args("generate", lora_request, tokenization_kwargs)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        prompts, sampling_params = batch_args(prompts, sampling_params)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                f"pass one SamplingParams or one per prompt"
            )
        priority = priorities(priority, len(prompts))
        resolved: dict[int, SamplingParams] = {}  # one tokenization per distinct params
        for sp in sampling_params:
            if id(sp) not in resolved:
                # The call's own copy (checked again), as vLLM clones it: what the sampler
                # caches on a params object (`logit_bias_arrays`, the bad words' sets) must not
                # outlive a caller's changes to one it passes again.
                resolved[id(sp)] = self.input_processor.resolve_bad_words(dataclasses.replace(sp))
        requests = [self.input_processor.make_sequences(i, p, resolved[id(sp)], priority[i])
                    for i, (p, sp) in enumerate(zip(prompts, sampling_params, strict=True))]
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: UseTqdm = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: Any = None,
        chat_template_content_format: str = "auto",
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of `{"role", "content"}` messages) or
        a list of conversations, rendered with the tokenizer's chat template (or
        `chat_template`), as vLLM's `LLM.chat`: a message's content is a string or OpenAI's
        text parts (`[{"type": "text", "text": ...}]`, joined a line apart, as vLLM joins
        them); `continue_final_message` leaves the last message open for the model to continue
        (an assistant prefill; with `add_generation_prompt=False`); `chat_template_kwargs` are
        the template's own variables (e.g. Qwen3's `enable_thinking`); `tools` are passed to
        the template as they are. vLLM's `lora_request` is taken as None, else refused.
        `chat_template_content_format` (vLLM's): "auto" and "string" render text parts
        joined, as above; "openai" (the parts as a list) is refused."""
        check_vllm_request_args("chat", lora_request)
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r} "
                             f"is not supported: a message's text parts reach the template "
                             f"joined into one string; pass 'auto' or 'string'")
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer and the model folder has none")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True continues the last message, "
                             "add_generation_prompt=True starts a new one: pass "
                             "add_generation_prompt=False")
        kwargs = dict(chat_template_kwargs or {})
        # The template call's own arguments (tokenize, return_tensors, ...) would change what
        # it returns, not what the template reads.
        if clash := sorted(template_call_args(self.tokenizer.apply_chat_template)
                           & set(kwargs)):
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: an argument "
                             f"of the template call, not a variable of the template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
             "prompt": text}
            for text in (
                self.tokenizer.apply_chat_template(
                    [_template_message(i, j, m) for j, m in enumerate(conv)],
                    tokenize=False, add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    chat_template=chat_template, tools=tools, **kwargs,
                )
                for i, conv in enumerate(conversations)
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def make_request(self, prompt: Prompt, params: SamplingParams,
                     request_id: str, priority: int = 0) -> list[Sequence]:
        """Tokenize and validate one request without queueing it: its `n` sequences, named
        `request_id` (front ends that queue requests themselves, e.g. the async engine).
        Raises ValueError naming the setting, like `generate`."""
        return self.input_processor.make_request(prompt, params, request_id, priority)

    def _step(self) -> list[Sequence]:
        """One engine step (under `_lock`), counted: a caller that finds the count moved
        since its own last step knows that another one's steps advanced its sequences."""
        self._num_steps += 1
        return self.engine.step()

    def _stepped_requests(self) -> bool:
        """Whether requests added through `llm_engine` wait for its loop (under `_lock`)."""
        return self._llm_engine is not None and self._llm_engine.has_unfinished_requests()

    def _run(self, requests: list[list[Sequence]], use_tqdm: UseTqdm) -> list[RequestOutput]:
        with self._lock:
            self.engine.check_can_run()
            if self.engine.is_paused:
                # Held, they would never finish in this call's steps: it would return them
                # unfinished and leave them to run inside a later one.
                raise RuntimeError("generate() while generation is paused "
                                   "(EngineCore.pause): call llm.engine.resume() first")
            try:
                for seq in itertools.chain.from_iterable(requests):
                    self.engine.add_request(seq)
            except ValueError:
                for seqs in requests:
                    self.engine.abort_request(seqs[0].request_id)
                raise
            self._num_runs += 1
        # This call's sequences not yet counted finished. Read from their status, not from
        # what this thread's steps return: another thread's `generate` steps them too.
        own = list(itertools.chain.from_iterable(requests))
        total, bar, stepping = len(own), None, False
        try:
            if callable(use_tqdm):  # vLLM's: the caller's tqdm class or factory makes the bar
                bar = use_tqdm(total=total, desc="Generating")
            else:
                # None: no bar where stderr is not a terminal (a log file gets no line per
                # update).
                bar = tqdm(total=total, desc="Generating", disable=None if use_tqdm else True)
            finished = True  # whether to look again which of this call's sequences are done
            seen = -1  # `_num_steps` after this call's last step
            running = True
            while running:
                num_done = 0
                with self._lock:  # a step at a time: other threads' calls go in between
                    # Another caller's steps (a `generate` on another thread, `llm_engine`'s
                    # loop) finish ours too.
                    if finished or self._num_steps != seen:
                        left = [seq for seq in own if not seq.is_finished]
                        num_done, own = len(own) - len(left), left
                    # Until this call's sequences finished; the last call running also drains
                    # the engine (the step in flight), as one call alone always has, unless
                    # `llm_engine`'s loop has requests in it: those are that loop's to run.
                    running = self.engine.has_unfinished() and bool(
                        own or (self._num_runs == 1 and not self._stepped_requests()))
                    if running:
                        stepping = True
                        finished = bool(self._step())
                        seen = self._num_steps
                        stepping = False
                bar.update(num_done)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: drop this call's requests, or they would keep
            # their KV blocks and run to their end inside the next call. A step that raised
            # left its batch's state unknown: every request it held goes (`fail_step`); else
            # the requests of other threads' calls run on.
            with self._lock:
                # A step that raised, or one left in flight that holds only this call's
                # requests (no other call's nor `llm_engine`'s: theirs run on).
                if stepping or (self._num_runs == 1 and not self._stepped_requests()):
                    self.engine.fail_step()
                for seqs in requests:
                    self.engine.abort_request(seqs[0].request_id)
                self._request_counts.count(requests)
            raise
        finally:
            with self._lock:
                self._num_runs -= 1
            if bar is not None:
                bar.close()
        with self._lock:
            self._request_counts.count(requests)
        return [RequestOutput.from_seqs(seqs) for seqs in requests]


def _template_message(conversation: int, index: int, message: Any) -> Any:
    """`message` as the chat template reads it: OpenAI's text parts (`content` a list) joined
    a line apart, as vLLM joins them (rendered as a list, the template would write the parts'
    Python repr into the prompt)."""
    content = message.get("content") if isinstance(message, Mapping) else None
    if not isinstance(content, list):
        return message
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"conversation {conversation}, message {index}: content part {k} "
                             f"is {describe(part)}; this engine takes text only: a string or parts "
                             f"{{'type': 'text', 'text': ...}}")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _without_vllm_noops(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` less vLLM's engine arguments that ask for what kvfit does anyway (e.g.
    `trust_remote_code=True`), as the command line takes their flags; one asking for what
    kvfit does not do raises ValueError naming what to do instead."""
    rest = {}
    for name, value in kwargs.items():
        if name == "disable_log_stats":
            # vLLM's LLM defaults it to True; False there logs the engine's figures every 10 s
            # and lets get_metrics() answer. kvfit's get_metrics() always answers and its LLM
            # logs no figures (`kvfit serve` does), so False is taken, saying so.
            if not value:
                logger.warning("disable_log_stats=False: kvfit's LLM logs no periodic engine "
                               "figures (kvfit serve does); LLM.get_metrics() returns them at "
                               "any time")
            continue
        flag = "--" + name.replace("_", "-")
        if name in EngineArgs.__dataclass_fields__ or (
                flag not in VLLM_NOOP_FLAGS and flag not in VLLM_UNSUPPORTED_FLAGS):
            rest[name] = value
            continue
        if flag in VLLM_NOOP_FLAGS:
            # enable_chunked_prefill=False asks for --no-enable-chunked-prefill.
            if value or f"--no-{flag[2:]}" not in VLLM_UNSUPPORTED_FLAGS:
                continue
            flag = f"--no-{flag[2:]}"
        # At a value that asks for nothing (None, 0, "auto", a size of 1): nothing to refuse.
        elif value in (None, False, 0, "auto") or (value == 1 and name.endswith("_size")) or (
                name in VLLM_DEFAULT_VALUES and value == VLLM_DEFAULT_VALUES[name]) or (
                value in VLLM_NOOP_VALUES.get(flag, ())):
            continue
        taken = (f" ({name}={VLLM_DEFAULT_VALUES[name]!r}, vLLM's default, is taken)"
                 if name in VLLM_DEFAULT_VALUES else "")
        raise ValueError(f"{name}={value!r} (a vLLM argument) is not supported: "
                         f"{VLLM_UNSUPPORTED_FLAGS[flag]}{taken}")
    return rest
