"""`SharedStorageConnector`: full KV blocks as safetensors files in one directory, so another
engine (another process, or this one after a restart) on the same model and KV layout loads
what this one computed.

A block's file name is its key (`connectors/chain.py`): equal names mean equal prefixes on an
equal model. Files that cannot be used (truncated, corrupt, written for another
model) are skipped with a warning and their blocks recomputed; a later save replaces them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import torch

from kvfit.connectors.base import (
    BlockTransfer,
    KVConnector,
    KVConnectorMetadata,
    KVLoadError,
    ScheduledSeq,
    checked_caches,
    registered,
)
from kvfit.connectors.block_file import (
    SUFFIX,
    BlockFileError,
    BlockFormat,
    read_block,
    read_header,
    write_block,
)
from kvfit.connectors.chain import BlockChains, store_namespace
from kvfit.connectors.config import KVConnectorConfig
from kvfit.kv.spec import KVCacheSpec

logger = logging.getLogger(__name__)

STAGING_BLOCKS = 64
"""Blocks moved per round through the host staging buffer (which bounds its size)."""
IO_THREADS = 8
"""Files read or written at once (file I/O and the checksum release the GIL)."""
SAVE_WARNING_INTERVAL_S = 30.0
"""Least seconds between two warnings about failed saves: a full or unwritable store fails
every block of every step, and one line per block would flood the log."""


@dataclass
class ConnectorStats:
    """What the worker side moved, for tests and benchmarks."""

    loaded_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0
    failed_loads: int = 0
    saved_blocks: int = 0
    save_bytes: int = 0
    save_seconds: float = 0.0
    failed_saves: int = 0  # blocks a save could not write (the store is best effort)


class SharedStorageConnector(KVConnector):
    """Both sides of the shared-storage connector (an instance serves one `role`).

    Scheduler side: hits are the leading blocks whose files have a valid header; saves are the
    blocks a step fills whose tokens are all known and that the store does not hold yet.
    Worker side: no device memory is allocated; blocks move between the registered cache and a
    host staging buffer (pinned on a GPU) of `STAGING_BLOCKS` blocks, and file I/O runs on
    `IO_THREADS` threads. Saves are synchronous: a step that fills blocks waits for its forward
    and its files before the engine goes on. Failed saves are warned about at most once per
    `SAVE_WARNING_INTERVAL_S` of `clock` (the first with its cause, then counts).
    """

    @classmethod
    def host_buffer_bytes(cls, config: KVConnectorConfig, spec: KVCacheSpec) -> int:
        """The staging buffer at its largest: `STAGING_BLOCKS` blocks of `spec` (see
        `_staging_buffer`)."""
        return STAGING_BLOCKS * spec.block_bytes

    def __init__(self, role: str, config: KVConnectorConfig, spec: KVCacheSpec,
                 model_id: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(role)
        self.root = Path(config.kv_connector_path)
        self.spec = spec
        self.block_size = spec.block_size
        self._name_blocks(model_id)
        self._warned: set[str] = set()
        # Scheduler side.
        self._pending_loads: list[BlockTransfer] = []
        self._finished_saves: list[BlockTransfer] = []  # planned by `request_finished`
        self._bad_keys: set[str] = set()
        # Worker side.
        self._caches: list[torch.Tensor] | None = None
        self._staging: torch.Tensor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self.stats = ConnectorStats()
        self._clock = clock
        self._save_warned_at: float | None = None  # `clock` at the last failed-save warning
        self._unsaved = 0  # blocks not saved since that warning
        self._save_error: tuple[str, Exception] | None = None  # the latest failure's key, cause

    def _name_blocks(self, model_id: str) -> None:
        """Key blocks (`chains`) and write and check their files (`format`) in the namespace
        of `model_id`'s K/V."""
        spec, namespace = self.spec, store_namespace(model_id, self.spec)
        self.format = BlockFormat(spec.dtype, (spec.num_segments, *spec.block_shape), namespace)
        self._file_meta = {"model": model_id, "layout": "/".join(spec.dims)}
        self.chains = BlockChains(namespace, spec.block_size)

    def path(self, key: str) -> Path:
        """The file that holds the block named `key`."""
        return self.root / f"{key}{SUFFIX}"

    # -- scheduler side -----------------------------------------------------------------------

    def keys_for(self, token_ids: list[int]) -> list[str]:
        """Keys of the full blocks of `token_ids`, in order."""
        return self.chains.keys_for(token_ids)

    def get_num_new_matched_tokens(self, seq: ScheduledSeq) -> int:
        return self.chains.num_hit_tokens(seq, self._holds)

    def _holds(self, key: str) -> bool:
        if key in self._bad_keys:
            return False
        try:
            read_header(self.path(key), self.format, key)
        except FileNotFoundError:
            return False
        except (BlockFileError, OSError) as e:
            self._bad_keys.add(key)
            self._warn(key, e)
            return False
        return True

    def update_state_after_alloc(self, seq: ScheduledSeq, num_external_tokens: int) -> None:
        self._pending_loads += [BlockTransfer(seq.block_table[i], key, seq.seq_id,
                                              i * self.block_size)
                                for i, key in self.chains.hit_blocks(seq, num_external_tokens)]

    def build_connector_meta(self, seqs: Sequence[ScheduledSeq],
                             num_new_tokens: Sequence[int]) -> KVConnectorMetadata:
        meta = KVConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        planned: set[str] = set()  # two sequences may fill the same block in one step
        for seq, num_new in zip(seqs, num_new_tokens, strict=True):
            first, keys = self.chains.fill_keys(seq, num_new)
            self._plan_saves(meta, [BlockTransfer(seq.block_table[i], key)
                                    for i, key in enumerate(keys, first)], planned)
        return meta

    def build_finished_meta(self) -> KVConnectorMetadata | None:
        meta = KVConnectorMetadata()
        self._plan_saves(meta, self._finished_saves, set())
        self._finished_saves = []
        return meta if meta.saves else None

    def _plan_saves(self, meta: KVConnectorMetadata, saves: list[BlockTransfer],
                    planned: set[str]) -> None:
        """Add to `meta.saves` each of `saves` whose block the store needs."""
        for t in saves:
            if t.key not in planned and self._needs_save(t.key):
                planned.add(t.key)
                meta.saves.append(t)

    def _needs_save(self, key: str) -> bool:
        """Whether the store lacks `key` (earlier steps' saves are done: they are synchronous)
        or holds a file that could not be used, which the save replaces."""
        if key in self._bad_keys:
            self._bad_keys.discard(key)
            return True
        return not self.path(key).exists()

    def launched(self, meta: KVConnectorMetadata) -> None:
        """Nothing to record: a store's files are its own index, each there once written."""

    def request_finished(self, seq: ScheduledSeq) -> None:
        if (tail := self.chains.unsaved_tail(seq)) is not None:
            index, key = tail
            self._finished_saves.append(BlockTransfer(seq.block_table[index], key))
        self.chains.forget(seq.seq_id)

    def loads_failed(self, error: KVLoadError) -> None:
        self._bad_keys |= error.bad_keys

    def weights_replaced(self, model_id: str) -> None:
        # The old weights' files stay: engines that still run those weights share them, and
        # no key of the new namespace names one (remove the directory's files to reclaim it).
        self._name_blocks(model_id)
        self._pending_loads, self._finished_saves = [], []
        self._bad_keys.clear()

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = checked_caches(kv_caches, self.format.shape, self.format.dtype)

    def unregister_kv_caches(self) -> None:
        self._caches = None

    def close(self) -> None:
        self._caches = self._staging = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    @property
    def registered_caches(self) -> list[torch.Tensor] | None:
        """The registered per-segment caches (None while unregistered)."""
        return self._caches

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        if not meta.loads:
            return
        caches, start = registered(self._caches), time.perf_counter()
        lost: dict[int, int] = {}  # seq_id -> its first token that must be recomputed
        bad: set[str] = set()
        loaded = 0
        for group, staging in self._rounds(meta.loads):
            errors = self._io(lambda t, out: read_block(self.path(t.key), self.format, t.key,
                                                        out), group, staging)
            for t, error in zip(group, errors, strict=True):
                if error is not None:
                    self._warn(t.key, error)
                    bad.add(t.key)
                    lost[t.seq_id] = min(lost.get(t.seq_id, t.first_token), t.first_token)
            for t, buffer in zip(group, staging, strict=True):
                if t.first_token < lost.get(t.seq_id, t.first_token + 1):  # else recomputed
                    for cache, part in zip(caches, buffer, strict=True):
                        cache[t.block_id].copy_(part, non_blocking=True)
                    loaded += 1
            self._synchronize()  # the staging buffer is reused by the next round
        self.stats.loaded_blocks += loaded
        self.stats.failed_loads += len(bad)
        self.stats.load_bytes += loaded * self.format.nbytes
        self.stats.load_seconds += time.perf_counter() - start
        if bad:
            raise KVLoadError(lost, bad)

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        if not meta.saves:
            return
        caches, start = registered(self._caches), time.perf_counter()
        saved = failed = 0
        # The directory itself may have gone (a user clearing the store removes it, as
        # `reset_prefix_cache` suggests; a tmp cleaner): made again, as at startup, or every
        # save fails from then on. A failure here is the writes' to report.
        with suppress(OSError):
            self.root.mkdir(parents=True, exist_ok=True)
        for group, staging in self._rounds(meta.saves):
            for t, buffer in zip(group, staging, strict=True):
                for cache, part in zip(caches, buffer, strict=True):
                    part.copy_(cache[t.block_id], non_blocking=True)
            self._synchronize()
            errors = self._io(lambda t, data: write_block(self.path(t.key), self.format, t.key,
                                                          data, self._file_meta), group, staging)
            for t, error in zip(group, errors, strict=True):
                if error is not None:  # a save is best effort: the engine goes on
                    failed += 1
                    self._save_error = (t.key, error)
            saved += sum(error is None for error in errors)
        self.stats.saved_blocks += saved
        self.stats.failed_saves += failed
        self.stats.save_bytes += saved * self.format.nbytes
        self.stats.save_seconds += time.perf_counter() - start
        self._warn_unsaved(failed)

    def num_failed_saves(self) -> int:
        return self.stats.failed_saves

    def _warn_unsaved(self, failed: int) -> None:
        """Count `failed` blocks not saved; warn when `SAVE_WARNING_INTERVAL_S` has passed since
        the last warning. A failure after a quiet interval is warned about at once, with its
        cause; failures within an interval of a warning are summed into the next one."""
        now, last = self._clock(), self._save_warned_at
        self._unsaved += failed
        if last is not None and now - last < SAVE_WARNING_INTERVAL_S:
            return
        if not self._unsaved:
            self._save_warned_at = None  # a quiet interval: the next failure is a first one
            return
        key, error = self._save_error
        if last is None:
            logger.warning("KV store: could not save %d block(s) to %s (block %s: %s); requests "
                           "go on, their blocks stay out of the store; further failures are "
                           "counted, one warning per %.0f s", self._unsaved, self.root, key,
                           error, SAVE_WARNING_INTERVAL_S)
        else:
            logger.warning("KV store: %d block(s) not saved to %s in the last %.0f s (latest: "
                           "block %s: %s)", self._unsaved, self.root, now - last, key, error)
        self._save_warned_at, self._unsaved = now, 0

    def _rounds(self, transfers: list[BlockTransfer]
                ) -> Iterator[tuple[list[BlockTransfer], torch.Tensor]]:
        """`transfers` in groups of `STAGING_BLOCKS`, each with its slice of staging buffer."""
        staging = self._staging_buffer(min(len(transfers), STAGING_BLOCKS))
        for i in range(0, len(transfers), STAGING_BLOCKS):
            group = transfers[i : i + STAGING_BLOCKS]
            yield group, staging[: len(group)]

    def _staging_buffer(self, num_blocks: int) -> torch.Tensor:
        """A host buffer of at least `num_blocks` (<= `STAGING_BLOCKS`) blocks, grown on demand.

        Host memory, at most `host_buffer_bytes` = `STAGING_BLOCKS * spec.block_bytes`
        (Qwen3-0.6B, bf16, 16-token blocks: 64 x 1.75 MiB = 112 MiB), never two buffers at
        once. It is allocated after the KV cache was sized, so on the CPU, where the host is
        the device, the worker keeps this much out of the cache's budget; on a GPU it is pinned
        host memory, outside the device's budget."""
        if self._staging is None or len(self._staging) < num_blocks:
            shape, pin = (num_blocks, *self.format.shape), self._caches[0].device.type == "cuda"
            self._staging = None  # the old buffer goes first: the bound holds while growing
            try:
                self._staging = torch.empty(shape, dtype=self.format.dtype, pin_memory=pin)
            except RuntimeError as error:  # pinned memory is capped (ulimit -l, containers)
                logger.warning("KV store: no pinned host memory for staging (%s); copies run "
                               "from pageable memory, slower", error)
                self._staging = torch.empty(shape, dtype=self.format.dtype)
        return self._staging

    def _io(self, op: Callable[[BlockTransfer, torch.Tensor], None],
            group: list[BlockTransfer], staging: torch.Tensor) -> list[Exception | None]:
        """Run `op` on each (transfer, staging row) on the I/O threads; each one's error."""
        def run(i: int) -> Exception | None:
            try:
                op(group[i], staging[i])
            except (BlockFileError, OSError) as e:
                return e
            return None

        if self._pool is None:
            self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="kvfit-kv-store")
        return list(self._pool.map(run, range(len(group))))

    def _synchronize(self) -> None:
        if self._caches and self._caches[0].device.type == "cuda":
            torch.cuda.synchronize(self._caches[0].device)

    def _warn(self, key: str, error: Exception) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("KV store: skipping %s (%s); its blocks are recomputed",
                           self.path(key), error)
