"""`LLM`: offline generation over the engine, with vLLM's names."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from typing import Any

from tqdm.auto import tqdm

from kvfit.engine.config import EngineArgs
from kvfit.engine.engine_core import EngineCore
from kvfit.engine.outputs import RequestOutput
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.sequence import Sequence
from kvfit.kv.report import KVCacheReport
from kvfit.models.loader import load_tokenizer

Prompt = str | dict[str, Any]
Message = dict[str, str]


class LLM:
    """An engine for offline batch generation.

    Keyword arguments beyond the named ones are `EngineArgs` fields (e.g.
    `gpu_memory_utilization`, `num_gpu_blocks_override`, `enable_extensible_kv_cache`).

    A batch is validated as a whole before any request is queued: one bad request raises a
    `ValueError` naming it and the setting to change, and nothing runs, so no other request is
    disturbed (vLLM raises at add time too).
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
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        unknown = set(kwargs) - set(EngineArgs.__dataclass_fields__)
        if unknown:
            raise TypeError(f"LLM() got unknown engine arguments: {', '.join(sorted(unknown))}")
        args = EngineArgs(
            model=model, dtype=dtype, device=device, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            block_size=block_size, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, load_format=load_format, seed=seed, **kwargs,
        )
        self.config = args.create_engine_config()
        self.tokenizer = load_tokenizer(model)
        self.engine = EngineCore(self.config, self.tokenizer)
        self._request_counter = itertools.count()

    @property
    def kv_cache_report(self) -> KVCacheReport:
        """How the KV cache was sized (method, blocks, the memory figures behind them)."""
        return self.engine.kv_cache_report

    def shutdown(self) -> None:
        """Free the model and the KV cache now rather than at garbage collection (to start
        another engine in the same process)."""
        self.engine.shutdown()

    def get_tokenizer(self) -> Any | None:
        """The model's tokenizer, or None for a folder without one (token-id prompts only)."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | SequenceOf[Prompt],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or `{"prompt_token_ids": [...]}`); results in
        input order. `sampling_params` is one for all prompts or one per prompt."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(
                f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts; "
                f"pass one SamplingParams or one per prompt"
            )
        seqs = [self._make_sequence(i, p, sp)
                for i, (p, sp) in enumerate(zip(prompts, sampling_params, strict=True))]
        return self._run(seqs, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of `{"role", "content"}` messages) or
        a list of conversations, rendered with the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat() needs a tokenizer and the model folder has none")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
             "prompt": text}
            for text in (
                self.tokenizer.apply_chat_template(
                    conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                )
                for conv in conversations
            )
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _make_sequence(self, index: int, prompt: Prompt, params: SamplingParams) -> Sequence:
        """Tokenize and validate one request; errors name the request and the setting."""
        where = f"request {index}"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{where}: the model has no tokenizer; pass "
                                 f"{{'prompt_token_ids': [...]}} instead of text")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        else:
            raise ValueError(f"{where}: a prompt is a string or {{'prompt_token_ids': [...]}}, "
                             f"got {type(prompt).__name__}")
        mc = self.config.model_config
        vocab_size = mc.hf_config.vocab_size
        if not token_ids:
            raise ValueError(f"{where}: the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in token_ids):
            raise ValueError(f"{where}: prompt_token_ids must be ints in [0, {vocab_size})")
        if len(token_ids) >= mc.max_model_len:
            raise ValueError(
                f"{where}: the prompt has {len(token_ids)} tokens, max_model_len is "
                f"{mc.max_model_len} (one more is needed to generate); shorten the prompt or "
                f"raise max_model_len"
            )
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > mc.max_logprobs:
                raise ValueError(f"{where}: SamplingParams.{name}={n} is above max_logprobs="
                                 f"{mc.max_logprobs}; lower it or raise max_logprobs")
        if params.stop and self.tokenizer is None:
            raise ValueError(f"{where}: SamplingParams.stop needs a tokenizer; use "
                             f"stop_token_ids instead")
        return Sequence(token_ids, params, request_id=str(next(self._request_counter)),
                        prompt=text)

    def _run(self, seqs: list[Sequence], use_tqdm: bool) -> list[RequestOutput]:
        try:
            for seq in seqs:
                self.engine.add_request(seq)
        except ValueError:
            for seq in seqs:
                self.engine.abort_request(seq.request_id)
            raise
        with tqdm(total=len(seqs), desc="Generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(len(self.engine.step()))
        return [RequestOutput.from_seq(seq) for seq in seqs]
