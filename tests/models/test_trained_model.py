"""The shipped trained model, kvfit-sotu: kvfit and transformers read the same files and agree,
its weights are really trained (perplexity far below chance), and `kvfit generate`'s default
greedy output is made of English words, which random weights' output is not."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfit import LLM, SamplingParams
from kvfit.cli import main
from kvfit.models.loader import BUILTIN_DIR, load_hf_config, load_tokenizer, resolve_load_format

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = "kvfit-sotu"
FOLDER = BUILTIN_DIR / MODEL
# The corpus's vocabulary, most frequent first (tools/tiny_model/corpus.py writes it).
VOCABULARY = (Path(__file__).parent / "data" / "sotu_words.txt").read_text().split()
WORDS, FUNCTION_WORDS = frozenset(VOCABULARY), frozenset(VOCABULARY[:50])
ENGINE = dict(device="cpu", max_model_len=128, max_num_batched_tokens=128, max_num_seqs=4)
ENGINE_FLAGS = ["--device", "cpu", "--max-model-len", "128", "--max-num-batched-tokens", "128",
                "--max-num-seqs", "4"]
PROMPTS = ("The people of the United States", "Congress has passed a law to",
           "The capital of France is")
# Written for this test (not a corpus passage): plain English in the corpus's register.
PASSAGE = ("We must work together to make our country stronger. The people of this nation "
           "expect their Government to keep the peace, to protect their rights, and to spend "
           "their money wisely. I ask the Congress to act on these proposals this year.")


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(MODEL, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()


def test_it_ships_trained_weights_loaded_by_default() -> None:
    assert resolve_load_format(MODEL, "auto") == "safetensors"
    assert resolve_load_format("kvfit-tiny", "auto") == "dummy"
    assert (FOLDER / "model.safetensors").stat().st_size <= 16 * 2**20
    tokenizer = load_tokenizer(MODEL)
    assert len(tokenizer) == load_hf_config(MODEL).vocab_size
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_greedy_continuations_match_transformers(llm: LLM, hf: torch.nn.Module) -> None:
    """Token-exact greedy in float32 on the CPU, from the same files."""
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for out in llm.generate(list(PROMPTS), params, use_tqdm=False):
        ids = tokenizer(out.prompt)["input_ids"]
        assert ids == out.prompt_token_ids
        for _ in range(16):  # full forwards: no cache, no stopping rule on either side
            with torch.no_grad():
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == ids[len(out.prompt_token_ids):]


def test_prompt_logprobs_match_transformers(llm: LLM, hf: torch.nn.Module) -> None:
    """Every position's top-5 log-probabilities equal transformers' log_softmax (top-1 first)."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    out = llm.generate([PASSAGE], params, use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([out.prompt_token_ids])).logits[0].log_softmax(-1)
    for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = ref[pos - 1]
        top1 = min(entry, key=lambda t: entry[t].rank)
        assert top1 == int(row.argmax())
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(row[token].item(), abs=1e-3)


def perplexity(engine: LLM, text: str) -> float:
    """exp of the mean negative log-likelihood of `text`'s tokens after the first."""
    out = engine.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=0),
                          use_tqdm=False)[0]
    pairs = zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], strict=True)
    return math.exp(-sum(entry[t].logprob for t, entry in pairs) / (len(out.prompt_token_ids) - 1))


def test_perplexity_far_below_chance_and_random_weights(llm: LLM) -> None:
    report = json.loads((FOLDER / "training_report.json").read_text())
    vocab = load_hf_config(MODEL).vocab_size
    assert report["uniform_perplexity"] == vocab
    assert report["val_perplexity"] < vocab / 20
    trained = perplexity(llm, PASSAGE)
    random_weights = LLM(MODEL, load_format="dummy", **ENGINE)
    try:
        untrained = perplexity(random_weights, PASSAGE)
    finally:
        random_weights.shutdown()
    assert trained < vocab / 20 and trained < untrained / 20


def test_the_docs_figures_are_the_training_reports() -> None:
    # docs/tiny-model.md scored "the first 131,072 held-out tokens" (the --val-tokens cap) of
    # a split that holds 117,070: its figures are the report's, over the whole split.
    report = json.loads((FOLDER / "training_report.json").read_text())
    doc = " ".join((Path(__file__).resolve().parents[2] / "docs" / "tiny-model.md")
                   .read_text().split())
    assert report["val_tokens"] < report["train"]["val_tokens"]
    assert (f"**{report['val_perplexity']:.1f}** (loss {report['best_val_loss']:.3f} nats/token)"
            f" on the whole held-out split ({report['val_tokens']:,} tokens;") in doc
    assert f"{report['parameters']:,}" in doc and f"{report['steps']:,} steps" in doc


def looks_english(text: str) -> bool:
    """Most words are corpus words; as in any English prose, a good share of them are its most
    frequent ones (the, of, and, to...); and at least 3 in 10 words are distinct. Word
    fragments fail the first test; a word, or a loop of a few words, repeated fails the last."""
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    assert len(words) >= 8, f"too few words to judge: {text!r}"
    known = sum(w in WORDS for w in words) / len(words)
    function = sum(w in FUNCTION_WORDS for w in words) / len(words)
    distinct = len(set(words)) / len(words)
    return known >= 0.9 and function >= 0.25 and distinct >= 0.3


def test_english_check_accepts_prose_and_rejects_repetition() -> None:
    assert looks_english(PASSAGE)
    assert not looks_english(" commit commit commit commit commit commit commit commit tea")
    assert not looks_english(" the States, and the be be be be be be be be be be be be be")
    assert not looks_english(", and the United States" * 8)
    assert not looks_english(" the ofation Congressure ingly tothe wered ment the of and")


def generated_text(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`kvfit generate`'s greedy completions; with a repetition penalty, as small models under
    plain greedy fall into a loop of a few words ("and the United States, and the...")."""
    assert main(["generate", "--temperature", "0", "--repetition-penalty", "1.2",
                 "--max-tokens", "48", "--ignore-eos", *ENGINE_FLAGS, "--log-level", "warning",
                 *argv]) == 0
    return "\n".join(re.findall(r"^completion: '(.*)' \(length\)$", capsys.readouterr().out,
                                flags=re.M))


def test_generate_default_model_writes_english(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    trained = generated_text(prompts, capsys)
    assert looks_english(trained), trained
    # The same check fails for random weights at the same shape: it measures the training.
    noise = generated_text([*prompts, "--load-format", "dummy"], capsys)
    assert not looks_english(noise), noise
