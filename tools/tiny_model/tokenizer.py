"""The tiny model's tokenizer: a byte-level BPE trained on the corpus, with kvfit-tiny's chat
special tokens and template (so `kvfit chat` and the OpenAI chat route work unchanged).

    PYTHONPATH=src python3 tools/tiny_model/tokenizer.py --corpus /tmp/sotu/corpus.txt --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvfit.models.configs.build_tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

VOCAB_SIZE = 4096
# Ids fixed by SPECIAL_TOKENS' order; the model config names them.
END_OF_TEXT_ID, IM_START_ID, IM_END_ID = range(3)


def documents(corpus: Path) -> list[str]:
    """The corpus's documents (blank-line separated blocks), in file order."""
    return [d for d in corpus.read_text(encoding="utf-8").split("\n\n") if d.strip()]


def train_tokenizer(docs: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE over `docs`: any string round-trips through bytes, so every prompt
    encodes; `vocab_size` ids in all, the special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(docs, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, expected {vocab_size}")
    return tokenizer


def save(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write `tokenizer.json` and a `tokenizer_config.json` that transformers' fast tokenizer
    loads (end of sequence = `<|im_end|>`, as the chat template ends a turn)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": SPECIAL_TOKENS[IM_END_ID],
        "pad_token": SPECIAL_TOKENS[END_OF_TEXT_ID],
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="corpus.txt from corpus.py")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = p.parse_args(argv)
    save(train_tokenizer(documents(args.corpus), args.vocab_size), args.out)


if __name__ == "__main__":
    main()
