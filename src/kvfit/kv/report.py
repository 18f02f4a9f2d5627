"""`KVCacheReport`: how the KV cache was sized, printable as an aligned table."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("measured", "estimate", "override")


def format_bytes(n: int) -> str:
    """Human units: GiB from 1 GiB up, MiB below."""
    if abs(n) >= 1 << 30:
        return f"{n / (1 << 30):.2f} GiB"
    return f"{n / (1 << 20):.2f} MiB"


@dataclass(frozen=True)
class KVCacheReport:
    """The numbers behind one KV cache size, in bytes and blocks.

    `method` is `measured` (after warmup), `estimate` (profiling estimate, the fallback) or
    `override` (`kv_cache_memory_bytes` / `num_gpu_blocks_override`). `estimate_num_blocks` is
    what the estimate's budget arithmetic gives, for comparison; None where it was not computed.
    `max_blocks` caps both methods (what `max_num_seqs` sequences of `max_model_len` can use,
    raised on a device to keep a prefix cache), so a size below the estimate shows its reason;
    None under an override. `oom_guard_shrinks` counts the times the engine's out-of-memory
    guard has shrunk the cache since (the other figures stay those of startup); its row is
    shown once there is one. `on_host`: the CPU device, whose `total` is the host memory budget
    (`cpu_kv_cache_space_bytes`) and whose committed KV bytes are allocated host memory.
    `dtype` (the cache's storage dtype, e.g. `float8_e4m3fn` under `kv_cache_dtype="fp8"`),
    `block_bytes` (one block over all layers, K and V) and `graphs_and_buffers` (live torch
    memory besides the weights, the model's buffers and the KV cache: CUDA graph pools and the
    runner's persistent input buffers) are shown when given, and so is `host_process` (on the
    host: the process's private memory besides the weights, Python's and torch's included,
    which the host budget counts too).
    """

    method: str
    total: int
    budget: int
    weights: int
    non_torch: int
    transient: int
    margin: int
    committed_bytes: int
    num_blocks: int
    estimate_num_blocks: int | None = None
    max_blocks: int | None = None
    oom_guard_shrinks: int = 0
    on_host: bool = False
    dtype: str | None = None
    block_bytes: int | None = None
    graphs_and_buffers: int | None = None
    host_process: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"KVCacheReport.method must be one of {METHODS}, got {self.method!r}")

    def _rows(self) -> list[tuple[str, str]]:
        """The table's (label, value) rows."""
        estimate = "-" if self.estimate_num_blocks is None else f"{self.estimate_num_blocks:,}"
        cap = "-" if self.max_blocks is None else f"{self.max_blocks:,}"
        rows = [
            ("method", self.method),
            # On the CPU the device is a configured budget, not a size of hardware.
            ("host budget" if self.on_host else "device total", format_bytes(self.total)),
            ("budget", format_bytes(self.budget)),
            ("weights", format_bytes(self.weights)),
            *([("graphs, buffers", format_bytes(self.graphs_and_buffers))]
              if self.graphs_and_buffers is not None else []),
            *([("process, other", format_bytes(self.host_process))]
              if self.host_process is not None else []),
            ("non-torch use", format_bytes(self.non_torch)),
            ("transient peak", format_bytes(self.transient)),
            ("margin", format_bytes(self.margin)),
            ("KV cache committed", format_bytes(self.committed_bytes)),
            *([("KV cache dtype", self.dtype)] if self.dtype else []),
            *([("bytes per block", f"{self.block_bytes:,}")] if self.block_bytes else []),
            ("KV cache blocks", f"{self.num_blocks:,}"),
            ("blocks by estimate", estimate),
            ("blocks cap", cap),
        ]
        if self.oom_guard_shrinks:
            rows.append(("OOM guard shrinks", f"{self.oom_guard_shrinks:,}"))
        return rows

    def format_table(self) -> str:
        """Labels left-aligned, values right-aligned, one row per figure."""
        rows = self._rows()
        label_width = max(len(label) for label, _ in rows)
        value_width = max(len(value) for _, value in rows)
        return "\n".join(f"{label:<{label_width}}  {value:>{value_width}}" for label, value in rows)

    def __str__(self) -> str:
        return self.format_table()
