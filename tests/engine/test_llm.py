"""The `LLM` API end to end on the CPU, against Hugging Face transformers on the same weights."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvfit import LLM, SamplingParams
from kvfit.engine.sequence import ScheduledBatch, Sequence

MAX_TOKENS = 12
# Lengths cross block boundaries (block_size 16) and include a one-token prompt.
PROMPT_LENGTHS = (1, 5, 16, 17, 31, 48, 70, 101)


def make_prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


@cache
def hf_model(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(folder: Path, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    """Greedy continuation by full forwards (no HF cache, no stopping: ignore_eos)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        logits = hf_model(folder)(torch.tensor([ids])).logits[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def hf_logprobs(folder: Path, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of every position's logits, [len(token_ids), vocab]."""
    return hf_model(folder)(torch.tensor([token_ids])).logits[0].log_softmax(-1)


def greedy(max_tokens: int = MAX_TOKENS, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def make_llm(folder: Path, **kwargs: object) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 256)
    kwargs.setdefault("max_num_batched_tokens", 512)
    return LLM(str(folder), device="cpu", **kwargs)


def spy_sequences(llm: LLM) -> list[Sequence]:
    """Record every sequence added to `llm`'s engine (to read cache hits, preemptions)."""
    seen: list[Sequence] = []
    add = llm.engine.add_request
    llm.engine.add_request = lambda seq: (seen.append(seq), add(seq))[1]  # type: ignore[method-assign]
    return seen


@pytest.fixture(scope="module")
def qwen3_llm(qwen3: Path) -> LLM:
    return make_llm(qwen3)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_greedy_matches_transformers_batched(
    tiny_model: Callable[[str], Path], arch: str, enable_prefix_caching: bool
) -> None:
    folder = tiny_model(arch)
    # The first prompt shares 2 blocks with the warm-up one, so prefix caching has something
    # to hit (it comes first: freed cached blocks are the lowest ids, the next ones handed out).
    prompts = make_prompts()
    prompts.insert(0, prompts[-1][:32] + [7, 8, 9])
    llm = make_llm(folder, enable_prefix_caching=enable_prefix_caching)
    seen = spy_sequences(llm)
    llm.generate(token_prompts(prompts[-1:]), greedy(), use_tqdm=False)  # caches the prefix
    outputs = llm.generate(token_prompts(prompts), greedy(), use_tqdm=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(folder, prompt)
        assert out.outputs[0].finish_reason == "length"
    hits = sum(seq.num_cached_tokens for seq in seen[1:])
    assert (hits > 0) == enable_prefix_caching


def test_num_cached_tokens_counts_the_prompts_prefix_cache_hits(qwen3: Path) -> None:
    prompt = make_prompts((50,), seed=3)[0]
    for enable in (True, False):
        llm = make_llm(qwen3, enable_prefix_caching=enable)
        block_size = llm.engine.config.cache_config.block_size
        (cold,) = llm.generate(token_prompts([prompt]), greedy(), use_tqdm=False)
        (warm,) = llm.generate(token_prompts([prompt + [5, 6]]), greedy(), use_tqdm=False)
        assert cold.num_cached_tokens == 0
        # The first prompt's full blocks, never its last token.
        assert warm.num_cached_tokens == (49 // block_size * block_size if enable else 0)
        llm.shutdown()


def test_preemption_on_a_tiny_cache_keeps_outputs(qwen3: Path) -> None:
    prompts = make_prompts((40, 45, 50, 55, 60, 65), seed=1)
    # 10 blocks of 16 tokens hold one max_model_len sequence, not six of up to 105 tokens.
    llm = make_llm(
        qwen3, num_gpu_blocks_override=10, max_model_len=128, enable_prefix_caching=False
    )
    outputs = llm.generate(token_prompts(prompts), greedy(max_tokens=40), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(qwen3, prompt, 40)


def test_chunked_prefill_keeps_outputs(qwen3: Path) -> None:
    prompts = make_prompts()
    llm = make_llm(qwen3, max_num_batched_tokens=16)
    seen = spy_sequences(llm)
    outputs = llm.generate(token_prompts(prompts), greedy(), use_tqdm=False)
    assert max(len(s) for s in seen) > 16  # at least one prompt ran in several chunks
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(qwen3, prompt)


def test_long_prefill_token_threshold_cuts_prompts_and_keeps_outputs(qwen3: Path) -> None:
    prompts = make_prompts()
    llm = make_llm(qwen3, long_prefill_token_threshold=7)
    assert llm.engine.scheduler.long_prefill_token_threshold == 7
    chunks: list[int] = []
    schedule = llm.engine.scheduler.schedule

    def spy() -> object:
        batch = schedule()
        if batch is not None:
            chunks.extend(batch.num_new_tokens)
        return batch

    llm.engine.scheduler.schedule = spy  # type: ignore[method-assign]
    params = greedy(logprobs=2)
    outputs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert max(chunks) == 7  # every prompt longer than 7 tokens was cut at 7
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(qwen3, prompt)
        ref = hf_logprobs(qwen3, prompt + out.outputs[0].token_ids)
        for i, entry in enumerate(out.outputs[0].logprobs):
            for token, lp in entry.items():
                assert lp.logprob == pytest.approx(ref[len(prompt) + i - 1, token].item(),
                                                   abs=1e-4)


def test_logprobs_and_prompt_logprobs_match_log_softmax(qwen3: Path) -> None:
    prompts = make_prompts((9, 40, 23))
    # A small token budget splits prompts into chunks: prompt logprobs cross chunk borders.
    llm = make_llm(qwen3, max_num_batched_tokens=16)
    params = greedy(max_tokens=5, logprobs=3, prompt_logprobs=2)
    for prompt, out in zip(
        prompts, llm.generate(token_prompts(prompts), params, use_tqdm=False), strict=True
    ):
        completion = out.outputs[0]
        full = prompt + completion.token_ids
        ref = hf_logprobs(qwen3, full)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
            row = ref[pos - 1]
            assert set(row.topk(2).indices.tolist()) <= set(entry)
            assert prompt[pos] in entry
            for token, lp in entry.items():
                assert lp.logprob == pytest.approx(row[token].item(), abs=1e-4)
                assert lp.rank == 1 + int((row > row[token]).sum())
        assert len(completion.logprobs) == len(completion.token_ids)
        for i, (token, entry) in enumerate(
            zip(completion.token_ids, completion.logprobs, strict=True)
        ):
            row = ref[len(prompt) + i - 1]
            assert token in entry and len(entry) == 3  # greedy: the sampled one is the top-1
            for t, lp in entry.items():
                assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
                assert lp.rank == 1 + int((row > row[t]).sum())
                assert lp.decoded_token == llm.get_tokenizer().decode([t])
        assert completion.cumulative_logprob == pytest.approx(
            sum(entry[t].logprob
                for t, entry in zip(completion.token_ids, completion.logprobs, strict=True))
        )


def test_results_come_back_in_input_order(qwen3_llm: LLM, qwen3: Path) -> None:
    prompts = make_prompts((30, 3, 12, 50), seed=2)
    # Different lengths make requests finish in a different order than they were given.
    params = [greedy(max_tokens=n) for n in (2, 9, 1, 5)]
    outputs = qwen3_llm.generate(token_prompts(prompts), params, use_tqdm=False)
    for prompt, p, out in zip(prompts, params, outputs, strict=True):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(qwen3, prompt, p.max_tokens)


def test_text_prompts_and_chat(qwen3_llm: LLM) -> None:
    tokenizer = qwen3_llm.get_tokenizer()
    [out] = qwen3_llm.generate("hello world", greedy(), use_tqdm=False)
    assert out.prompt == "hello world"
    assert out.prompt_token_ids == tokenizer.encode("hello world")
    assert out.outputs[0].text == tokenizer.decode(
        out.outputs[0].token_ids, skip_special_tokens=True
    )
    conversation = [{"role": "user", "content": "what is the sky?"}]
    [chat] = qwen3_llm.chat(conversation, greedy(), use_tqdm=False)
    rendered = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=True
    )
    assert chat.prompt == rendered
    [direct] = qwen3_llm.generate(
        {"prompt_token_ids": tokenizer.encode(rendered, add_special_tokens=False)},
        greedy(),
        use_tqdm=False,
    )
    assert chat.prompt_token_ids == direct.prompt_token_ids
    assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
    two = qwen3_llm.chat([conversation, conversation[:1]], greedy(), use_tqdm=False)
    assert len(two) == 2


def test_chat_continues_the_final_message_and_takes_template_variables(
    qwen3_llm: LLM,
) -> None:
    # vLLM's LLM.chat arguments: an assistant prefill, the template's own variables, tools.
    tokenizer = qwen3_llm.get_tokenizer()
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    [out] = qwen3_llm.chat(conversation, greedy(1), use_tqdm=False,
                           add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel"
    assert out.prompt_token_ids == tokenizer.encode(out.prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        qwen3_llm.chat(conversation, greedy(1), use_tqdm=False, continue_final_message=True)
    template = ("{{ greeting }}{% for t in tools or [] %}<{{ t['name'] }}>{% endfor %}"
                "{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    [out] = qwen3_llm.chat(conversation[:1], greedy(1), use_tqdm=False, chat_template=template,
                           chat_template_kwargs={"greeting": "hey"}, tools=[{"name": "f"}])
    assert out.prompt == "hey<f>[hi]"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set tokenize"):
        qwen3_llm.chat(conversation[:1], greedy(1), use_tqdm=False,
                       chat_template_kwargs={"tokenize": True})


def test_chat_joins_openai_text_parts(qwen3_llm: LLM) -> None:
    # OpenAI's content parts, as vLLM's LLM.chat takes them: rendered as the list they are,
    # the template wrote their Python repr into the prompt.
    parts = [{"type": "text", "text": "what is"}, {"type": "text", "text": "the sky?"}]
    [out] = qwen3_llm.chat([{"role": "user", "content": parts}], greedy(1), use_tqdm=False)
    [ref] = qwen3_llm.chat([{"role": "user", "content": "what is\nthe sky?"}], greedy(1),
                           use_tqdm=False)
    assert out.prompt == ref.prompt and out.prompt_token_ids == ref.prompt_token_ids
    image = [{"type": "image_url", "image_url": {"url": "data:..."}}]
    with pytest.raises(ValueError, match="message 0: content part 0 .*text only"):
        qwen3_llm.chat([{"role": "user", "content": image}], greedy(1), use_tqdm=False)


@pytest.mark.parametrize(
    ("prompt", "params", "setting"),
    [
        ({"prompt_token_ids": []}, greedy(), "empty"),
        ({"prompt_token_ids": [5] * 512}, greedy(), "max_model_len"),
        ({"prompt_token_ids": [5, 100000]}, greedy(), "prompt_token_ids"),
        ({"prompt_token_ids": [5]}, greedy(logprobs=21), "max_logprobs"),
        ({"prompt_token_ids": [5]}, greedy(prompt_logprobs=50), "max_logprobs"),
        ([5, 6], greedy(), "prompt_token_ids"),
        # vLLM's keys for what a text-only engine does not do: they were ignored.
        ({"prompt": "hi", "multi_modal_data": {"image": None}}, greedy(), "multi_modal_data"),
    ],
)
def test_one_bad_request_raises_before_anything_runs(
    qwen3_llm: LLM, qwen3: Path, prompt: object, params: SamplingParams, setting: str
) -> None:
    good = make_prompts((7, 20), seed=3)
    with pytest.raises(ValueError, match=setting) as err:
        qwen3_llm.generate(
            [*token_prompts(good), prompt], [greedy(), greedy(), params], use_tqdm=False
        )
    assert "request 2" in str(err.value)
    assert not qwen3_llm.engine.has_unfinished()
    outputs = qwen3_llm.generate(token_prompts(good), greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(qwen3, p) for p in good]


def test_sampling_params_and_argument_errors(qwen3_llm: LLM) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="sampling_params"):
        qwen3_llm.generate(["a", "b"], [greedy()], use_tqdm=False)
    with pytest.raises(TypeError, match="no_such_flag"):
        LLM("kvfit-tiny", no_such_flag=1)


def test_generation_config_sampling_defaults_apply_where_a_request_leaves_them(
        tmp_path: Path, qwen3: Path) -> None:
    # vLLM's generation_config="auto" (its default): generation_config.json's temperature,
    # top_k, ..., max_new_tokens are the defaults of a request that leaves them unset.
    prompt = make_prompts((9,), seed=4)[0]
    shutil.copytree(qwen3, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "temperature": 0.0, "top_k": 3, "max_new_tokens": 5,
         "do_sample": True}))
    llm = make_llm(tmp_path / "m")
    assert llm.config.model_config.sampling_defaults == {"temperature": 0.0, "top_k": 3,
                                                         "max_tokens": 5}
    assert llm.get_default_sampling_params() == SamplingParams(temperature=0, top_k=3,
                                                               max_tokens=5)
    [out] = llm.generate(token_prompts([prompt]), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(qwen3, prompt, max_tokens=5)
    llm.shutdown()
    # "vllm": SamplingParams' own defaults (max_tokens 16, temperature 1).
    llm = make_llm(tmp_path / "m", generation_config="vllm")
    assert llm.config.model_config.sampling_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()
    llm.shutdown()
    # A folder: its generation_config.json, whatever the model's.
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    llm = make_llm(qwen3, generation_config=str(other))
    assert llm.get_default_sampling_params() == SamplingParams(top_p=0.5)
    llm.shutdown()
    # What SamplingParams refuses is refused at start, naming the way out.
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config.json.*temperature.*'vllm'"):
        make_llm(tmp_path / "m")
    with pytest.raises(ValueError, match="generation_config='nowhere' is neither"):
        make_llm(qwen3, generation_config="nowhere")


def test_vllm_arguments_kvfit_does_anyway_are_taken_and_others_say_why(qwen3: Path) -> None:
    # LLM(model, trust_remote_code=True), in most vLLM scripts, was a TypeError (unknown engine
    # argument), though the command line takes its flag; the others said nothing of why.
    make_llm(qwen3, trust_remote_code=True, enable_chunked_prefill=True, quantization=None,
             pipeline_parallel_size=1, logprobs_mode="raw_logprobs").shutdown()
    with pytest.raises(ValueError, match="quantization='awq' .*unquantized checkpoints"):
        LLM(str(qwen3), device="cpu", quantization="awq")
    with pytest.raises(ValueError, match="enable_chunked_prefill=False .*always chunks"):
        LLM(str(qwen3), device="cpu", enable_chunked_prefill=False)


def test_vllm_s_disable_log_stats_and_default_swap_space_are_taken(
        qwen3: Path, caplog: pytest.LogCaptureFixture) -> None:
    # LLM(model, disable_log_stats=False) (vLLM's way to get get_metrics()) was a TypeError,
    # and swap_space=4 (vLLM's default, in many scripts) was refused as CPU offloading.
    make_llm(qwen3, disable_log_stats=True, swap_space=4).shutdown()
    assert "disable_log_stats" not in caplog.text
    with caplog.at_level(logging.WARNING, logger="kvfit"):
        llm = make_llm(qwen3, disable_log_stats=False)
    assert "disable_log_stats=False: kvfit's LLM logs no periodic" in caplog.text
    assert llm.get_metrics()
    llm.shutdown()
    with pytest.raises(ValueError, match=r"swap_space=8 .*recomputing.*\(swap_space=4, "
                                         r"vLLM's default, is taken\)"):
        LLM(str(qwen3), device="cpu", swap_space=8)
    # vLLM's scheduling_policy: its two values, and a clear error for any other.
    for policy in ("fcfs", "priority"):
        llm = make_llm(qwen3, scheduling_policy=policy)
        assert llm.config.scheduler_config.scheduling_policy == policy
        llm.shutdown()
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority"):
        LLM(str(qwen3), device="cpu", scheduling_policy="lifo")


def test_generate_takes_vllms_priority_at_zero_only_under_fcfs(qwen3_llm: LLM) -> None:
    # vLLM's generate(..., priority=[...]) was a TypeError (unexpected keyword argument);
    # under first-come-first-served scheduling vLLM takes only 0 too.
    prompts = token_prompts(make_prompts((5, 9)))
    expected = qwen3_llm.generate(prompts, greedy(3), use_tqdm=False)
    for priority in (None, [0, 0]):
        outputs = qwen3_llm.generate(prompts, greedy(3), use_tqdm=False, priority=priority)
        assert [o.outputs[0].token_ids for o in outputs] == [
            o.outputs[0].token_ids for o in expected]
    with pytest.raises(ValueError, match=r"request 1: priority=1 needs .*--scheduling-policy "
                                         r"priority"):
        qwen3_llm.generate(prompts, greedy(3), use_tqdm=False, priority=[0, 1])
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        qwen3_llm.generate(prompts, greedy(3), use_tqdm=False, priority=[0])
    with pytest.raises(TypeError, match="priority must be a list of ints"):
        qwen3_llm.generate(prompts, greedy(3), use_tqdm=False, priority=0)  # type: ignore[arg-type]
    assert not qwen3_llm.engine.has_unfinished()  # nothing was queued by the refused calls


def test_priority_scheduling_runs_lower_values_first(qwen3: Path) -> None:
    """One sequence at a time: the requests start in priority order (ties by arrival), each
    with the output it has alone; `priority` reaches every completion of an n > 1 request."""
    llm = make_llm(qwen3, scheduling_policy="priority", max_num_seqs=1)
    try:
        prompts = token_prompts(make_prompts((5, 9, 7)))
        alone = [llm.generate([p], greedy(3), use_tqdm=False)[0] for p in prompts]
        started: list[str] = []
        schedule = llm.engine.scheduler.schedule

        def schedule_and_record() -> ScheduledBatch | None:
            batch = schedule()
            for seq in batch.seqs if batch is not None else ():
                if seq.request_id not in started:
                    started.append(seq.request_id)
            return batch

        llm.engine.scheduler.schedule = schedule_and_record  # type: ignore[method-assign]
        outputs = llm.generate(prompts, greedy(3), use_tqdm=False, priority=[1, -1, 0])
        assert [o.outputs[0].token_ids for o in outputs] == [
            o.outputs[0].token_ids for o in alone]
        order = [o.request_id for o in outputs]
        assert started == [order[1], order[2], order[0]]
        seqs = llm.make_request(prompts[0], SamplingParams(n=2, max_tokens=2), "x", 5)
        assert [s.priority for s in seqs] == [5, 5]
    finally:
        llm.shutdown()


def test_use_tqdm_takes_a_bar_factory(qwen3_llm: LLM) -> None:
    # vLLM's use_tqdm may be a tqdm class or factory; it was taken as True and a default bar
    # shown instead of the caller's.
    bars = []

    class Bar:
        def __init__(self, total: int, desc: str) -> None:
            self.total, self.n, self.closed = total, 0, False
            bars.append(self)

        def update(self, n: int) -> None:
            self.n += n

        def close(self) -> None:
            self.closed = True

    qwen3_llm.generate(token_prompts(make_prompts((3, 5))), greedy(2, n=2), use_tqdm=Bar)
    [bar] = bars
    assert (bar.total, bar.n, bar.closed) == (4, 4, True)


def test_unknown_architecture_names_the_config_field(tmp_path: Path, qwen3: Path) -> None:
    shutil.copytree(qwen3, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["FancyForCausalLM"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="architectures"):
        LLM(str(tmp_path / "m"), device="cpu")


def test_generation_config_eos_ids_end_the_output(tmp_path: Path, qwen3: Path) -> None:
    # Chat models list their end-of-turn token only in generation_config.json (Llama 3
    # Instruct: config.json eos 128001, generation_config.json [128001, 128009]).
    prompt = make_prompts((9,), seed=3)[0]
    expected = hf_greedy(qwen3, prompt)
    eos = expected[3]
    shutil.copytree(qwen3, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, eos]}))
    llm = make_llm(tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    [out] = llm.generate(token_prompts([prompt]), params, use_tqdm=False)
    assert out.outputs[0].token_ids == expected[: expected.index(eos) + 1]
    # Not the tokenizer's EOS: as vLLM adds generation_config.json's other ids to the stop
    # tokens, the id is the stop_reason.
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", eos)
    # Below min_tokens it is banned like the config's own EOS.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    [out] = llm.generate(token_prompts([prompt]), params, use_tqdm=False)
    assert eos not in out.outputs[0].token_ids and len(out.outputs[0].token_ids) == MAX_TOKENS


def test_the_tokenizers_eos_ends_the_output(tmp_path: Path, qwen3: Path) -> None:
    # vLLM's first EOS is the tokenizer's: a chat fine-tune may set tokenizer_config.json's
    # eos_token to its end-of-turn token and leave config.json's eos_token_id as it was.
    prompt = make_prompts((9,), seed=3)[0]
    expected = hf_greedy(qwen3, prompt)
    shutil.copytree(qwen3, tmp_path / "m")
    eos = expected[3]
    config_file = tmp_path / "m" / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    llm = make_llm(qwen3)
    tokenizer_config["eos_token"] = llm.get_tokenizer().convert_ids_to_tokens(eos)
    llm.shutdown()
    config_file.write_text(json.dumps(tokenizer_config))
    llm = make_llm(tmp_path / "m")
    assert llm.get_tokenizer().eos_token_id == eos
    [out] = llm.generate(token_prompts([prompt]), SamplingParams(temperature=0, max_tokens=12),
                         use_tqdm=False)
    assert out.outputs[0].token_ids == expected[: expected.index(eos) + 1]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", None)


def test_folder_without_tokenizer_serves_token_ids(tmp_path: Path, qwen3: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(qwen3, folder, ignore=shutil.ignore_patterns("tokenizer*"))
    llm = make_llm(folder)
    assert llm.get_tokenizer() is None
    [out] = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(qwen3, [5, 6, 7])
    assert out.outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text", greedy(), use_tqdm=False)


@pytest.mark.parametrize(("extensible", "method"), [(None, "measured"), (False, "estimate")])
def test_engine_sizing_methods_report_and_generate(
    qwen3: Path, extensible: bool | None, method: str
) -> None:
    llm = LLM(str(qwen3), device="cpu", max_num_batched_tokens=256,
              enable_extensible_kv_cache=extensible)
    report = llm.kv_cache_report
    cc = llm.config.cache_config
    assert report.method == method
    assert report.num_blocks == cc.num_gpu_blocks
    assert report.num_blocks * cc.block_size >= llm.config.model_config.max_model_len
    prompts = make_prompts((10, 33))
    outputs = llm.generate(token_prompts(prompts), greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(qwen3, p) for p in prompts]
    llm.shutdown()


def test_vmm_probe_failure_falls_back_to_the_estimate(
    qwen3: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from kvfit.engine.worker import Worker

    monkeypatch.setattr(Worker, "vmm_unavailable_reason", lambda self: "no VMM in this test")
    llm = make_llm(qwen3, num_gpu_blocks_override=None)
    assert llm.kv_cache_report.method == "estimate"
    assert llm.config.cache_config.memory_utilization == 0.92
    assert "no VMM in this test" in caplog.text


def test_cache_smaller_than_max_model_len_is_an_error_naming_it(qwen3: Path) -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks_override or lower max_model_len"):
        make_llm(qwen3, num_gpu_blocks_override=4)
    # Less than one block: refused before warmup, which has no block to run on.
    with pytest.raises(ValueError, match="holds 0 blocks .* raise kv_cache_memory_bytes"):
        make_llm(qwen3, num_gpu_blocks_override=None, kv_cache_memory_bytes=1)


def test_a_stop_token_ends_the_output_though_the_next_step_is_in_flight(
    qwen3_llm: LLM, qwen3: Path
) -> None:
    # The step after the stop token is launched before the token reaches the host; its extra
    # token must not reach the output.
    prompts = make_prompts((9, 23), seed=3)
    expected = [hf_greedy(qwen3, prompt) for prompt in prompts]
    params = [greedy(stop_token_ids=[tokens[2]]) for tokens in expected]
    outputs = qwen3_llm.generate(token_prompts(prompts), params, use_tqdm=False)
    for tokens, out in zip(expected, outputs, strict=True):
        assert out.outputs[0].token_ids == tokens[: tokens.index(tokens[2]) + 1]
        assert out.outputs[0].finish_reason == "stop"


def test_an_interrupted_generate_leaves_nothing_behind(
    qwen3_llm: LLM, qwen3: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ctrl-C in a notebook: the requests of the interrupted call must not hold blocks, nor run
    # to their end inside the next call.
    engine = qwen3_llm.engine
    step, calls = engine.step, []

    def interrupted_step() -> list[Sequence]:
        calls.append(None)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        qwen3_llm.generate(token_prompts(make_prompts((12, 30))), greedy(max_tokens=200),
                           use_tqdm=False)
    assert not engine.has_unfinished()
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    prompt = make_prompts((9,), seed=4)[0]
    [out] = qwen3_llm.generate(token_prompts([prompt]), greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == hf_greedy(qwen3, prompt)
    assert len(calls) < 3 + 2 * MAX_TOKENS  # not the 200 tokens of the interrupted requests


def test_abort_while_a_step_is_in_flight_frees_everything(qwen3_llm: LLM) -> None:
    engine = qwen3_llm.engine
    [seq] = qwen3_llm.input_processor.make_sequences(
        0, {"prompt_token_ids": make_prompts((12,))[0]}, greedy(max_tokens=20))
    engine.add_request(seq)
    engine.step()
    engine.step()  # decoding, with the next token still on the device
    engine.abort_request(seq.request_id)
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason == "abort"
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_shut_down_llm_refuses_every_call_naming_shutdown(qwen3: Path) -> None:
    # After `shutdown` the workers hold no model: each call used to fail deep inside with an
    # AttributeError on None ('launch', 'weight_arena', 'kv_cache').
    llm = make_llm(qwen3, enable_sleep_mode=True)
    llm.shutdown()
    calls = {
        "generate": lambda: llm.generate(token_prompts([[3, 4, 5]]), greedy(), use_tqdm=False),
        "sleep": llm.sleep,
        "resize_kv_cache": lambda: llm.resize_kv_cache(64),
        # These three still failed so ('weight_arena', 'kv_cache'), or wake_up() said the
        # engine was not asleep.
        "load_weights": lambda: llm.load_weights({"model.norm.weight": torch.ones(64)}),
        "wake_up": llm.wake_up,
        "get_metrics": llm.get_metrics,
        "apply_model": lambda: llm.apply_model(lambda model: None),
        "collective_rpc": lambda: llm.collective_rpc("sleep_state"),
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"{name}\(\) after shutdown\(\).*new LLM"):
            call()
    assert not llm.engine.has_unfinished()
    llm.shutdown()  # a second one is harmless


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_decode_input_takes_the_decode_steps_to_the_same_outputs(
    tiny_model: Callable[[str], Path], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fused_decode_input` sends every decode step's attention, and no other step's, through
    `decode_attention` (on the CPU the unfused pair behind one call, so the model's fused
    branch runs here): the same tokens and logprobs as without it."""
    from kvfit.models import llama

    steps: list[int] = []
    real = llama.decode_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        metadata = args[10]
        assert metadata.max_query_len == 1
        steps.append(args[1].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(llama, "decode_attention", spy)
    params = [greedy(logprobs=2), SamplingParams(temperature=1.0, seed=3, max_tokens=MAX_TOKENS,
                                                 ignore_eos=True, logprobs=2)]
    outputs = {}
    for fused in (False, True):
        llm = make_llm(tiny_model(arch), fused_decode_input=fused)
        outputs[fused] = [(c.token_ids, c.cumulative_logprob) for p in params
                          for o in llm.generate(token_prompts(make_prompts()), p,
                                                use_tqdm=False)
                          for c in o.outputs]  # fmt: skip
        assert bool(steps) is fused
        llm.shutdown()
    assert outputs[True] == outputs[False]


def _num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_apply_model_and_collective_rpc_as_vllms(qwen3: Path) -> None:
    # vLLM's `LLM.apply_model(func)` and `LLM.collective_rpc(method, timeout, args, kwargs)`
    # were AttributeErrors. Each answers per worker; the model is not read while asleep.
    llm = make_llm(qwen3, enable_sleep_mode=True)
    try:
        [count] = llm.apply_model(_num_parameters)
        assert count == _num_parameters(hf_model(qwen3)) > 0
        [state] = llm.collective_rpc("sleep_state")
        assert not state.is_sleeping
        assert llm.collective_rpc(lambda worker, a, b=0: (worker.rank, a, b), args=(1,),
                                  kwargs={"b": 2}) == [(0, 1, 2)]
        with pytest.raises(ValueError, match="timeout"):
            llm.collective_rpc("sleep_state", timeout=5.0)
        llm.sleep(level=1)
        with pytest.raises(RuntimeError, match=r"apply_model\(\) while the weights are asleep"):
            llm.apply_model(_num_parameters)
        llm.wake_up()
        assert llm.apply_model(_num_parameters) == [count]
    finally:
        llm.shutdown()


def test_vllms_lora_and_tokenization_keywords_that_ask_for_nothing(qwen3_llm: LLM) -> None:
    # vLLM scripts pass `lora_request=None` to `generate` and `chat`: a TypeError. Taken when
    # it asks for nothing (None, or None per prompt); an adapter or tokenizer arguments are
    # refused by name, before anything is queued.
    prompts = token_prompts([[3, 4, 5], [6, 7]])
    expected = [o.outputs[0].token_ids for o in qwen3_llm.generate(prompts, greedy(),
                                                                     use_tqdm=False)]
    for kwargs in ({"lora_request": None, "tokenization_kwargs": None},
                   {"lora_request": [None, None], "tokenization_kwargs": {}}):
        outputs = qwen3_llm.generate(prompts, greedy(), use_tqdm=False, **kwargs)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    conversation = [{"role": "user", "content": "Hi"}]
    [chat] = qwen3_llm.chat(conversation, greedy(2), use_tqdm=False, lora_request=None)
    assert len(chat.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match=r"generate\(lora_request=...\): LoRA"):
        qwen3_llm.generate(prompts, greedy(), use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match="tokenization_kwargs"):
        qwen3_llm.generate(prompts, greedy(), use_tqdm=False,
                           tokenization_kwargs={"truncation": True})
    with pytest.raises(ValueError, match=r"chat\(lora_request=...\): LoRA"):
        qwen3_llm.chat(conversation, greedy(), use_tqdm=False, lora_request=object())
    assert not qwen3_llm.engine.has_unfinished()


def test_profiling_calls_say_how_to_profile(qwen3_llm: LLM) -> None:
    # vLLM's `LLM.start_profile()` / `stop_profile()` were AttributeErrors.
    for call in (qwen3_llm.start_profile, qwen3_llm.stop_profile):
        with pytest.raises(NotImplementedError, match="profile_run"):
            call()


def test_vllms_beam_search_and_pooling_calls_say_what_to_do(qwen3_llm: LLM) -> None:
    # vLLM's `LLM.beam_search`, `encode`, `embed`, `classify`, `score` and `reward` were
    # AttributeErrors, as if kvfit had misspelt them.
    with pytest.raises(NotImplementedError, match=r"beam_search\(\).*cumulative_logprob"):
        qwen3_llm.beam_search(["Hi"], None)
    for name in ("encode", "embed", "classify", "score", "reward"):
        with pytest.raises(NotImplementedError, match=rf"LLM\.{name}\(\): .*generative"):
            getattr(qwen3_llm, name)("Hi")


def test_chat_takes_vllms_chat_template_content_format(qwen3_llm: LLM) -> None:
    # vLLM's `chat(..., chat_template_content_format=...)` was a TypeError. Text parts reach
    # the template joined ("string", what "auto" picks for a text template); "openai" refused.
    conversation = [{"role": "user", "content": [{"type": "text", "text": "Hi"},
                                                 {"type": "text", "text": "there"}]}]
    [chat] = qwen3_llm.chat(conversation, greedy(2), use_tqdm=False)
    for content_format in ("auto", "string"):
        [same] = qwen3_llm.chat(conversation, greedy(2), use_tqdm=False,
                                chat_template_content_format=content_format)
        assert same.outputs[0].token_ids == chat.outputs[0].token_ids
        assert same.prompt == chat.prompt and "Hi\nthere" in same.prompt
    with pytest.raises(ValueError, match="chat_template_content_format='openai'"):
        qwen3_llm.chat(conversation, greedy(), use_tqdm=False,
                       chat_template_content_format="openai")
