"""Passages of the corpus the tiny model never trained on, one per line: the prompts of the
accuracy checks on trained weights (`bench/kv_dtype.py --prompts-file`).

    python3 tools/tiny_model/corpus.py --out /tmp/sotu
    python3 tools/tiny_model/heldout.py --corpus /tmp/sotu/corpus.txt --out /tmp/sotu/heldout.txt

The documents are train.py's validation split (`is_held_out`, every 20th address). Each is cut
at sentence ends into passages of about `--chars` characters (~512 tokens of the model's
tokenizer at 4.5 characters per token); passages are taken round-robin over the documents, so
`--num` of them span the eras of the split rather than exhausting its first address.
"""

from __future__ import annotations

import argparse
import itertools
import re
from pathlib import Path

from tokenizer import documents
from train import is_held_out

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def passages(text: str, chars: int) -> list[str]:
    """`text` cut at sentence ends into passages of at least `chars` characters (the last,
    shorter one dropped: every prompt has the same length class)."""
    out, current = [], ""
    for sentence in _SENTENCE_END.split(" ".join(text.split())):
        current = f"{current} {sentence}" if current else sentence
        if len(current) >= chars:
            out.append(current)
            current = ""
    return out


def held_out_passages(corpus: Path, num: int, chars: int) -> list[str]:
    """`num` passages of the validation documents, round-robin over the documents."""
    docs = [passages(d, chars) for i, d in enumerate(documents(corpus)) if is_held_out(i)]
    rounds = itertools.zip_longest(*docs)
    return [p for p in itertools.chain.from_iterable(rounds) if p is not None][:num]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="corpus.txt from corpus.py")
    p.add_argument("--out", type=Path, required=True, help="the prompts file to write")
    p.add_argument("--num", type=int, default=32, help="passages (default: %(default)s)")
    p.add_argument("--chars", type=int, default=2300,
                   help="characters per passage, at least (default: %(default)s)")
    args = p.parse_args(argv)
    found = held_out_passages(args.corpus, args.num, args.chars)
    if len(found) < args.num:
        raise SystemExit(f"the validation split has {len(found)} passages of {args.chars} "
                         f"characters, not {args.num}: lower --num or --chars")
    args.out.write_text("\n".join(found) + "\n", encoding="utf-8")
    print(f"{len(found)} held-out passages -> {args.out}")


if __name__ == "__main__":
    main()
