"""`ChannelRouter`: one engine process serving several API server processes
(`kvfit serve --api-server-count N`), one channel (pipe) each.

The engine core loop knows nothing of channels: commands from every channel go into its one
queue, and each `EngineOutputs` it sends is split here, each request's deltas and errors and
each call's result to the channel that sent it, the engine-wide state (stats, sleep state, KV
report) to every live channel. Call ids are each API process's own counter, so they collide
across channels: they are remapped to engine-wide ids on the way in and back on the way out.

Channel 0 (the API process that owns the engine) is live from the start; another channel is
live once it attaches (`attach`), after it has been sent `EngineReady`: nothing queues up for
an API process that has not started reading yet. Thread-safe: commands arrive on one reader
thread per channel, outputs on the engine's thread.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from kvfit.engine.engine_core import EngineStats
from kvfit.server.engine_messages import EngineOutputs


class ChannelRouter:
    """Which channel each request and call came from, and the split of outputs by channel."""

    def __init__(self, num_channels: int, stats: EngineStats, is_sleeping: bool) -> None:
        self.num_channels = num_channels
        self._live = [i == 0 for i in range(num_channels)]
        self._closed = [False] * num_channels
        self._owner: dict[str, int] = {}  # request id -> channel
        self._calls: dict[int, tuple[int, int]] = {}  # engine call id -> (channel, its id)
        self._call_ids = itertools.count()
        self._stats, self._is_sleeping = stats, is_sleeping  # for replies of the router's own
        self._lock = threading.Lock()

    def attach(self, channel: int) -> None:
        """`channel` has been sent `EngineReady`: from now on it gets every output of its own
        and the engine-wide state."""
        with self._lock:
            if not self._closed[channel]:
                self._live[channel] = True

    def is_live(self, channel: int) -> bool:
        return self._live[channel]

    def command(self, channel: int, command: tuple[Any, ...]
                ) -> tuple[tuple[Any, ...] | None, EngineOutputs | None]:
        """`(for the engine, reply to the channel)`: the command as the engine loop takes it
        (None: nothing to run), and the router's own answer to `channel`, if any (a request
        id already running for another channel is refused). A `stop` stops the engine only
        from channel 0, the engine's owner (another channel's reader detaches it)."""
        kind = command[0]
        with self._lock:
            if kind == "add":
                request_id = command[1]
                owner = self._owner.get(request_id)
                if owner is not None:
                    error = ValueError(f"request_id {request_id!r} is already running; use "
                                       f"another")
                    return None, EngineOutputs([], [], [(request_id, error)], self._stats,
                                               self._is_sleeping)
                self._owner[request_id] = channel
                return command, None
            if kind == "abort":
                # Only a request of its own: another API process's requests are not its to end.
                return (command if self._owner.get(command[1]) == channel else None), None
            if kind == "call":
                call_id = next(self._call_ids)
                self._calls[call_id] = (channel, command[1])
                return ("call", call_id, *command[2:]), None
        if kind == "stop":  # from another channel, its reader detaches it instead
            return (command if channel == 0 else None), None
        raise ValueError(f"unknown engine command {kind!r}")

    def detach(self, channel: int) -> list[tuple[Any, ...]]:
        """`channel` closed: the commands that abort its requests (and stop the engine once
        every channel has closed). Its later outputs are dropped."""
        with self._lock:
            self._live[channel], self._closed[channel] = False, True
            mine = [rid for rid, owner in self._owner.items() if owner == channel]
            for request_id in mine:
                del self._owner[request_id]
            for call_id in [c for c, (owner, _) in self._calls.items() if owner == channel]:
                del self._calls[call_id]
            commands: list[tuple[Any, ...]] = [("abort", rid) for rid in mine]
            if all(self._closed):
                commands.append(("stop",))
        return commands

    def route(self, outputs: EngineOutputs) -> list[tuple[int, EngineOutputs]]:
        """`(channel, message)` for every live channel: its own part of `outputs` with the
        engine-wide state. A delta, error or result of an unknown id (its channel closed) is
        dropped."""
        n = self.num_channels
        tokens: list[list[Any]] = [[] for _ in range(n)]
        deltas: list[list[Any]] = [[] for _ in range(n)]
        errors: list[list[Any]] = [[] for _ in range(n)]
        results: list[list[Any]] = [[] for _ in range(n)]
        with self._lock:
            owner = self._owner
            for delta in outputs.tokens:
                if (channel := owner.get(delta[0])) is not None:
                    tokens[channel].append(delta)
            for delta in outputs.outputs:
                # A finished delta is the request's last message.
                channel = owner.pop(delta[0], None) if delta[2] else owner.get(delta[0])
                if channel is not None:
                    deltas[channel].append(delta)
            for request_id, error in outputs.errors:
                if (channel := owner.pop(request_id, None)) is not None:
                    errors[channel].append((request_id, error))
            for call_id, result, error in outputs.results:
                if (call := self._calls.pop(call_id, None)) is not None:
                    results[call[0]].append((call[1], result, error))
            self._stats, self._is_sleeping = outputs.stats, outputs.is_sleeping
            live = list(self._live)
        return [(i, EngineOutputs(tokens[i], deltas[i], errors[i], outputs.stats,
                                  outputs.is_sleeping, outputs.kv_cache_report, results[i]))
                for i in range(n) if live[i]]
