"""OpenAI-compatible request bodies (pydantic) and their conversion to `SamplingParams`.

Field names follow OpenAI's API, plus vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `allowed_token_ids`, `bad_words`, ...) and chat-template
fields (`add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`). Unknown
fields are refused (vLLM ignores them), so a misspelt setting is an error naming it rather
than silently ignored; vLLM's and OpenAI's fields this server does not do are refused with
the reason (`UNSUPPORTED_FIELDS`), and taken at `null` or a value that asks for nothing.
OpenAI's tool and format fields are taken at the values that ask for nothing (`tools: []`,
`tool_choice: "none"`, `response_format: {"type": "text"}`; clients send them so) and refused
at any other, as unsupported. Every error here is an `APIError`, which the app answers with
OpenAI's error body.
"""

from __future__ import annotations

import json
import re
import types
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvfit.engine.sampling_params import MAX_N, SamplingParams, truncate_prompt


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status_code, self.type = message, status_code, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_NO_STRUCTURED_OUTPUT = "structured output (guided decoding) is not supported by this server"
_NO_BEAM_SEARCH = "beam search is not supported by this server"
_TEXT_ONLY = "not supported: this server's models take text only"
_NO_REASONING = ("reasoning parsers and efforts are not supported by this server (Qwen3's "
                 "thinking is switched by chat_template_kwargs {\"enable_thinking\": false})")
UNSUPPORTED_FIELDS: dict[str, str] = {
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag",
                     "structured_outputs"), _NO_STRUCTURED_OUTPUT),
    **dict.fromkeys(("use_beam_search", "length_penalty"), _NO_BEAM_SEARCH),
    "cache_salt": "not supported: the prefix cache takes no per-request salt",
    "kv_transfer_params": "disaggregated serving (KV transfer between servers) is not "
                          "supported by this server",
    "chat_template": "a request may not bring its own chat template (as in vLLM without "
                     "--trust-request-chat-template): start the server with --chat-template",
    **dict.fromkeys(("mm_processor_kwargs", "media_io_kwargs", "audio"), _TEXT_ONLY),
    "prompt_embeds": "prompt embeddings are not supported by this server: send the prompt as "
                     "text or token ids",
    "logits_processors": "custom logits processors are not supported by this server",
    "vllm_xargs": "not supported: this server has no request extensions to pass them to",
    **dict.fromkeys(("include_reasoning", "reasoning_effort"), _NO_REASONING),
    "verbosity": "not supported: a setting of OpenAI's reasoning models",
    "echo": "vLLM's chat echo is not supported by this server (only echo false is taken)",
    "best_of": "not supported on chat completions (/v1/completions takes it at the value of n)",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not supported by this server",
    "max_completion_tokens": "a chat completions field: /v1/completions takes max_tokens",
    **dict.fromkeys(("tools", "tool_choice", "response_format"), "a chat completions field "
                    "(there taken only at the value that asks for nothing: tool calling and "
                    "structured output are not supported by this server)"),
}
"""Fields of vLLM's and OpenAI's request bodies that a route does not take, each with why: the
400 naming one says so, where an unknown field's reads as a misspelling."""
_NO_OP_VALUES: dict[str, Any] = {"use_beam_search": False, "echo": False,
                                 "length_penalty": 1.0, "include_reasoning": True}
"""`UNSUPPORTED_FIELDS` at the value that asks for nothing (vLLM's default): taken, as `null`
for any of them is, so that a client sending vLLM's defaults is served."""


def _admits_none(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(
        annotation)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    # A request body (not a part of one): takes `UNSUPPORTED_FIELDS` that ask for nothing.
    _request: ClassVar[bool] = False

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A JSON `null` for an optional field whose type has no None (`n`, `stream`, `echo`,
        `logprobs`, ...) means its default, as OpenAI's API (where they are nullable) and vLLM
        take it: clients send `"n": null` for a parameter left at None."""
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if (field := cls.model_fields.get(key)) is None
                and not (cls._request and _asks_nothing(key, value))
                or field is not None and (value is not None or field.is_required()
                                          or _admits_none(field.annotation))}


def _asks_nothing(key: str, value: Any) -> bool:
    """Whether `key`, a field this server does not take, is sent at a value that asks for
    nothing (see `_NO_OP_VALUES`)."""
    if key not in UNSUPPORTED_FIELDS:
        return False
    default = _NO_OP_VALUES.get(key)
    # A number as JSON gives it (1 for 1.0), but no bool for a number nor a number for one.
    return value is None or (key in _NO_OP_VALUES and value == default
                             and isinstance(value, bool) == isinstance(default, bool))


class StreamOptions(_Body):
    # Unset: off (OpenAI's), unless continuous_usage_stats asks for the usage (vLLM's, where
    # include_usage defaults to true whenever stream_options is sent).
    include_usage: bool | None = None
    # vLLM's extension: every chunk carries the usage so far (how a client counts the tokens
    # of a chunk that holds several).
    continuous_usage_stats: bool = False

    @property
    def usage(self) -> bool:
        return bool(self.include_usage or (self.include_usage is None
                                           and self.continuous_usage_stats))


class _SamplingFields(_Body):
    """Fields every generation request shares."""

    _request = True

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    # Checked by the engine (`SamplingParams`, then its vocabulary as the request is queued):
    # non-empty, at most MAX_TOKEN_LIST ids, each in the vocabulary; a 400 naming the field.
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the completion must not contain (each as written and after a space).
    bad_words: list[str] | None = None
    # vLLM's: at every prompt position after the first, its own token's logprob and the
    # `prompt_logprobs` most likely (`"prompt_logprobs"` in the answer); not with stream.
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the last max_model_len).
    truncate_prompt_tokens: int | None = None
    # vLLM's: logprobs give each token as `token_id:N` (a token that is part of a character
    # has no text of its own to tell it by).
    return_tokens_as_token_ids: bool = False
    # vLLM's: the answer carries the prompt's token ids and each completion's (streamed: the
    # prompt's once, in a choice's first chunk, and each chunk's new ids).
    return_token_ids: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # vLLM's: lower runs first under `--scheduling-policy priority`; anything but 0 is a 400
    # under fcfs, as vLLM answers.
    priority: int = 0
    # vLLM's: names the answer (`cmpl-<id>`) where no X-Request-Id header does. Only a label:
    # the engine's requests are named apart, so clients sending the same one never clash.
    request_id: str | None = None

    # Request field -> SamplingParams field, where the names differ.
    _renamed: dict[str, str] = {}

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """`token_ids` left-truncated as `truncate_prompt_tokens` asks (unchanged when unset)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        if k == 0 or k < -1:
            raise APIError(f"truncate_prompt_tokens must be >= 1, or -1 for the model's "
                           f"max_model_len ({max_model_len}); got {k}",
                           param="truncate_prompt_tokens")
        return truncate_prompt(token_ids, k, max_model_len)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        model_defaults: dict[str, Any] | None = None) -> SamplingParams:
        """The request as `SamplingParams`; an invalid value is an `APIError` naming its field.
        A field the request leaves unset takes `model_defaults` (generation_config.json's,
        vLLM's `--generation-config auto`), else SamplingParams' default."""
        fields: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            logit_bias=self.logit_bias, allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
        defaults = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, presence_penalty=0.0,
                        frequency_penalty=0.0, repetition_penalty=1.0)
        defaults.update((k, v) for k, v in (model_defaults or {}).items() if k in defaults)
        for name, default in defaults.items():
            value = getattr(self, name)
            fields[name] = default if value is None else value
        if self.stream_options is not None and not self.stream:
            # As OpenAI and vLLM answer: the options would silently do nothing.
            raise APIError("stream_options is only allowed with stream=true",
                           param="stream_options")
        options = self.stream_options
        if options is not None and options.continuous_usage_stats and (
                options.include_usage is False):
            # Usage in every chunk but none at all: one of the two is a mistake.
            raise APIError("stream_options.continuous_usage_stats needs include_usage: leave "
                           "include_usage unset or true to get the usage in every chunk",
                           param="stream_options.continuous_usage_stats")
        if self.prompt_logprobs is not None and self.stream:
            # As vLLM answers: the prompt's logprobs would all come in the first chunk.
            raise APIError("prompt_logprobs is not available with stream=true",
                           param="prompt_logprobs")
        if self.logit_bias and any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise APIError("logit_bias values must be in [-100, 100]", param="logit_bias")
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            raise self.value_error(e) from None

    def value_error(self, error: ValueError) -> APIError:
        """An engine ValueError as a 400, its `param` the request field it names."""
        message = str(error)
        match = re.search(r"SamplingParams\.(\w+)", message)
        param = "prompt" if "prompt" in message else None
        if message.startswith("priority="):
            param = "priority"
        if match:
            param = self._renamed.get(match.group(1), match.group(1))
            message = message.replace(f"SamplingParams.{match.group(1)}", param)
        return APIError(message, param=param)


class CompletionRequest(_SamplingFields):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # vLLM's: whether text prompts are tokenized with the tokenizer's special tokens (BOS).
    add_special_tokens: bool = True

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text or a token id list."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        # Every prompt's n completions are sequences built as the request is queued: bounded
        # together as n alone is, or a body of a million one-token prompts would take them
        # (an n out of range is named by its own check).
        if 1 <= self.n <= MAX_N < len(p) * self.n:
            raise APIError(f"a request may ask for at most {MAX_N} completions in all (prompts "
                           f"x n); this one asks for {len(p)} x {self.n}", param="prompt")
        return list(p)

    def check(self) -> None:
        if self.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("best_of other than n is not supported", param="best_of")


# Parts whose `text` is text: OpenAI's chat's, and its Responses API's two, which vLLM takes in
# a chat too (clients moving between the two APIs send them).
_TEXT_PARTS = ("text", "input_text", "output_text")


class ContentPart(_Body):
    """A part of a message's text: one of `_TEXT_PARTS`, or an assistant's `refusal` (OpenAI's
    API replays it in a conversation), whose words are its text, as vLLM renders it."""

    type: Literal["text", "input_text", "output_text", "refusal"]
    # The one its type names (`ChatMessage` checks): `refusal` for a refusal, else `text`.
    text: str | None = None
    refusal: str | None = None

    @property
    def words(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class _ChatTemplateFields(_Body):
    """How the messages are rendered: a new assistant turn's header after them
    (`add_generation_prompt`), or the final message left open for the model to continue
    (vLLM's `continue_final_message`: an assistant prefill)."""

    _request = True

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Variables the template reads besides the messages (vLLM's field): Qwen3's
    # `enable_thinking`, a date, ...
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for retrieval-augmented generation, each best {"title", "text"}, which
    # a template that knows them writes into the prompt (one that does not leaves them out).
    documents: list[dict[str, str]] | None = None

    def template_flags(self) -> dict[str, Any]:
        """The chat template's keyword arguments. A continued final message takes no new
        turn's header, so add_generation_prompt left at its default is false then."""
        flags: dict[str, Any] = dict(self.chat_template_kwargs or {})
        if self.documents is not None:
            flags["documents"] = self.documents
        if not self.continue_final_message:
            return {**flags, "add_generation_prompt": self.add_generation_prompt}
        if self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise APIError("continue_final_message and add_generation_prompt cannot both be "
                           "true: set add_generation_prompt to false to continue the final "
                           "message", param="add_generation_prompt")
        return {**flags, "add_generation_prompt": False, "continue_final_message": True}


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool and function fields pass to the template

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant message's calls, each `{"id", "type", "function": {"name", "arguments"}}`.
    tool_calls: list[dict[str, Any]] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A part of another kind (image_url, input_audio, file, ...) is named as such rather
        than reported as a mismatch with every type `content` could have, as is a part
        without the words its type names (`text`, or a refusal's `refusal`)."""
        for i, part in enumerate(content if isinstance(content, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in (*_TEXT_PARTS, "refusal"):
                raise PydanticCustomError(
                    "content_part_unsupported",
                    "part {index} is of type '{kind}': this server's model takes text only; "
                    "send a string or parts of type 'text'", {"index": i, "kind": kind})
            words, other = ("refusal", "text") if kind == "refusal" else ("text", "refusal")
            if isinstance(kind, str) and (not isinstance(part.get(words), str)
                                          or part.get(other) is not None):
                raise PydanticCustomError(
                    "content_part_words", "part {index} is of type '{kind}': it takes its "
                    "words as a string '{words}' (and no '{other}')",
                    {"index": i, "kind": kind, "words": words, "other": other})
        return content

    @field_validator("tool_calls")
    @classmethod
    def _arguments_as_objects(cls, tool_calls: list[dict[str, Any]] | None,
                              info: ValidationInfo) -> list[dict[str, Any]] | None:
        """An assistant's tool calls as chat templates take them (and vLLM passes them): each
        call's `arguments`, a JSON text in OpenAI's API, parsed into its object, which
        templates write with `tojson` (the text would be written as a quoted string); none
        at all is no `tool_calls`, so the template takes its plain assistant path."""
        if info.data.get("role") != "assistant" or tool_calls is None:
            return tool_calls
        if not tool_calls:
            return None
        for i, call in enumerate(tool_calls):
            function = call.get("function")
            if not isinstance(function, dict):
                continue
            arguments = function.get("arguments")
            if not arguments:
                function["arguments"] = {}
            elif isinstance(arguments, str):
                try:
                    function["arguments"] = json.loads(arguments)
                except ValueError as e:
                    raise PydanticCustomError(
                        "tool_call_arguments",
                        "call {index}'s function.arguments is not JSON ({error}): send them "
                        "as the JSON text of an object, as a tool call gives them",
                        {"index": i, "error": str(e)}) from None
        return tool_calls

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined a line apart, as
        vLLM joins them (parts are separate pieces of text: "Describe", "this code:" must
        not run together into one word)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.words for part in self.content)
        message.setdefault("content", "")
        return message


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Taken only at values that ask for nothing (`check`): no tool calling, no format.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI's deprecated tool fields, and the output modalities: taken at values that ask for
    # nothing, as the tool fields above.
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    # OpenAI's bookkeeping and routing fields, which change no output here: taken and ignored
    # (as vLLM does), so a client written for OpenAI works unchanged.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    # vLLM's: whether the rendered chat is tokenized with the tokenizer's special tokens too
    # (off: the chat template writes its own).
    add_special_tokens: bool = False

    _renamed = {"logprobs": "top_logprobs"}

    def check(self) -> None:
        """Refuse what this server does not do: tool calls, structured output, audio."""
        if self.functions:
            raise APIError("functions are not supported by this server", param="functions")
        if self.function_call not in (None, "none", "auto"):
            raise APIError("function_call other than 'none' or 'auto' is not supported by this "
                           "server (it has no functions)", param="function_call")
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise APIError("modalities other than ['text'] are not supported by this server",
                           param="modalities")
        if self.tools:
            raise APIError("tools are not supported by this server", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice other than 'none' or 'auto' is not supported by this "
                           "server (it has no tools)", param="tool_choice")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise APIError("response_format other than {'type': 'text'} is not supported by "
                           "this server", param="response_format")

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """The completion-length limit asked for and the field that asked (None: unset)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def num_logprobs(self) -> int | None:
        # top_logprobs=0 without logprobs asks for nothing: vLLM takes it, as clients send it.
        if self.top_logprobs and not self.logprobs:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_ChatTemplateFields):
    """`POST /tokenize`: a prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Unset: on for a prompt, off for messages (as in a completion and a chat completion).
    add_special_tokens: bool = True
    # vLLM's: the answer's `token_strs` lists each token's vocabulary string too.
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: list[int]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
