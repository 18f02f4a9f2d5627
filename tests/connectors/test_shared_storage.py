"""The shared-storage connector's worker side without an engine: a store that cannot take a
save warns once with the cause, then at most once per interval with a count."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvfit.connectors import BlockTransfer, KVConnectorConfig, KVConnectorMetadata
from kvfit.connectors.shared_storage import SAVE_WARNING_INTERVAL_S, SharedStorageConnector
from kvfit.engine.engine_core import EngineStats
from kvfit.engine.metrics import engine_metrics
from kvfit.kv.report import KVCacheReport
from kvfit.kv.spec import KVCacheSpec

SPEC = KVCacheSpec(num_layers=2, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float32)
BLOCKS_PER_STEP = 3


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker_side(root: Path, clock: Clock) -> SharedStorageConnector:
    conn = SharedStorageConnector("worker", KVConnectorConfig("shared_storage", str(root)),
                                  SPEC, "model", clock=clock)
    conn.register_kv_caches([torch.zeros(16, *SPEC.block_shape, dtype=SPEC.dtype)])
    return conn


def step(conn: SharedStorageConnector, n: int) -> None:
    """One step's saves: blocks of keys never saved before (a new prompt each step)."""
    conn.wait_for_save(KVConnectorMetadata(saves=[
        BlockTransfer(i, f"{n:032x}{i:032x}") for i in range(BLOCKS_PER_STEP)]))


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_failing_store_warns_once_with_its_cause_then_once_per_interval(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")  # every save fails: its "directory" is a file
    clock = Clock()
    conn = worker_side(not_a_dir, clock)
    caplog.set_level(logging.WARNING, logger="kvfit.connectors.shared_storage")

    step(conn, 0)
    [first] = warnings(caplog)
    assert f"could not save {BLOCKS_PER_STEP} block(s)" in first and "Not a directory" in first

    for n in range(1, 30):  # a step per second: within the interval, silent
        clock.now = float(n)
        step(conn, n)
    assert len(warnings(caplog)) == 1
    clock.now = SAVE_WARNING_INTERVAL_S
    step(conn, 30)
    summary = warnings(caplog)[1]
    assert f"{30 * BLOCKS_PER_STEP} block(s) not saved" in summary and "last 30 s" in summary
    assert conn.stats.failed_saves == conn.num_failed_saves() == 31 * BLOCKS_PER_STEP
    assert conn.stats.saved_blocks == 0

    # The store works again: a quiet interval ends the episode without a line, and the next
    # failure is warned about at once, with its cause.
    conn.root = tmp_path
    clock.now = 2 * SAVE_WARNING_INTERVAL_S
    step(conn, 31)
    assert conn.stats.saved_blocks == BLOCKS_PER_STEP and len(warnings(caplog)) == 2
    conn.root = not_a_dir
    clock.now += 1
    step(conn, 32)
    assert len(warnings(caplog)) == 3 and "could not save" in warnings(caplog)[2]


def test_failed_saves_and_store_hits_are_metrics_only_with_a_connector() -> None:
    report = KVCacheReport(method="measured", total=1, budget=1, weights=0, non_torch=0,
                           transient=0, margin=0, committed_bytes=0, num_blocks=1)
    stats = EngineStats(0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0)
    names = {"kvfit:kv_connector_failed_saves": 7.0, "kvfit:kv_connector_hit_tokens": 48.0}
    assert not names.keys() & {m.name for m in engine_metrics(stats, report)}
    stats = EngineStats(0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, kv_connector_failed_saves=7,
                        kv_connector_hit_tokens=48)
    assert {m.name: (m.kind, m.value) for m in engine_metrics(stats, report)
            if m.name in names} == {name: ("counter", v) for name, v in names.items()}


def test_the_metric_names_architecture_md_gives_are_those_metrics_exposes() -> None:
    # It named the connector's counters without the `_total` that /metrics gives a counter.
    report = KVCacheReport(method="measured", total=1, budget=1, weights=0, non_torch=0,
                           transient=0, margin=0, committed_bytes=0, num_blocks=1)
    stats = EngineStats(0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, kv_connector_failed_saves=0,
                        kv_connector_hit_tokens=0)
    exposed = {m.name + ("_total" if m.kind == "counter" else "")
               for m in engine_metrics(stats, report)}
    doc = (Path(__file__).resolve().parents[2] / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`(kvfit:\w+)", doc))
    assert named and named <= exposed, named - exposed


def test_a_block_a_decode_fills_with_a_pending_token_is_saved_by_the_next_step(
        tmp_path: Path) -> None:
    # With a step in flight, a decode computes the token that step samples (read on the
    # device; -1 on the host): its block's key is known one step later, and so is its save.
    @dataclass
    class Seq:
        seq_id: int
        token_ids: list[int]
        block_table: list[int]
        num_computed_tokens: int = 0

    bs = SPEC.block_size
    conn = SharedStorageConnector("scheduler", KVConnectorConfig("shared_storage",
                                                                 str(tmp_path)), SPEC, "model")
    seq = Seq(0, list(range(bs - 1)), [3, 4])
    assert conn.build_connector_meta([seq], [bs - 1]).saves == []  # the prefill: no full block
    seq.num_computed_tokens = bs - 1
    seq.token_ids.append(-1)  # the prefill's sample, pending
    assert conn.build_connector_meta([seq], [1]).saves == []  # fills block 0 with it
    seq.num_computed_tokens += 1
    seq.token_ids[-1] = 7  # the prefill's output arrived
    seq.token_ids.append(-1)  # the decode's sample, pending
    [save] = conn.build_connector_meta([seq], [1]).saves
    assert (save.block_id, save.key) == (3, conn.keys_for([*range(bs - 1), 7])[0])
