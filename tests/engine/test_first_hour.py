"""What a new user meets first in the Python API: wrong arguments name their cause (NaN and
fractional settings, bools as token ids, a dict as sampling_params, an int as the prompt, an
id outside the vocabulary, a damaged checkpoint, a Hub id), vLLM's prompt forms are accepted,
and vLLM's `reset_prefix_cache`, `get_metrics` and `tokenizer` work."""

from __future__ import annotations

import itertools
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams
from kvfit.engine.outputs import RequestOutput


@pytest.fixture(scope="module")
def llm(qwen3: Path) -> LLM:
    return LLM(str(qwen3), device="cpu", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=128)


def greedy(**kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"temperature": math.nan}, r"temperature must be a finite number, got nan"),
    ({"temperature": math.inf}, r"temperature must be a finite number, got inf"),
    ({"top_p": math.nan}, r"top_p must be a finite number"),
    ({"presence_penalty": -math.inf}, r"presence_penalty must be a finite number"),
    ({"max_tokens": 2.5}, r"max_tokens must be an integer, got 2.5"),
    ({"n": True}, r"n must be an integer, got True"),
    ({"seed": 1.0}, r"seed must be an integer"),
    ({"logprobs": 1.5}, r"logprobs must be an integer"),
    ({"stop_token_ids": [2, False]}, r"stop_token_ids must hold integers"),
    # Found by the hunt: these reached the detokenizer inside a step and failed the batch.
    ({"stop": ["a", 1]}, r"stop must hold strings, got \['a', 1\]"),
    ({"stop": [b"a"]}, r"stop must hold strings"),
    ({"bad_words": [3]}, r"bad_words must hold strings"),
    ({"bad_words_token_ids": [[1.5]]}, r"bad_words_token_ids must hold lists of integers"),
    ({"stop": 5}, r"stop must be a list, got 5"),
    ({"allowed_token_ids": 5}, r"allowed_token_ids must be a list, got 5"),
    ({"bad_words_token_ids": [5]}, r"bad_words_token_ids must be a list, got 5"),
    ({"logit_bias": {"a": 1.0}}, r"logit_bias must map token ids to numbers"),
    ({"logit_bias": [(1, 2.0)]}, r"logit_bias must map token ids to numbers"),
    ({"bad_words": ["ok", " "]}, r"bad_words must not contain an empty word"),
    ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens must be >= 1, -1"),
    ({"truncate_prompt_tokens": -2}, r"truncate_prompt_tokens must be >= 1, -1"),
])
def test_sampling_params_refuse_non_finite_and_non_integer_values(
    kwargs: dict, match: str,
) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{match}"):
        SamplingParams(**kwargs)


def test_sampling_params_accept_what_they_should() -> None:
    import numpy as np

    params = SamplingParams(temperature=0, max_tokens=np.int64(4), seed=None, top_p=1)
    assert params.greedy and params.max_tokens == 4


def test_vllm_prompt_dict_forms_are_accepted(llm: LLM) -> None:
    text = "hello world"
    ids = llm.get_tokenizer().encode(text)
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], greedy(),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == [text, text, None]
    assert outs[0].prompt_token_ids == outs[1].prompt_token_ids == outs[2].prompt_token_ids
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm: LLM) -> None:
    # vLLM's SamplingParams field, offline as the server takes it: a prompt past max_model_len
    # runs on its last k tokens, and gives what those tokens alone give.
    ids = list(range(3, 203))  # 200 tokens, max_model_len 128
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": ids}, greedy(), use_tqdm=False)
    cut, alone = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": ids[-50:]}],
                              [greedy(truncate_prompt_tokens=50), greedy()], use_tqdm=False)
    assert cut.prompt_token_ids == ids[-50:]
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    short = llm.generate({"prompt_token_ids": ids[:10]}, greedy(truncate_prompt_tokens=50),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == ids[:10]


def test_numpy_and_torch_prompt_token_ids_are_accepted(llm: LLM) -> None:
    import numpy as np
    import torch

    ids = [5, 6, 7]
    forms = [np.array(ids), torch.tensor(ids), [np.int64(i) for i in ids]]
    outs = llm.generate([{"prompt_token_ids": f} for f in [ids, *forms]], greedy(),
                        use_tqdm=False)
    assert all(o.prompt_token_ids == ids and type(o.prompt_token_ids[0]) is int for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1


@pytest.mark.parametrize(("prompts", "params", "error", "match"), [
    ("hi", {"temperature": 0}, TypeError,
     r"sampling_params must be a SamplingParams .* got dict .*SamplingParams\(\*\*params\)"),
    ("hi", [greedy(), {"temperature": 0}], TypeError, r"sampling_params must be a SamplingParams"),
    (5, None, TypeError, r"prompts must be a string, a prompt dict or a list .* got int 5"),
    ([5], None, ValueError, r"request 0: a prompt is a string, \{'prompt': 'text'\} .* got int"),
    ([{"text": "hi"}], None, ValueError, r"request 0: a prompt is .* got dict"),
    ([{"prompt_token_ids": [5, True]}], None, ValueError,
     r"request 0: prompt_token_ids\[1\] is True, not an int"),
    ([{"prompt_token_ids": "5 6"}], None, ValueError, r"prompt_token_ids is a list of ints"),
    (["ok", {"prompt_token_ids": [5, 600, 7]}], None, ValueError,
     r"request 1: prompt_token_ids\[1\] = 600 is outside the model's vocabulary of 512 ids"),
])
def test_wrong_arguments_name_their_cause(
    llm: LLM, prompts: object, params: object, error: type, match: str,
) -> None:
    with pytest.raises(error, match=match):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished()  # nothing was queued


def test_reset_prefix_cache_forgets_cached_prefixes(llm: LLM) -> None:
    prompt = {"prompt_token_ids": list(range(3, 70))}

    def hits_and_queries() -> tuple[float, float]:
        m = {metric.name: metric.value for metric in llm.get_metrics()}
        return m["kvfit:prefix_cache_hits"], m["kvfit:prefix_cache_queries"]

    llm.generate(prompt, greedy(), use_tqdm=False)
    hits, queries = hits_and_queries()
    llm.generate(prompt, greedy(), use_tqdm=False)
    warm_hits, warm_queries = hits_and_queries()
    assert warm_hits >= hits + 64  # the prompt's four full blocks came from the cache
    assert llm.reset_prefix_cache() is True
    llm.generate(prompt, greedy(), use_tqdm=False)
    cold_hits, cold_queries = hits_and_queries()
    assert cold_hits == warm_hits and cold_queries > warm_queries


def test_get_metrics_reports_the_engine_figures(llm: LLM) -> None:
    metrics = llm.get_metrics()
    by_name = {m.name: m for m in metrics}
    stats, report = llm.engine.stats(), llm.kv_cache_report
    assert by_name["kvfit:kv_cache_blocks_total"].value == stats.num_blocks == report.num_blocks
    assert by_name["kvfit:kv_cache_committed_bytes"].value == stats.committed_kv_bytes > 0
    assert by_name["kvfit:num_requests_running"].value == 0
    assert by_name["kvfit:kv_cache_sizing_info"].labels == {"method": report.method}
    assert {m.kind for m in metrics} == {"gauge", "counter"}
    assert by_name["kvfit:num_preemptions"].kind == "counter"
    assert all(m.name.startswith("kvfit:") and m.help for m in metrics)


def test_tokenizer_from_another_folder(
        qwen3: Path, split_tokenizer: Callable[[Path], tuple[Path, Path]]) -> None:
    model, tokenizer = split_tokenizer(qwen3)
    kwargs = dict(device="cpu", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64)
    bare = LLM(str(model), **kwargs)
    assert bare.get_tokenizer() is None
    bare.shutdown()
    llm = LLM(str(model), tokenizer=str(tokenizer), **kwargs)
    out = llm.generate("hello", greedy(), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode("hello")
    llm.shutdown()
    with pytest.raises(ValueError, match="tokenizer=.* holds no tokenizer files"):
        LLM(str(model), tokenizer=str(model), **kwargs)
    with pytest.raises(ValueError, match="tokenizer='/no/such/folder' is neither a folder"):
        LLM(str(model), tokenizer="/no/such/folder", **kwargs)


def test_truncated_checkpoint_names_the_file(qwen3: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(qwen3, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"cannot read the checkpoint file {weights}: .*fetch "
                       "it again"):
        LLM(str(model), device="cpu", max_model_len=64, max_num_batched_tokens=64)


def test_a_hub_id_says_how_to_get_a_local_folder() -> None:
    with pytest.raises(FileNotFoundError, match=r"kvfit loads local Hugging Face folders .*"
                       r"hf download Qwen/Qwen3-0\.6B --local-dir \./Qwen3-0\.6B"):
        LLM("Qwen/Qwen3-0.6B", device="cpu")


def test_logprobs_are_vllm_logprob_objects(llm: LLM) -> None:
    from kvfit.engine.outputs import Logprob

    out = llm.generate("hello world", greedy(logprobs=2, prompt_logprobs=1), use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    assert out.prompt_logprobs[0] is None and entries
    for entry in entries:
        for token_id, lp in entry.items():
            assert isinstance(lp, Logprob) and lp.logprob <= 0 and lp.rank >= 1
            assert lp.decoded_token == tokenizer.decode([token_id])
    # Greedy: each sampled token is the most likely one.
    assert all(entry[t].rank == 1 for t, entry in
               zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True))


def test_get_metrics_counts_the_steps_and_the_tokens_they_computed(llm: LLM) -> None:
    def steps() -> tuple[float, float, float]:
        m = {metric.name: metric.value for metric in llm.get_metrics()}
        return (m["kvfit:engine_steps"], m["kvfit:engine_step_tokens"],
                m["kvfit:engine_decode_steps"])

    llm.reset_prefix_cache()  # a cached prefix would not be computed: keep counts exact
    before = steps()
    # Two 40-token prompts (one prefill step under the 128-token budget), 4 tokens each: the
    # first comes from the prefill, the last is sampled by a step that needs no successor.
    prompts = [{"prompt_token_ids": list(range(100 + i, 140 + i))} for i in range(2)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    num_steps, num_tokens, num_decode = (a - b for a, b in zip(steps(), before, strict=True))
    assert (num_steps, num_decode) == (4, 3)
    assert num_tokens == 2 * 40 + 2 * 3
    # One token of one prompt: its prefill step alone, which is no decode step.
    before = steps()
    llm.generate({"prompt_token_ids": list(range(300, 400))},
                 SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    num_steps, num_tokens, num_decode = (a - b for a, b in zip(steps(), before, strict=True))
    assert (num_steps, num_tokens, num_decode) == (1, 100, 0)


def test_get_metrics_counts_the_requests_as_the_servers_metrics_do(llm: LLM) -> None:
    """vLLM's offline get_metrics() has the request counters /metrics has: prompt and
    generated tokens, and each completion by its finish reason."""
    def counts() -> dict[str, float]:
        return {m.name + "".join(m.labels.values()): m.value for m in llm.get_metrics()
                if m.name in ("kvfit:prompt_tokens", "kvfit:generation_tokens",
                              "kvfit:request_success")}

    before = counts()
    assert {"kvfit:request_successstop", "kvfit:request_successlength"} <= set(before)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [8, 9]}],
                        SamplingParams(temperature=1.0, max_tokens=3, n=2, ignore_eos=True),
                        use_tqdm=False)
    grew = {k: v - before.get(k, 0) for k, v in counts().items()}
    assert grew["kvfit:prompt_tokens"] == sum(len(o.prompt_token_ids) for o in outs) == 5
    assert grew["kvfit:generation_tokens"] == 2 * 2 * 3
    assert grew["kvfit:request_successlength"] == 2 * 2
    assert all(m.kind == "counter" for m in llm.get_metrics()
               if m.name == "kvfit:request_success")


def test_reset_prefix_cache_with_running_requests_preempts_them_as_vllms_does(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": list(range(5 + i, 70 + i))} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expect = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.reset_prefix_cache() is True  # cold: the prompts run for several steps
    requests = [llm.make_request(p, params, f"reset-{i}") for i, p in enumerate(prompts)]
    for seq in itertools.chain.from_iterable(requests):
        llm.engine.add_request(seq)
    llm.engine.step()
    llm.engine.step()
    assert llm.reset_prefix_cache() is False  # requests hold blocks: nothing changes
    preempted = llm.engine.stats().num_preemptions
    assert llm.reset_prefix_cache(reset_running_requests=True) is True
    assert llm.engine.stats().num_preemptions > preempted
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [RequestOutput.from_seqs(r).outputs[0].token_ids for r in requests] == expect
    # No KV connector here: vLLM's answer, False with a warning (not an error).
    assert llm.reset_prefix_cache(reset_connector=True) is False
