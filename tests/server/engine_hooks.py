"""Functions the server tests run inside the engine with `AsyncLLM.call_engine` (in the engine
process, or on the engine thread): they make the executor stall or fail the steps of chosen
prompts and record what the engine did. Imported as a top-level module (conftest puts this
folder on sys.path before any engine process is spawned) so the engine process can import it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from kvfit.engine.llm import LLM

# prompt -> ("stall", release file), ("slow", seconds) or ("fail", None); module state of the
# engine's process.
_rules: dict[str, tuple[str, Any]] = {}
_batch_sizes: list[int] = []
_detokenized: list[str] = []
_STALL_LIMIT_S = 30.0


def _install(llm: LLM) -> None:
    """Wrap the executor's launch once: it records batch sizes and applies `_rules`."""
    executor = llm.engine.executor
    if hasattr(executor, "_test_launch"):
        return
    executor._test_launch = launch = executor.launch

    def hooked(batch: Any) -> Any:
        _batch_sizes.append(len(batch))
        for seq in batch.seqs:
            kind, release = _rules.get(seq.prompt, (None, None))
            if kind == "fail":
                raise RuntimeError("injected failure")
            if kind == "slow":
                time.sleep(release)
            if kind == "stall":
                deadline = time.monotonic() + _STALL_LIMIT_S
                while not Path(release).exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
        return launch(batch)

    executor.launch = hooked


def record_batches(llm: LLM) -> None:
    """Start recording the size of every launched batch afresh."""
    _install(llm)
    _batch_sizes.clear()


def batch_sizes(llm: LLM) -> list[int]:
    return list(_batch_sizes)


def stall(llm: LLM, prompt: str, release_file: str) -> None:
    """Steps holding `prompt` wait until `release_file` exists (at most 30 s)."""
    _install(llm)
    _rules[prompt] = ("stall", release_file)


def slow(llm: LLM, prompt: str, seconds: float) -> None:
    """Steps holding `prompt` take `seconds` longer."""
    _install(llm)
    _rules[prompt] = ("slow", seconds)


def fail(llm: LLM, prompt: str) -> None:
    """Steps holding `prompt` raise, as an engine bug would."""
    _install(llm)
    _rules[prompt] = ("fail", None)


def clear(llm: LLM) -> None:
    """Drop every rule (the recording wrapper stays; it changes nothing else)."""
    _rules.clear()


def num_unfinished(llm: LLM) -> int:
    """Requests queued or running in the engine now (between two steps)."""
    scheduler = llm.engine.scheduler
    return len(scheduler.waiting) + len(scheduler.running)


def count_detokenized(llm: LLM) -> None:
    """Record the request id of every sequence the engine's step detokenizes."""
    detokenizer = llm.engine.scheduler.detokenizer
    if not hasattr(detokenizer, "_test_step"):
        detokenizer._test_step = step = detokenizer.step

        def counted(seq: Any, check_stop: bool = True) -> Any:
            _detokenized.append(seq.request_id)
            return step(seq, check_stop)

        detokenizer.step = counted
    _detokenized.clear()


def detokenized(llm: LLM) -> list[str]:
    return list(_detokenized)


def pause(llm: LLM, seconds: float) -> None:
    """Hold the engine between two steps."""
    time.sleep(seconds)


def break_stats(llm: LLM) -> None:
    """The engine's next figures raise: its core loop fails outside any step, as an executor
    whose workers died does."""
    def broken() -> Any:
        raise RuntimeError("worker rank 1 was killed (injected)")

    llm.engine.stats = broken


def refuse_device_memory(llm: LLM, what: str, refuse: bool) -> None:
    """While `refuse`, the driver behind `what` (`kv_cache` or `weights`) has no physical
    memory: its allocations fail as a device out of memory does."""
    from kvfit.vmm import VmmOutOfMemoryError

    runner = llm.engine.executor.workers[0].runner
    tensor = runner.kv_cache.tensor if what == "kv_cache" else runner.weight_arena.tensor
    reservation = tensor._reservation
    if not refuse:
        reservation.__dict__.pop("create", None)  # the class's method again
        return

    def create(size: int) -> Any:
        raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")

    reservation.create = create


def prefix_cache_blocks(llm: LLM) -> int:
    """Blocks the prefix cache can hand out again (by hash)."""
    return len(llm.engine.scheduler.block_manager.hash_to_block)
