"""Tensor parallelism on the CPU (gloo): sharded models agree with one rank and with
transformers, every rank agrees on one KV cache size and one cache kind, and a worker that
fails or dies fails the engine quickly, leaving no process behind."""

from __future__ import annotations

import logging
import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvfit import LLM, SamplingParams
from kvfit.engine.executor import ExecutorFailedError

HERE = Path(__file__).parent
SRC = HERE.parents[1] / "src"
LIMITS = dict(device="cpu", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128)
PROMPTS = [[5, 17, 300, 42, 9], [7, 8], list(range(20, 57))]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(autouse=True)
def hooks_importable(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Spawned workers get this process's sys.path: they can import `tp_hooks`."""
    monkeypatch.syspath_prepend(str(HERE))
    yield
    assert not _children(), "a worker process outlived its test"


def _children() -> list[psutil.Process]:
    """This process's spawned workers still running (not multiprocessing's resource tracker,
    a helper shared by every spawn that exits with this process)."""
    def is_worker(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            return False

    return [p for p in psutil.Process().children(recursive=True) if is_worker(p)]


def _running(pids: list[int]) -> list[int]:
    """Those of `pids` still running (an orphan that exited may stay a zombie until reaped)."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [pid for pid in pids if running(pid)]


def generate(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


@torch.no_grad()
def hf_greedy(folder: Path, prompt: list[int]) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = list(prompt)
    for _ in range(MAX_TOKENS):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def mqa_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with one KV head: under TP=2 each rank keeps a copy of it."""
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=2,
                         max_position_embeddings=512, initializer_range=0.1,
                         attention_bias=True, tie_word_embeddings=False, eos_token_id=2)
    folder = tmp_path_factory.mktemp("mqa-llama")
    with torch.random.fork_rng():
        torch.manual_seed(1)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ["qwen3", "mqa-llama"])
def test_tp2_greedy_matches_tp1_and_transformers(
    arch: str, tiny_model: Callable[[str], Path], mqa_llama: Path
) -> None:
    # qwen3: 2 KV heads split one per rank, a tied vocab-parallel head; mqa-llama: the one KV
    # head replicated, q/k/v bias rows split, the o_proj bias added once after the reduce.
    folder = mqa_llama if arch == "mqa-llama" else tiny_model("qwen3")
    expected = [hf_greedy(folder, p) for p in PROMPTS]
    one = LLM(str(folder), **LIMITS)
    try:
        assert generate(one) == expected
    finally:
        one.shutdown()
    two = LLM(str(folder), tensor_parallel_size=2, **LIMITS)
    try:
        assert two.config.parallel_config.distributed_executor_backend == "mp"
        assert generate(two) == expected
    finally:
        two.shutdown()


def test_tp2_fused_decode_input_matches_transformers(mqa_llama: Path) -> None:
    """`fused_decode_input` on each rank's share of the heads (the one KV head replicated,
    q/k/v bias rows split): the model's fused branch gives transformers' greedy tokens."""
    expected = [hf_greedy(mqa_llama, p) for p in PROMPTS]
    two = LLM(str(mqa_llama), tensor_parallel_size=2, fused_decode_input=True, **LIMITS)
    try:
        assert two.config.fused_decode_input
        assert generate(two) == expected
    finally:
        two.shutdown()


def test_tp2_dummy_weights_match_tp1() -> None:
    # Built-in shapes get seeded random weights: every rank must draw the same model as one
    # rank does and keep its part, or TP=2 generates other tokens than TP=1.
    outputs = []
    for tp in (1, 2):
        llm = LLM("kvfit-tiny", load_format="dummy", tensor_parallel_size=tp, **LIMITS)
        try:
            outputs.append(generate(llm))
        finally:
            llm.shutdown()
    assert outputs[1] == outputs[0]


def test_tp2_with_a_fixed_cache_size_reports_its_stats() -> None:
    # The workers hold their own copy of the config, which the engine's sizing never reaches:
    # a fixed-size cache's figures come from what each worker allocated (the front ends read
    # them at every step; `kvfit serve --num-gpu-blocks-override` failed at startup).
    llm = LLM("kvfit-tiny", load_format="dummy", tensor_parallel_size=2,
              num_gpu_blocks_override=64, **LIMITS)
    try:
        block_bytes = llm.config.kv_cache_spec().block_bytes
        stats = llm.engine.stats()
        assert stats.committed_kv_bytes == stats.reserved_kv_bytes == 64 * block_bytes
        assert llm.engine.kv_cache_state()["num_blocks"] == 64
        assert generate(llm)
    finally:
        llm.shutdown()


def test_mp_executor_at_tp1_matches_in_process(tiny_model: Callable[[str], Path]) -> None:
    folder = str(tiny_model("qwen3"))
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=MAX_TOKENS,
                            logprobs=2, prompt_logprobs=1, presence_penalty=0.5)
    outputs = {}
    for backend in ("uni", "mp"):
        llm = LLM(folder, distributed_executor_backend=backend, **LIMITS)
        try:
            result = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                  use_tqdm=False)
            outputs[backend] = [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs)
                                for o in result]
        finally:
            llm.shutdown()
    assert outputs["mp"] == outputs["uni"]


def test_engine_steps_on_after_a_worker_error_it_can_survive(
    tiny_model: Callable[[str], Path]
) -> None:
    # Step 4 raises in the worker while step 3 is in flight; the engine drops both
    # (`fail_step`), and the next steps must get their own outputs, not step 3's.
    folder = str(tiny_model("qwen3"))
    one = LLM(folder, **LIMITS)
    try:
        expected = generate(one)
    finally:
        one.shutdown()
    llm = LLM(folder, distributed_executor_backend="mp", worker_init_fn="tp_hooks:fail_fourth_step",
              **LIMITS)
    try:
        with pytest.raises(ValueError, match="injected failure in the fourth step"):
            generate(llm)
        llm.engine.fail_step()
        assert generate(llm) == expected
    finally:
        llm.shutdown()


def test_a_grow_without_memory_on_one_rank_is_a_resize_error_and_the_engine_goes_on(
    tiny_model: Callable[[str], Path]
) -> None:
    """A worker's out-of-memory driver error reaches the engine as itself (the resizer's
    fallbacks catch it by type): a grow that rank 1 cannot back is a `KVCacheResizeError`
    naming the size, both ranks keep the old one, and generation goes on."""
    from kvfit.engine.kv_resize import KVCacheResizeError

    llm = LLM(str(tiny_model("qwen3")), distributed_executor_backend="mp",
              worker_init_fn="tp_hooks:no_memory_to_grow_on_rank_1", tensor_parallel_size=2,
              **LIMITS)
    try:
        expected = generate(llm)
        resizer = llm.engine.kv_resizer
        full = resizer.num_blocks
        llm.resize_kv_cache(resizer.floor)  # a shrink needs no memory
        with pytest.raises(KVCacheResizeError, match="could not grow .*OUT_OF_MEMORY"):
            llm.resize_kv_cache(full)
        assert resizer.num_blocks == resizer.floor
        assert [c for c, _, _ in llm.engine.executor.collective_rpc("kv_cache_blocks")] == [
            resizer.floor] * 2
        assert generate(llm) == expected
    finally:
        llm.shutdown()


def test_ranks_with_different_budgets_commit_the_smaller_count(
    tiny_model: Callable[[str], Path]
) -> None:
    # 64 KiB blocks (one KV head per rank), 32 to a 2 MiB granule; the cap is 32 sequences of
    # 4 blocks = 128 blocks, which rank 0 holds and rank 1 (2.5 granules) does not.
    llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2, device="cpu", block_size=128,
              max_model_len=512, max_num_seqs=32, max_num_batched_tokens=256,
              worker_init_fn="tp_hooks:small_budget_on_rank_1")
    try:
        rpc = llm.engine.executor.collective_rpc
        rank_0, rank_1 = rpc("measure_kv_cache_blocks")
        assert rank_1 == 64 < rank_0 == 128
        assert llm.kv_cache_report.num_blocks == rank_1
        assert rpc("probe_committed_blocks") == [rank_1, rank_1]
        assert llm.engine.scheduler.block_manager.num_blocks == rank_1
        # Warmup took the smaller committable count on both ranks (rank 1 reported 7 fewer).
        committable = rpc("probe_committable")
        assert committable[1] < committable[0]
        assert rpc("probe_warmed_with") == [committable[1]] * 2
        assert len(generate(llm)[0]) == MAX_TOKENS
    finally:
        llm.shutdown()


def test_one_rank_without_vmm_makes_every_rank_fall_back(
    tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2,
                  worker_init_fn="tp_hooks:no_vmm_on_rank_1", **LIMITS)
    try:
        [warning] = [r.getMessage() for r in caplog.records if "VMM" in r.getMessage()
                     or "extensible" in r.getMessage()]
        assert "rank 1" in warning and "injected: no VMM on this device" in warning
        assert llm.kv_cache_report.method == "estimate"
        assert llm.engine.executor.collective_rpc("probe_extensible") == [False, False]
        blocks = llm.kv_cache_report.num_blocks
        assert llm.engine.executor.collective_rpc("probe_committed_blocks") == [blocks] * 2
        assert len(generate(llm)[0]) == MAX_TOKENS
    finally:
        llm.shutdown()


@pytest.mark.parametrize("hook, match", [
    ("tp_hooks:fail_load_on_rank_1", "injected failure while loading"),
    ("tp_hooks:no_such_hook", "has no attribute 'no_such_hook'"),  # on every rank
])
def test_worker_failing_at_startup_raises_its_error_with_its_rank(
    tiny_model: Callable[[str], Path], caplog: pytest.LogCaptureFixture, hook: str, match: str
) -> None:
    with caplog.at_level(logging.WARNING), pytest.raises(Exception, match=match) as info:
        LLM(str(tiny_model("qwen3")), tensor_parallel_size=2, worker_init_fn=hook, **LIMITS)
    rank = 1 if "rank_1" in hook else 0
    assert any(f"worker rank {rank}" in note for note in info.value.__notes__)
    assert "tp_hooks" in str(info.value.__cause__)  # the worker's traceback
    # The error is the only word: stopping the workers after it logs no second failure (a
    # worker that failed to start has exited, which is no news to be blamed on the OOM killer).
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    # (the autouse fixture checks that no worker is left)


def test_worker_killed_mid_generation_fails_the_engine_within_seconds(
    tiny_model: Callable[[str], Path]
) -> None:
    llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2,
              worker_init_fn="tp_hooks:die_on_third_step_on_rank_1", **LIMITS)
    start = time.monotonic()
    try:
        with pytest.raises(ExecutorFailedError, match=r"worker rank 1 .* killed by SIGKILL"):
            generate(llm)
        assert time.monotonic() - start < 10
        assert not _children()  # rank 0, stuck in a collective with the dead rank, is gone
        with pytest.raises(ExecutorFailedError, match="stopped earlier"):
            generate(llm)
    finally:
        llm.shutdown()


def test_one_rank_raising_while_the_other_waits_in_a_collective_fails_the_engine(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvfit.engine import mp_executor

    monkeypatch.setattr(mp_executor, "ERROR_GRACE_S", 1.0)
    llm = LLM(str(tiny_model("qwen3")), tensor_parallel_size=2,
              worker_init_fn="tp_hooks:fail_third_step_on_rank_1", **LIMITS)
    try:
        with pytest.raises(ExecutorFailedError, match=r"(?s)worker rank 1 raised in launch, "
                           r"and ranks \[0\] did not answer.*injected failure on rank 1"):
            generate(llm)
        assert not _children()  # rank 0, stuck in the collective, was stopped
    finally:
        llm.shutdown()


@pytest.mark.parametrize("engine_process", [True, False])
def test_a_worker_dying_while_the_server_is_idle_fails_the_engine_at_once(
    tiny_model: Callable[[str], Path], engine_process: bool
) -> None:
    # With no request coming, nothing asked the workers anything: /health answered 200 over a
    # dead worker until the next request failed, and a load balancer kept sending them.
    import asyncio

    import tp_hooks

    from kvfit.engine.config import EngineArgs
    from kvfit.server.async_llm import AsyncLLM

    engine = AsyncLLM(EngineArgs(model=str(tiny_model("qwen3")), tensor_parallel_size=2,
                                 worker_init_fn="tp_hooks:probes", **LIMITS),
                      engine_process=engine_process)
    died: list[BaseException] = []
    engine.add_dead_callback(died.append)
    try:
        pids = asyncio.run(engine.call_engine(tp_hooks.worker_pids))
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not died and time.monotonic() < deadline:
            time.sleep(0.05)
        assert died, "the idle engine did not notice its dead worker"
        assert re.search(r"worker rank 1 .* killed by SIGKILL", str(died[0]))
        assert not engine.is_alive
    finally:
        engine.shutdown()


def test_workers_exit_when_the_engine_process_is_killed(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    script = tmp_path / "engine.py"
    script.write_text(
        "import sys, time\n"
        "from kvfit import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_model('qwen3'))!r}, tensor_parallel_size=2, "
        f"worker_init_fn='tp_hooks:probes', **{LIMITS!r})\n"
        "    print(*llm.engine.executor.collective_rpc('probe_pid'), flush=True)\n"
        "    time.sleep(600)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(HERE)])}
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env,
                              text=True)
    try:
        pids = [int(pid) for pid in engine.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        deadline = time.monotonic() + 5
        while _running(pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _running(pids)
    finally:
        engine.kill()
        engine.wait()


def test_torchrun_launch_of_tp2_matches_one_rank(
    tiny_model: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = str(tiny_model("qwen3"))
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, os, sys\n"
        "import torch\n"
        "from kvfit import LLM, SamplingParams\n"
        "torch.set_num_threads(1)\n"
        f"llm = LLM({folder!r}, tensor_parallel_size=2, "
        f"distributed_executor_backend='external_launcher', **{LIMITS!r})\n"
        f"params = SamplingParams(temperature=0.0, max_tokens={MAX_TOKENS}, ignore_eos=True)\n"
        f"out = llm.generate([{{'prompt_token_ids': p}} for p in {PROMPTS!r}], params, "
        "use_tqdm=False)\n"
        "ids = [list(o.outputs[0].token_ids) for o in out]\n"
        "json.dump(ids, open(sys.argv[1] + os.environ['RANK'], 'w'))\n"
        "llm.shutdown()\n")
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--standalone", str(script), str(tmp_path / "out")],
                   env=env, check=True, timeout=120, capture_output=True)
    one = LLM(folder, **LIMITS)
    try:
        expected = generate(one)
    finally:
        one.shutdown()
    import json

    assert [json.loads((tmp_path / f"out{r}").read_text()) for r in (0, 1)] == [expected] * 2


@pytest.mark.parametrize("overrides, match", [
    (dict(tensor_parallel_size=3), "does not divide the model's num_attention_heads"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uni"), "runs one worker"),
    (dict(distributed_executor_backend="ray"), "distributed_executor_backend must be one of"),
])
def test_parallel_settings_are_checked(
    tiny_model: Callable[[str], Path], overrides: dict, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_model("qwen3")), **LIMITS, **overrides)


@pytest.mark.parametrize("shape, tp, match", [
    (dict(intermediate_size=102), 4, r"does not divide the model's intermediate_size \(102\)"),
    (dict(num_attention_heads=6, num_key_value_heads=2, hidden_size=96, intermediate_size=96), 3,
     r"neither divides nor is a multiple of the model's num_key_value_heads \(2\)"),
])
def test_shapes_the_ranks_cannot_split_are_refused_before_loading(
    tmp_path: Path, shape: dict, tp: int, match: str
) -> None:
    from kvfit.engine.config import EngineArgs

    config = dict(vocab_size=509, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=512,
                  architectures=["LlamaForCausalLM"])
    LlamaConfig(**{**config, **shape}).save_pretrained(tmp_path)  # no weights: never loaded
    args = EngineArgs(model=str(tmp_path), device="cpu", tensor_parallel_size=tp)
    with pytest.raises(ValueError, match=match):
        args.create_engine_config()


@pytest.mark.parametrize("method", ["answer", "fail"])
def test_a_rank_whose_engine_died_mid_call_exits_quietly(method: str) -> None:
    # Found by the hunt: an engine killed while its ranks worked left each rank printing a
    # BrokenPipeError traceback as it answered (it exited all the same).
    from kvfit.engine.worker_proc import _serve

    class Worker:
        def answer(self) -> int:
            return 1

        def fail(self) -> None:
            raise RuntimeError("a step that failed")

    class GonePipe:  # one message in, then the engine's end is closed
        def __init__(self) -> None:
            self.payloads = [pickle.dumps(("rpc", method, ()))]

        def recv_bytes(self) -> bytes:
            return self.payloads.pop(0)

        def send_bytes(self, payload: bytes) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    _serve(Worker(), 1, GonePipe())  # returns: nobody to answer


def _num_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def test_apply_model_and_collective_rpc_reach_every_rank() -> None:
    # vLLM's `LLM.apply_model` / `collective_rpc` over worker processes: the function and its
    # arguments pickle to each rank (a module-level one), answers come in rank order.
    llm = LLM("kvfit-tiny", load_format="dummy", tensor_parallel_size=2,
              num_gpu_blocks_override=64, **LIMITS)
    try:
        assert llm.collective_rpc(getattr, args=("rank",)) == [0, 1]
        sharded = llm.apply_model(_num_parameters)
        assert len(sharded) == 2 and sharded[0] == sharded[1] > 0
        with pytest.raises(Exception, match="pickle"):
            llm.apply_model(lambda model: None)
        assert generate(llm)  # a refused call leaves the engine serving
    finally:
        llm.shutdown()
