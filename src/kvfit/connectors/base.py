"""The KV connector API: how the engine hands KV blocks to and takes them from a store outside
it, split as in vLLM v1 into a scheduler side and a worker side.

The scheduler side runs in the engine. When a sequence starts, it says how many of its prompt
tokens the store holds beyond the local prefix-cache hit (`get_num_new_matched_tokens`); once
blocks are allocated it plans their loads (`update_state_after_alloc`), and each step it
builds the step's `KVConnectorMetadata` (loads, plus saves of the blocks the step fills); when
a sequence finishes, the saves of the block its last step filled but could not name
(`request_finished`, `build_finished_meta`), run before the block is handed out again. The
worker side runs beside each device's cache: it registers the cache's memory
(`register_kv_caches`) and moves the blocks that metadata names, loads before the step's
forward (`start_load_kv`), saves after it (`wait_for_save`).

The connector only sees plain block ids, token ids and tensors: it knows nothing of the
engine's classes (`ScheduledSeq` is the little it reads from a sequence).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from kvfit.kv.spec import KVCacheSpec

if TYPE_CHECKING:
    from kvfit.connectors.config import KVConnectorConfig

ROLES = ("scheduler", "worker")


class ScheduledSeq(Protocol):
    """What a connector reads from one of the engine's sequences."""

    seq_id: int
    token_ids: list[int]
    block_table: list[int]
    num_computed_tokens: int


@dataclass(frozen=True)
class BlockTransfer:
    """One block to move: cache block `block_id` <-> the stored block named `key` (at `slot`,
    for a store that keeps blocks at positions of its own). For a load, `seq_id` and
    `first_token` say which sequence's tokens from where the block holds (what to recompute if
    it cannot be loaded)."""

    block_id: int
    key: str
    seq_id: int = -1
    first_token: int = 0
    slot: int = -1


@dataclass
class KVConnectorMetadata:
    """What the scheduler side asks the worker side to do in one step: `loads` before the
    forward, `saves` after it."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


class KVLoadError(RuntimeError):
    """Blocks a step was to load could not be (corrupt, truncated, gone). Raised before the
    step's forward runs: the engine recomputes each sequence from its first lost token
    (`first_lost_token`: seq_id -> token index) and tells the scheduler side (`bad_keys`)."""

    def __init__(self, first_lost_token: dict[int, int], bad_keys: set[str]) -> None:
        super().__init__(f"{len(bad_keys)} KV block(s) could not be loaded from the store; "
                         f"recomputing them")
        self.first_lost_token = first_lost_token
        self.bad_keys = bad_keys

    def __reduce__(self) -> tuple[type[KVLoadError], tuple[dict[int, int], set[str]]]:
        # Rebuilt from its fields where it crosses a pipe (the multiprocess executor's worker
        # raises it), not from the message its args hold: the engine reads the fields.
        return type(self), (self.first_lost_token, self.bad_keys)


def checked_caches(kv_caches: list[torch.Tensor], shape: tuple[int, ...],
                   dtype: torch.dtype) -> list[torch.Tensor]:
    """`kv_caches` as a worker side registers them, once each is `[blocks, *block_shape]` of
    `dtype` with as many blocks as the others and one per segment (`shape`:
    `(num_segments, *block_shape)`); `ValueError` otherwise."""
    num_segments, *block_shape = shape
    if len(kv_caches) != num_segments or any(
            tuple(c.shape[1:]) != tuple(block_shape) or c.dtype != dtype
            or c.shape[0] != kv_caches[0].shape[0] for c in kv_caches):
        raise ValueError(f"expected {num_segments} caches of [blocks, *{block_shape}] {dtype}, "
                         f"got {[(tuple(c.shape), c.dtype) for c in kv_caches]}")
    return list(kv_caches)


def registered(kv_caches: list[torch.Tensor] | None) -> list[torch.Tensor]:
    """A worker side's registered caches; `RuntimeError` while there are none."""
    if kv_caches is None:
        raise RuntimeError("the KV connector has no cache registered (the engine is asleep "
                           "or startup did not finish)")
    return kv_caches


class KVConnector(ABC):
    """A connector of one role (`"scheduler"` in the engine, `"worker"` beside each cache);
    each instance serves its own role's methods only."""

    needs_one_chunk: bool = True
    """Whether each segment of the registered cache must be one physical allocation, as memory
    registered with hardware outside the GPU (RDMA) must be: such a cache is resized by
    recommitting it whole, which preempts every sequence. A connector that moves blocks with
    copies through the cache's views says False, and the elastic cache keeps its cheap
    resizes (the views are registered again after each)."""

    @classmethod
    def host_buffer_bytes(cls, config: KVConnectorConfig, spec: KVCacheSpec) -> int:
        """The most host memory the worker side allocates for a cache of `spec` once it runs
        (after the cache was sized): on the CPU, whose host memory is the device's, sizing
        keeps it free. 0 for a connector that allocates none."""
        return 0

    @classmethod
    def check(cls, config: KVConnectorConfig, spec: KVCacheSpec) -> None:
        """Raise ValueError naming the setting where `config` cannot serve a cache of `spec`;
        the engine asks as its config is made, before a model loads and warms up."""
        return None  # the store takes blocks of any size

    def __init__(self, role: str) -> None:
        if role not in ROLES:
            raise ValueError(f"KV connector role must be one of {ROLES}, got {role!r}")
        self.role = role

    # -- scheduler side -----------------------------------------------------------------------

    @abstractmethod
    def get_num_new_matched_tokens(self, seq: ScheduledSeq) -> int:
        """Tokens past `seq.num_computed_tokens` (the local hit, block aligned) whose K/V the
        store holds, in whole blocks; never the last token (it is sampled from)."""

    @abstractmethod
    def update_state_after_alloc(self, seq: ScheduledSeq, num_external_tokens: int) -> None:
        """`seq` holds blocks for its `num_external_tokens` store hits (the ones right before
        its `num_computed_tokens`, which already counts them): plan their loads."""

    @abstractmethod
    def build_connector_meta(self, seqs: Sequence[ScheduledSeq],
                             num_new_tokens: Sequence[int]) -> KVConnectorMetadata:
        """The step's loads (everything planned since the last call) and saves (the blocks
        this step fills). Sequence i computes `num_new_tokens[i]` tokens from its
        `num_computed_tokens`."""

    @abstractmethod
    def launched(self, meta: KVConnectorMetadata) -> None:
        """The step `meta` was built for was launched: its saves will land. (A launch that
        fails, a device out of memory, is scheduled again with new metadata.)"""

    @abstractmethod
    def request_finished(self, seq: ScheduledSeq) -> None:
        """`seq` is done (its blocks are freed next); forget what was kept for it, and plan
        the save of its last full block where no step could save it: the step that filled it
        was built while the block's last token was still being sampled, and none of `seq`
        followed (`BlockChains.unsaved_tail`). `build_finished_meta` hands the plan out."""

    @abstractmethod
    def build_finished_meta(self) -> KVConnectorMetadata | None:
        """The saves `request_finished` planned since the last call, which the engine has the
        worker side run at once, outside a step (before a step can hand their freed blocks
        out again), then reports `launched`; None where there are none. A plan the engine
        drops (a failed step: the blocks' K/V may not be written) is dropped by taking it."""

    @abstractmethod
    def weights_replaced(self, model_id: str) -> None:
        """The model's weights changed in place (`LLM.load_weights`, a wake that reloaded
        changed files, `reset_prefix_cache(reset_connector=True)`): name blocks in
        `model_id`'s namespace from now on, so that no block stored for the old weights is
        offered as a hit or stands in for one of the new, and the new weights' blocks are
        saved and found again. Called on both sides between steps, with no request holding
        KV blocks (requests may wait, to be computed from their start); saves launched
        before it may still run on the device."""

    @abstractmethod
    def loads_failed(self, error: KVLoadError) -> None:
        """The worker side could not load `error.bad_keys`: stop offering them as hits and let
        saves replace them."""

    # -- worker side --------------------------------------------------------------------------

    @abstractmethod
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Take the cache's memory: per segment `[num_blocks, *block_shape]`, each storage
        exactly the backed bytes (`ExtensibleKVCache.committed_views`)."""

    @abstractmethod
    def unregister_kv_caches(self) -> None:
        """Let go of the registered memory (before sleep releases the pages)."""

    def close(self) -> None:
        """Let go of the registered memory and free what the worker side allocated (host
        buffers, threads): the engine shut down, and another may start in this process and
        need that memory. Idempotent."""
        self.unregister_kv_caches()

    @abstractmethod
    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Load `meta.loads` into the registered cache before the step's forward reads them;
        raises `KVLoadError` for blocks it could not load (after loading the rest)."""

    @abstractmethod
    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Save `meta.saves` once the step's forward has written them. Returns when they are
        done, or, for copies ordered on the device, once they are queued (the connector then
        orders whatever reads or overwrites them after them)."""

    def num_failed_saves(self) -> int:
        """Blocks `wait_for_save` could not save since startup (for the engine's metrics);
        0 for a connector that does not count them."""
        return 0
