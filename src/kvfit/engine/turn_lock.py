"""A reentrant lock granted in arrival order, for `LLM`'s calls from several threads.

`LLM.generate` steps the engine under the lock one step at a time, so that other threads' calls
(`shutdown`, `sleep`, another `generate`) act between two steps. A plain `threading.RLock`
does not make that happen: the stepping thread releases it and takes it again within
microseconds, before a waiter is even scheduled, so on a busy machine the waiter can wait out
the whole run. Here a release with threads waiting hands the lock to the first of them.
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType


class TurnLock:
    """A reentrant lock whose release hands it to the longest-waiting thread (FIFO)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards the fields below, held for a few operations
        self._owner: int | None = None
        self._depth = 0
        self._waiters: deque[tuple[int, threading.Lock]] = deque()

    def acquire(self) -> None:
        me = threading.get_ident()
        with self._mutex:
            if self._owner == me or (self._owner is None and not self._waiters):
                self._owner, self._depth = me, self._depth + 1
                return
            turn = threading.Lock()
            turn.acquire()
            self._waiters.append((me, turn))
        try:
            turn.acquire()  # released by the owner's `release`, which made this thread owner
        except BaseException:  # interrupted while waiting (Ctrl-C): leave the queue cleanly
            with self._mutex:
                if (me, turn) in self._waiters:
                    self._waiters.remove((me, turn))
                    raise
            self.release()  # the turn came meanwhile: pass it on
            raise

    def release(self) -> None:
        with self._mutex:
            if self._owner != threading.get_ident():
                raise RuntimeError("TurnLock.release() by a thread that does not hold it")
            self._depth -= 1
            if self._depth:
                return
            if self._waiters:
                self._owner, turn = self._waiters.popleft()
                self._depth = 1
                turn.release()
            else:
                self._owner = None

    def __enter__(self) -> TurnLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
