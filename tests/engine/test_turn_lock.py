"""`TurnLock`: a release with threads waiting hands the lock to the first of them, so a thread
that releases and takes it again at once (`LLM.generate`, a step at a time) cannot keep another
thread's call waiting (a plain RLock let a `shutdown` wait out a whole run on a busy machine)."""

from __future__ import annotations

import threading
import time

import pytest

from kvfit.engine.turn_lock import TurnLock


def _wait_for_waiters(lock: TurnLock, n: int) -> None:
    deadline = time.monotonic() + 30
    while len(lock._waiters) < n:
        assert time.monotonic() < deadline, "the other threads never queued"
        time.sleep(0.001)


def test_a_release_hands_the_lock_to_the_waiting_thread_before_the_releaser_takes_it_again(
) -> None:
    lock, order = TurnLock(), []

    def other(name: str) -> None:
        with lock:
            order.append(name)

    lock.acquire()
    threads = [threading.Thread(target=other, args=(name,)) for name in ("b", "c")]
    for i, thread in enumerate(threads):
        thread.start()
        _wait_for_waiters(lock, i + 1)
    lock.release()
    lock.acquire()  # queued behind b and c: they run first, in the order they came
    order.append("a")
    lock.release()
    for thread in threads:
        thread.join(30)
    assert order == ["b", "c", "a"]
    assert lock._owner is None and not lock._waiters


def test_the_owner_takes_it_again_while_others_wait_and_only_the_owner_releases() -> None:
    lock, got = TurnLock(), threading.Event()

    def other() -> None:
        with lock:
            got.set()

    with lock:
        thread = threading.Thread(target=other)
        thread.start()
        _wait_for_waiters(lock, 1)
        with lock:  # reentrant: `chat` calls `generate` under it
            assert lock._depth == 2
        assert not got.is_set()  # still held once
    thread.join(30)
    assert got.is_set()
    with pytest.raises(RuntimeError, match="does not hold it"):
        lock.release()
