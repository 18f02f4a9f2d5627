"""One device's worker: loads the model, profiles, creates and sizes the KV cache, warms up,
captures graphs and executes steps. The engine drives it through `collective_rpc`."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kvfit.connectors import (
    KVConnector,
    KVConnectorMetadata,
    create_kv_connector,
    kv_connector_host_bytes,
    kv_connector_one_chunk,
)
from kvfit.engine import sampler
from kvfit.engine.async_output import AsyncModelOutput
from kvfit.engine.config import EngineConfig
from kvfit.engine.model_runner import ModelRunner
from kvfit.engine.sequence import ScheduledBatch
from kvfit.engine.sleep import SleepReport, SleepState
from kvfit.kv.monitor import CudaMemoryMonitor, HostMemoryMonitor, MemoryMonitor
from kvfit.kv.report import KVCacheReport
from kvfit.kv.sizing import (
    MemoryProfile,
    MemorySnapshot,
    StepPeak,
    available_kv_bytes,
    estimate_num_blocks,
    kv_margin,
    memory_budget,
    memory_profile,
    non_torch_bytes,
    transient_bytes,
)
from kvfit.models.loader import fill_weights
from kvfit.models.weights import canonical_names, load_weights
from kvfit.vmm import get_driver, vmm_unavailable_reason
from kvfit.vmm.extensible_tensor import commit_granule

logger = logging.getLogger(__name__)


class Worker:
    """Owns one device, its memory monitor and its `ModelRunner`.

    Memory is read at fixed points of startup: a baseline before the weights, the profiling step
    and every warmup step's peak; `measure_kv_cache_blocks` turns them into a block count.
    """

    def __init__(self, config: EngineConfig, rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.device = config.device
        self.monitor = _memory_monitor(config)
        self.runner: ModelRunner | None = None
        self.step_peaks: list[StepPeak] = []
        self.baseline: MemorySnapshot | None = None
        self.weights = 0
        self.estimate_blocks = 0
        self.sized_profile: MemoryProfile | None = None  # what measured sizing saw
        # Weights woken without contents (sleep level 2, no reload) and not loaded since.
        self.missing_weights: set[str] = set()
        # The worker side of the KV connector, once the cache has its final size.
        self.kv_connector: KVConnector | None = None

    def vmm_unavailable_reason(self) -> str | None:
        """Why this device cannot back the extensible cache, or None when it can."""
        return vmm_unavailable_reason(self.device)

    def load_model(self) -> None:
        """Snapshot memory, check the estimate's budget against it, then load the weights."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
        self.baseline = self.monitor.snapshot()
        if self.config.cache_config.sizing_method == "estimate":
            self._check_budget_is_free()
        self.runner = ModelRunner(self.config)
        model = self.runner.model
        self.weights = sum(t.numel() * t.element_size() for t in (*model.parameters(),
                                                                  *model.buffers()))

    def _check_budget_is_free(self) -> None:
        """The estimate takes its whole budget up front, so it must be free now. (The measured
        path tolerates more: there the budget only caps, and over-reserves address space.)"""
        cc, b = self.config.cache_config, self.baseline
        setting = self.monitor.budget_setting
        budget = memory_budget(b.total, cc.memory_utilization, setting)
        free = b.usable_free
        if budget > free:
            raise ValueError(
                f"sizing the KV cache by estimate needs its whole budget free ({budget} bytes: "
                f"{cc.memory_utilization} of {b.total}), but {free} bytes are free on "
                f"{self.device}; lower {setting} or free the device"
            )

    def profile(self, measure_graphs: bool = False) -> int:
        """Run the largest step before the cache exists; return the blocks the estimate gives
        within the budget (the capacity to reserve, or the final size without VMM).

        `measure_graphs` (the estimate path): capture the graphs once, against the profiling
        scratch cache, and subtract what that took, and profile the largest sampling step too
        (`ModelRunner.profile_sampling_run`: the profiling prefill samples no row, and the
        estimate comes before warmup). Only the estimate path does these; the measured path
        captures once, for real, and its warmup samples the most rows, both measured.
        """
        self._measured_step(self.runner.profile_run)
        if measure_graphs:
            self._measured_step(self.runner.profile_sampling_run)
        graph_capture = self._throwaway_capture_bytes() if measure_graphs else 0
        now = self.monitor.snapshot()
        host_bytes = self._connector_host_bytes()
        try:
            self.estimate_blocks = estimate_num_blocks(
                total=now.total,
                utilization=self.config.cache_config.memory_utilization,
                weights=self.weights,
                activation_peak=transient_bytes(self.step_peaks),
                graph_capture=graph_capture,
                # The connector's host buffers come after sizing: on the CPU, more of the same
                # use.
                non_torch=non_torch_bytes(self.baseline, now, self._arena_bytes()) + host_bytes,
                block_bytes=self.runner.kv_cache_spec.block_bytes,
                setting=self.monitor.budget_setting,
            )
        except ValueError as error:
            cfg = self.config.kv_connector_config
            if not (host_bytes and cfg is not None and cfg.kv_offloading_bytes):
                raise
            # "What the model uses" is then mostly the host tier: name the setting behind it.
            raise ValueError(f"{error}, or lower kv_offloading_size: {host_bytes} of those bytes "
                             f"are its host tier, which on the CPU comes out of the same "
                             f"budget") from None
        return self.estimate_blocks

    def _throwaway_capture_bytes(self) -> int:
        """Device memory one graph capture pass takes (0 when eager); the graphs are dropped."""
        before = self.monitor.snapshot()
        self.runner.capture_cuda_graphs()
        self._synchronize()
        after = self.monitor.snapshot()
        self.runner.drop_cuda_graphs()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the dropped graph pool back for the cache
        return max(0, before.free - after.free)

    def initialize_kv_cache(self, num_blocks: int, extensible: bool) -> int:
        """Create the cache (extensible: `num_blocks` is the capacity, the minimum is
        committed); return how many blocks this worker could commit for warmup. With a
        one-chunk connector the capacity is rounded up so that every segment starts on a
        granule."""
        if extensible and self._one_chunk_connector():
            step = self.runner.kv_cache_spec.granule_block_step(
                commit_granule(get_driver(self.device).granularity(self.device.index or 0)))
            num_blocks = -(-num_blocks // step) * step
        if self.config.cache_config.sizing_method == "override":
            self._check_override_fits(num_blocks)
        self.runner.initialize_kv_cache(num_blocks, extensible)
        if extensible:
            profile = self.memory_profile()
            num_blocks = self.runner.kv_cache.blocks_that_fit(profile.free + profile.committed_kv)
        return num_blocks

    def _check_override_fits(self, num_blocks: int) -> None:
        """A manual size is taken as given, but not past the memory free now: the allocation
        failed with the allocator's words ("can't allocate memory", or an overflowed size for
        kv_cache_memory_bytes=1e20), naming no setting."""
        cc = self.config.cache_config
        need = num_blocks * self.runner.kv_cache_spec.block_bytes
        free = self.memory_profile().free
        if need > free:
            setting = ("num_gpu_blocks_override" if cc.num_gpu_blocks_override is not None
                       else "kv_cache_memory_bytes")
            raise ValueError(f"{setting} asks for a KV cache of {num_blocks} blocks "
                             f"({need} bytes), but {free} bytes are free on {self.device}; "
                             f"lower {setting}, or leave it unset to size from free memory")

    def kv_cache_commit_granule(self) -> int:
        """Bytes of this rank's commit granule (0 without the extensible cache)."""
        cache = self.runner.kv_cache
        return cache.granularity if cache is not None else 0

    def warm_up(self, num_committable_blocks: int) -> None:
        """Kernel warmup, then the two steps that make every allocation a real step can make at
        its largest, each step's memory peak recorded (the profiling step, a prefill of
        `max_num_batched_tokens`, is the third). Dummy block ids stay below
        `num_committable_blocks` (the engine's minimum over workers).

        - A mixed prefill+decode step at `max_num_batched_tokens`: the prefill activations, the
          decode kernel's split-KV scratch at `max_model_len`, and a whole
          `PROMPT_LOGPROBS_CHUNK` of prompt logprobs where the budget allows (the largest
          logits tensor any step makes, beside the step's activations, as a real step meets it).
        - The most rows one step samples (`max_num_seqs`, within the token budget) as decodes,
          beside a prefill of the rest of the budget: a real step samples that many rows while
          the activations of `max_num_batched_tokens` tokens are live.
        Both sample with every feature at its worst case (`ModelRunner.warmup_params`). Under
        `small_batch_kernels` or `fused_decode_input`, a one-token decode too (the only step
        that runs the former's fused variants, and a step of decodes alone, the only kind the
        latter's kernel takes: it allocates no more than the steps above, whose decode rows at
        `max_model_len` size the same split scratch, but it compiles here, not at a user's
        first step). And a short prefill and a short decode (contexts of one block): the decode
        kernels' variant of one split per sequence, which every step at `max_model_len` splits
        past, compiles here too, not at a user's first short prompt.
        """
        sc = self.config.scheduler_config
        runner, params = self.runner, self.runner.warmup_params
        max_rows = min(sc.max_num_seqs, sc.max_num_batched_tokens)
        num_decodes = min(sc.max_num_seqs - 1, sc.max_num_batched_tokens // 2)
        if sc.max_num_batched_tokens > sampler.PROMPT_LOGPROBS_CHUNK:
            num_decodes = min(num_decodes,
                              sc.max_num_batched_tokens - sampler.PROMPT_LOGPROBS_CHUNK)
        self._measured_step(runner.dummy_run, min(16, sc.max_num_batched_tokens),
                            num_committable_blocks)
        if self.config.runs_small_batch_kernels or self.config.runs_fused_decode_input:
            # One sampled decode token: the small-batch kernels' fused variants (the norms and
            # the SiLU inside the linear layers) run only at one token, and the LM head's only
            # at the few rows a step samples, which no other warmup step has; the fused decode
            # input runs only in a step of decodes alone.
            self._measured_step(runner.dummy_run, 1, num_committable_blocks, 1)
        short = self.config.cache_config.block_size
        self._measured_step(runner.dummy_run, min(2, sc.max_num_batched_tokens),
                            num_committable_blocks, 0, None, short)
        self._measured_step(runner.dummy_run, 1, num_committable_blocks, 1, None, short)
        self._measured_step(runner.dummy_run, sc.max_num_batched_tokens, num_committable_blocks,
                            num_decodes, params)
        self._measured_step(runner.dummy_run, sc.max_num_batched_tokens, num_committable_blocks,
                            max_rows, params)

    def _measured_step(self, step: Callable[..., None], *args: object) -> None:
        """Run `step(*args)` and record its memory peak (the transient sizing keeps free)."""
        self.monitor.reset_peak()
        step(*args)
        self._synchronize()
        self.step_peaks.append(self.monitor.step_peak())

    def capture_cuda_graphs(self) -> int:
        """One capture pass over the configured sizes; returns passes so far (0 when eager)."""
        self.runner.capture_cuda_graphs()
        self._synchronize()
        graphs = self.runner.graphs
        return graphs.num_capture_passes if graphs is not None else 0

    def memory_profile(self) -> MemoryProfile:
        """The measured numbers sizing needs, read now (memory torch holds idle counts as
        free: the transient reuses it)."""
        committed = self.runner.kv_cache.physical_bytes if self.runner.kv_cache else 0
        return memory_profile(self.baseline, self.monitor.snapshot(), self.step_peaks,
                              self.weights, committed, self._arena_bytes())

    def _arena_bytes(self) -> int:
        arena = self.runner.weight_arena if self.runner is not None else None
        return arena.physical_bytes if arena is not None else 0

    def measure_kv_cache_blocks(self) -> int:
        """The most blocks that fit in what is measured free within the budget, less the
        transient and the margin; never more than the reserved capacity. With a one-chunk
        connector, a count at which every segment ends on a granule (each its own physical
        chunk)."""
        self.sized_profile = self.memory_profile()
        cache = self.runner.kv_cache
        available = self._available(self.sized_profile)
        num_blocks = min(cache.capacity_blocks, cache.blocks_that_fit(available))
        if self._one_chunk_connector():
            num_blocks = cache.granule_aligned_blocks(num_blocks)
        return num_blocks

    def _available(self, profile: MemoryProfile) -> int:
        cc = self.config.cache_config
        available = available_kv_bytes(profile, cc.memory_utilization,
                                       cc.kv_cache_margin_floor_bytes, cc.kv_cache_margin_fraction,
                                       self.monitor.budget_setting)
        return max(0, available - self._connector_host_bytes())

    def _connector_host_bytes(self) -> int:
        """Memory sizing keeps for the KV connector's worker side, which allocates it only
        after the cache was sized (so no measurement saw it): its host buffers on the CPU,
        where host memory is the device's budget; 0 on a GPU, whose budget they are not in."""
        cfg = self.config.kv_connector_config
        if cfg is None or self.device.type != "cpu":
            return 0
        return kv_connector_host_bytes(cfg, self.runner.kv_cache_spec)

    def extend_kv_cache(self, num_blocks: int) -> None:
        """Commit exactly `num_blocks` (growing, or shrinking below what warmup used). For a
        one-chunk connector the commit defragments: each segment becomes one physical
        allocation (RDMA registration cannot span several) and warmup's contents are dropped.
        Under the co-tenancy governor it maps small chunks, as its resizes do (~0.2 s more per
        100 GiB), so that its first shrink under memory pressure gives back no more than it
        needs."""
        self.runner.commit_blocks(num_blocks,
                                  defragment=self._one_chunk_connector(),
                                  elastic=self.config.elastic is not None)

    def init_kv_connector(self, model_id: str) -> None:
        """Create the worker side of the configured connector, for the store's `model_id`
        (`model_identity`, the engine's), and register the cache's backed memory (after the
        final `extend_kv_cache`, so it sees only the final size)."""
        self.kv_connector = create_kv_connector(self.config.kv_connector_config, "worker",
                                                self.runner.kv_cache_spec, model_id)
        self.kv_connector.register_kv_caches(self.runner.kv_cache_views())

    def kv_connector_weights_replaced(self, model_id: str) -> None:
        """The weights changed in place: the connector names blocks by `model_id` from now on
        (`KVConnector.weights_replaced`)."""
        if self.kv_connector is not None:
            self.kv_connector.weights_replaced(model_id)

    def kv_connector_failed_saves(self) -> int:
        """Blocks the connector's saves could not write since startup (0 before it exists)."""
        if self.kv_connector is None:
            return 0
        return self.kv_connector.num_failed_saves()

    def kv_cache_shrink_target(self, nbytes: int, num_granules: int = 1) -> int:
        """The most blocks the extensible cache can commit in `nbytes` and `num_granules` commit
        granules less than it holds now, by unmapping whole physical chunks (the out-of-memory
        guard's shrink target: cutting a chunk would need memory for a copy)."""
        cache = self.runner.kv_cache
        keep = cache.physical_bytes - nbytes - num_granules * cache.granularity
        return self.kv_cache_reachable_blocks(cache.blocks_that_fit(max(0, keep)))

    def kv_cache_reachable_blocks(self, num_blocks: int) -> int:
        """The most blocks <= `num_blocks` a shrink reaches without memory for a copy: whole
        physical chunks dropped, or for a one-chunk cache (`kv_cache_one_chunk`) any size whose
        segments end on a granule, since `recommit_kv_cache` releases before it maps."""
        cache = self.runner.kv_cache
        if self.kv_cache_one_chunk():
            return cache.granule_aligned_blocks(num_blocks)
        return cache.uncut_blocks(num_blocks)

    def kv_cache_one_chunk(self) -> bool:
        """Whether each segment of the extensible cache must stay one physical chunk: a KV
        connector that needs it registered it (`KVConnector.needs_one_chunk`: RDMA
        registration cannot span allocations). Such a cache is resized by
        `recommit_kv_cache`, never by cutting or dropping chunks."""
        return (self.kv_connector is not None and self.kv_connector.needs_one_chunk
                and self.runner.kv_cache is not None)

    def _one_chunk_connector(self) -> bool:
        """Whether the configured connector (before it exists) needs a one-chunk cache."""
        cfg = self.config.kv_connector_config
        return cfg is not None and kv_connector_one_chunk(cfg)

    def check_kv_cache_room(self, num_blocks: int) -> None:
        """Raise `VmmOutOfMemoryError`, touching nothing (no page released, the connector's
        registration kept), unless the device holds what `recommit_kv_cache(num_blocks)`
        would take beyond the pages the cache holds now: a one-chunk cache's grow asks
        before it releases anything."""
        self.runner.kv_cache.check_room(num_blocks)

    def recommit_kv_cache(self, num_blocks: int) -> None:
        """Release the extensible cache's pages (unless asleep already) and back `num_blocks`
        zeroed at the same addresses (graphs stay valid): how a one-chunk cache
        (`kv_cache_one_chunk`) resizes, as one chunk per segment registered with the connector
        again, and how a wake short of memory backs fewer blocks. Every block's contents are
        dropped: none may be in use and no step may be running.

        Device memory: none beyond the new chunks, the old ones being released first. A
        failure leaves the cache released (and unregistered; nothing mapped): call it again,
        smaller."""
        cache, connector = self.runner.kv_cache, self.kv_connector
        if connector is not None:
            connector.unregister_kv_caches()
        if not cache.is_released:
            cache.release_physical()
        cache.recommit(defragment=self._one_chunk_connector(), num_blocks=num_blocks)
        if connector is not None:
            connector.register_kv_caches(self.runner.kv_cache_views())

    def resize_kv_cache(self, num_blocks: int) -> int:
        """Commit exactly `num_blocks` of the extensible cache (same addresses: graphs stay
        valid); returns the physical bytes it gained (negative: gave back). A shrink keeps
        torch's idle memory: it is the steps' transient. The blocks dropped must be unused and
        no step may be running; a failed commit leaves the cache as it was.

        Device memory beyond the new size: a shrink that cuts a physical chunk holds a copy of
        the chunk's kept part while it swaps: at most `ELASTIC_CHUNK_BYTES` (2 GiB) over all
        segments for chunks this grew and startup's last `TAIL_BYTES`, `BULK_CHUNK_BYTES`
        (1 GiB) per segment for startup's others;
        `kv_cache_reachable_blocks` gives the sizes that need none."""
        cache = self.runner.kv_cache
        before = cache.physical_bytes
        if self.kv_connector is not None:  # its storages end where the committed bytes do
            self.kv_connector.unregister_kv_caches()
        try:
            self.runner.commit_blocks(num_blocks, elastic=True)
        finally:
            if self.kv_connector is not None:
                self.kv_connector.register_kv_caches(self.runner.kv_cache_views())
        return cache.physical_bytes - before

    def kv_cache_blocks(self) -> tuple[int, int, int]:
        """`(committed, capacity, budget)` blocks of the extensible cache: what it backs now,
        what its reservation holds, and the most the sizing budget allows (startup's rule with
        free memory set aside: gpu_memory_utilization of the device less this process's other
        use as measured at startup, the transient and the margin). A fixed-size cache: its
        size, three times."""
        cache = self.runner.kv_cache
        if cache is None:
            # What this worker allocated: in a worker process the config is a copy that the
            # engine's `num_gpu_blocks` never reaches.
            num_blocks = self.runner.num_blocks
            return num_blocks, num_blocks, num_blocks
        budget = cache.capacity_blocks
        if self.sized_profile is not None:
            unbounded = dataclasses.replace(self.sized_profile, free=self.sized_profile.total)
            budget = min(budget, cache.blocks_that_fit(self._available(unbounded)))
        return cache.committed_blocks, cache.capacity_blocks, budget

    def kv_cache_blocks_at(self, delta_bytes: int) -> int:
        """The most blocks that fit in the physical bytes the cache holds now plus
        `delta_bytes` (negative: to give back). A one-chunk cache: a size whose segments end
        on a granule (its resizes need no memory beyond the new one)."""
        cache = self.runner.kv_cache
        num_blocks = cache.blocks_that_fit(max(0, cache.physical_bytes + delta_bytes))
        if self.kv_cache_one_chunk():  # a whole chunk per segment: sizes ending on a granule
            return cache.granule_aligned_blocks(num_blocks)
        return num_blocks

    def device_memory(self) -> tuple[int, int]:
        """`(free, total)` device bytes now, from the memory monitor (the elastic governor's
        poll: one `cudaMemGetInfo` on a GPU)."""
        return self.monitor.free_and_total()

    def device_key(self) -> str:
        """The physical device, the same in every process that sees it (a GPU's UUID, under
        whatever index CUDA_VISIBLE_DEVICES gives it; `cpu` for the host): where elastic
        engines meet to share their demand."""
        if self.device.type == "cuda":
            return f"cuda-{torch.cuda.get_device_properties(self.device).uuid}"
        return self.device.type

    def empty_cache(self) -> None:
        """Release the memory torch's caching allocator holds idle (after an out-of-memory
        error, so the retried step can have it)."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def kv_cache_report(
        self, method: str, num_blocks: int, max_blocks: int | None = None
    ) -> KVCacheReport:
        """How this worker's cache was sized (`max_blocks`: the engine's cap on any method's
        size). The margin is only kept by measured sizing."""
        profile = self.memory_profile()
        cc, cache = self.config.cache_config, self.runner.kv_cache
        margin = 0
        if method == "measured":
            margin = kv_margin(profile.transient, cc.kv_cache_margin_floor_bytes,
                               cc.kv_cache_margin_fraction)
        # Physical (granule-rounded) bytes of the extensible cache; else what torch holds,
        # which torch's live bytes then include.
        kv_bytes = (cache.physical_bytes if cache is not None
                    else num_blocks * self.runner.kv_cache_spec.block_bytes)
        torch_kv = 0 if cache is not None else kv_bytes
        return KVCacheReport(
            method=method,
            total=profile.total,
            budget=memory_budget(profile.total, cc.memory_utilization, self.monitor.budget_setting),
            weights=self.weights,
            non_torch=profile.non_torch,
            transient=profile.transient,
            margin=margin,
            committed_bytes=kv_bytes,
            num_blocks=num_blocks,
            estimate_num_blocks=self.estimate_blocks,
            max_blocks=max_blocks,
            on_host=self.device.type == "cpu",
            dtype=str(self.runner.kv_cache_spec.dtype).removeprefix("torch."),
            block_bytes=self.runner.kv_cache_spec.block_bytes,
            # On the host torch's figures are the process's private memory: no such split.
            graphs_and_buffers=(max(0, profile.torch_live - self.weights - torch_kv)
                                if self.device.type == "cuda" else None),
            # ... but the budget counts it, so the rows add up to what the cache was left.
            host_process=(max(0, profile.torch_live - self.weights - torch_kv)
                          if self.device.type == "cpu" else None),
        )

    def kv_cache_bytes(self) -> tuple[int, int]:
        """`(committed, reserved)` bytes of the KV cache now; without the extensible cache
        both are what torch allocated for it."""
        cache, spec = self.runner.kv_cache, self.runner.kv_cache_spec
        if cache is None:
            nbytes = self.runner.num_blocks * spec.block_bytes  # allocated (as above)
            return nbytes, nbytes
        # The reservation, not capacity x block bytes: committed granules can pass the latter.
        return cache.physical_bytes, cache.reserved_bytes

    # -- sleep mode ---------------------------------------------------------------------------

    def sleep(self, level: int) -> SleepReport:
        """Release the weights' pages (level 1: after a host copy; level 2: discarded) and the
        extensible KV cache's, keeping every address; then hand torch's idle cache back.

        No step may be in flight (the engine drains first; the releases also wait for the
        device). A failure part way leaves what was released released: `sleep_state` tells.
        Without the extensible cache the KV cache stays allocated and is reported as kept.
        """
        runner, released, kept = self.runner, {}, {}
        arena, cache = runner.weight_arena, runner.kv_cache
        if arena is None:
            raise RuntimeError("Worker.sleep() needs the weight arena: set enable_sleep_mode")
        self._synchronize()
        released["weights"] = arena.physical_bytes
        if level == 1:
            host_bytes = arena.offload()
        else:
            arena.discard()
            host_bytes = 0
            self.missing_weights = canonical_names(runner.model)
        if cache is not None:
            released["kv_cache"] = cache.physical_bytes
            if self.kv_connector is not None:  # it must not touch pages about to go
                self.kv_connector.unregister_kv_caches()
            cache.release_physical()
        else:  # a torch allocation: releasing it would move the addresses the graphs hold
            kept["kv_cache"] = self.kv_cache_bytes()[0]
            logger.warning("sleep keeps the %d-byte KV cache: it is not extensible (a manual "
                           "size or no VMM); leave num_gpu_blocks_override and "
                           "kv_cache_memory_bytes unset to release it too", kept["kv_cache"])
        kept["buffers"] = sum(b.numel() * b.element_size() for b in runner.model.buffers())
        if self.device.type == "cuda":
            before = torch.cuda.memory_reserved(self.device)
            torch.cuda.empty_cache()
            # What torch keeps is live: graph pools, the graphs' inputs, buffers, sampler state.
            kept["torch"] = torch.cuda.memory_reserved(self.device) - kept["buffers"]
            released["torch_cache"] = before - torch.cuda.memory_reserved(self.device)
        return SleepReport(level, released, kept, host_bytes)

    def wake_up_weights(self, reload_weights: bool = True) -> bool:
        """Recommit asleep weights at the same addresses (nothing is recaptured): from their
        host copy, else reloaded from the model's source (`reload_weights`), else left zeroed
        and missing until `load_weights`. Returns whether they were reloaded from the source
        (whose files may have changed since startup). The KV cache wakes through
        `recommit_kv_cache` (`KVCacheResizer.wake`), which can back fewer blocks."""
        arena = self.runner.weight_arena
        if arena is not None and arena.is_released:
            restored = arena.restore()
            if not restored and reload_weights:
                mc = self.config.model_config
                fill_weights(self.runner.model, mc.model, self.device, mc.load_format)
                self.runner.use_checkpoint_kv_scales()  # the files may have changed
                self.missing_weights = set()
                return True
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint-named tensors into the parameters, in place. Asleep weights are
        woken first (from their host copy, else zeroed: then only what is given is loaded)."""
        arena = self.runner.weight_arena
        if arena is not None and arena.is_released:
            self.wake_up_weights(reload_weights=False)
        self.missing_weights -= load_weights(self.runner.model, weights)
        self.runner.use_checkpoint_kv_scales()  # scales among them, as a checkpoint's
        self._synchronize()

    def run_rpc(self, method: str | Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        """`self.method(*args, **kwargs)`, or `method(self, *args, **kwargs)` for a callable
        (`LLM.collective_rpc`, vLLM's convention: executors pass positional arguments only)."""
        if isinstance(method, str):
            return getattr(self, method)(*args, **kwargs)
        return method(self, *args, **kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> Any:
        """`func(model)` on this worker's model (`LLM.apply_model`)."""
        state = self.sleep_state()
        if state.weights_asleep or state.missing_weights:
            # Asleep, their pages are unmapped: reading them would fault.
            raise RuntimeError("apply_model() while the weights are asleep or not loaded "
                               "since a level 2 sleep: call wake_up() (or load_weights) first")
        return func(self.runner.model)

    def sleep_state(self) -> SleepState:
        """What is asleep on this worker now."""
        arena, cache = self.runner.weight_arena, self.runner.kv_cache
        return SleepState(
            kv_cache_asleep=cache is not None and cache.is_released,
            weights_asleep=arena is not None and arena.is_released,
            missing_weights=tuple(sorted(self.missing_weights)),
        )

    def launch(self, batch: ScheduledBatch) -> AsyncModelOutput:
        """Queue one scheduled step; its output arrives later. The connector's loads land
        before the forward (a `KVLoadError` stops the step before it runs); its saves wait
        for the forward."""
        meta, connector = batch.kv_connector_meta, self.kv_connector
        if connector is not None and meta:
            connector.start_load_kv(meta)
        output = self.runner.launch(batch)
        if connector is not None and meta:
            connector.wait_for_save(meta)
        return output

    def save_kv(self, meta: KVConnectorMetadata) -> None:
        """Run the KV connector's `meta.saves` outside a step (the blocks of sequences that
        finished: `KVConnector.build_finished_meta`), after the steps queued before."""
        if self.kv_connector is not None:
            self.kv_connector.wait_for_save(meta)

    def shutdown(self) -> None:
        """Release the model, graphs and KV cache, the KV connector's host memory and threads,
        and return cached device memory."""
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self.runner is not None:
            self.runner.shutdown()
            self.runner = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _memory_monitor(config: EngineConfig) -> MemoryMonitor:
    if config.device.type == "cuda":
        return CudaMemoryMonitor(config.device)
    return HostMemoryMonitor(config.cache_config.cpu_kv_cache_space_bytes,
                             "cpu_kv_cache_space_bytes")
