"""Incremental detokenization of generated tokens into `Sequence.output_text`, with stop strings."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvfit.engine.sequence import Logprobs, Sequence

# Prompt tokens fed to a new stream as context: enough for decoders that drop a leading space
# at the start of text, or merge bytes of a character split across tokens.
PROMPT_CONTEXT_TOKENS = 6


class Detokenizer:
    """Turns each sequence's output tokens into text as they arrive.

    Uses the `tokenizers` library's `DecodeStream`, which holds back bytes of a character split
    across tokens until it is complete. `tokenizer` is a `tokenizers.Tokenizer`, a transformers
    fast tokenizer (its `backend_tokenizer` is used), or None, in which case texts stay "".
    """

    def __init__(self, tokenizer: Any | None) -> None:
        if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
            backend = getattr(tokenizer, "backend_tokenizer", None)
            if not isinstance(backend, Tokenizer):
                raise TypeError(
                    f"detokenization needs a fast tokenizer (a `tokenizers.Tokenizer` backend); "
                    f"{type(tokenizer).__name__} has none"
                )
            tokenizer = backend
        self.tokenizer: Tokenizer | None = tokenizer
        # seq_id -> (stream, number of output tokens fed to it)
        self._streams: dict[int, tuple[DecodeStream, int]] = {}
        self._token_texts: dict[int, str] = {}

    def decode_token(self, token_id: int) -> str | None:
        """The text of one token on its own (cached; None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def annotate(self, logprobs: Logprobs) -> Logprobs:
        """Fill each entry's `decoded_token` (in place); returns `logprobs`."""
        for token_id, entry in logprobs.items():
            entry.decoded_token = self.decode_token(token_id)
        return logprobs

    def step(self, seq: Sequence, check_stop: bool = True) -> str | None:
        """Append the text of `seq`'s new output tokens to `seq.output_text`.

        With `check_stop`, looks for the request's stop strings in the new text (one may start in
        earlier text); on a match truncates `output_text` before it (after it with
        `include_stop_str_in_output`) and returns the stop string.
        """
        if self.tokenizer is None:
            return None
        stream, num_fed = self._streams.get(seq.seq_id) or (self._new_stream(seq), 0)
        new_text = ""
        for token_id in seq.output_token_ids[num_fed:]:
            new_text += stream.step(self.tokenizer, token_id) or ""
        self._streams[seq.seq_id] = (stream, seq.num_output_tokens)
        if not new_text:
            return None
        start = len(seq.output_text)
        seq.output_text += new_text
        return self._truncate_at_stop(seq, start) if check_stop else None

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s stream once it is finished."""
        self._streams.pop(seq.seq_id, None)

    def _new_stream(self, seq: Sequence) -> DecodeStream:
        # The prompt's text is already known: feed its tail as context and drop what it yields.
        context = seq.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        stream, num_complete = self._stream_over(seq, context)
        if num_complete < len(context):
            # The prompt ends inside a character (a token-id prompt cut mid-way): the stream
            # holds its first bytes and would emit them, as U+FFFD, at the start of the
            # output's text. They are the prompt's: leave them out of the context.
            stream, _ = self._stream_over(seq, context[:num_complete])
        return stream

    def _stream_over(self, seq: Sequence, context: list[int]) -> tuple[DecodeStream, int]:
        """A stream fed `context`, and how many of its tokens end in complete text."""
        stream = DecodeStream(skip_special_tokens=seq.sampling_params.skip_special_tokens)
        num_complete = 0
        for i, token_id in enumerate(context, start=1):
            if stream.step(self.tokenizer, token_id) is not None:
                num_complete = i
        return stream, num_complete

    @staticmethod
    def _truncate_at_stop(seq: Sequence, new_start: int) -> str | None:
        stops = seq.sampling_params.stop
        if not stops:
            return None
        window_start = max(0, new_start - max(map(len, stops)) + 1)
        found = [
            (index, stop)
            for stop in stops
            if (index := seq.output_text.find(stop, window_start)) != -1
        ]
        if not found:
            return None
        index, stop = min(found)
        if seq.sampling_params.include_stop_str_in_output:
            index += len(stop)
        seq.output_text = seq.output_text[:index]
        return stop
