"""Engines sharing one device publish what their KV caches lack (`DemandBoard`), and an idle
one gives back only that: the board's files, the governor's use of a peer's want, and two
simulated engines whose busy one gets its demand while the idle one keeps the rest."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from kvfit.elastic import DemandBoard, KVUsage

from .test_idle import HIGH, LOW, TOTAL, Engine, GiB, governor


def test_a_board_reads_its_peers_wants_not_its_own(tmp_path: Path) -> None:
    a, b, c = (DemandBoard(tmp_path, "cuda-GPU-1") for _ in range(3))
    other_device = DemandBoard(tmp_path, "cuda-GPU-2")
    assert a.peers_short_bytes() is None  # nobody has published yet
    a.publish(5 * GiB)
    b.publish(0)
    other_device.publish(7 * GiB)
    assert a.peers_short_bytes() == 0  # a peer that lacks nothing is still a peer
    assert b.peers_short_bytes() == 5 * GiB
    c.publish(3 * GiB)
    assert b.peers_short_bytes() == 8 * GiB and other_device.peers_short_bytes() is None
    a.close()
    assert b.peers_short_bytes() == 3 * GiB
    b.publish(1, now=100.0)  # changed: rewritten at once
    assert c.peers_short_bytes() == 1


def test_the_folders_a_board_makes_are_shared_by_every_user_and_sticky(tmp_path: Path) -> None:
    """The default folder (/dev/shm/kvfit-elastic) is one for the host: made with the umask's
    mode, only the first engine's user could publish there, and co-tenant engines of other
    users would share nothing. Sticky, as /tmp: none removes another's entry."""
    tmp_path.chmod(0o700)
    board = DemandBoard(tmp_path / "board", "cuda-GPU-1")
    for folder in (tmp_path / "board", board.folder):
        assert folder.stat().st_mode & 0o7777 == 0o1777
    assert tmp_path.stat().st_mode & 0o7777 == 0o700  # a folder that was there keeps its mode
    board.publish(GiB)
    assert DemandBoard(tmp_path / "board", "cuda-GPU-1").peers_short_bytes() == GiB


def test_entries_of_dead_or_silent_engines_are_ignored(tmp_path: Path) -> None:
    board = DemandBoard(tmp_path, "cpu")
    dead_pid = 2**22 + 12345  # above the kernel's pid_max: never a live process
    (board.folder / f"{dead_pid}-0").write_text(str(9 * GiB))
    silent = board.folder / f"{os.getpid()}-999"
    silent.write_text(str(4 * GiB))
    os.utime(silent, (time.time() - 60, time.time() - 60))
    (board.folder / "notes.txt").write_text("not an entry")
    assert board.peers_short_bytes() is None
    assert not (board.folder / f"{dead_pid}-0").exists()  # removed: its engine died
    os.utime(silent)  # written again: alive
    assert board.peers_short_bytes() == 4 * GiB


def test_engines_in_other_pid_namespaces_are_peers_even_under_this_engines_pid(
        tmp_path: Path) -> None:
    """Containers sharing the device and /dev/shm (`--ipc=host`) number their processes
    from 1 each: an engine there may have this one's pid, or one no process has here. Its
    entry is a peer while it is fresh, never taken for this engine's own nor removed as dead."""
    board = DemandBoard(tmp_path, "cpu")
    pid, serial, namespace = board.name.split("-")
    other = int(namespace) + 1
    dead_pid = 2**22 + 12345  # no process here
    twin = board.folder / f"{pid}-{serial}-{other}"  # this engine's pid and serial, elsewhere
    twin.write_text(str(2 * GiB))
    (board.folder / f"{dead_pid}-0-{other}").write_text(str(GiB))
    assert board.peers_short_bytes() == 3 * GiB
    board.publish(5 * GiB)
    assert twin.read_text() == str(2 * GiB)  # its own entry is another file
    os.utime(twin, (time.time() - 60, time.time() - 60))
    assert board.peers_short_bytes() == GiB  # silent: ignored by its age alone
    assert twin.exists()


def test_entries_named_by_no_possible_pid_are_removed_not_a_crash(tmp_path: Path) -> None:
    # The board's folder is shared (/dev/shm): a name no process can have must not fail the
    # engine's poll, and with it every step.
    board = DemandBoard(tmp_path, "cpu")
    names = ["99999999999999999999-0", "0-0"]
    for name in names:
        (board.folder / name).write_text(str(GiB))
    assert board.peers_short_bytes() is None
    assert not any((board.folder / name).exists() for name in names)


def test_an_unchanged_want_is_rewritten_only_to_show_the_engine_alive(tmp_path: Path) -> None:
    board = DemandBoard(tmp_path, "cpu")
    board.publish(GiB, now=0.0)
    entry = board.folder / board.name
    entry.write_text("0")  # what a rewrite would overwrite
    board.publish(GiB, now=0.5)
    assert entry.read_text() == "0"
    board.publish(GiB, now=1.5)
    assert entry.read_text() == str(GiB)


def test_a_board_it_cannot_write_shares_nothing_and_fails_nothing(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    board = DemandBoard(blocker, "cpu")  # a folder under a file: cannot be made
    board.publish(GiB)
    assert board.peers_short_bytes() is None
    board.close()
    assert "elastic_demand_dir" in caplog.text


def test_shortfall_is_the_demand_beyond_the_cache_up_to_the_budget() -> None:
    assert KVUsage(100, 90, floor=8, need_blocks=150).shortfall(budget=400) == 50
    assert KVUsage(100, 90, floor=8, need_blocks=150).shortfall(budget=120) == 20
    assert KVUsage(100, 90, floor=8, need_blocks=60).shortfall(budget=400) == 0
    assert KVUsage(100, 90, floor=8, short=True).shortfall(budget=400) == 8  # preempted
    assert KVUsage(100, 90, floor=8, short=True).shortfall(budget=100) == 0  # at its budget


def test_an_idle_cache_with_peers_gives_what_they_lack_and_keeps_the_rest() -> None:
    g, idle = governor(idle_s=1.0), KVUsage(100, used_blocks=0, floor=4)
    assert g.idle_shrink(idle, now=0.0, peers_keep=100) is None
    assert g.idle_shrink(idle, now=5.0, peers_keep=100) is None  # nobody lacks: keeps all
    assert g.idle_shrink(idle, now=5.1, peers_keep=70) == 70  # at once: idle long enough
    # The peer's want grew (its burst admitted): answered at once, still idle.
    assert g.idle_shrink(replace(idle, num_blocks=70), now=5.2, peers_keep=40) == 40
    assert g.idle_shrink(replace(idle, num_blocks=40), now=5.3, peers_keep=1) == 4  # the floor
    assert g.idle_shrink(KVUsage(100, 30, floor=4), now=9.0, peers_keep=10) is None  # busy
    # A give to its own use plus headroom (no peer asking) starts a new idle spell.
    g = governor(idle_s=1.0)
    assert g.idle_shrink(idle, now=0.0) is None and g.idle_shrink(idle, now=1.0) == 4
    assert g.idle_shrink(KVUsage(40, 0, floor=4), now=1.1, peers_keep=10) is None
    assert g.idle_shrink(KVUsage(40, 0, floor=4), now=2.1, peers_keep=10) == 10


@dataclass
class BoardEngine(Engine):
    """`test_idle.Engine` on a demand board, wanting `demand` blocks when busy."""

    board: DemandBoard | None = None
    demand: int = 0

    def usage(self) -> KVUsage:
        need = self.demand if self.busy else 0
        return KVUsage(self.blocks, min(need, self.blocks), floor=2,
                       short=self.busy and self.blocks < need, need_blocks=need)

    def publish(self, usage: KVUsage, now: float) -> None:
        """What `KVCacheResizer._publish_demand` does, in whole blocks."""
        self.board.publish(usage.shortfall(self.budget) * GiB, now)

    def peers_keep(self, usage: KVUsage, now: float, spare: int) -> int | None:
        """What `KVCacheResizer.govern` does with the board before deciding, in whole blocks:
        say what this cache lacks, and keep what the peers need not have from it; a busy
        cache keeps its demand plus one sequence (its live blocks lie at the front)."""
        self.publish(usage, now)
        if usage.short:
            return None
        peers = self.board.peers_short_bytes()
        if peers is None:
            return None
        give = -(-max(0, peers - spare) // GiB)
        keep = self.blocks - (give if give >= usage.floor else 0)
        return keep if usage.is_low else max(keep, usage.demand_blocks + usage.floor)


@pytest.mark.parametrize("demand", [30, 60, 85])
def test_the_idle_engine_keeps_what_the_busy_one_does_not_need(tmp_path: Path,
                                                              demand: int) -> None:
    """Alternating load, 90 GiB of caches between two engines: the busy one reaches its
    demand (or what the device holds), the idle one gives no more than that and keeps the rest
    of its cache (its prefix cache with it), and free memory stays above the low watermark."""
    a, b = (BoardEngine(governor(idle_s=0.5, min_interval_s=2.0), blocks=42, budget=85,
                        board=DemandBoard(tmp_path, "gpu"), demand=demand) for _ in range(2))
    other = 10 * GiB
    now, dt = 0.0, 0.1
    for phase in range(4):
        busy, idle = (a, b) if phase % 2 == 0 else (b, a)
        busy.busy, idle.busy = True, False
        while now < (phase + 1) * 20.0:
            for engine in (a, b):
                free = TOTAL - other - (a.blocks + b.blocks) * GiB
                engine.poll_free(free, now)
            now += dt
        free = TOTAL - other - (a.blocks + b.blocks) * GiB
        assert busy.blocks >= min(demand, 85 - 4), (phase, a.blocks, b.blocks)
        # The busy one took what it needs, not the device; the idle one kept the rest (each
        # within the band's width). Without the board: 82 and 2 blocks at every demand.
        need = max(demand, 42)
        assert busy.blocks <= need + HIGH // GiB, (phase, a.blocks, b.blocks)
        assert idle.blocks >= 90 - need - HIGH // GiB, (phase, a.blocks, b.blocks)
        assert free >= LOW
