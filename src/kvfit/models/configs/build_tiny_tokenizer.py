"""Build kvfit-tiny's tokenizer files beside this script (run once; the output is committed).

A byte-level BPE trained on the short text below: any string round-trips through bytes, so the
tiny model serves arbitrary prompts, and the file stays a few tens of KiB.

    python3 src/kvfit/models/configs/build_tiny_tokenizer.py
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512  # must equal `vocab_size` in kvfit-tiny/config.json
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEXT = """\
The engine keeps the key and value cache of every sequence in fixed-size blocks. A block table
maps each sequence to the blocks that hold its tokens, and a slot mapping tells the kernel where
each new token's key and value are written. The cache lives in a range of virtual addresses that
is reserved once; physical memory is committed to it as it is needed, so the base address never
moves and captured graphs stay valid while the cache grows, shrinks, sleeps and wakes.
How much memory is there for the cache? The engine does not guess. It loads the weights, runs a
profiling step at the largest batch, warms up every kernel and captures the graphs, and only then
measures what is free. The transient peak of the allocator is kept free, plus a margin, and the
rest becomes blocks of the cache.
The scheduler batches requests continuously: new prompts are prefilled in chunks alongside the
decode steps of running sequences, and when blocks run out the newest sequence is preempted and
recomputed later. Full blocks are hashed so that a shared prompt prefix is computed only once.
Hello! How are you today? What is the capital of France? Paris is the capital of France.
Tell me a story about a small model that answered every question with a question of its own.
Once upon a time there was a tiny language model. It knew only a few hundred tokens, but it
could count: one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9.
"""


def build(out_dir: Path) -> None:
    """Train the tokenizer and write `tokenizer.json` and `tokenizer_config.json` to out_dir."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([TEXT], trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"trained {tokenizer.get_vocab_size()} tokens, expected {VOCAB_SIZE}: lengthen TEXT"
        )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    build(Path(__file__).parent / "kvfit-tiny")
