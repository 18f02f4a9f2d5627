"""The physical limit of a run: the bytes that must move and the FLOPs that must be done, over
the copy bandwidth and GEMM throughput measured on the same device in the same run.

Counting (`ModelShape`, `step_work`) is pure arithmetic over a model's config and the steps a run
scheduled, so it is unit-tested exactly. Per step:

- weights: every GEMM weight is read once (the LM head only when the step samples a row); an
  untied embedding table is not (a step reads only its tokens' rows);
- KV cache: the cached prefix each sequence attends over is read once, and each new token's
  K/V written once;
- FLOPs: 2 x params x tokens for the dense GEMMs (the LM head over the sampled rows only), and
  4 x heads x head_dim per (query, key) pair for QK^T and PV, causal: a chunk of n tokens after
  a prefix of s attends over n*s + n(n+1)/2 pairs.

Norms, biases, rope, activations and sampling are not counted (under 1% of either side for
the shapes published), so the limit is a lower bound on time. A step's limit time is
max(bytes / bandwidth, FLOPs / GEMM throughput): an ideal step overlaps its memory traffic
with its compute. Summing per kernel instead (attention and GEMMs each at their own bound)
would be tighter but no longer a limit: fused kernels can hide one behind the other. A run's
limit is the sum over its steps, which run one after another.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a dense decoder that set its bytes and FLOPs (one rank's worth)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    kv_dtype_bytes: int = 2

    @classmethod
    def from_hf_config(cls, config: Any, dtype_bytes: int = 2,
                       kv_dtype_bytes: int | None = None) -> ModelShape:
        """The shape of a Llama/Qwen3-style `transformers` config."""
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
            dtype_bytes=dtype_bytes,
            kv_dtype_bytes=dtype_bytes if kv_dtype_bytes is None else kv_dtype_bytes)

    @property
    def layer_params(self) -> int:
        """GEMM weights of one decoder layer: qkv, o, gate/up and down projections."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size \
            + 3 * self.hidden_size * self.intermediate_size

    @property
    def body_params(self) -> int:
        """GEMM weights every token goes through (all layers)."""
        return self.num_layers * self.layer_params

    @property
    def head_params(self) -> int:
        """The LM head's weights, applied to sampled rows only."""
        return self.vocab_size * self.hidden_size

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @property
    def attention_flops_per_pair(self) -> int:
        """QK^T and PV of one (query, key) pair over all layers and heads."""
        return 4 * self.num_layers * self.num_heads * self.head_dim


@dataclass(frozen=True)
class StepShape:
    """One step as scheduled: per sequence, tokens already in the cache (`starts`) and tokens
    computed now (`num_new`); `num_logits` rows go through the LM head."""

    starts: Sequence[int]
    num_new: Sequence[int]
    num_logits: int


@dataclass(frozen=True)
class Work:
    """Bytes that must move and FLOPs that must be done, by kind (one step or a sum)."""

    weight_bytes: int = 0
    kv_read_bytes: int = 0
    kv_write_bytes: int = 0
    gemm_flops: int = 0
    attention_flops: int = 0

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    @property
    def flops(self) -> int:
        return self.gemm_flops + self.attention_flops

    def __add__(self, other: Work) -> Work:
        return Work(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[int, ...]:
        return (self.weight_bytes, self.kv_read_bytes, self.kv_write_bytes, self.gemm_flops,
                self.attention_flops)


def step_work(shape: ModelShape, step: StepShape) -> Work:
    """What one step must move and compute (see the module docstring for what counts)."""
    tokens = sum(step.num_new)
    pairs = sum(n * s + n * (n + 1) // 2 for s, n in zip(step.starts, step.num_new, strict=True))
    head = shape.head_params if step.num_logits else 0
    return Work(
        weight_bytes=(shape.body_params + head) * shape.dtype_bytes,
        kv_read_bytes=sum(step.starts) * shape.kv_bytes_per_token,
        kv_write_bytes=tokens * shape.kv_bytes_per_token,
        gemm_flops=2 * shape.body_params * tokens + 2 * shape.head_params * step.num_logits,
        attention_flops=pairs * shape.attention_flops_per_pair,
    )


@dataclass(frozen=True)
class DeviceLimits:
    """What the device sustains, measured: copy bandwidth (bytes read + written per second)
    and dense GEMM throughput (FLOPs per second) in the model's dtype."""

    copy_bytes_per_s: float
    gemm_flops_per_s: float

    def seconds(self, work: Work) -> float:
        """The least time `work` takes: its memory traffic and its compute fully overlapped."""
        return max(work.bytes / self.copy_bytes_per_s, work.flops / self.gemm_flops_per_s)


@dataclass(frozen=True)
class RunLimit:
    """The limit of a run of steps: `seconds` and what it is made of."""

    seconds: float
    work: Work
    num_steps: int
    memory_bound_steps: int  # steps whose bytes, not FLOPs, set their limit

    def as_dict(self) -> dict[str, Any]:
        w = self.work
        return {"limit_s": self.seconds, "num_steps": self.num_steps,
                "memory_bound_steps": self.memory_bound_steps,
                "weight_gib": w.weight_bytes / GiB, "kv_read_gib": w.kv_read_bytes / GiB,
                "kv_write_gib": w.kv_write_bytes / GiB, "gemm_tflop": w.gemm_flops / 1e12,
                "attention_tflop": w.attention_flops / 1e12}


def run_limit(shape: ModelShape, steps: Iterable[StepShape], limits: DeviceLimits) -> RunLimit:
    """The sum over `steps` of each step's limit time (steps run one after another)."""
    total, seconds, count, memory_bound = Work(), 0.0, 0, 0
    for step in steps:
        work = step_work(shape, step)
        t = limits.seconds(work)
        memory_bound += work.bytes / limits.copy_bytes_per_s >= t
        total, seconds, count = total + work, seconds + t, count + 1
    return RunLimit(seconds, total, count, memory_bound)


# -- measuring the device ---------------------------------------------------------------------

def _median_seconds(fn: Any, device: Any, iters: int) -> float:
    import torch

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # first call outside the timing (allocation, library choice)
    times = []
    for _ in range(iters):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: Any, nbytes: int = GiB, iters: int = 10) -> float:
    """Bytes moved per second (read + written) by a device-to-device copy of `nbytes`, median.
    Holds 2 x `nbytes` of device memory while it runs."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), device, iters)


def gemm_throughput(device: Any, dtype: Any, n: int = 8192, iters: int = 10) -> float:
    """FLOPs per second of an `n` x `n` x `n` matmul in `dtype` (2 n^3 per product), median.
    Holds 3 x n^2 elements of device memory while it runs."""
    import torch

    a = torch.randn(n, n, device=device).to(dtype)
    b, out = torch.randn_like(a), torch.empty_like(a)
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b, out=out), device, iters)


def measure_device_limits(device: Any, dtype: Any, copy_bytes: int | None = None,
                          gemm_size: int | None = None) -> DeviceLimits:
    """Copy bandwidth and GEMM throughput of `device` now: 1 GiB copies and 8192^3 products on
    a GPU (large enough to reach peak), 256 MiB and 1024^3 elsewhere (a CPU takes seconds
    for more). What it held on a GPU is back with the device when it returns."""
    gpu = getattr(device, "type", str(device)) == "cuda"
    copy_bytes = copy_bytes or (GiB if gpu else GiB // 4)
    gemm_size = gemm_size or (8192 if gpu else 1024)
    limits = DeviceLimits(copy_bandwidth(device, copy_bytes),
                          gemm_throughput(device, dtype, gemm_size))
    if gpu:  # an engine started next sizes its KV cache from the free memory it measures
        import torch

        torch.cuda.empty_cache()
    return limits


def limit_keys(limits: DeviceLimits, dtype: Any) -> dict[str, Any]:
    """`limits` as a bench's payload carries them: the keys `figures.device_limits` reads."""
    return {"copy_bandwidth_gbps": limits.copy_bytes_per_s / 1e9,
            "gemm_tflops": limits.gemm_flops_per_s / 1e12,
            "gemm_dtype": str(dtype).removeprefix("torch.")}


def _measured_keys(device: str, dtype: Any) -> dict[str, Any]:
    import torch

    return limit_keys(measure_device_limits(torch.device(device), dtype), dtype)


def bench_device(name: str) -> str:
    """A bench's `--device` (argparse `type=`, applied to the default too): a CUDA device where
    torch sees none is a usage error naming the CPU run, where it would fail later in
    `in_run_limits`' process with a traceback."""
    import torch

    if name == "auto":
        return name
    try:
        kind = torch.device(name).type
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{name!r} is not a torch device ({e})") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name!r}: torch sees no CUDA device here; pass "
                                         "--device cpu for the CPU smoke run")
    return name


def in_run_limits(device: Any, dtype: Any = None) -> dict[str, Any]:
    """The limits of a CUDA `device` ("auto": CUDA where there is one) measured now, as
    payload keys (`limit_keys`; the GEMM in `dtype`, default bf16); {} on any other device,
    whose smoke runs need no limit and should stay fast. A CUDA device where torch sees none
    is a ValueError naming the device (the message `kvfit` shows on one line).

    Measured in a spawned process that has exited when this returns, so the caller gains no
    CUDA context, cuBLAS workspace or cached blocks from it (benches whose engines run in
    other processes keep none in their own), and the ~2.4 GiB it holds are back before an
    engine sizes its KV cache from measured free memory. Call it before any engine starts:
    one running alongside would share the bandwidth."""
    import torch

    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        return {}
    if not torch.cuda.is_available():  # else an AssertionError from the spawned process
        raise ValueError(f"device={str(device)!r} but CUDA is not available here; "
                         "use device='cpu'")
    spawn = multiprocessing.get_context("spawn")  # fork is unsafe once the caller used CUDA
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        return pool.submit(_measured_keys, str(device), dtype or torch.bfloat16).result()
