"""Sleep mode on the CPU: what sleep releases (the host driver's physical bytes), outputs after
wake, cycles, partial wakes, weights swapped while asleep, and requests running at sleep."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvfit import LLM, SamplingParams
from kvfit.engine.worker import Worker

SETTINGS = dict(device="cpu", enable_sleep_mode=True, max_num_seqs=8, max_model_len=256,
                max_num_batched_tokens=256)
PROMPTS = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return outputs(llm)


@pytest.fixture(autouse=True)
def awake(llm: LLM, qwen3: Path) -> Iterator[None]:
    """Every test starts and leaves the shared engine awake with its own weights."""
    yield
    if llm.is_sleeping:
        llm.wake_up()
    if llm.engine._sleep_state.missing_weights or getattr(llm, "_swapped", False):
        llm.load_weights(load_file(qwen3 / "model.safetensors"))
        llm._swapped = False


def outputs(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def worker(llm: LLM) -> Worker:
    return llm.engine.executor.workers[0]


def physical(llm: LLM) -> dict[str, int]:
    runner = worker(llm).runner
    return {"kv_cache": runner.kv_cache.physical_bytes,
            "weights": runner.weight_arena.physical_bytes}


def addresses(llm: LLM) -> list[int]:
    runner = worker(llm).runner
    kv = [t.data_ptr() for pair in runner.kv_cache.layer_views() for t in pair]
    return [p.data_ptr() for p in runner.model.parameters()] + kv


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))  # a leaked memfd is a leaked allocation


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_kv_and_weights_and_wake_restores_outputs(llm, reference, level) -> None:
    awake, ptrs = physical(llm), addresses(llm)
    rotary = worker(llm).runner.model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.clone()
    report = llm.sleep(level=level)
    assert llm.is_sleeping and report.level == level
    assert physical(llm) == {"kv_cache": 0, "weights": 0}
    assert report.released["kv_cache"] == awake["kv_cache"] > 0
    assert report.released["weights"] == awake["weights"] > 0
    assert report.released_bytes >= 0.95 * sum(awake.values())
    assert report.kept["buffers"] >= rotary.numel() * rotary.element_size()
    arena = worker(llm).runner.weight_arena
    assert report.host_bytes == (arena.nbytes if level == 1 else 0)
    with pytest.raises(RuntimeError, match=r"asleep .*call LLM.wake_up\(\)"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping and physical(llm) == awake and addresses(llm) == ptrs
    assert torch.equal(
        worker(llm).runner.model.model.layers[0].self_attn.rotary_emb.cos_sin_cache, rotary)
    assert outputs(llm) == reference


def test_ten_cycles_leave_memory_where_it_was(llm, reference) -> None:
    outputs(llm)  # settle what a first generate allocates
    awake, fds = physical(llm), open_fds()
    for cycle in range(10):
        llm.sleep(level=1 + cycle % 2)
        llm.wake_up()
        assert physical(llm) == awake, cycle
    assert open_fds() == fds
    assert outputs(llm) == reference


def test_tags_wake_each_part_on_its_own(llm, reference) -> None:
    awake = physical(llm)
    llm.sleep(level=1)
    llm.wake_up(tags=["kv_cache"])
    assert llm.is_sleeping and physical(llm) == {"kv_cache": awake["kv_cache"], "weights": 0}
    with pytest.raises(RuntimeError, match="weights released"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    with pytest.raises(RuntimeError, match="kv_cache is not asleep"):
        llm.wake_up(tags=["kv_cache"])
    with pytest.raises(ValueError, match="unknown tag"):
        llm.wake_up(tags=["graphs"])
    with pytest.raises(RuntimeError, match="already asleep"):
        llm.sleep()
    llm.wake_up(tags=["weights"])
    assert not llm.is_sleeping and physical(llm) == awake
    with pytest.raises(RuntimeError, match="not asleep; call LLM.sleep"):
        llm.wake_up()
    assert outputs(llm) == reference


def test_bad_arguments_name_the_setting(llm) -> None:
    with pytest.raises(ValueError, match="level is 1"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="level is 1"):
        llm.sleep(level=True)
    with pytest.raises(ValueError, match="mode is 'wait'"):
        llm.sleep(mode="later")
    assert not llm.is_sleeping


@pytest.fixture(scope="module")
def other_model(qwen3: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with every weight perturbed: what an RL trainer's next step hands over."""
    folder = tmp_path_factory.mktemp("qwen3-swapped")
    for file in qwen3.iterdir():
        shutil.copy(file, folder / file.name)
    g = torch.Generator().manual_seed(1)
    weights = {name: t + 0.05 * torch.randn(t.shape, generator=g)
               for name, t in load_file(qwen3 / "model.safetensors").items()}
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def other_reference(other_model: Path) -> list[list[int]]:
    other = LLM(str(other_model), **SETTINGS)
    try:
        return outputs(other)
    finally:
        other.shutdown()


@pytest.mark.parametrize("level", [1, 2])
def test_weights_swapped_while_asleep_are_the_ones_used_after_wake(
    llm, reference, other_model, other_reference, level
) -> None:
    assert other_reference != reference
    ptrs = addresses(llm)
    llm.sleep(level=level)
    llm._swapped = True
    llm.load_weights(load_file(other_model / "model.safetensors"))
    assert llm.is_sleeping  # the weights woke for the copy; the KV cache still sleeps
    assert worker(llm).runner.kv_cache.physical_bytes == 0
    llm.wake_up()
    assert addresses(llm) == ptrs
    assert outputs(llm) == other_reference


def test_weights_swapped_while_awake_invalidate_the_prefix_cache(
    llm, other_model, other_reference
) -> None:
    outputs(llm)  # fills the prefix cache with the old weights' K/V
    llm._swapped = True
    llm.update_weights(load_file(other_model / "model.safetensors").items())
    assert outputs(llm) == other_reference


def test_a_load_refused_part_way_still_invalidates_the_prefix_cache(
    llm, other_model, other_reference
) -> None:
    # Found by the hunt: the tensors before the refused one were copied, but the prefix cache
    # kept the old weights' K/V, so a prompt's output hung on whether its prefix was cached.
    outputs(llm)  # fills the prefix cache with the old weights' K/V
    llm._swapped = True
    weights = list(load_file(other_model / "model.safetensors").items())
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        llm.load_weights([*weights, ("model.norm.weight", torch.zeros(3))])
    assert outputs(llm) == other_reference  # every tensor before the bad one was the other's


def test_level_2_without_reload_refuses_to_generate_until_loaded(llm, reference, qwen3) -> None:
    llm.sleep(level=2)
    llm.wake_up(reload_weights=False)
    assert not llm.is_sleeping
    with pytest.raises(RuntimeError, match=r"woken without contents .* LLM.load_weights"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    weights = load_file(qwen3 / "model.safetensors")
    llm.load_weights({k: v for k, v in weights.items() if "layers.0." in k})
    with pytest.raises(RuntimeError, match="still not loaded"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.load_weights(weights)
    assert outputs(llm) == reference


def test_a_partial_load_while_asleep_names_load_weights_as_the_cause(llm, reference,
                                                                     qwen3) -> None:
    weights = load_file(qwen3 / "model.safetensors")
    llm.sleep(level=2)
    llm.load_weights({k: v for k, v in weights.items() if "layers.0." in k})
    llm.wake_up()  # the KV cache; the weights woke for load_weights, empty but for those given
    # The message had blamed wake_up(reload_weights=False), which this user never called.
    with pytest.raises(RuntimeError, match=r"or by a load_weights\(\) while they slept"):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    llm.load_weights(weights)
    assert outputs(llm) == reference


def _start(llm: LLM) -> list:
    seqs = [s for i, p in enumerate(PROMPTS)
            for s in llm.make_request(p, GREEDY, f"sleep-{i}")]
    for seq in seqs:
        llm.engine.add_request(seq)
    llm.engine.step()
    llm.engine.step()
    return seqs


def test_sleep_waits_for_running_requests(llm, reference) -> None:
    seqs = _start(llm)
    llm.sleep(mode="wait")
    assert [s.output_token_ids for s in seqs] == reference
    # The front end still gets every finished sequence from the next step.
    assert llm.engine.has_unfinished()
    assert set(llm.engine.step()) == set(seqs)
    assert not llm.engine.has_unfinished()
    llm.wake_up()


def test_sleep_aborts_running_requests(llm, reference) -> None:
    seqs = _start(llm)
    llm.sleep(mode="abort")
    assert all(s.finish_reason == "abort" for s in seqs)
    assert set(llm.engine.step()) == set(seqs)
    llm.wake_up()
    assert outputs(llm) == reference


def test_sleep_needs_sleep_mode(qwen3) -> None:
    plain = LLM(str(qwen3), **{**SETTINGS, "enable_sleep_mode": False})
    try:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            plain.sleep()
    finally:
        plain.shutdown()


def test_level_2_regenerates_dummy_weights_from_the_seed() -> None:
    builtin = LLM("kvfit-tiny", **SETTINGS)
    try:
        before = outputs(builtin)
        builtin.sleep(level=2)
        builtin.wake_up()
        assert outputs(builtin) == before
    finally:
        builtin.shutdown()


def test_a_fixed_size_kv_cache_is_kept_and_reported(qwen3, reference) -> None:
    fixed = LLM(str(qwen3), **{**SETTINGS, "num_gpu_blocks_override": 64})
    try:
        report = fixed.sleep(level=1)
        assert report.kept["kv_cache"] > 0 and "kv_cache" not in report.released
        fixed.wake_up()
        assert not fixed.is_sleeping and outputs(fixed) == reference
        # vLLM's pattern, the weights then the KV cache, whatever the cache's sizing: waking
        # the kept cache does nothing, before the weights and after them.
        fixed.sleep(level=1)
        fixed.wake_up(tags=["kv_cache"])
        assert fixed.is_sleeping
        fixed.wake_up(tags=["weights"])
        assert not fixed.is_sleeping
        with pytest.raises(RuntimeError, match="not asleep"):
            fixed.wake_up(tags=["kv_cache"])  # awake: nothing was kept by a sleep
        assert outputs(fixed) == reference
    finally:
        fixed.shutdown()


def test_vllms_wake_order_weights_then_kv_cache_runs_on_a_kept_cache(qwen3, reference) -> None:
    """vLLM's RLHF pattern wakes the weights, then the KV cache: with a fixed-size cache (an
    override, or a device without VMM) the weights' wake leaves nothing asleep, and the KV
    cache's wake that follows is the kept cache's no-op, not "not asleep"."""
    fixed = LLM(str(qwen3), **{**SETTINGS, "num_gpu_blocks_override": 64})
    try:
        for level in (1, 2):
            fixed.sleep(level=level)
            fixed.wake_up(tags=["weights"])
            assert not fixed.is_sleeping
            fixed.wake_up(tags=["kv_cache"])
            assert not fixed.is_sleeping and outputs(fixed) == reference
            with pytest.raises(RuntimeError, match="not asleep"):
                fixed.wake_up(tags=["kv_cache"])  # once per sleep
        fixed.sleep(level=1)
        fixed.wake_up()
        with pytest.raises(RuntimeError, match="not asleep"):
            fixed.wake_up(tags=["kv_cache"])  # everything was woken
        # A wake refused for another tag woke nothing: the kept cache's wake is still due.
        fixed.sleep(level=1)
        with pytest.raises(ValueError, match="unknown tag"):
            fixed.wake_up(tags=["kv_cache", "weight"])
        fixed.wake_up(tags=["weights"])
        fixed.wake_up(tags=["kv_cache"])
        assert not fixed.is_sleeping and outputs(fixed) == reference
    finally:
        fixed.shutdown()


def test_a_wake_short_of_memory_backs_a_smaller_cache_and_one_at_none_stays_asleep(
    qwen3, monkeypatch
) -> None:
    """Memory another process took while the engine slept: the KV cache wakes at the most
    blocks that fit (never below one max_model_len sequence) rather than leaving an engine
    that neither wakes nor resizes; with not even that, it stays asleep until memory frees."""
    from kvfit.engine.kv_resize import KVCacheResizeError
    from kvfit.vmm import host

    big = LLM(str(qwen3), **{**SETTINGS, "max_num_seqs": 64, "max_model_len": 512})
    try:
        reference = outputs(big)
        blocks, cache = big.engine.scheduler.block_manager.num_blocks, worker(big).runner.kv_cache
        assert cache.physical_bytes == 16 * 2 * 1024 * 1024 and blocks == 2048
        available = host._available_bytes
        big.sleep(level=1)
        monkeypatch.setattr(host, "_available_bytes", lambda: 9 << 20)  # weights and 8 MiB
        big.wake_up()
        woken = big.engine.scheduler.block_manager.num_blocks
        assert not big.is_sleeping and big.engine.kv_resizer.floor <= woken < blocks
        assert cache.committed_blocks == woken and cache.physical_bytes <= 8 << 20
        assert outputs(big) == reference

        big.sleep(level=1)
        monkeypatch.setattr(host, "_available_bytes", lambda: 0)
        with pytest.raises(RuntimeError, match=r"wake_up\(\): no device memory for the weights"):
            big.wake_up()
        assert big.engine._sleep_state.asleep_tags() == ["weights", "kv_cache"]
        monkeypatch.setattr(host, "_available_bytes", available)
        big.wake_up(tags=["weights"])
        monkeypatch.setattr(host, "_available_bytes", lambda: 0)
        with pytest.raises(KVCacheResizeError, match=r"wake_up\(\).*free device memory"):
            big.wake_up()
        assert big.engine._sleep_state.asleep_tags() == ["kv_cache"]
        with pytest.raises(RuntimeError, match="asleep"):
            big.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
        monkeypatch.setattr(host, "_available_bytes", available)
        big.wake_up()  # the size it had: none of the failed attempts sticks
        assert big.engine.scheduler.block_manager.num_blocks == cache.committed_blocks == woken
        big.resize_kv_cache(blocks)
        assert outputs(big) == reference
    finally:
        big.shutdown()
