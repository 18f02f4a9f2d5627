"""`--enable-log-requests`: one INFO line on the `kvfit` logger as a generation request is
queued (its id, prompt size, sampling settings and the prompt, cut at `--max-log-len`), and
one as it ends (how each completion ended, its tokens); with `--enable-log-outputs`, then one a
completion with its generated text and token ids, cut alike. Off, the server never calls
here."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

from kvfit.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from kvfit.engine.outputs import CompletionOutput
    from kvfit.server.async_llm import RequestStream, StreamObserver

logger = logging.getLogger(__name__)

# Containers longer than this (a logit_bias of 1,000 entries) are logged as their size.
_MOST_ITEMS_SHOWN = 8
_DEFAULTS = SamplingParams()


class RequestLog:
    """Logs each generation request of one server: `received` as it is queued, then its end
    through `watch`. `max_log_len`: the most characters of a prompt's text (or token ids of a
    prompt sent as ids) logged, and of each completion's text and token ids (None: all; 0:
    none). `log_outputs`: log what each completion generated as the request ends (vLLM's
    `--enable-log-outputs`); a stream's output is logged whole at its end, never in pieces."""

    def __init__(self, max_log_len: int | None = None, log_outputs: bool = False) -> None:
        self.max_log_len = max_log_len
        self.log_outputs = log_outputs

    def received(self, request_id: str, answer_id: str, prompt: dict[str, Any],
                 params: SamplingParams) -> None:
        """Log the engine request `request_id` (of the answer `answer_id`) as queued."""
        ids = prompt["prompt_token_ids"]
        logger.info("Received request %s (%s): prompt_tokens=%d, params: %s%s", request_id,
                    answer_id, len(ids), params_summary(params),
                    self._prompt(prompt["prompt"], ids))

    def _prompt(self, text: str | None, ids: list[int]) -> str:
        if self.max_log_len == 0:
            return ""
        if text is not None:
            return f", prompt: {self._text(text)}"
        return f", prompt_token_ids: {self._ids(ids)}"

    def _text(self, text: str) -> str:
        cut = self.max_log_len
        more = "" if cut is None or len(text) <= cut else f" (+{len(text) - cut} chars)"
        return f"{text[:cut]!r}{more}"

    def _ids(self, ids: list[int]) -> str:
        cut = self.max_log_len
        more = "" if cut is None or len(ids) <= cut else f" (+{len(ids) - cut} ids)"
        return f"{list(ids[:cut])}{more}"

    def watch(self, stream: RequestStream) -> None:
        """Log `stream`'s end, after its observer (the request metrics) is told of it."""
        stream.observer = _Finished(self, stream, stream.observer)

    def finished(self, request_id: str, outputs: list[CompletionOutput], failed: bool) -> None:
        """Log how the engine request `request_id` ended, and with `log_outputs` what each of
        its completions generated (all of it, also when its reader left or it failed)."""
        # A completion without a finish reason was cut short: its reader left or it failed.
        left = "error" if failed else "abort"
        reasons = [o.finish_reason or left for o in outputs]
        tokens = [len(o.token_ids) for o in outputs]
        if len(outputs) == 1:
            logger.info("Finished request %s: finish_reason=%s, output_tokens=%d",
                        request_id, reasons[0], tokens[0])
        else:
            logger.info("Finished request %s: finish_reasons=%s, output_tokens=%s",
                        request_id, reasons, tokens)
        if not self.log_outputs or self.max_log_len == 0:
            return
        for o in outputs:
            index = "" if len(outputs) == 1 else f" (index {o.index})"
            logger.info("Generated response %s%s: output: %s, output_token_ids: %s",
                        request_id, index, self._text(o.text), self._ids(o.token_ids))


class _Finished:
    """A `StreamObserver` passing everything on to `inner`, then logging the end."""

    __slots__ = ("log", "stream", "inner")

    def __init__(self, log: RequestLog, stream: RequestStream,
                 inner: StreamObserver | None) -> None:
        self.log, self.stream, self.inner = log, stream, inner

    def output(self, output: Any) -> None:
        if self.inner is not None:
            self.inner.output(output)

    def end(self, failed: bool) -> None:
        if self.inner is not None:
            self.inner.end(failed)
        # The stream's own output holds every completion whole, whatever its output kind.
        self.log.finished(self.stream.request_id, self.stream.output.outputs, failed)


def params_summary(params: SamplingParams) -> str:
    """`max_tokens` and `temperature`, then every other field `params` sets apart from
    SamplingParams' default, as `name=value` (long lists as their size)."""
    parts = []
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if f.name not in ("max_tokens", "temperature") and value == getattr(_DEFAULTS, f.name):
            continue
        if isinstance(value, list | dict) and len(value) > _MOST_ITEMS_SHOWN:
            text = f"<{len(value)} items>"
        elif isinstance(value, RequestOutputKind):
            text = value.name
        else:
            text = repr(value)
        parts.append(f"{f.name}={text}")
    return ", ".join(parts)


def show_request_log() -> None:
    """Let the request log's INFO lines reach stderr in a server process, whatever the
    `kvfit` logger's own level (`kvfit serve` leaves it at WARNING)."""
    logger.setLevel(logging.INFO)
    if not logger.hasHandlers():  # else a handler of the user's (or the root's) shows them
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s",
                                               datefmt="%H:%M:%S"))
        logger.addHandler(handler)
