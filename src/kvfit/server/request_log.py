"""`--enable-log-requests`: one INFO line on the `kvfit` logger as a generation request is
queued (its id, prompt size, sampling settings and the prompt, cut at `--max-log-len`), and
one as it ends (how each completion ended, its tokens). Off, the server never calls here."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

from kvfit.engine.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from kvfit.server.async_llm import RequestStream, StreamObserver

logger = logging.getLogger(__name__)

# Containers longer than this (a logit_bias of 1,000 entries) are logged as their size.
_MOST_ITEMS_SHOWN = 8
_DEFAULTS = SamplingParams()


class RequestLog:
    """Logs each generation request of one server: `received` as it is queued, then its end
    through `watch`. `max_log_len`: the most characters of a prompt's text (or token ids of a
    prompt sent as ids) logged (None: all; 0: none)."""

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def received(self, request_id: str, answer_id: str, prompt: dict[str, Any],
                 params: SamplingParams) -> None:
        """Log the engine request `request_id` (of the answer `answer_id`) as queued."""
        ids = prompt["prompt_token_ids"]
        logger.info("Received request %s (%s): prompt_tokens=%d, params: %s%s", request_id,
                    answer_id, len(ids), params_summary(params),
                    self._prompt(prompt["prompt"], ids))

    def _prompt(self, text: str | None, ids: list[int]) -> str:
        cut = self.max_log_len
        if cut == 0:
            return ""
        if text is not None:
            more = "" if cut is None or len(text) <= cut else f" (+{len(text) - cut} chars)"
            return f", prompt: {text[:cut]!r}{more}"
        more = "" if cut is None or len(ids) <= cut else f" (+{len(ids) - cut} ids)"
        return f", prompt_token_ids: {list(ids[:cut])}{more}"

    def watch(self, stream: RequestStream) -> None:
        """Log `stream`'s end, after its observer (the request metrics) is told of it."""
        stream.observer = _Finished(stream, stream.observer)


class _Finished:
    """A `StreamObserver` passing everything on to `inner`, then logging the end."""

    __slots__ = ("stream", "inner")

    def __init__(self, stream: RequestStream, inner: StreamObserver | None) -> None:
        self.stream, self.inner = stream, inner

    def output(self, output: Any) -> None:
        if self.inner is not None:
            self.inner.output(output)

    def end(self, failed: bool) -> None:
        if self.inner is not None:
            self.inner.end(failed)
        outs = self.stream.output.outputs
        # A completion without a finish reason was cut short: its reader left or it failed.
        left = "error" if failed else "abort"
        reasons = [o.finish_reason or left for o in outs]
        tokens = [len(o.token_ids) for o in outs]
        if len(outs) == 1:
            logger.info("Finished request %s: finish_reason=%s, output_tokens=%d",
                        self.stream.request_id, reasons[0], tokens[0])
        else:
            logger.info("Finished request %s: finish_reasons=%s, output_tokens=%s",
                        self.stream.request_id, reasons, tokens)


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
