"""What the KV caches of kvfit engines sharing one device lack, shared between them: each
elastic engine publishes the bytes its cache is short of, and an idle one gives back what the
others lack rather than its whole cache, keeping the rest (its prefix cache with it) for its
next burst. Device free memory alone cannot say this: a busy engine that cannot grow leaves
free memory where it was, so nothing tells an idle co-tenant how much it needs.

The board is a folder per device (`<root>/<device key>/`) holding one small file per engine,
named by its process id, a sequence number and its pid namespace, holding the bytes it is
short of. Files are written whole (a temporary file renamed over the old one) and read by
listing the folder: no lock, no daemon. An entry is ignored once its process is gone (and
removed) or once it was not rewritten for `STALE_S` (an engine that hangs stops asking).

Containers that share the device and /dev/shm (`--ipc=host`) each number their processes from
1: the namespace in the name keeps two engines with one pid apart, and a process id is
looked up only for an entry of this namespace (another's pid means nothing here: its entry
lives by its age alone).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_DEMAND_DIR = "/dev/shm/kvfit-elastic" if os.path.isdir("/dev/shm") else None
REFRESH_S = 1.0
"""An unchanged entry is rewritten this often, so that its age says the engine is alive."""
STALE_S = 5.0
"""An entry older than this is ignored: its engine stopped polling."""
_ENTRY = re.compile(r"^(\d+)-(\d+)(?:-(\d+))?$")  # pid-serial[-pid namespace]
_serial = itertools.count()


class DemandBoard:
    """One engine's entry on its device's board, and its view of the other entries.

    `device_key` names the physical device (a GPU's UUID), so engines that see it under other
    indices still meet. Every file operation's failure is logged once and the board then
    reads as having no peers: sharing demand is an optimisation, never a reason to fail."""

    def __init__(self, root: str | Path, device_key: str) -> None:
        self.folder = Path(root) / re.sub(r"[^A-Za-z0-9_.-]", "_", device_key)
        self.name = f"{os.getpid()}-{next(_serial)}-{_PID_NAMESPACE}"
        self._published: tuple[int, float] | None = None  # (bytes, when)
        self._broken = False
        try:
            _make_shared(Path(root))
            _make_shared(self.folder)
        except OSError as error:
            self._fail("create", error)

    def publish(self, short_bytes: int, now: float | None = None) -> None:
        """Say this engine's cache is `short_bytes` short (0: it has what it needs). Writes
        only when the figure changed or `REFRESH_S` passed."""
        now = time.monotonic() if now is None else now
        last = self._published
        if self._broken or (last and last[0] == short_bytes and now - last[1] < REFRESH_S):
            return
        path, tmp = self.folder / self.name, self.folder / f".{self.name}.tmp"
        try:
            tmp.write_text(str(int(short_bytes)))
            tmp.replace(path)
        except OSError as error:
            self._fail("write", error)
            return
        self._published = (short_bytes, now)

    def peers_short_bytes(self) -> int | None:
        """What the other live engines on the device lack in all, in bytes; None when there
        is no other (an idle engine then gives back as if alone)."""
        if self._broken:
            return None
        try:
            entries = list(os.scandir(self.folder))
        except OSError as error:
            self._fail("list", error)
            return None
        total, peers, wall = 0, 0, time.time()
        for entry in entries:
            match = _ENTRY.match(entry.name)
            if match is None or entry.name == self.name:
                continue
            try:
                here = match[3] is None or int(match[3]) == _PID_NAMESPACE
                if here and not _alive(int(match[1])):
                    os.unlink(entry.path)  # its engine died without closing
                    continue
                if wall - entry.stat().st_mtime > STALE_S:
                    continue
                short = int(Path(entry.path).read_text() or 0)
            except (OSError, ValueError):
                continue  # removed or rewritten under us: it is read at the next poll
            peers += 1
            total += max(0, short)
        return total if peers else None

    def close(self) -> None:
        """Remove this engine's entry (it no longer shares the device)."""
        if not self._broken:
            try:
                (self.folder / self.name).unlink(missing_ok=True)
            except OSError as error:
                self._fail("remove an entry from", error)

    def _fail(self, what: str, error: OSError) -> None:
        self._broken = True
        logger.warning("elastic KV cache: cannot %s the demand board in %s (%s); engines on "
                       "this device will not share their demand (set elastic_demand_dir to a "
                       "writable folder)", what, self.folder, error)


def _pid_namespace() -> int:
    """This process's pid namespace (its inode), 0 where /proc does not say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PID_NAMESPACE = _pid_namespace()


def _make_shared(folder: Path) -> None:
    """Create `folder` (and its parents) if missing, writable by every user and sticky, as
    /tmp is: engines of other users on the device meet in it (with the umask's mode, the first
    engine's user would be the only one able to publish), and none can remove another's
    entry. A folder that exists keeps its mode: whoever made it chose it."""
    try:
        folder.mkdir(parents=True)
    except FileExistsError:
        return
    with contextlib.suppress(OSError):  # sharing across users is a bonus, never a failure
        folder.chmod(0o1777)


def _alive(pid: int) -> bool:
    if pid <= 0:  # kill(0) would signal this process's own group: never an engine's pid
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # too large for a pid_t: no such process
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True
