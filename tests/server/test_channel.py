"""The engine process's pipe: framed messages, and an outbox that never blocks its caller."""

from __future__ import annotations

import multiprocessing
import threading

import pytest

from kvfit.server.engine_client import _Channel, _Outbox


def test_send_many_arrives_as_separate_messages_in_order() -> None:
    a, b = multiprocessing.Pipe()
    sender, receiver = _Channel(a), _Channel(b)
    sender.send_many([("add", i, list(range(i))) for i in range(50)])
    sender.send(("stop",))
    got: list = []
    while not got or got[-1] != ("stop",):
        got += receiver.receive()
    assert got == [("add", i, list(range(i))) for i in range(50)] + [("stop",)]


def test_the_outbox_never_blocks_on_a_full_pipe_and_delivers_everything() -> None:
    """A peer that reads nothing for a while (an engine in a long step): 8 MB of commands,
    far over a socket's buffer, queue at once; once the peer reads, all arrive in order and
    `close` sends what was left."""
    a, b = multiprocessing.Pipe()
    outbox, receiver = _Outbox(_Channel(a)), _Channel(b)
    commands = [("add", str(i), list(range(1000))) for i in range(1000)]  # ~8 KB each
    queuing = threading.Thread(target=lambda: [outbox.put(c) for c in commands], daemon=True)
    queuing.start()
    queuing.join(timeout=2)
    assert not queuing.is_alive()  # a blocking write would wait for the reader
    outbox.put(("stop",))
    got: list = []

    def read() -> None:
        while not got or got[-1] != ("stop",):
            got.extend(receiver.receive())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    outbox.close(timeout=30)
    reader.join(timeout=30)
    assert got == [*commands, ("stop",)]
    with pytest.raises(OSError, match="closed"):
        outbox.put(("add", "late", []))


def test_the_outbox_stops_after_a_failed_write() -> None:
    a, b = multiprocessing.Pipe()
    outbox = _Outbox(_Channel(a))
    b.close()  # the engine process is gone
    outbox.put(("add", "x", [1]))
    outbox.close(timeout=5)
    assert not outbox._thread.is_alive()


def test_a_command_that_does_not_pickle_is_dropped_and_the_rest_still_go() -> None:
    # Found by the hunt: it stopped the outbox's thread, and every later command (every
    # request) waited forever.
    a, b = multiprocessing.Pipe()
    outbox, receiver = _Outbox(_Channel(a)), _Channel(b)
    outbox.put(("add", "before", [1]))
    outbox.put(("call", 0, lambda llm: None, ()))
    outbox.put(("add", "after", [2]))
    outbox.put(("stop",))
    got: list = []
    while not got or got[-1] != ("stop",):
        assert b.poll(10), f"only {got} arrived"
        got += receiver.receive()
    assert got == [("add", "before", [1]), ("add", "after", [2]), ("stop",)]
    outbox.put(("add", "later", [3]))  # the thread serves on
    assert b.poll(10) and receiver.receive() == [("add", "later", [3])]
    outbox.close(timeout=5)
