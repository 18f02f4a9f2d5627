"""Detokenizer: incremental text equals a full decode; stop strings found across tokens."""

from __future__ import annotations

import pytest
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import PreTrainedTokenizerFast

from kvfit.engine.block_manager import BlockManager
from kvfit.engine.detokenizer import Detokenizer
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.scheduler import Scheduler
from kvfit.engine.sequence import ModelOutput, Sequence

CORPUS = ["hello world, the stop word is STOP here. Good night moon"] * 20


@pytest.fixture(scope="module")
def byte_level() -> Tokenizer:
    """Byte-level BPE that knows no CJK or accented merges: such characters span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def metaspace() -> Tokenizer:
    """SentencePiece-style: the decoder drops the space marker of the text's first token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Metaspace(prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def generate(detok: Detokenizer, prompt: list[int], output: list[int], **params: object) -> tuple:
    """Feed `output` one token at a time; returns (sequence, stop string, tokens fed)."""
    seq = Sequence(prompt, SamplingParams(**params))
    for i, token in enumerate(output):
        seq.append_token(token)
        if (stop := detok.step(seq)) is not None:
            return seq, stop, i + 1
    return seq, None, len(output)


@pytest.mark.parametrize(
    "text", ["hello world 日本語 night", "é moon ü", "STOP 🌙 here", "naïve façade"]
)
def test_incremental_text_equals_full_decode(byte_level: Tokenizer, text: str) -> None:
    prompt = byte_level.encode("Good night ").ids
    output = byte_level.encode(text).ids
    assert len(output) > len(text.split())  # characters really span several tokens
    seq, stop, _ = generate(Detokenizer(byte_level), prompt, output)
    assert stop is None
    assert seq.output_text == byte_level.decode(output) == text


def test_prompt_context_keeps_the_leading_space(metaspace: Tokenizer) -> None:
    prompt = metaspace.encode("hello").ids
    output = metaspace.encode("world moon").ids
    assert metaspace.decode(output) == "world moon"  # decoded alone the space is dropped
    seq, _, _ = generate(Detokenizer(metaspace), prompt, output)
    assert seq.output_text == " world moon"


def test_prompt_cut_inside_a_character_adds_nothing_to_the_output(
    byte_level: Tokenizer,
) -> None:
    # A token-id prompt may end with the first bytes of a character; they are the prompt's,
    # so the output's text must not start with the replacement character they decode to.
    first_bytes = byte_level.encode("日").ids[:-1]
    assert byte_level.decode(first_bytes).endswith("\ufffd")  # the character spans tokens
    prompt = byte_level.encode("Good night ").ids + first_bytes
    output = byte_level.encode(" moon").ids
    seq, _, _ = generate(Detokenizer(byte_level), prompt, output)
    assert seq.output_text == byte_level.decode(output) == " moon"


def test_stop_string_across_token_boundaries(byte_level: Tokenizer) -> None:
    output = byte_level.encode("hello world, the stop word").ids
    seq, stop, fed = generate(Detokenizer(byte_level), [1], output, stop=["lo wor", "stop"])
    assert stop == "lo wor"
    assert seq.output_text == "hel"
    assert byte_level.decode(output[:fed]).find("lo wor") != -1
    assert "lo wor" not in byte_level.decode(output[: fed - 1])  # found on the completing token


def test_stop_string_inside_multibyte_characters(byte_level: Tokenizer) -> None:
    output = byte_level.encode("moon 日本語 night").ids
    seq, stop, _ = generate(Detokenizer(byte_level), [1], output, stop=["本語"])
    assert (stop, seq.output_text) == ("本語", "moon 日")


def test_earliest_stop_string_wins(byte_level: Tokenizer) -> None:
    output = byte_level.encode("Good night moon").ids
    seq, stop, _ = generate(Detokenizer(byte_level), [1], output, stop=["ght moon", "night"])
    assert (stop, seq.output_text) == ("night", "Good ")


def test_special_tokens_follow_skip_special_tokens(byte_level: Tokenizer) -> None:
    eos = byte_level.token_to_id("<eos>")
    output = [*byte_level.encode("moon").ids, eos]
    skipped, _, _ = generate(Detokenizer(byte_level), [1], output)
    kept, _, _ = generate(Detokenizer(byte_level), [1], output, skip_special_tokens=False)
    assert skipped.output_text == "moon"
    assert kept.output_text == "moon<eos>"


def test_spaces_between_special_tokens_follow_vllm() -> None:
    """vLLM's `spaces_between_special_tokens=False` (with special tokens kept): an added token
    after another comes without the space a WordPiece decoder puts before it; the first of a
    run keeps it, as in vLLM. The field was refused (SamplingParams took no such argument)."""
    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "##b": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken("<x>", special=True), AddedToken("<y>", special=True)])
    output = [1, 2, 3, 4, 3, 1, 4]  # a ##b <x> <y> <x> a <y>

    def text(**params: object) -> str:
        seq, _, _ = generate(Detokenizer(tok), [1], output, **params)
        return seq.output_text

    assert text(skip_special_tokens=False) == " ab <x> <y> <x> a <y>"
    assert text(skip_special_tokens=False, spaces_between_special_tokens=False) == \
        " ab <x><y><x> a <y>"
    # Skipped special tokens leave no space to drop: the setting changes nothing (vLLM's).
    assert text(spaces_between_special_tokens=False) == text() == " ab a"


def test_transformers_fast_tokenizer_and_no_tokenizer(byte_level: Tokenizer) -> None:
    output = byte_level.encode("hello 日本").ids
    wrapped = PreTrainedTokenizerFast(tokenizer_object=byte_level)
    seq, _, _ = generate(Detokenizer(wrapped), [1], output)
    assert seq.output_text == "hello 日本"
    none, stop, _ = generate(Detokenizer(None), [1], output, stop=["hello"])
    assert (none.output_text, stop) == ("", None)
    with pytest.raises(TypeError, match="fast tokenizer"):
        Detokenizer(object())


def test_scheduler_finishes_on_a_stop_string(byte_level: Tokenizer) -> None:
    scheduler = Scheduler(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=128,
        block_manager=BlockManager(32, 4, enable_prefix_caching=True),
        eos_token_id=byte_level.token_to_id("<eos>"),
        detokenizer=Detokenizer(byte_level),
    )
    output = byte_level.encode(" the stop word is STOP here").ids
    seq = Sequence([1, 2], SamplingParams(max_tokens=50, stop=["STOP"]))
    scheduler.add(seq)
    for token in output:
        batch = scheduler.schedule()
        finished = scheduler.postprocess(batch, ModelOutput([token], [None], [None]))
        if finished:
            break
    assert finished == [seq]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "STOP")
    assert seq.output_text == " the stop word is "
    assert scheduler.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("text", ["hello 日本語 night", "é moon ü 🌙"])
def test_token_bytes_join_into_the_text(byte_level: Tokenizer, text: str) -> None:
    """Tokens holding part of a character give its raw bytes, not U+FFFD's."""
    detok = Detokenizer(byte_level)
    ids = byte_level.encode(text).ids
    assert any(detok.decode_token(t) == "\ufffd" for t in ids)
    assert b"".join(detok.token_bytes(t) for t in ids) == text.encode()


def test_token_bytes_of_byte_fallback_pieces() -> None:
    """SentencePiece-style byte fallback: a `<0xNN>` piece is the byte NN."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁moon"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    detok = Detokenizer(tok)
    ids = [1 + b for b in "日".encode()] + [257]
    assert [detok.decode_token(t) for t in ids[:3]] == ["\ufffd"] * 3
    assert b"".join(detok.token_bytes(t) for t in ids) == "日 moon".encode()


@pytest.mark.parametrize("in_prompt", [False, True])
def test_byte_fallback_run_rewritten_by_a_later_token_does_not_fail_the_step(
    in_prompt: bool,
) -> None:
    """A byte-fallback decoder turns every byte of an invalid UTF-8 run into U+FFFD, so a
    token after a lone lead byte rewrites text `DecodeStream` already gave, and it raises
    ("Invalid prefix encountered"). That failed the engine's step and every request in it;
    a new stream takes over instead (vLLM's recovery), in the prompt's context too."""
    pieces = ["<unk>", *(f"<0x{b:02X}>" for b in range(256)), "▁moon"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                               byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    a, lead, moon = 1 + ord("a"), 1 + 0xC5, 257
    prompt, output = [a, a], [lead, moon, a]
    if in_prompt:
        prompt, output = [a, lead, moon], [moon, a]
    seq, stop, fed = generate(Detokenizer(tok), prompt, output)
    assert (stop, fed) == (None, len(output))
    assert seq.output_text == " moona"


@pytest.fixture(scope="module")
def sentencepiece_bytes() -> Tokenizer:
    """Llama 2's decoder: byte fallback (a run of byte pieces that is not valid UTF-8 decodes
    to U+FFFD, every byte of it) and the text's first space stripped."""
    pieces = ["<unk>", "<s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "c", "▁moon"]
    tok = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken("<s>", special=True)])
    return tok


@pytest.mark.parametrize("prompt_text", ["ü語ü", "▁", "ab😀"])
def test_output_keeps_its_leading_space_after_any_prompt_tail(
    sentencepiece_bytes: Tokenizer, prompt_text: str
) -> None:
    """The output's text is the whole text's after the prompt's. The context fed to the
    stream was cut to nothing where the prompt's tail started inside a character (every byte
    piece of the run then decodes to U+FFFD, "incomplete") or held no text (`<s>▁`), and the
    decoder stripped the output's leading space."""
    tok = sentencepiece_bytes
    pieces = [tok.token_to_id("▁")] if prompt_text == "▁" else tok.encode(
        prompt_text, add_special_tokens=False).ids[1:]  # without the space prepended
    prompt = [tok.token_to_id("<s>"), *pieces]
    output = tok.encode(" c moon", add_special_tokens=False).ids
    assert output[0] == tok.token_to_id("▁")  # the space the decoder strips from the start
    seq, _, _ = generate(Detokenizer(tok), prompt, output)
    full, before = tok.decode(prompt + output), tok.decode(prompt)
    assert full.startswith(before) and seq.output_text == full[len(before):]
