"""Incremental detokenization of generated tokens into `Sequence.output_text`, with stop strings."""

from __future__ import annotations

import json
import re
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from kvfit.engine.sequence import Logprobs, Sequence

# Prompt tokens fed to a new stream as context: enough for decoders that drop a leading space
# at the start of text, or merge bytes of a character split across tokens.
PROMPT_CONTEXT_TOKENS = 6
# A byte-fallback vocabulary's token for one raw byte (SentencePiece-style, as Llama 2's).
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# What `DecodeStream.step` raises when text it already gave changes: a byte-fallback decoder
# turns every byte of an invalid UTF-8 run into U+FFFD, so a token ending the run rewrites
# bytes before it (vLLM recovers from it the same way, by a new stream).
_INVALID_PREFIX = "Invalid prefix encountered"


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): each byte is spelled by one printable character,
    itself where it is printable and not a space, else U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    moved = [b for b in range(256) if b not in kept]
    chars = {chr(b): b for b in kept}
    chars.update({chr(256 + i): b for i, b in enumerate(moved)})
    return chars


_BYTE_LEVEL_CHARS = _byte_level_chars()


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
        # seq_id -> [stream, number of the sequence's tokens (prompt included) fed to it,
        # whether its last output token was an added one (None: spaces between them kept)]
        self._streams: dict[int, list[DecodeStream | int | bool | None]] = {}
        self._token_texts: dict[int, str] = {}
        self._byte_level: bool | None = None  # whether the decoder is byte-level (lazily)
        self._added_tokens: dict[int, str] | None = None  # id -> text (lazily)

    def decode_token(self, token_id: int) -> str | None:
        """The text of one token on its own (cached; None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for. Its text's UTF-8, except for a token that holds
        part of a character (alone it decodes to U+FFFD): its raw bytes, read from its
        vocabulary entry (byte-level BPE, or a byte-fallback `<0xNN>` piece), so that the
        bytes of consecutive tokens join into the character, as OpenAI's logprobs `bytes`
        promise. Empty without a tokenizer."""
        text = self.decode_token(token_id) or ""
        if "\ufffd" not in text:
            return text.encode()
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return text.encode()
        if match := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(match[1], 16)])
        if self._byte_level is None:
            decoder = json.loads(self.tokenizer.to_str()).get("decoder") or {}
            self._byte_level = "ByteLevel" in {decoder.get("type"), *(
                d.get("type") for d in decoder.get("decoders") or ())}
        if self._byte_level and all(ch in _BYTE_LEVEL_CHARS for ch in piece):
            return bytes(_BYTE_LEVEL_CHARS[ch] for ch in piece)
        return text.encode()

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
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        # Runs for every token of every sequence: one step a token, the state updated in
        # place, no copy of the tokens before the new ones.
        state = self._streams.get(seq.seq_id)
        if state is None:
            params = seq.sampling_params
            # vLLM's: only where special tokens are kept (skipped, there is no space to drop).
            joined = not (params.spaces_between_special_tokens or params.skip_special_tokens)
            state = self._streams[seq.seq_id] = [self._new_stream(seq), seq.num_prompt_tokens,
                                                 False if joined else None]
        num_fed = state[1]
        tokens = seq.token_ids
        end = state[1] = len(tokens)
        if state[2] is not None:
            new_text = "".join(filter(None, (self._joined_step(state, seq, token_id)
                                             for token_id in tokens[num_fed:end])))
        elif end - num_fed == 1:
            new_text = self._protected_step(state, seq, tokens[num_fed])
        else:
            new_text = "".join(filter(None, (self._protected_step(state, seq, token_id)
                                             for token_id in tokens[num_fed:end])))
        if not new_text:
            return None
        start = len(seq.output_text)
        seq.output_text += new_text
        return self._truncate_at_stop(seq, start) if check_stop else None

    def _joined_step(self, state: list, seq: Sequence, token_id: int) -> str | None:
        """`_protected_step` without spaces between special tokens (vLLM's
        `spaces_between_special_tokens=False`): an added token right after another is its
        bare text, without the space a decoder (WordPiece's, or none) puts before it."""
        text = self._protected_step(state, seq, token_id)
        if self._added_tokens is None:
            self._added_tokens = {token_id: added.content for token_id, added
                                  in self.tokenizer.get_added_tokens_decoder().items()}
        added = self._added_tokens.get(token_id)
        if added is not None and state[2]:
            text = added
        state[2] = added is not None
        return text

    def _protected_step(self, state: list, seq: Sequence, token_id: int) -> str | None:
        """`state`'s stream stepped with `token_id`; where the stream cannot go on (text it
        gave changed), a new stream takes over from this token: the text already given stays,
        and the step does not fail (it would fail every request of the batch)."""
        try:
            return state[0].step(self.tokenizer, token_id)
        except Exception as e:  # tokenizers raises a bare Exception
            if _INVALID_PREFIX not in str(e):
                raise
        state[0] = DecodeStream(skip_special_tokens=seq.sampling_params.skip_special_tokens)
        return state[0].step(self.tokenizer, token_id)

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s stream once it is finished."""
        self._streams.pop(seq.seq_id, None)

    def _new_stream(self, seq: Sequence) -> DecodeStream:
        # The prompt's text is already known: feed its tail as context and drop what it yields.
        # The context is the longest window of the tail whose text ends in a whole character:
        # - the prompt may end inside one (a token-id prompt cut mid-way): the stream would
        #   emit its first bytes, as U+FFFD, at the start of the output's text; they are the
        #   prompt's, so the window ends before them;
        # - the tail may start inside one: a byte-fallback decoder then turns the whole run of
        #   byte tokens after it into U+FFFD, so the window starts after it (over nothing, a
        #   SentencePiece decoder would strip the output's leading space).
        # A token of no text (a skipped special token, a stripped space) is context too.
        skip = seq.sampling_params.skip_special_tokens
        context = seq.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        window: list[int] = []
        for end in range(len(context), 0, -1):
            window = next((context[first:end] for first in range(end) if not self.tokenizer.decode(
                context[first:end], skip_special_tokens=skip).endswith("\ufffd")), [])
            if window:
                break
        state: list = [DecodeStream(skip_special_tokens=skip)]
        for token_id in window:
            self._protected_step(state, seq, token_id)
        return state[0]

    @staticmethod
    def _truncate_at_stop(seq: Sequence, new_start: int) -> str | None:
        stops = seq.sampling_params.stop
        if not stops:
            return None
        # Each stop string where it ends in the new text: one wholly in earlier text was
        # looked for before, or lies in text that min_tokens keeps (not checked then).
        found = [
            (index, stop)
            for stop in stops
            if (index := seq.output_text.find(stop, max(0, new_start - len(stop) + 1))) != -1
        ]
        if not found:
            return None
        index, stop = min(found)
        if seq.sampling_params.include_stop_str_in_output:
            index += len(stop)
        seq.output_text = seq.output_text[:index]
        return stop
