"""Sleep mode's vocabulary: what a sleep released and kept (`SleepReport`), and what is asleep
now (`SleepState`). The mechanics live with what they touch: the worker's weight arena and KV
cache, the engine's draining of requests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

TAGS = ("weights", "kv_cache")
"""What `wake_up(tags=...)` can wake, each on its own."""
LEVELS = (1, 2)
MODES = ("wait", "abort")


class WakeUpOutOfMemoryError(RuntimeError):
    """`wake_up` found no device memory for the weights; they stay asleep (the KV cache too)
    until a later `wake_up` finds it. (The KV cache's own shortfall is a
    `KVCacheResizeError`.)"""


@dataclass(frozen=True)
class SleepReport:
    """What one `sleep` did on a worker, in bytes by kind (the engine's: summed over its
    workers, `merge`).

    `released`: device memory handed back (`kv_cache`, `weights`, `torch_cache`: what torch's
    caching allocator held idle). `kept`: what stays resident on the device (`buffers` such as
    rotary tables; `torch`: torch's live allocations, i.e. graph pools, graph inputs, buffers,
    which cannot go without invalidating the graphs; a `kv_cache` or `weights` that could not be
    released). `host_bytes`: the weights' host copy (level 1). On the CPU the device is the
    host: `torch` is not measured there.
    """

    level: int
    released: dict[str, int] = field(default_factory=dict)
    kept: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0

    @property
    def released_bytes(self) -> int:
        return sum(self.released.values())

    @property
    def kept_bytes(self) -> int:
        return sum(self.kept.values())

    @staticmethod
    def merge(reports: Iterable[SleepReport]) -> SleepReport:
        """The engine's report over its workers: each kind summed (every device's memory, and
        the host copies, which tensor-parallel ranks on one host all keep there)."""
        reports = list(reports)
        released: dict[str, int] = {}
        kept: dict[str, int] = {}
        for report in reports:
            for total, part in ((released, report.released), (kept, report.kept)):
                for kind, nbytes in part.items():
                    total[kind] = total.get(kind, 0) + nbytes
        return SleepReport(reports[0].level, released, kept,
                           sum(r.host_bytes for r in reports))


@dataclass(frozen=True)
class SleepState:
    """What is asleep: the KV cache's pages, the weights' pages, and the weights that were
    woken without contents and not loaded since (generation refuses to run until they are)."""

    kv_cache_asleep: bool = False
    weights_asleep: bool = False
    missing_weights: tuple[str, ...] = ()

    @property
    def is_sleeping(self) -> bool:
        return self.kv_cache_asleep or self.weights_asleep

    def asleep_tags(self) -> list[str]:
        return [tag for tag, asleep in zip(TAGS, (self.weights_asleep, self.kv_cache_asleep),
                                           strict=True) if asleep]

    @staticmethod
    def merge(states: Iterable[SleepState]) -> SleepState:
        """The engine's view over its workers: asleep where any worker is."""
        states = list(states)
        missing = sorted({name for s in states for name in s.missing_weights})
        return SleepState(any(s.kv_cache_asleep for s in states),
                          any(s.weights_asleep for s in states), tuple(missing))

    def check_can_run(self) -> None:
        """Raise `RuntimeError` saying what to call when a step could touch released memory
        or run on weights that were never loaded."""
        if self.is_sleeping:
            raise RuntimeError(
                f"the engine is asleep ({', '.join(self.asleep_tags())} released by "
                f"LLM.sleep()); call LLM.wake_up() before generating"
            )
        if self.missing_weights:
            shown = ", ".join(self.missing_weights[:4])
            more = len(self.missing_weights) - 4
            raise RuntimeError(
                f"the weights were woken without contents after sleep(level=2) (by "
                f"wake_up(reload_weights=False), or by a load_weights() while they slept, which "
                f"reloads nothing from disk) and {len(self.missing_weights)} are still not "
                f"loaded ({shown}{f', and {more} more' if more > 0 else ''}); pass them to "
                f"LLM.load_weights() before generating"
            )


def check_sleep_args(level: int, mode: str) -> None:
    if isinstance(level, bool) or level not in LEVELS:  # True == 1, but no level anyone meant
        raise ValueError(f"sleep(level={level!r}): level is 1 (offload the weights to host "
                         f"memory) or 2 (discard them)")
    if mode not in MODES:
        raise ValueError(f"sleep(mode={mode!r}): mode is 'wait' (finish the requests first) or "
                         f"'abort' (abort them)")


def resolve_tags(tags: Iterable[str] | None, state: SleepState) -> list[str]:
    """The tags to wake: every one asleep when `tags` is None; else each must be known and
    asleep (`ValueError` / `RuntimeError` naming it)."""
    asleep = state.asleep_tags()
    if not asleep:
        raise RuntimeError("wake_up() but the engine is not asleep; call LLM.sleep() first")
    if tags is None:
        return asleep
    tags = [tags] if isinstance(tags, str) else list(tags)
    unknown = [t for t in tags if t not in TAGS]
    if unknown:
        raise ValueError(f"wake_up(tags={tags}): unknown tag(s) {unknown}; tags are "
                         f"{', '.join(TAGS)}")
    awake = [t for t in tags if t not in asleep]
    if awake:
        raise RuntimeError(f"wake_up(tags={tags}): {', '.join(awake)} is not asleep (asleep: "
                           f"{', '.join(asleep)})")
    return tags
