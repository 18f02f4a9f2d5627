"""`HostConnector`: a host-memory tier under the prefix cache. Every full block the engine
computes is copied to pinned host memory (`kv_offloading_size` GiB, least recently used blocks
make room), and a prompt whose prefix left the device cache (evicted, preempted, or given back
by an elastic cache to a peer engine) loads it from there instead of computing it again.

Why it pays: a block of the 8B shape (2.25 MiB) crosses PCIe in ~50 us, where computing it
again costs 16 tokens of prefill; a multi-turn conversation whose history fell out of the
device comes back in a copy rather than a prefill of every earlier turn.

What it costs a step: nothing on the device's compute. Saves run on a copy stream of their own
once the step's forward has written their blocks; loads run on the compute stream before the
forward that reads them. A later step that overwrites a block still being saved, or loads a
slot still being written, waits for that save on the device (the scheduler side names it in
the metadata); the host waits only where `MAX_SAVES_IN_FLIGHT` saves are queued.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psutil
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
from kvfit.connectors.chain import BlockChains, store_namespace
from kvfit.connectors.config import KVConnectorConfig
from kvfit.kv.spec import KVCacheSpec

logger = logging.getLogger(__name__)

PIECE_BYTES = 1 << 30
"""Host memory is pinned in pieces of this size (a power of two: torch's pinned allocator
rounds each allocation up to one, so a single 40 GiB tensor would pin 64)."""
MAX_SAVES_IN_FLIGHT = 4
"""Steps whose saves may be queued on the copy stream at once; the host waits for the oldest
beyond it (a bound on what the scheduler side must track as possibly unfinished)."""


@dataclass
class HostConnectorMetadata(KVConnectorMetadata):
    """`KVConnectorMetadata` with the ordering the device needs: `save_id` numbers this step's
    saves (None: it has none); `wait_save_id` is the latest earlier save whose blocks this
    step overwrites or whose slots it loads (None: no such)."""

    save_id: int | None = None
    wait_save_id: int | None = None

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.wait_save_id is not None)


@dataclass
class HostStats:
    """What the worker side moved, for tests and benchmarks."""

    loaded_blocks: int = 0
    saved_blocks: int = 0
    host_waits: int = 0  # times the host waited for the copy stream (too many saves queued)


class HostConnector(KVConnector):
    """Both sides of the host tier (an instance serves one `role`).

    Scheduler side: an index of block keys (`connectors/chain.py`) to slots of the host pool,
    in least-recently-used order; hits are a prompt's leading blocks past the local prefix
    hit that the index holds; saves are the full blocks a step fills that it does not.
    Entries a step saves join the index only once that step was launched (`launched`).
    Worker side: the pool, `kv_offloading_size` bytes of whole blocks pinned in
    `PIECE_BYTES` pieces when the cache is first registered (host memory: on the CPU, where it
    is the device's, sizing keeps it free); no device memory.
    """

    needs_one_chunk = False  # blocks move by copies through the cache's views

    @classmethod
    def host_buffer_bytes(cls, config: KVConnectorConfig, spec: KVCacheSpec) -> int:
        """The pool: `kv_offloading_bytes` rounded down to whole blocks per piece."""
        return num_slots(config, spec) * spec.block_bytes

    @classmethod
    def check(cls, config: KVConnectorConfig, spec: KVCacheSpec) -> None:
        if num_slots(config, spec) == 0:
            raise ValueError(f"kv_offloading_size ({config.kv_offloading_bytes / (1 << 30):g} "
                             f"GiB) holds no KV block of {spec.block_bytes} bytes; set it to at "
                             f"least {least_offloading_gib(spec):g}")

    def __init__(self, role: str, config: KVConnectorConfig, spec: KVCacheSpec,
                 model_id: str) -> None:
        super().__init__(role)
        self.check(config, spec)
        self.spec = spec
        self.block_size = spec.block_size
        self.block_shape = (spec.num_segments, *spec.block_shape)
        self.dtype = spec.dtype
        self.num_slots = num_slots(config, spec)
        self.block_bytes = spec.block_bytes
        self.slots_per_piece = max(1, PIECE_BYTES // spec.block_bytes)
        # Scheduler side.
        self.chains = BlockChains(store_namespace(model_id, spec), spec.block_size)
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> slot, least recent first
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # popped from the end
        self._pending_loads: list[BlockTransfer] = []
        self._finished_saves: list[BlockTransfer] = []  # planned by `request_finished`
        self._unlaunched: HostConnectorMetadata | None = None
        self._next_save_id = 0
        # The last MAX_SAVES_IN_FLIGHT saves (those that may still run when a step launches):
        # (save_id, blocks read, slots written).
        self._recent_saves: deque[tuple[int, set[int], set[int]]] = deque(
            maxlen=MAX_SAVES_IN_FLIGHT)
        # Worker side.
        self._caches: list[torch.Tensor] | None = None
        self._pieces: list[torch.Tensor] = []
        self._stream: torch.cuda.Stream | None = None
        self._save_events: OrderedDict[int, torch.cuda.Event] = OrderedDict()
        self.stats = HostStats()

    # -- scheduler side -----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, seq: ScheduledSeq) -> int:
        hits = self.chains.num_hit_tokens(seq, self._index.__contains__)
        # The prefix is used now, the device's hits too: a head only the device cache served
        # would be the pool's least recent block, evicted first, and every block the pool
        # keeps after it could never be a hit again.
        self._touch_prefix(seq, (seq.num_computed_tokens + hits) // self.block_size)
        return hits

    def update_state_after_alloc(self, seq: ScheduledSeq, num_external_tokens: int) -> None:
        hits = self.chains.hit_blocks(seq, num_external_tokens)
        self._pending_loads += [BlockTransfer(seq.block_table[i], key, seq.seq_id,
                                              i * self.block_size, self._index[key])
                                for i, key in hits]
        self._touch_prefix(seq, seq.num_computed_tokens // self.block_size)

    def build_connector_meta(self, seqs: Sequence[ScheduledSeq],
                             num_new_tokens: Sequence[int]) -> HostConnectorMetadata:
        self._drop_unlaunched()
        meta = HostConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        bs = self.block_size
        loading = {t.slot for t in meta.loads}
        written = {t.block_id for t in meta.loads}
        planned: set[str] = set()  # two sequences may fill the same block in one step
        for seq, num_new in zip(seqs, num_new_tokens, strict=True):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            written.update(seq.block_table[start // bs : -(-end // bs)])
            if start // bs == end // bs and start % bs:  # most decode steps: no block to save
                continue
            first, keys = self.chains.fill_keys(seq, num_new)
            # Blocks the pool holds already are used now, before any slot is taken for the
            # others: the pool makes room from what this step does not touch. (Not the block
            # before the step's, when `fill_keys` starts there: a hit, it was touched with its
            # chain, and touched alone it would outlive its parent.)
            lookback = first < start // bs
            self._touch([key for key in keys[lookback:] if key in self._index])
            fills = [(seq.block_table[i], key) for i, key in enumerate(keys, first)]
            self._plan_saves(meta, fills, loading, planned)
        meta.wait_save_id = max((save_id for save_id, blocks, slots in self._recent_saves
                                 if blocks & written or slots & loading), default=None)
        return self._number_saves(meta)

    def build_finished_meta(self) -> HostConnectorMetadata | None:
        finished, self._finished_saves = self._finished_saves, []
        self._drop_unlaunched()
        meta = HostConnectorMetadata()
        # No slot a step in flight loads from is overwritten too soon: the copy stream runs
        # these saves after what the compute stream was given (that step's loads) by then.
        self._plan_saves(meta, [(t.block_id, t.key) for t in finished], set(), set())
        return self._number_saves(meta) if meta.saves else None

    def _plan_saves(self, meta: HostConnectorMetadata, blocks: list[tuple[int, str]],
                    loading: set[int], planned: set[str]) -> None:
        """Add to `meta.saves` each `(block_id, key)` the pool lacks, to a slot of its own."""
        for block_id, key in blocks:
            if key not in self._index and key not in planned and (
                    slot := self._take_slot(loading)) is not None:
                planned.add(key)
                meta.saves.append(BlockTransfer(block_id, key, slot=slot))

    def _number_saves(self, meta: HostConnectorMetadata) -> HostConnectorMetadata:
        """Give `meta`'s saves the next `save_id` and keep `meta` as the one not launched
        yet (`launched` remembers its saves as possibly still running)."""
        if meta.saves:
            meta.save_id, self._next_save_id = self._next_save_id, self._next_save_id + 1
        self._unlaunched = meta
        return meta

    def _take_slot(self, loading: set[int]) -> int | None:
        """A free slot, else the least recently used one's (never one this step loads from);
        None where every slot is being loaded from."""
        if self._free_slots:
            return self._free_slots.pop()
        for key, slot in self._index.items():
            if slot not in loading:
                del self._index[key]
                return slot
        return None

    def launched(self, meta: KVConnectorMetadata) -> None:
        if meta is not self._unlaunched:
            return
        for t in reversed(meta.saves):  # a chain's head the most recent, as in `_touch`
            self._index[t.key] = t.slot
        if meta.saves:
            # Only now: the worker keeps the last MAX_SAVES_IN_FLIGHT saves it ran, and a plan
            # dropped unlaunched (a failed launch or step) would push a real one out of these.
            self._recent_saves.append((meta.save_id, {t.block_id for t in meta.saves},
                                       {t.slot for t in meta.saves}))
        self._unlaunched = None

    def _touch(self, keys: list[str]) -> None:
        """Mark `keys` (a chain's blocks in order) used now, its last block least recently:
        the pool evicts a chain from its end, so what stays is a prefix, still a hit (a block
        whose parent is gone can never be one)."""
        for key in reversed(keys):
            self._index.move_to_end(key)

    def _touch_prefix(self, seq: ScheduledSeq, num_blocks: int) -> None:
        """`_touch` those of `seq`'s first `num_blocks` blocks that the pool holds."""
        self._touch([key for key in self.chains.block_keys(seq, num_blocks) if key in self._index])

    def _drop_unlaunched(self) -> None:
        """The last metadata's launch failed (it is scheduled again): its slots hold nothing."""
        if self._unlaunched is not None:
            self._free_slots.extend(t.slot for t in self._unlaunched.saves)
            self._unlaunched = None

    def request_finished(self, seq: ScheduledSeq) -> None:
        if (tail := self.chains.unsaved_tail(seq)) is not None:
            index, key = tail
            self._finished_saves.append(BlockTransfer(seq.block_table[index], key))
        self.chains.forget(seq.seq_id)

    def loads_failed(self, error: KVLoadError) -> None:
        """Never called: a copy from host memory does not fail as a file read can."""

    def weights_replaced(self, model_id: str) -> None:
        """Scheduler side: every entry holds K/V of the old weights, so the index empties and
        every slot is free again (saves still queued on the device stay ordered: save ids and
        `_recent_saves` go on). Worker side: nothing; the pool stays allocated."""
        self.chains = BlockChains(store_namespace(model_id, self.spec), self.block_size)
        self._index.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pending_loads, self._finished_saves, self._unlaunched = [], [], None

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the index holds (scheduler side)."""
        return len(self._index)

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self._caches = checked_caches(kv_caches, self.block_shape, self.dtype)
        if not self._pieces:
            self._allocate_pool(kv_caches[0].device)

    def _allocate_pool(self, device: torch.device) -> None:
        pin, start = device.type == "cuda", time.perf_counter()
        nbytes, available = self.num_slots * self.block_bytes, psutil.virtual_memory().available
        if pin and nbytes > available:  # (on the CPU, sizing kept it out of the cache's budget)
            raise ValueError(f"kv_offloading_size asks for {nbytes / (1 << 30):.1f} GiB of host "
                             f"memory and {available / (1 << 30):.1f} GiB is available; lower "
                             f"kv_offloading_size")
        left = self.num_slots
        while left:
            n = min(left, self.slots_per_piece)
            # Segment first: a run of slots is contiguous in each segment, as in the cache.
            piece = _host_tensor((self.block_shape[0], n, *self.block_shape[1:]), self.dtype, pin)
            pin = pin and piece.is_pinned()  # once pinning failed (and warned), pageable
            self._pieces.append(piece)
            left -= n
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
        logger.info("KV offloading: %d blocks (%.1f GiB) of %shost memory in %.1f s",
                    self.num_slots, sum(p.nbytes for p in self._pieces) / (1 << 30),
                    "pinned " if self._pieces[0].is_pinned() else "",
                    time.perf_counter() - start)

    def unregister_kv_caches(self) -> None:
        # The pages may go next (a resize, sleep): no save may still read them.
        if self._stream is not None:
            self._stream.synchronize()
        self._save_events.clear()
        self._caches = None

    def close(self) -> None:
        self.unregister_kv_caches()  # waits for the saves still reading the cache
        self._pieces, self._stream = [], None  # the pool: kv_offloading_size of host memory

    def start_load_kv(self, meta: HostConnectorMetadata) -> None:
        caches = registered(self._caches)
        wait = meta.wait_save_id
        if wait is not None and (event := self._save_events.get(wait)) is not None:
            torch.cuda.current_stream(caches[0].device).wait_event(event)
        for blocks, piece, slots in self._runs(meta.loads):
            for i, cache in enumerate(caches):
                cache[blocks].copy_(piece[i, slots], non_blocking=True)
        self.stats.loaded_blocks += len(meta.loads)

    def wait_for_save(self, meta: HostConnectorMetadata) -> None:
        if not meta.saves:
            return
        caches = registered(self._caches)
        if self._stream is None:  # the CPU: copies in order, nothing to wait for
            self._save(caches, meta.saves)
            return
        self._stream.wait_stream(torch.cuda.current_stream(caches[0].device))
        with torch.cuda.stream(self._stream):
            self._save(caches, meta.saves)
        event = torch.cuda.Event()
        event.record(self._stream)
        self._save_events[meta.save_id] = event
        if len(self._save_events) > MAX_SAVES_IN_FLIGHT:
            self._save_events.popitem(last=False)[1].synchronize()
            self.stats.host_waits += 1

    def _save(self, caches: list[torch.Tensor], saves: list[BlockTransfer]) -> None:
        for blocks, piece, slots in self._runs(saves):
            for i, cache in enumerate(caches):
                piece[i, slots].copy_(cache[blocks], non_blocking=True)
        self.stats.saved_blocks += len(saves)

    def _runs(self, transfers: list[BlockTransfer]) -> Iterator[tuple[slice, torch.Tensor, slice]]:
        """`transfers` as runs of consecutive blocks to consecutive slots of one piece, each
        `(blocks, piece, slots)`: one copy per run and segment rather than per block."""
        spp, i = self.slots_per_piece, 0
        while i < len(transfers):
            first, j = transfers[i], i + 1
            while (j < len(transfers) and transfers[j].block_id == first.block_id + j - i
                   and transfers[j].slot == first.slot + j - i
                   and transfers[j].slot // spp == first.slot // spp):
                j += 1
            offset = first.slot % spp
            yield (slice(first.block_id, first.block_id + j - i),
                   self._pieces[first.slot // spp], slice(offset, offset + j - i))
            i = j


def num_slots(config: KVConnectorConfig, spec: KVCacheSpec) -> int:
    """Blocks of `spec` the pool of `config` holds: whole blocks in each `PIECE_BYTES` piece."""
    per_piece = max(1, PIECE_BYTES // spec.block_bytes)
    nbytes = config.kv_offloading_bytes
    whole, rest = divmod(nbytes, per_piece * spec.block_bytes)
    return whole * per_piece + rest // spec.block_bytes


def least_offloading_gib(spec: KVCacheSpec) -> float:
    """The least `kv_offloading_size` (GiB) that holds one block of `spec`, rounded up to a
    millionth of a GiB: a figure that, given back, is accepted (a rounded-down one is not)."""
    return math.ceil(spec.block_bytes * 1e6 / (1 << 30)) / 1e6


def _host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    if pin:
        try:
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as error:  # pinned memory is capped (ulimit -l, containers)
            logger.warning("KV offloading: no pinned host memory (%s); copies run from pageable "
                           "memory, slower and synchronous", error)
    return torch.empty(shape, dtype=dtype)
