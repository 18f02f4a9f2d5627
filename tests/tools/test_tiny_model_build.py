"""tools/tiny_model, the scripts that rebuild kvfit-sotu: corpus cleaning, and a short training
run on a synthetic corpus that writes a folder kvfit and transformers both load."""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path
from types import ModuleType

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfit.models.loader import load_hf_config, load_model, resolve_load_format

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "tiny_model"

pytestmark = pytest.mark.usefixtures("one_thread")


def tool(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """A script of tools/tiny_model as a module (they import their siblings by name)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    return importlib.import_module(name)


def test_clean_folds_typography_and_whitespace(monkeypatch: pytest.MonkeyPatch) -> None:
    corpus = tool("corpus", monkeypatch)
    text = "\u201cWe  the\tPeople\u201d \u2014 of the\nStates\u2026\n\n\n  Second\u00a0one.  \n"
    assert corpus.clean(text) == '"We the People" - of the States...\nSecond one.'
    assert corpus.vocabulary("The the THE people; a b b", min_count=2) == ["the", "b"]


def synthetic_documents(n: int) -> list[str]:
    """Documents from a tiny grammar: learnable within seconds, so the loss must fall."""
    rng = random.Random(0)
    nouns, verbs = ["the farmer", "the ship", "the nation", "our army"], ["builds", "sees"]
    return [" ".join(f"{rng.choice(nouns).capitalize()} {rng.choice(verbs)} "
                     f"{rng.choice(nouns)}." for _ in range(40)) for _ in range(n)]


def test_short_training_run_writes_a_loadable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    train = tool("train", monkeypatch)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(synthetic_documents(200)) + "\n")
    out = tmp_path / "model"
    report = train.main(["--corpus", str(corpus), "--out", str(out), "--device", "cpu",
                         "--minutes", "0.15", "--vocab-size", "280", "--hidden-size", "64",
                         "--intermediate-size", "128", "--layers", "1", "--batch-size", "8",
                         "--seq-len", "64", "--eval-every-s", "3", "--val-tokens", "2048"])
    written = json.loads((out / "training_report.json").read_text())
    assert written["steps"] == report.steps > 0 and written["device"] == "cpu"
    assert report.evals[0]["step"] == 0  # the untrained baseline
    assert report.best_val_loss < report.evals[0]["val_loss"] - 1.0
    assert written["checkpoint_bytes"] == (out / "model.safetensors").stat().st_size
    # transformers 4.x reads rope_theta at the top level; 5.x writes only rope_parameters.
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 10000.0 and config["torch_dtype"] == "bfloat16"
    assert resolve_load_format(str(out), "auto") == "safetensors"
    hf_config = load_hf_config(str(out))
    ours = load_model(hf_config, str(out), torch.float32, torch.device("cpu"), "auto")
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    embed = hf.get_input_embeddings().weight
    assert torch.equal(ours.model.embed_tokens.weight, embed)


def test_max_epochs_ends_the_run_before_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    train = tool("train", monkeypatch)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(synthetic_documents(100)) + "\n")
    report = train.main(["--corpus", str(corpus), "--out", str(tmp_path / "model"),
                         "--device", "cpu", "--minutes", "10", "--max-epochs", "0.5",
                         "--vocab-size", "280", "--hidden-size", "64", "--intermediate-size",
                         "128", "--layers", "1", "--batch-size", "8", "--seq-len", "64",
                         "--val-tokens", "1024"])
    half = report.train_tokens / 2
    assert half <= report.tokens_seen < half + 8 * 64 and report.seconds < 60


def test_held_out_passages_come_from_the_validation_split_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    heldout, train = tool("heldout", monkeypatch), tool("train", monkeypatch)
    # Document i says only "Doc i." (many times): a passage shows which document it came from.
    docs = [" ".join([f"Doc {i}."] * 100) for i in range(60)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(docs) + "\n")
    found = heldout.held_out_passages(corpus, num=6, chars=200)
    sources = [int(p.split()[1].rstrip(".")) for p in found]
    assert all(train.is_held_out(i) for i in sources)
    assert sources == [19, 39, 59, 19, 39, 59]  # round-robin over the held-out documents
    assert all(len(p) >= 200 for p in found)
    with pytest.raises(SystemExit, match="lower --num or --chars"):
        heldout.main(["--corpus", str(corpus), "--out", str(tmp_path / "p.txt"),
                      "--num", "1000", "--chars", "200"])
