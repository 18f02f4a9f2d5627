"""`worker_init_fn` hooks for the tensor-parallel tests. They run inside each spawned worker
(which imports this module by name: the tests put this folder on `sys.path` first), change
what one rank sees, and add `probe_*` methods the test reads through `collective_rpc`."""

from __future__ import annotations

import os
import signal
from typing import Any

from kvfit.kv.sizing import kv_margin


def probes(worker: Any) -> None:
    """What each rank committed, which cache it has, and the bound its warmup was given."""
    warm_up, initialize = worker.warm_up, worker.initialize_kv_cache

    def recorded_warm_up(num_blocks: int) -> None:
        worker.warmed_with = num_blocks
        warm_up(num_blocks)

    def recorded_initialize(num_blocks: int, extensible: bool) -> int:
        worker.committable = initialize(num_blocks, extensible)
        return worker.committable

    worker.warm_up, worker.initialize_kv_cache = recorded_warm_up, recorded_initialize
    worker.probe_committable = lambda: worker.committable
    worker.probe_committed_blocks = lambda: worker.runner.num_blocks
    worker.probe_extensible = lambda: worker.runner.kv_cache is not None
    worker.probe_warmed_with = lambda: worker.warmed_with
    worker.probe_pid = os.getpid
    worker.probe_kv_scales = lambda: worker.runner.kv_scales()


def small_budget_on_rank_1(worker: Any) -> None:
    """Rank 1's host budget leaves its cache 2.5 commit granules after warmup (rank 0 keeps
    the configured budget, which holds the engine's cap)."""
    probes(worker)
    if worker.rank != 1:
        return
    measure, initialize = worker.measure_kv_cache_blocks, worker.initialize_kv_cache

    def measure_with_small_budget() -> int:
        cc, profile = worker.config.cache_config, worker.memory_profile()
        margin = kv_margin(profile.transient, cc.kv_cache_margin_floor_bytes,
                           cc.kv_cache_margin_fraction)
        granule = worker.runner.kv_cache.granularity
        worker.monitor.budget_bytes = (profile.non_kv_use + profile.transient + margin
                                       + 5 * granule // 2)
        return measure()

    def initialize_fewer(num_blocks: int, extensible: bool) -> int:
        worker.committable = initialize(num_blocks, extensible) - 7  # less free at warmup too
        return worker.committable

    worker.measure_kv_cache_blocks = measure_with_small_budget
    worker.initialize_kv_cache = initialize_fewer


def no_vmm_on_rank_1(worker: Any) -> None:
    probes(worker)
    if worker.rank == 1:
        worker.vmm_unavailable_reason = lambda: "injected: no VMM on this device"


def fail_load_on_rank_1(worker: Any) -> None:
    probes(worker)
    if worker.rank == 1:
        def load_model() -> None:
            raise RuntimeError("injected failure while loading the weights")

        worker.load_model = load_model


def die_on_third_step_on_rank_1(worker: Any) -> None:
    probes(worker)
    if worker.rank != 1:
        return
    launch, steps = worker.launch, []

    def launch_then_die(batch: Any) -> Any:
        steps.append(batch)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return launch(batch)

    worker.launch = launch_then_die


def fail_fourth_step(worker: Any) -> None:
    """The fourth real step raises on every rank (an error the engine can step past)."""
    launch, steps = worker.launch, []

    def launch_or_fail(batch: Any) -> Any:
        steps.append(batch)
        if len(steps) == 4:
            raise ValueError("injected failure in the fourth step")
        return launch(batch)

    worker.launch = launch_or_fail


def no_memory_to_grow_on_rank_1(worker: Any) -> None:
    """Rank 1's driver finds no memory for any grow of the KV cache (shrinks still work)."""
    if worker.rank != 1:
        return
    from kvfit.vmm import VmmOutOfMemoryError

    resize = worker.resize_kv_cache

    def resize_without_memory(num_blocks: int) -> int:
        if num_blocks > worker.runner.kv_cache.committed_blocks:
            raise VmmOutOfMemoryError("cuMemCreate", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        return resize(num_blocks)

    worker.resize_kv_cache = resize_without_memory


CO_TENANT_DEVICE_BYTES = 128 << 20


def co_tenant_on_rank_1(worker: Any) -> None:
    """Rank 1's device holds `CO_TENANT_DEVICE_BYTES`: its KV cache, what a co-tenant holds
    (`probe_set_co_tenant(nbytes)`; until the first call the device reports plenty free) and
    the free rest."""
    probes(worker)
    worker.probe_set_co_tenant = lambda nbytes: None
    if worker.rank != 1:
        return
    held: list[int | None] = [None]

    def device_memory() -> tuple[int, int]:
        if held[0] is None:
            return 1 << 40, 1 << 40
        cache = worker.runner.kv_cache
        return CO_TENANT_DEVICE_BYTES - held[0] - cache.physical_bytes, CO_TENANT_DEVICE_BYTES

    def set_co_tenant(nbytes: int) -> None:
        held[0] = nbytes

    worker.device_memory = device_memory
    worker.probe_set_co_tenant = set_co_tenant


def worker_pids(llm: Any) -> list[int]:
    """Every rank's pid (an `AsyncLLM.call_engine` function; needs the `probes` hook)."""
    return llm.engine.executor.collective_rpc("probe_pid")


def fail_third_step_on_rank_1(worker: Any) -> None:
    """Rank 1's third step raises before its forward; rank 0 waits for it in a collective."""
    probes(worker)
    if worker.rank != 1:
        return
    launch, steps = worker.launch, []

    def launch_or_fail(batch: Any) -> Any:
        steps.append(batch)
        if len(steps) == 3:
            raise ValueError("injected failure on rank 1 only")
        return launch(batch)

    worker.launch = launch_or_fail
