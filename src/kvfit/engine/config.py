"""Engine configuration: `EngineArgs` (flags and `LLM` keywords, vLLM's names) and the validated
`EngineConfig` it resolves to. Every error names the setting to change."""

from __future__ import annotations

import argparse
import logging
import math
import numbers
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kvfit.connectors import check_kv_connector
from kvfit.connectors.config import CONNECTOR_NAMES, KVConnectorConfig
from kvfit.elastic.demand import DEFAULT_DEMAND_DIR
from kvfit.elastic.governor import (
    DEFAULT_HIGH_WATERMARK,
    DEFAULT_IDLE_S,
    DEFAULT_LOW_WATERMARK,
    DEFAULT_MIN_INTERVAL_S,
    ElasticConfig,
    MemoryAmount,
)
from kvfit.engine.sampling_params import SamplingParams
from kvfit.engine.vllm_compat import (
    VLLM_NOOP_VALUES,
    VLLM_UNSUPPORTED_FLAGS,
    vllm_noop_dest,
)
from kvfit.kv.spec import LAYOUTS, KVCacheSpec
from kvfit.kv_quant import KV_CACHE_DTYPES, is_fp8, kv_cache_torch_dtype

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GiB = 1 << 30
MiB = 1 << 20

logger = logging.getLogger(__name__)

# Upper bounds on the defaults (never on explicit values): a 40k-token window is rarely wanted and
# would make one max-length sequence dominate the cache check, more so on the CPU.
_DEFAULT_MAX_MODEL_LEN_CAP = {"cuda": 32768, "cpu": 4096}
_DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 8192, "cpu": 2048}
MAX_BLOCK_SIZE = 1024
"""The largest `--block-size`, four times vLLM's largest (256). A sequence's last block is
mostly empty, and warmup profiles a step of at least one block: a million-token block took
minutes before the engine served anything."""
# Utilization left unset: the whole device under measured sizing, the usual 0.92 otherwise.
_UTILIZATION_EXTENSIBLE = 1.0
_UTILIZATION_ESTIMATE = 0.92
# The CPU budget holds the weights too (it stands for a device's memory): 8 GiB leaves a
# float32 0.6B model (2.3 GiB) room for its steps and several 4k-token sequences. Never more
# than a third of the host.
_DEFAULT_CPU_KV_SPACE_BYTES = 8 * GiB
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}


_SUFFIX_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4}


def at_least_one(what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= 1 counting `what` (argparse names the flag on error)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be an integer >= 1 ({what}), got {value!r}")
        return n

    return parse


def _max_model_len_arg(text: str) -> int:
    """`--max-model-len`: a token count as `human_readable_int` reads it, or "auto" (-1)."""
    return -1 if text.strip().lower() == "auto" else human_readable_int(text)


def human_readable_int(text: str) -> int:
    """An argparse type for token and byte counts, as vLLM reads them: an integer, or one with
    a suffix, k/m/g/t for powers of 1000 (`32k` = 32000, `25.6k` = 25600) and K/M/G/T for
    powers of 1024 (`32K` = 32768)."""
    match = re.fullmatch(r"(-?\d+)|(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    value = None
    if match and match[1] is not None:
        value = int(match[1])
    elif match:
        number, suffix = match[2], match[3]
        if suffix.islower():
            # Exact decimal arithmetic: 25.6k is 25600, not 25599.999...
            whole, _, frac = number.partition(".")
            scaled = int(whole + frac) * 1000 ** _SUFFIX_POWERS[suffix]
            value, rest = divmod(scaled, 10 ** len(frac))
            value = None if rest else value
        elif "." not in number:
            value = int(number) * 1024 ** _SUFFIX_POWERS[suffix.lower()]
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be an integer, plain or with a suffix: k/m/g/t for 1000s (32k = 32000, "
            f"25.6k = 25600), K/M/G/T for 1024s (32K = 32768, whole numbers only); got {text!r}")
    return value


@dataclass
class ModelConfig:
    """The model and how it runs: weights, dtype, context window."""

    model: str
    hf_config: PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    # `max_model_len` "auto" / -1 (vLLM's): the model's whole context, lowered at sizing to
    # what the KV cache holds where one sequence of it would not fit.
    max_model_len_auto: bool = False
    load_format: str = "auto"
    seed: int = 0
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    # Ids that end generation: config.json's `eos_token_id` and generation_config.json's
    # (chat models list their end-of-turn token there only, e.g. Llama 3 Instruct's <|eot_id|>),
    # and the tokenizer's, which `LLM` adds once it has loaded it.
    eos_token_ids: list[int] = field(default_factory=list)
    # SamplingParams fields a request that leaves them unset takes from generation_config.json
    # (`--generation-config`, vLLM's "auto"), e.g. {"temperature": 0.6, "top_p": 0.95}.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        c = self.hf_config
        return getattr(c, "num_key_value_heads", None) or c.num_attention_heads

    @property
    def head_dim(self) -> int:
        c = self.hf_config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


@dataclass
class CacheConfig:
    """The KV cache: block size, prefix caching and how its size is decided.

    `enable_extensible_kv_cache` is resolved to a bool by `EngineArgs`; startup turns it off
    when the VMM probe fails. `gpu_memory_utilization` None follows it (`memory_utilization`).
    """

    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_extensible_kv_cache: bool | None = None
    kv_cache_margin_fraction: float = 0.5
    kv_cache_margin_floor_bytes: int = 256 * MiB
    cpu_kv_cache_space_bytes: int | None = None
    # `kv_cache_dtype` (vLLM's `cache_dtype`): "auto" = the model's dtype, "bfloat16", or
    # "fp8"/"fp8_e4m3".
    cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    # Set by the engine once sizing is done.
    num_gpu_blocks: int | None = None

    @property
    def sizing_method(self) -> str:
        """How the cache size is decided (a `KVCacheReport.method`): `measured` after warmup
        on the extensible cache, `override` by a manual size, else `estimate` by profiling."""
        if self.enable_extensible_kv_cache:
            return "measured"
        manual = (self.num_gpu_blocks_override, self.kv_cache_memory_bytes)
        return "estimate" if manual == (None, None) else "override"

    @property
    def memory_utilization(self) -> float:
        """The budget's share of device memory: as given, else by sizing method."""
        if self.gpu_memory_utilization is not None:
            return self.gpu_memory_utilization
        return _UTILIZATION_EXTENSIBLE if self.enable_extensible_kv_cache else _UTILIZATION_ESTIMATE


@dataclass
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Most tokens of one prompt computed in a step (0 = off): vLLM's cap that keeps one long
    # prompt from taking a whole step's budget while other prompts wait.
    long_prefill_token_threshold: int = 0
    # vLLM's: "fcfs" serves requests in arrival order; "priority" by each request's
    # `priority` (lower first, ties by arrival), and preempts the lowest first.
    scheduling_policy: str = "fcfs"


SCHEDULING_POLICIES = ("fcfs", "priority")
EXECUTOR_BACKENDS = ("uni", "mp", "external_launcher")
# vLLM's CUDAGraphMode names: FULL = decode steps whole from a graph (`cuda_graph_sizes`),
# PIECEWISE = any step's dense pieces from graphs at token buckets, attention eager between.
CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
# vLLM's `logprobs_mode` names: what sample logprobs hold (`kvfit.engine.sampler.Sampler`).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@dataclass
class ParallelConfig:
    """Tensor parallelism and the executor that runs its ranks: `uni` (one worker in this
    process), `mp` (one spawned process per rank) or `external_launcher` (this process is one
    rank of a torchrun launch). `worker_init_fn` (`module:function`) is called with each
    `Worker` right after it is created, in its own process (instrumentation, tests)."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    worker_init_fn: str | None = None


@dataclass
class EngineConfig:
    """Everything the engine needs, validated and with defaults resolved."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] = field(default_factory=list)
    cudagraph_mode: str = "FULL_DECODE_ONLY"  # one of CUDAGRAPH_MODES; enforce_eager wins
    enable_sleep_mode: bool = False
    kv_cache_layout: str = "block_outer"
    kv_connector_config: KVConnectorConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    elastic: ElasticConfig | None = None  # the co-tenancy governor (`elastic_kv_cache`)
    deterministic: bool = False  # batch-invariant kernels (`kvfit.batch_invariant`)
    # One-node Triton linear layers (norms and SiLU folded in) for steps of at most 16 tokens
    # on CUDA (`kvfit.ops.small_batch`); off in the deterministic mode, whose GEMMs win. On by
    # default: 4-9% off the batch-1 decode step on both shapes (docs/benchmarks.md).
    small_batch_kernels: bool = True
    # Decode steps' attention input (q/k norm, rope, K/V store) inside the decode kernel
    # (`kvfit.ops.attention_input.decode_attention`): a graph node fewer a layer; off until
    # timed on a GPU. Off in the deterministic mode, whose attention is its own kernel.
    fused_decode_input: bool = False

    @property
    def runs_small_batch_kernels(self) -> bool:
        """`small_batch_kernels` as the engine runs it: never in the deterministic mode."""
        return self.small_batch_kernels and not self.deterministic

    @property
    def runs_fused_decode_input(self) -> bool:
        """`fused_decode_input` as the engine runs it: never in the deterministic mode."""
        return self.fused_decode_input and not self.deterministic

    def kv_cache_spec(self) -> KVCacheSpec:
        """What one KV cache block holds on one rank, in `kv_cache_layout`: its share of the
        KV heads, one when there are more ranks than KV heads (each keeps a copy)."""
        mc = self.model_config
        return KVCacheSpec(
            num_layers=mc.num_layers,
            block_size=self.cache_config.block_size,
            num_kv_heads=max(1, mc.num_kv_heads // self.parallel_config.tensor_parallel_size),
            head_dim=mc.head_dim,
            dtype=kv_cache_torch_dtype(self.cache_config.cache_dtype, mc.dtype),
            layout=self.kv_cache_layout,
        )


# `EngineArgs` fields that only `elastic_kv_cache=True` uses.
_ELASTIC_SETTINGS = ("elastic_low_watermark", "elastic_high_watermark", "elastic_min_interval",
                     "elastic_idle_s", "elastic_demand_dir")


@dataclass
class EngineArgs:
    """Engine settings as the user gives them (CLI flags or `LLM(...)` keywords).

    `create_engine_config()` resolves the `None`/"auto" defaults and validates; every error
    names the flag or keyword to change.
    """

    model: str = "kvfit-tiny"
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    block_size: int = 16
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    load_format: str = "auto"
    # None is vLLM's V1 default too, and means 0 there (every worker must sample alike).
    seed: int | None = 0
    generation_config: str = "auto"
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"  # vLLM's; one of LOGPROBS_MODES
    cuda_graph_sizes: list[int] | None = None
    cudagraph_mode: str = "FULL_DECODE_ONLY"
    gpu_memory_utilization: float | None = None
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_extensible_kv_cache: bool | None = None
    kv_cache_margin_fraction: float = 0.5
    kv_cache_margin_floor_bytes: int = 256 * MiB
    cpu_kv_cache_space_bytes: int | None = None
    enable_sleep_mode: bool = False
    kv_cache_layout: str = "block_outer"
    kv_connector: str | None = None
    kv_connector_path: str | None = None
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    worker_init_fn: str | None = None
    elastic_kv_cache: bool = False
    elastic_low_watermark: str | float = DEFAULT_LOW_WATERMARK
    elastic_high_watermark: str | float = DEFAULT_HIGH_WATERMARK
    elastic_min_interval: float = DEFAULT_MIN_INTERVAL_S
    elastic_idle_s: float = DEFAULT_IDLE_S
    elastic_demand_dir: str | None = DEFAULT_DEMAND_DIR
    deterministic: bool = False
    batch_invariant: bool = False  # vLLM's name for `deterministic`
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    small_batch_kernels: bool = True
    fused_decode_input: bool = False

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add one `--flag` per field (vLLM's spelling) to `parser`."""
        d = EngineArgs()
        p = parser.add_argument_group("engine")
        p.add_argument("--model", default=d.model,
                       help="local Hugging Face folder or built-in name (kvfit-tiny, "
                       "kvfit-sotu, qwen3-0.6b-shape, qwen3-8b-shape; default: %(default)s)")
        p.add_argument("--tokenizer", default=d.tokenizer,
                       help="a folder holding the tokenizer files, when --model's has none "
                       "or another is wanted (default: --model's own)")
        p.add_argument("--dtype", default=d.dtype, choices=["auto", *_DTYPES],
                       help="weights and activations; auto is float32 on the CPU, the "
                       "checkpoint's bf16/fp16 (else bf16) on a GPU (default: %(default)s)")
        p.add_argument("--device", default=d.device,
                       help="'auto' (cuda where there is one, else cpu), 'cpu', 'cuda' or "
                       "'cuda:N' (default: %(default)s)")
        p.add_argument("--max-model-len", type=_max_model_len_arg, default=d.max_model_len,
                       help="context window in tokens, e.g. 4096, 32k (32000) or 32K (32768); "
                       "auto (or -1): the model's whole context, lowered to what the measured "
                       "KV cache holds where one sequence of it would not fit (default: the "
                       f"model's, capped at {_DEFAULT_MAX_MODEL_LEN_CAP['cuda']} on a GPU and "
                       f"{_DEFAULT_MAX_MODEL_LEN_CAP['cpu']} on the CPU)")
        p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                       help="most sequences in one batch (default: %(default)s)")
        p.add_argument("--max-num-batched-tokens", type=human_readable_int,
                       default=d.max_num_batched_tokens,
                       help="most tokens in one step (8k, 8K: as --max-model-len), also the "
                       "profiling step's size (default: "
                       f"{_DEFAULT_MAX_NUM_BATCHED_TOKENS['cuda']} on a GPU, "
                       f"{_DEFAULT_MAX_NUM_BATCHED_TOKENS['cpu']} on the CPU, at most "
                       "--max-num-seqs x --max-model-len)")
        p.add_argument("--long-prefill-token-threshold", type=human_readable_int,
                       default=d.long_prefill_token_threshold,
                       help="most tokens of one prompt computed in a step, so a long prompt "
                       "is cut into chunks that leave room for others; 0 = off (default: "
                       "%(default)s)")
        p.add_argument("--scheduling-policy", default=d.scheduling_policy,
                       choices=SCHEDULING_POLICIES,
                       help="fcfs: requests run in the order they arrive; priority: by each "
                       "request's priority (lower first, ties by arrival), and when the cache "
                       "runs out the lowest-priority running request is preempted first "
                       "(default: %(default)s)")
        p.add_argument("--block-size", type=int, default=d.block_size,
                       help=f"tokens per KV cache block, a power of two up to {MAX_BLOCK_SIZE} "
                       "(default: %(default)s)")
        p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d.enable_prefix_caching,
                       help="reuse the KV blocks of shared prompt prefixes (default: on)")
        # Switches are --x / --no-x, as vLLM makes every bool field: a vLLM command line
        # with --no-enforce-eager was an argparse error here.
        p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction,
                       default=d.enforce_eager,
                       help="no CUDA graphs (always so on the CPU; default: off)")
        p.add_argument("--load-format", default=d.load_format, type=_load_format_arg,
                       help="auto (dummy for built-in shapes without weights, else "
                       "safetensors), safetensors or dummy (default: %(default)s)")
        p.add_argument("--seed", type=int, default=d.seed,
                       help="engine random seed: the sampling noise of requests without a "
                       "seed of their own (dummy weights are the same at every seed, as "
                       "vLLM's; default: %(default)s)")
        p.add_argument("--generation-config", default=d.generation_config,
                       metavar="{auto,vllm,FOLDER}",
                       help="where a request's unset sampling fields (temperature, top_p, "
                       "top_k, min_p, repetition_penalty, max_tokens) come from: 'auto' the "
                       "model's generation_config.json, 'vllm' SamplingParams' own defaults, "
                       "or FOLDER's generation_config.json; its max_new_tokens also caps every "
                       "served request's max_tokens, as vLLM's (default: %(default)s, as vLLM)")
        p.add_argument("--max-logprobs", type=int, default=d.max_logprobs,
                       help="most logprobs / prompt_logprobs a request may ask for, -1 for "
                       "the whole vocabulary; warmup measures this many (default: %(default)s)")
        p.add_argument("--logprobs-mode", default=d.logprobs_mode, choices=LOGPROBS_MODES,
                       help="what sampled tokens' logprobs hold (vLLM's flag): raw_ = the "
                       "model's logits, processed_ = after logit bias, bans, penalties, "
                       "temperature and top-k/top-p/min-p (filtered tokens -inf); _logprobs "
                       "= their log-softmax; prompt_logprobs stay raw_logprobs "
                       "(default: %(default)s)")
        p.add_argument("--cuda-graph-sizes", "--cudagraph-capture-sizes", type=int, nargs="+",
                       default=d.cuda_graph_sizes,
                       metavar="N", help="decode batch sizes to capture as CUDA graphs "
                       "(default: 1 2 4 8 16..512 by 16; sizes above max-num-seqs or "
                       "max-num-batched-tokens are dropped)")
        p.add_argument("--cudagraph-mode", default=d.cudagraph_mode, type=str.upper,
                       choices=CUDAGRAPH_MODES,
                       help="FULL_DECODE_ONLY: decode steps from whole-step graphs, the rest "
                       "eager; FULL_AND_PIECEWISE: prefill and mixed steps too, from graphs of "
                       "the layers' dense parts at token-count buckets up to "
                       "max-num-batched-tokens, attention eager between them; PIECEWISE: "
                       "every step piecewise; NONE: no graphs (default: %(default)s)")
        p.add_argument("--gpu-memory-utilization", type=float,
                       default=d.gpu_memory_utilization,
                       help="share of device memory the engine may use, in (0, 1] (default: "
                       f"{_UTILIZATION_EXTENSIBLE} with the extensible cache, "
                       f"{_UTILIZATION_ESTIMATE} otherwise)")
        p.add_argument("--kv-cache-memory-bytes", type=human_readable_int,
                       default=d.kv_cache_memory_bytes,
                       help="a fixed KV cache size in bytes, e.g. 4G (4 GiB) (turns the "
                       "extensible default off; default: none, sized from memory)")
        p.add_argument("--num-gpu-blocks-override", type=int,
                       default=d.num_gpu_blocks_override,
                       help="a fixed KV cache block count (turns the extensible default off; "
                       "default: none, sized from memory)")
        p.add_argument("--enable-extensible-kv-cache", action=argparse.BooleanOptionalAction,
                       default=d.enable_extensible_kv_cache,
                       help="size the KV cache from measured memory on a VMM reservation "
                       "(default: on wherever supported)")
        p.add_argument("--kv-cache-margin-fraction", type=float,
                       default=d.kv_cache_margin_fraction,
                       help="safety margin as a share of the measured transient peak "
                       "(default: %(default)s)")
        p.add_argument("--kv-cache-margin-floor-bytes", type=int,
                       default=d.kv_cache_margin_floor_bytes,
                       help="least safety margin in bytes (default: %(default)s)")
        p.add_argument("--cpu-kv-cache-space-bytes", type=human_readable_int,
                       default=d.cpu_kv_cache_space_bytes,
                       help="memory budget in bytes on the CPU device, weights included, e.g. "
                       "8G (8 GiB) (default: "
                       "8 GiB, at most a third of the host; the KV cache takes no more than "
                       "max-num-seqs sequences of max-model-len)")
        p.add_argument("--enable-sleep-mode", action=argparse.BooleanOptionalAction,
                       default=d.enable_sleep_mode,
                       help="place the weights in a VMM arena so LLM.sleep() can release them "
                       "and the KV cache without recapturing graphs (default: off)")
        p.add_argument("--kv-cache-layout", default=d.kv_cache_layout, choices=sorted(LAYOUTS),
                       help="dimension order of the KV cache (default: %(default)s, one "
                       "contiguous region per block)")
        p.add_argument("--kv-connector", default=d.kv_connector, choices=CONNECTOR_NAMES,
                       help="move KV blocks to and from a store outside the engine: "
                       "shared_storage keeps full blocks as files in --kv-connector-path, so "
                       "other engines on the same model get prefix hits from them (default: "
                       "none)")
        p.add_argument("--kv-connector-path", default=d.kv_connector_path, metavar="DIR",
                       help="the shared_storage connector's directory (created if missing)")
        p.add_argument("--kv-offloading-size", type=float, default=d.kv_offloading_size,
                       metavar="GIB",
                       help="keep every full KV block in this many GiB of pinned host memory "
                       "as well (the host connector), so a prompt whose prefix left the KV "
                       "cache loads it rather than computing it again (default: none)")
        p.add_argument("--kv-offloading-backend", default=d.kv_offloading_backend,
                       metavar="{native}",
                       help="what keeps the blocks --kv-offloading-size asks for: native, "
                       "kvfit's own host tier, as vLLM's default (LMCache is not supported)")
        p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                       help="devices (ranks) one model is split over (default: %(default)s)")
        p.add_argument("--distributed-executor-backend", choices=EXECUTOR_BACKENDS,
                       default=d.distributed_executor_backend,
                       help="how workers run: uni (in this process), mp (one spawned process "
                       "per rank) or external_launcher (each rank started by torchrun); "
                       "default: uni for one rank, mp for more")
        p.add_argument("--elastic-kv-cache", action=argparse.BooleanOptionalAction,
                       default=d.elastic_kv_cache,
                       help="share the device with other processes: shrink the KV cache when "
                       "device free memory falls under --elastic-low-watermark, grow it back "
                       "(up to the sizing budget) when it is above --elastic-high-watermark "
                       "(default: off)")
        amount = ("a fraction of device memory in (0, 1) (on the CPU: of "
                  "--cpu-kv-cache-space-bytes), or bytes: 2147483648, 2GiB, 512MiB")
        p.add_argument("--elastic-low-watermark", default=d.elastic_low_watermark,
                       help=f"device free memory under which the KV cache shrinks: {amount} "
                       "(default: %(default)s)")
        p.add_argument("--elastic-high-watermark", default=d.elastic_high_watermark,
                       help=f"device free memory above which the KV cache grows back: {amount} "
                       "(default: %(default)s)")
        p.add_argument("--elastic-min-interval", type=float, default=d.elastic_min_interval,
                       help="seconds from a shrink (also the out-of-memory guard's, or a "
                       "resize through the API) to the next grow, and between attempts at a "
                       "grow that was at the budget or found no memory (doubling with each "
                       "consecutive failure); a grow may follow a grow, and a shrink waits "
                       "only after one failed (default: %(default)s)")
        p.add_argument("--elastic-idle-s", type=float, default=d.elastic_idle_s,
                       help="seconds the KV cache's use must stay low before it shrinks to "
                       "what it uses plus headroom, leaving the memory to a busy co-tenant "
                       "engine (e.g. 5 for engines sharing a device; then only a cache short "
                       "of headroom grows back); 0, the default, turns it off")
        p.add_argument("--elastic-demand-dir", default=d.elastic_demand_dir,
                       help="folder where elastic engines on one device publish what their KV "
                       "caches lack, so that an idle one (--elastic-idle-s) gives back only "
                       "that and keeps the rest, its prefix cache with it; 'none' turns it off "
                       "(default: %(default)s)")
        p.add_argument("--deterministic", "--batch-invariant",
                       action=argparse.BooleanOptionalAction, default=d.deterministic,
                       help="batch-invariant kernels: a request gets the same token ids and "
                       "logprobs whatever else is in the batch, where it sits, and whether its "
                       "prefix came from the cache (slower GEMMs and attention; default: off)")
        p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype,
                       choices=list(KV_CACHE_DTYPES),
                       help="KV cache storage: auto (the model's dtype), bfloat16, or fp8 / "
                       "fp8_e4m3 (e4m3 with a per-layer k/v scale, 1.0 unless the checkpoint "
                       "has its own or --calculate-kv-scales: about twice the blocks of a "
                       "16-bit cache in the same memory, four times a float32 one's, the "
                       "CPU's; default: %(default)s)")
        p.add_argument("--calculate-kv-scales", action=argparse.BooleanOptionalAction,
                       default=d.calculate_kv_scales,
                       help="with --kv-cache-dtype fp8: set each layer's k/v scales once, from "
                       "the first step's K/V (amax / 200 for K, / 100 for V), instead of 1.0 "
                       "(default: off)")
        p.add_argument("--small-batch-kernels", action=argparse.BooleanOptionalAction,
                       default=d.small_batch_kernels,
                       help="on CUDA, run steps of at most 16 tokens (small decode batches) "
                       "through one-node Triton linear layers with the norms and SiLU folded "
                       "in, instead of cuBLAS and separate kernels; ignored with "
                       "--deterministic; --no-small-batch-kernels for cuBLAS at every size "
                       "(default: on)")
        p.add_argument("--fused-decode-input", action=argparse.BooleanOptionalAction,
                       default=d.fused_decode_input,
                       help="on CUDA, run a decode step's q/k norm, rotary and K/V store inside "
                       "its attention kernel (a launch fewer per layer) instead of a kernel of "
                       "their own; 16-bit KV caches only (an fp8 cache keeps the separate "
                       "kernel); ignored with --deterministic (default: off)")
        for flag, values in VLLM_NOOP_VALUES.items():
            p.add_argument(flag, dest=vllm_noop_dest(flag),
                           default=argparse.SUPPRESS, metavar="VALUE",
                           type=_vllm_noop_value(flag, values),
                           help=f"vLLM's, taken at {' or '.join(values)} (what kvfit does)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Pick this class's fields out of a parsed namespace."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        """Resolve defaults against the model and device, and validate everything."""
        # Imported here so that building the CLI parser does not load transformers.
        from kvfit.models.llama import check_config
        from kvfit.models.loader import LOAD_FORMATS, load_eos_token_ids, load_hf_config
        from kvfit.models.registry import get_model_class

        if isinstance(self.max_model_len, str) and self.max_model_len.strip().lower() == "auto":
            self.max_model_len = -1
        _check_types(self)
        if self.seed is None:  # vLLM V1's: no seed is seed 0
            self.seed = 0
        device = _resolve_device(self.device)
        hf_config = load_hf_config(self.model)
        get_model_class(hf_config)  # an unknown architecture fails here, before any work
        model_config = ModelConfig(
            model=self.model,
            hf_config=hf_config,
            dtype=_resolve_dtype(self.dtype, hf_config, device),
            max_model_len=_resolve_max_model_len(self.max_model_len, hf_config, device),
            max_model_len_auto=self.max_model_len == -1,
            load_format=_check_choice("load_format", self.load_format, LOAD_FORMATS),
            seed=self.seed,
            # -1: no cap, vLLM's (the whole vocabulary, which warmup then measures).
            max_logprobs=(hf_config.vocab_size if self.max_logprobs == -1
                          else self.max_logprobs),
            eos_token_ids=load_eos_token_ids(self.model, hf_config),
            logprobs_mode=self._check_logprobs_mode(),
            sampling_defaults=_sampling_defaults(self.model, self.generation_config),
        )
        max_len = model_config.max_model_len
        check_config(hf_config, max_len)  # features the model does not run: refused now
        block_size = self.block_size
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        if block_size > MAX_BLOCK_SIZE:
            raise ValueError(f"block_size (--block-size) must be at most {MAX_BLOCK_SIZE}, got "
                             f"{block_size}: each sequence holds whole blocks, so a larger one "
                             f"only wastes memory, and warmup runs a step of at least a block")
        max_num_seqs = self.max_num_seqs
        max_batched = _DEFAULT_MAX_NUM_BATCHED_TOKENS[device.type]
        if self.max_num_batched_tokens is not None:
            max_batched = self.max_num_batched_tokens
        # No step can hold more, and profiling and warmup run a step of this size: measured
        # sizing would keep its transient free for nothing.
        fill = max(max_num_seqs * max_len, block_size)
        if self.max_num_batched_tokens is None:
            max_batched = min(max(max_batched, block_size), fill)
        elif max_batched < block_size:
            raise ValueError(
                f"max_num_batched_tokens ({max_batched}) must be >= block_size ({block_size})"
            )
        elif max_batched > fill:
            logger.info("max_num_batched_tokens %d is more than a step can hold (max_num_seqs "
                        "%d x max_model_len %d): using %d", max_batched, max_num_seqs, max_len,
                        fill)
            max_batched = fill
        config = EngineConfig(
            model_config=model_config,
            cache_config=self._cache_config(device, block_size, model_config.dtype),
            scheduler_config=SchedulerConfig(
                max_num_seqs, max_batched, max_len,
                self.long_prefill_token_threshold,
                _check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES),
            ),
            device=device,
            enforce_eager=self.enforce_eager or device.type != "cuda",
            cuda_graph_sizes=_resolve_graph_sizes(
                self.cuda_graph_sizes, min(max_num_seqs, max_batched)
            ),
            cudagraph_mode=_check_choice("cudagraph_mode", _upper(self.cudagraph_mode),
                                         CUDAGRAPH_MODES),
            enable_sleep_mode=self._check_sleep_mode(device),
            kv_cache_layout=_check_choice("kv_cache_layout", self.kv_cache_layout,
                                          tuple(LAYOUTS)),
            kv_connector_config=self._kv_connector_config(),
            parallel_config=self._parallel_config(hf_config, device),
            elastic=self._elastic_config(),
            deterministic=self.deterministic or self.batch_invariant,
            small_batch_kernels=self.small_batch_kernels,
            fused_decode_input=self.fused_decode_input,
        )
        if config.kv_connector_config is not None:
            # Now, not after the model loaded and warmup ran: a host tier that holds no block.
            check_kv_connector(config.kv_connector_config, config.kv_cache_spec())
        return config

    def _kv_connector_config(self) -> KVConnectorConfig | None:
        if self.kv_offloading_backend != "native":
            # vLLM's other backend is LMCache, which kvfit does not integrate.
            raise ValueError(f"kv_offloading_backend={self.kv_offloading_backend!r} is not "
                             f"supported: kvfit's host tier is the 'native' backend; pass "
                             f"kv_offloading_backend='native' (the default) or drop it")
        # Each rank holds only its share of the KV heads, while a store's keys name the model
        # and the tokens alone: ranks would overwrite each other's blocks.
        if self.tensor_parallel_size > 1 and (self.kv_connector or self.kv_offloading_size):
            setting = "kv_connector" if self.kv_connector else "kv_offloading_size"
            raise ValueError(f"{setting}={getattr(self, setting)!r} stores whole blocks of one "
                             f"rank; it does not support tensor_parallel_size > 1 (got "
                             f"{self.tensor_parallel_size}): drop {setting} or use 1")
        return KVConnectorConfig.create(self.kv_connector, self.kv_connector_path,
                                        self.kv_cache_layout, self.kv_offloading_size)

    def _parallel_config(self, hf_config: PretrainedConfig, device: torch.device
                         ) -> ParallelConfig:
        tp = self.tensor_parallel_size
        backend = self.distributed_executor_backend
        if backend is None:
            backend = "uni" if tp == 1 else "mp"
        _check_choice("distributed_executor_backend", backend, EXECUTOR_BACKENDS)
        if backend == "uni" and tp > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one worker, but "
                             f"tensor_parallel_size is {tp}; use 'mp' or 'external_launcher'")
        _check_tp_divides(hf_config, tp)
        if device.type == "cuda" and backend == "mp":
            first = device.index or 0
            if first + tp > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size={tp} from {device} needs devices up to "
                                 f"cuda:{first + tp - 1}, but {torch.cuda.device_count()} are "
                                 f"visible; lower tensor_parallel_size")
        return ParallelConfig(tp, backend, self.worker_init_fn)

    def _elastic_config(self) -> ElasticConfig | None:
        if not self.elastic_kv_cache:
            # The governor's settings are ignored then: said, since a watermark set alone
            # looks like an elastic cache, one that never resizes. A warning, not an error: a
            # program may keep its settings and turn the cache on and off.
            default = EngineArgs.__dataclass_fields__
            if given := [name for name in _ELASTIC_SETTINGS
                         if getattr(self, name) != default[name].default]:
                flags = ", ".join(f"--{name.replace('_', '-')}" for name in given)
                logger.warning("%s set, but the elastic KV cache is off, so ignored: add "
                               "--elastic-kv-cache (elastic_kv_cache=True) for a KV cache that "
                               "follows free memory", flags)
            return None
        manual = [name for name in ("kv_cache_memory_bytes", "num_gpu_blocks_override")
                  if getattr(self, name) is not None]
        if manual or self.enable_extensible_kv_cache is False:
            setting = manual[0] if manual else "enable_extensible_kv_cache=False"
            raise ValueError(f"elastic_kv_cache=True resizes the extensible KV cache, which "
                             f"{setting} turns off; drop one of the two")
        # Floats by now (`_check_types`); `not >=` refuses NaN too.
        if not self.elastic_idle_s >= 0:
            raise ValueError(f"elastic_idle_s must be a number of seconds >= 0 (0: no idle "
                             f"shrink), got {self.elastic_idle_s!r}")
        if not self.elastic_min_interval >= 0:
            raise ValueError(f"elastic_min_interval must be a number of seconds >= 0, got "
                             f"{self.elastic_min_interval!r}")
        low = MemoryAmount.parse(self.elastic_low_watermark, "elastic_low_watermark")
        high = MemoryAmount.parse(self.elastic_high_watermark, "elastic_high_watermark")
        demand_dir = self.elastic_demand_dir
        if demand_dir is not None and str(demand_dir).lower() in ("", "none"):
            demand_dir = None
        config = ElasticConfig(low, high, self.elastic_min_interval, idle_s=self.elastic_idle_s,
                               demand_dir=demand_dir)
        # Of one kind (two fractions, or two byte counts), low < high is known now, on any
        # device; mixed, the device's size decides (`watermarks`, at startup).
        fractions, byte_counts = (low.fraction, high.fraction), (low.nbytes, high.nbytes)
        same_kind = next((pair for pair in (fractions, byte_counts) if None not in pair), None)
        if same_kind is not None and not same_kind[0] < same_kind[1]:
            raise ValueError(f"elastic_low_watermark ({low}) must be below "
                             f"elastic_high_watermark ({high}): the band between them keeps "
                             f"the cache from oscillating")
        return config

    def _check_sleep_mode(self, device: torch.device) -> bool:
        if self.enable_sleep_mode:
            from kvfit.vmm import vmm_unavailable_reason

            reason = vmm_unavailable_reason(device)
            if reason is not None:
                raise ValueError(f"enable_sleep_mode=True needs virtual memory management on "
                                 f"{device} for the weight arena: {reason}; leave it False")
        return self.enable_sleep_mode

    def _cache_config(self, device: torch.device, block_size: int,
                      model_dtype: torch.dtype) -> CacheConfig:
        manual = [
            name for name in ("kv_cache_memory_bytes", "num_gpu_blocks_override")
            if getattr(self, name) is not None
        ]
        extensible = self.enable_extensible_kv_cache
        if extensible and manual:
            raise ValueError(
                f"enable_extensible_kv_cache=True conflicts with {manual[0]}: the extensible cache "
                f"is sized from measured memory; drop one of the two"
            )
        if extensible:
            _check_vmm_usable(device)
        elif extensible is None:
            # Where the probe fails at startup the engine falls back to the estimate.
            extensible = not manual
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        if not (math.isfinite(self.kv_cache_margin_fraction)
                and self.kv_cache_margin_fraction >= 0):
            # nan and inf got past `< 0` and failed in sizing, as a float -> int conversion.
            raise ValueError(f"kv_cache_margin_fraction must be a finite number >= 0, got "
                             f"{self.kv_cache_margin_fraction}")
        cpu_space = self.cpu_kv_cache_space_bytes
        if cpu_space is None:
            cpu_space = min(_DEFAULT_CPU_KV_SPACE_BYTES, _host_memory_bytes() // 3)
        return CacheConfig(
            block_size=block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            gpu_memory_utilization=utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_extensible_kv_cache=extensible,
            kv_cache_margin_fraction=self.kv_cache_margin_fraction,
            kv_cache_margin_floor_bytes=self.kv_cache_margin_floor_bytes,
            cpu_kv_cache_space_bytes=cpu_space,
            cache_dtype=self._check_kv_cache_dtype(device, model_dtype),
            calculate_kv_scales=self.calculate_kv_scales,
        )

    def _check_logprobs_mode(self) -> str:
        """vLLM's `logprobs_mode`, one of `LOGPROBS_MODES`."""
        return _check_choice("logprobs_mode (--logprobs-mode)", self.logprobs_mode,
                             LOGPROBS_MODES)

    def _check_kv_cache_dtype(self, device: torch.device, model_dtype: torch.dtype) -> str:
        name = _check_choice("kv_cache_dtype (--kv-cache-dtype)", self.kv_cache_dtype,
                             tuple(KV_CACHE_DTYPES))
        cache_dtype = kv_cache_torch_dtype(name, model_dtype)
        fp8 = is_fp8(cache_dtype)
        if device.type == "cuda" and not fp8 and cache_dtype != model_dtype:
            # The CUDA kernels read a 16-bit cache in the query's dtype, unconverted.
            raise ValueError(f"kv_cache_dtype={name!r} on CUDA needs the model in {name} "
                             f"(got {str(model_dtype).removeprefix('torch.')}): set --dtype "
                             f"{name}, or --kv-cache-dtype auto or fp8")
        if self.calculate_kv_scales and not fp8:
            raise ValueError(f"calculate_kv_scales=True (--calculate-kv-scales) sets the scales "
                             f"of an FP8 KV cache, but kv_cache_dtype is {name!r}; set "
                             f"--kv-cache-dtype fp8 or drop --calculate-kv-scales")
        if self.calculate_kv_scales and self.kv_connector not in (None, "host"):
            # Stored blocks would be read back by engines whose first step set other scales.
            raise ValueError(f"calculate_kv_scales=True gives each engine its own scales, so "
                             f"blocks kv_connector={self.kv_connector!r} stores could not be "
                             f"shared; drop --calculate-kv-scales (scales 1.0) or the connector")
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"kv_cache_dtype={name!r} needs FP8 conversions (compute "
                             f"capability 8.9+); {device} is "
                             f"{torch.cuda.get_device_capability(device)}: use "
                             f"--kv-cache-dtype auto")
        return name


# Integer settings and the values they take, [low, high) (high None: no bound): checked
# before anything else by `_check_types`, which also takes each field's type from its
# annotation. Integral floats and numpy scalars are taken as vLLM's (pydantic) configs take them.
_INTEGER_RANGES: dict[str, tuple[int, int | None]] = {
    "max_model_len": (-1, None),  # -1: "auto" (0 is refused too, by _as_int)
    "max_num_seqs": (1, None),
    "max_num_batched_tokens": (1, None),  # 0 is no default: a step of no tokens
    "long_prefill_token_threshold": (0, None),  # 0 = off
    "block_size": (1, None),
    # The range torch's generators take: a float or an overflow failed in a worker with
    # torch's words, naming no setting.
    "seed": (-(2**63), 2**64),
    "max_logprobs": (-1, None),  # -1: the whole vocabulary
    "kv_cache_memory_bytes": (1, None),
    "num_gpu_blocks_override": (1, None),
    "kv_cache_margin_floor_bytes": (0, None),
    "cpu_kv_cache_space_bytes": (1, None),
    "tensor_parallel_size": (1, None),
}
# How an integer's range reads, where [low, high) says it wrong.
_RANGE_WORDS = {"max_model_len": ">= 1, or -1 ('auto': the model's context within what the KV "
                                 "cache holds)"}
# What a float setting counts, where "a number" says too little.
_FLOAT_UNITS = {"elastic_min_interval": "a number of seconds",
                "elastic_idle_s": "a number of seconds", "kv_offloading_size": "a number of GiB"}
# String settings naming a file or folder: a `pathlib.Path` is taken, as a str.
_PATH_SETTINGS = ("model", "tokenizer", "generation_config", "kv_connector_path",
                  "elastic_demand_dir")


def _check_types(args: EngineArgs) -> None:
    """Check every setting's type against its field's annotation and the integers'
    ranges, in place: a numpy scalar or an integral float becomes the int or float it stands
    for. Run first, so that a wrong type fails here naming the setting, not in a comparison
    or a worker; "True"/"0.5" strings are refused rather than read by truthiness."""
    for f in fields(args):
        name, value = f.name, getattr(args, f.name)
        if value is None and f.type.endswith("| None"):
            continue
        kind = f.type.removesuffix(" | None")
        if kind == "int":
            value = _as_int(name, value, *_INTEGER_RANGES[name])
        elif kind == "float":
            if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be {_FLOAT_UNITS.get(name, 'a number')}, "
                                 f"got {value!r}")
            value = float(value)
        elif kind == "bool":
            # 0 and 1 as vLLM takes them; a string is refused: "False" is truthy.
            if isinstance(value, numbers.Integral) and value in (0, 1):
                value = bool(value)
            elif not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {value!r}")
            value = bool(value)
        elif kind == "list[int]":
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list of integers >= 1, got {value!r}")
            value = [_as_int(name, size, 1, None) for size in value]
        elif name in _PATH_SETTINGS:
            if not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"{name} must be a path or name (a str), got {value!r}")
            value = os.fspath(value)
        setattr(args, name, value)
    hook = args.worker_init_fn
    if hook is not None and not (isinstance(hook, str)
                                 and re.fullmatch(r"[\w.]+:\w+", hook)):
        raise ValueError(f"worker_init_fn must be 'module:function', got {hook!r}")


def _as_int(name: str, value: object, low: int, high: int | None) -> int:
    """`value` as an int in [low, high), or a ValueError naming `name` and the range."""
    number = None
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) and (
            isinstance(value, numbers.Integral)
            or math.isfinite(value) and float(value).is_integer()):
        number = int(value)
    if name == "max_model_len" and number == 0:
        number = None  # the range's one hole
    if number is None or number < low or (high is not None and number >= high):
        allowed = _RANGE_WORDS.get(name) or (
            f">= {low}" if high is None else f"in [{_power(low)}, {_power(high)})")
        raise ValueError(f"{name} must be an integer {allowed}, got {value!r}")
    return number


def _power(n: int) -> str:
    """`n`, as 2**k where it is a large power of two (the seed's bounds)."""
    k = abs(n).bit_length() - 1
    return f"{'-' if n < 0 else ''}2**{k}" if abs(n) == 1 << k and k >= 32 else str(n)


def _sampling_defaults(model: str, source: str) -> dict[str, Any]:
    """generation_config.json's sampling defaults (`load_sampling_defaults`), checked now: a
    value SamplingParams refuses would otherwise fail every request that leaves it unset."""
    from kvfit.models.loader import load_sampling_defaults

    if not isinstance(source, str):
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder; got {source!r}")
    defaults = load_sampling_defaults(model, source)
    try:
        SamplingParams(**defaults)
    except (ValueError, TypeError) as e:
        raise ValueError(f"the sampling defaults of generation_config.json ({defaults}) are "
                         f"not valid SamplingParams ({e}); fix the file, or set "
                         f"generation_config='vllm' (--generation-config vllm) to ignore them"
                         ) from e
    if defaults:  # as vLLM warns: outputs differ from SamplingParams' defaults
        logger.warning("sampling defaults from the model's generation_config.json: %s (a "
                       "request's unset fields take them; --generation-config vllm to use "
                       "SamplingParams' own)", defaults)
    return defaults


def _upper(value: object) -> object:
    """A mode name in upper case (vLLM's spelling), anything else as it is, for
    `_check_choice` to refuse."""
    return value.upper() if isinstance(value, str) else value


def _vllm_noop_value(flag: str, values: tuple[str, ...]) -> Callable[[str], str]:
    """An argparse type: `flag`'s value where it asks for what kvfit does, else an error
    giving the reason kvfit does not do what it asks."""

    def parse(value: str) -> str:
        if value not in values:
            raise argparse.ArgumentTypeError(
                f"{value!r} (vLLM's) is not supported: {VLLM_UNSUPPORTED_FLAGS[flag]}")
        return value

    return parse


def _load_format_arg(value: str) -> str:
    """An argparse type: `--load-format`, checked as it is parsed (vLLM's other formats, `pt`,
    `gguf`, ..., failed only once the engine started loading), saying what to do instead."""
    from kvfit.models.loader import LOAD_FORMATS

    if value not in LOAD_FORMATS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(LOAD_FORMATS)}, got {value!r}: kvfit loads safetensors "
            f"weights only (convert other checkpoints to safetensors)")
    return value


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _check_tp_divides(hf_config: PretrainedConfig, tp: int) -> None:
    """Heads and the MLP split evenly over `tp` ranks; KV heads split too, or each rank keeps
    one copy when there are more ranks than KV heads."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads),
                        ("intermediate_size", hf_config.intermediate_size)):
        if value % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} "
                             f"({value}); choose a divisor")
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} neither divides nor is a multiple of the "
                         f"model's num_key_value_heads ({kv_heads}); choose one that is")


def _check_vmm_usable(device: torch.device) -> None:
    from kvfit.vmm import vmm_unavailable_reason

    reason = vmm_unavailable_reason(device)
    if reason is not None:
        raise ValueError(
            f"enable_extensible_kv_cache=True but the KV cache cannot be backed by virtual memory "
            f"on {device}: {reason}; leave enable_extensible_kv_cache unset or False"
        )


def _resolve_device(device: str | torch.device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}") from e
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N'; got {device!r}")
    if resolved.type == "cpu":
        # The CPU has one device: 'cpu:1' would fail later, in the weight loader, as if the
        # checkpoint were damaged.
        if resolved.index not in (None, 0):
            raise ValueError(f"device={device!r}: the CPU has no device index; use "
                             f"device='cpu'")
        resolved = torch.device("cpu")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use device='cpu'")
    if resolved.type == "cuda" and resolved.index is None:
        # An index-less device would fail `torch.cuda.set_device` and compare unequal to the
        # tensors' devices.
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def _resolve_dtype(dtype: str | torch.dtype, hf_config: PretrainedConfig,
                   device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        native = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(native, str):
            native = _DTYPES.get(native)
        # A float32 checkpoint would halve throughput on the GPU; serve it in bf16 like vLLM.
        return native if native in (torch.bfloat16, torch.float16) else torch.bfloat16
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def _resolve_max_model_len(max_model_len: int | None, hf_config: PretrainedConfig,
                           device: torch.device) -> int:
    from kvfit.models.llama import max_positions

    positions = getattr(hf_config, "max_position_embeddings", None)
    # A scaled rope runs past max_position_embeddings, to the context it was extended to.
    limit = max_positions(hf_config) if positions else None
    cap = _DEFAULT_MAX_MODEL_LEN_CAP[device.type]
    if max_model_len is None:
        return min(limit, cap) if limit else cap
    if max_model_len == -1:  # "auto": the whole context; sizing lowers it if need be
        return limit or cap
    if limit and max_model_len > limit:
        context = (f"max_position_embeddings ({limit})" if limit == positions else
                   f"context as its rope_scaling extends it ({limit}, max_position_embeddings "
                   f"{positions})")
        raise ValueError(f"max_model_len ({max_model_len}) is larger than the model's "
                         f"{context}; lower max_model_len")
    return max_model_len


def _resolve_graph_sizes(sizes: list[int] | None, max_batch: int) -> list[int]:
    if sizes is None:
        sizes = [1, 2, 4, 8, *range(16, 513, 16)]
    return sorted({s for s in sizes if s <= max_batch})


def _host_memory_bytes() -> int:
    import psutil

    return psutil.virtual_memory().total
