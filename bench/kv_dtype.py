"""FP8 KV cache against the cache in the model's dtype, side by side in one run.

How to run (on the GPU machine, about 3 minutes; JSON and run.log in $OUT):

    TESTS=none bash bench/run_gpu.sh "kv_dtype"
    TESTS=none bash bench/run_gpu.sh "kv_dtype --skip-engine --accuracy-model PATH"

CPU smoke check (a minute):

    python3 bench/kv_dtype.py --device cpu --model kvfit-tiny --num-seqs 8 --min-len 8 \\
        --max-len 64 --decode-batches 2 --decode-context 64 --accuracy-prompts 2 \\
        --accuracy-len 32 --out /tmp/k.json

Engine, per `--kv-cache-dtypes` (default `auto fp8`), one engine at a time (`--model`, dummy
weights, measured sizing, the same settings but the cache dtype):
- capacity: KV blocks under measured sizing, bytes per block, the bytes committed;
- throughput: bench/throughput.py's offline workload (same seeds for every dtype), after one
  untimed run of its shape (its workload and decode loop are imported from there), against the
  limit of the steps it ran with the KV bytes at the cache's dtype (`of_limit`; `limit_ratio`
  is fp8's limit over bf16's: the most the dtype alone can give this workload); `--profile`
  adds a torch.profiler split of one more run per dtype (kernels by family and step kind);
- decode: the engine's decode step at each `--decode-batches` over `--decode-context` tokens,
  against the roofline (weights + KV bytes read, at the cache's dtype) / copy bandwidth measured
  in the same run.
Each figure with its ratio to the first dtype.

Accuracy (`--accuracy-model`, default `--model`; meaningful for trained weights only, e.g. the
built-in trained model or a checkpoint folder): `--accuracy-prompts` prompts of `--accuracy-len`
tokens (the lines of `--prompts-file`, else random ids), teacher forced: one prefill of each
prompt per variant (auto, fp8, fp8 with calculate_kv_scales). Prefill reads K/V back from the
cache, so every position attends over quantised K/V. Per variant against auto: next-token
agreement and mean KL(auto || variant) in nats over every position; and, for a local checkpoint,
agreement with Hugging Face transformers on the same weights in the same dtype: top-1, and
top-5 (each side's argmax in the other side's top 5). A trained model this small is often
undecided (its held-out perplexity is 59), and where auto's top two tokens are within
`--near-tie-nats` a change of argmax says little about the cache: agreement is also given
over the decisive positions alone (auto's top-1 ahead by at least that margin), with their
share and the median margin of auto's top two where a variant disagrees.
The held-out prompts of the trained built-in model: `tools/tiny_model/heldout.py`.

`--error-split` adds three variants that say where the FP8 cache's disagreements come from, run
on the model-dtype engine with each layer's stored K/V rounded in place after the store: e4m3 K
alone (`fp8_k_only`), e4m3 V alone (`fp8_v_only`), and both rounded in a Hadamard-rotated basis
(`fp8_hadamard`: what a cache holding H k and H v would give, since q.k = Hq.Hk and the output
rotates back; an idea for the format, not an engine feature), and both less the prompt's own
per-channel mean (`fp8_smoothed`: what smoothing K and V could give at most). Scale 1.0 as the
default cache. `--noise-floor` adds K and V rounded at 4, 5 and 6 mantissa bits (6 is one bit
short of bf16) and as int8 with a scale per token and head: where agreement with the bf16 cache
stands for a format of any precision short of bf16's, i.e. the floor under the fp8 target.

Targets (H200): fp8 >= 1.9x the blocks of bf16; offline throughput >= 1.4x bf16's; on the
trained model next-token agreement >= 99% and mean KL <= 0.01 nats vs the bf16 cache.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import DeviceLimits, limit_keys, measure_device_limits
from kvfit.benchmarks.profiling import profile_text
from kvfit.benchmarks.record import write_record
from kvfit.engine.sequence import ScheduledBatch, Sequence
from kvfit.kv_quant import dequantize_fp8, quantize_fp8
from kvfit.models import llama
from kvfit.models.loader import is_builtin, resolve_model
from throughput import (  # the same workload, loop, step shapes and limit
    StepRecorder,
    _sync,
    check_lengths,
    count,
    engine_decode_step,
    limit_of,
    offline_workload,
    profile_offline,
)

GiB = 1 << 30
TARGETS = {"blocks_ratio": 1.9, "throughput_ratio": 1.4, "next_token_agreement": 0.99,
           "mean_kl": 0.01}
ACCURACY_VARIANTS = {"auto": {}, "fp8": {"kv_cache_dtype": "fp8"},
                     "fp8_calculated": {"kv_cache_dtype": "fp8", "calculate_kv_scales": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default="qwen3-0.6b-shape")
    p.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "fp8"],
                   help="cache dtypes of the engine runs, the first the baseline")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="engine runs of fp8 dtypes calculate their scales")
    p.add_argument("--max-num-seqs", type=count, default=256)
    p.add_argument("--num-seqs", type=count, default=256)
    p.add_argument("--min-len", type=count, default=100)
    p.add_argument("--max-len", type=count, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--decode-batches", type=count, nargs="*", default=[64, 256])
    p.add_argument("--decode-context", type=count, default=2048)
    p.add_argument("--iters", type=count, default=20)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-engine", action="store_true", help="accuracy only")
    p.add_argument("--profile", metavar="PREFIX",
                   help="profile the offline workload once more per cache dtype "
                        "(torch.profiler: kernels by family and step kind) into "
                        "PREFIX.<dtype>.txt, and its split into the record")
    p.add_argument("--accuracy-model", help="model of the accuracy runs (default: --model)")
    p.add_argument("--accuracy-prompts", type=count, default=32)
    p.add_argument("--accuracy-len", type=count, default=512)
    p.add_argument("--prompts-file", help="one prompt per line (default: random token ids)")
    p.add_argument("--accuracy-dtype", default="auto",
                   help="dtype of the accuracy engines (auto: the model's on a GPU, float32 on "
                        "a CPU; bfloat16 on a CPU matches a GPU run's rounding)")
    p.add_argument("--accuracy-load-format", default="auto",
                   help="load_format of the accuracy engines (auto: the model's weights, or "
                        "dummy for a built-in shape)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers comparison")
    p.add_argument("--near-tie-nats", type=float, default=0.1,
                   help="auto's top-1 lead under which a position counts as undecided")
    p.add_argument("--error-split", action="store_true",
                   help="also e4m3 K alone, V alone, both in a Hadamard-rotated basis, and "
                        "both less the prompt's per-channel mean")
    p.add_argument("--noise-floor", action="store_true",
                   help="also K and V at 4, 5 and 6 mantissa bits and as int8 per token and "
                        "head: the agreement any cache format short of bf16 can reach")
    args = p.parse_args(argv)
    check_lengths(p, args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def engine_run(args: argparse.Namespace, kv_cache_dtype: str,
               limits: DeviceLimits) -> dict[str, Any]:
    """One engine with the cache in `kv_cache_dtype`: its sizing, offline throughput (against
    the limit of its steps, its KV bytes at the cache's dtype) and decode steps."""
    calculate = args.calculate_kv_scales and kv_cache_dtype != "auto"
    llm = LLM(args.model, device=args.device, load_format="dummy",
              max_model_len=max(2 * args.max_len + 1, args.decode_context + 256),
              max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
              kv_cache_dtype=kv_cache_dtype, calculate_kv_scales=calculate)
    try:
        report, worker = llm.kv_cache_report, llm.engine.executor.workers[0]
        spec = worker.runner.kv_cache_spec
        row: dict[str, Any] = {
            "kv_cache_dtype": kv_cache_dtype, "calculate_kv_scales": calculate,
            "dtype": report.dtype, "method": report.method, "num_blocks": report.num_blocks,
            "block_bytes": spec.block_bytes, "kv_bytes": report.committed_bytes,
            "max_blocks": report.max_blocks, "transient": report.transient,
            "margin": report.margin, "report": report.format_table(),
        }
        row["throughput"] = offline_throughput(llm, args, limits)
        row["decode"] = decode_steps(llm, args, worker.weights, spec, limits.copy_bytes_per_s)
        if args.profile:
            vocab = llm.config.model_config.hf_config.vocab_size
            profile = profile_offline(llm, args, vocab, args.seed + 2)
            Path(f"{args.profile}.{kv_cache_dtype}.txt").write_text(profile_text(profile))
            row["profile"] = profile.as_dict()
        row["kv_scales"] = worker.runner.kv_scales()[:4]  # the first layers' (host copy)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    return row


def offline_throughput(llm: LLM, args: argparse.Namespace,
                       limits: DeviceLimits) -> dict[str, Any]:
    """Output tokens per second of the offline workload, after an untimed run of its shape,
    and the limit of the steps it ran (`of_limit` = limit time / measured time)."""
    vocab = llm.config.model_config.hf_config.vocab_size
    llm.generate(*offline_workload(args, vocab, args.seed + 1), use_tqdm=False)
    prompts, params = offline_workload(args, vocab, args.seed)
    _sync(llm.config.device)
    with StepRecorder(llm) as recorder:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        _sync(llm.config.device)
        elapsed = time.perf_counter() - start
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    limit = limit_of(llm, recorder.steps, limits)
    return {"elapsed_s": elapsed, "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / elapsed,
            "limit_output_tokens_per_s": output_tokens / limit.seconds,
            "of_limit": limit.seconds / elapsed, "limit": limit.as_dict(),
            "num_preemptions": llm.engine.scheduler.num_preemptions}


def decode_steps(llm: LLM, args: argparse.Namespace, weight_bytes: int, spec: Any,
                 bandwidth: float) -> list[dict[str, Any]]:
    """Engine decode step per batch size, against (weights + KV read) / bandwidth."""
    kv_bytes_per_token = spec.block_bytes // spec.block_size
    rows = []
    for batch in args.decode_batches:
        blocks = batch * -(-(args.decode_context + args.iters + 16) // spec.block_size)
        if batch > args.max_num_seqs or blocks > llm.kv_cache_report.num_blocks:
            print(f"skip decode batch {batch}: more than max_num_seqs or the cache holds")
            continue
        (step,), context, _, _ = engine_decode_step(llm, batch, args.decode_context, args.iters)
        roofline = (weight_bytes + batch * context * kv_bytes_per_token) / bandwidth
        rows.append({"batch": batch, "context": context, "step_ms": step * 1e3,
                     "roofline_ms": roofline * 1e3, "ratio": step / roofline,
                     "kv_gib": batch * context * kv_bytes_per_token / GiB})
    return rows


# -- accuracy ------------------------------------------------------------------------------------


def accuracy_prompts(args: argparse.Namespace, llm: LLM) -> list[list[int]]:
    """`--accuracy-prompts` token lists of at most `--accuracy-len` (at least 2 tokens each)."""
    if args.prompts_file:
        tokenizer = llm.get_tokenizer()
        lines = [line for line in Path(args.prompts_file).read_text().splitlines() if line]
        ids = [tokenizer.encode(line)[: args.accuracy_len] for line in lines]
        return [t for t in ids if len(t) >= 2][: args.accuracy_prompts]
    rng = random.Random(args.seed)
    vocab = llm.config.model_config.hf_config.vocab_size
    return [[rng.randrange(vocab) for _ in range(args.accuracy_len)]
            for _ in range(args.accuracy_prompts)]


@torch.inference_mode()
def prefill_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Log-probabilities [len, vocab] (float32) of one prefill of `prompt` from block 0 on: row
    i predicts token i + 1 having attended over the cache's K/V of tokens 0..i."""
    runner = llm.engine.executor.workers[0].runner
    seq = Sequence(list(prompt), SamplingParams(temperature=0.0, max_tokens=1))
    seq.block_table = list(range(-(-len(prompt) // runner.block_size)))
    input_ids, positions, metadata, _ = runner.prepare_inputs(ScheduledBatch([seq],
                                                                             [len(prompt)]))
    hidden = runner.model(input_ids, positions, metadata)
    return runner.model.compute_logits(hidden).float().log_softmax(-1)


def accuracy_engine(model: str, args: argparse.Namespace, variant: dict[str, Any]) -> LLM:
    """A small engine for teacher-forced prefills of `--accuracy-len` tokens (the cache holds
    one prompt; sizing is not what is measured here)."""
    blocks = -(-(args.accuracy_len + 16) // 16) + 1
    llm = LLM(model, device=args.device, max_model_len=args.accuracy_len + 16, max_num_seqs=4,
              num_gpu_blocks_override=blocks, enforce_eager=True,
              load_format=args.accuracy_load_format, dtype=args.accuracy_dtype, **variant)
    # calculate_kv_scales: the first real step sets the scales (the others: no effect).
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)
    return llm


def hf_logprobs(model: str, dtype: torch.dtype, device: str):  # noqa: ANN201 (a function)
    """Teacher-forced log-probabilities from transformers on the same weights, or None when
    `model` has no weights on disk (a built-in shape's are generated)."""
    folder = resolve_model(model)
    if is_builtin(model) and not any(folder.glob("*.safetensors")):
        return None
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def logprobs(prompt: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt], device=device)
        return hf(ids).logits[0].float().log_softmax(-1)

    return logprobs


Rounding = Callable[[torch.Tensor], torch.Tensor]


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to e4m3 at scale 1.0 (the default cache's) and widened back to float32."""
    one = torch.ones(1, device=x.device)
    return dequantize_fp8(quantize_fp8(x, one), one, torch.float32)


def hadamard(n: int, device: torch.device) -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order `n` (a power of two)."""
    if n & (n - 1):
        raise ValueError(f"--error-split's rotated variant needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / n**0.5


def e4m3_rotated(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to e4m3 in the basis rotated by the Hadamard matrix, then rotated back."""
    h = hadamard(x.shape[-1], x.device)
    return e4m3(x.float() @ h.T) @ h


def e4m3_smoothed(x: torch.Tensor) -> torch.Tensor:
    """`x` less its per-channel mean over the store's tokens, rounded to e4m3, the mean added
    back. A cache could store K - m exactly so (q.m is the same for every key of a query, and
    softmax ignores it) and V - m (the output adds m back); the mean here is the prompt's own,
    which no engine has in advance: the most that smoothing could give."""
    mean = x.float().mean(0, keepdim=True)
    return e4m3(x.float() - mean) + mean


def mantissa_bits(bits: int) -> Rounding:
    """Rounding to `bits` explicit mantissa bits, range unbounded (e4m3 keeps 3, bf16 7): how
    agreement falls with the precision alone."""
    def rounding(x: torch.Tensor) -> torch.Tensor:
        fraction, exponent = torch.frexp(x.float())  # x = fraction * 2**exponent, |f| in [0.5, 1)
        steps = 2.0 ** (bits + 1)
        return torch.ldexp(torch.round(fraction * steps) / steps, exponent)
    rounding.__name__ = f"mantissa_{bits}"
    return rounding


def int8_per_token_head(x: torch.Tensor) -> torch.Tensor:
    """`x` as int8 with one absmax scale per token and head (the last dim)."""
    scale = x.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(x.float() / scale).clamp(-127, 127) * scale


def exact(x: torch.Tensor) -> torch.Tensor:
    return x


ERROR_SPLIT: dict[str, tuple[Rounding, Rounding]] = {
    "fp8_k_only": (e4m3, exact), "fp8_v_only": (exact, e4m3),
    "fp8_hadamard": (e4m3_rotated, e4m3_rotated),
    "fp8_smoothed": (e4m3_smoothed, e4m3_smoothed)}

# K and V both rounded: the model's agreement as a function of the cache's precision. One bit
# less than bf16 (`bf16_less_1_bit`) is the smallest change a cache format can make; what it
# gives is the floor under any 8-bit format's agreement with the bf16 cache on this model.
NOISE_FLOOR: dict[str, tuple[Rounding, Rounding]] = {
    **{name: (mantissa_bits(bits), mantissa_bits(bits))
       for name, bits in (("mantissa_4", 4), ("mantissa_5", 5), ("bf16_less_1_bit", 6))},
    "int8_per_token_head": (int8_per_token_head, int8_per_token_head)}


@contextlib.contextmanager
def rounded_store(k_round: Rounding, v_round: Rounding) -> Iterator[None]:
    """Within the block every layer's store runs as usual, then the slots it wrote are rounded in
    place by `k_round`/`v_round` (the cache in the model's dtype). The store is the one point
    all K/V pass through, so this is the cache a format that rounds so would hold."""
    store = llama.attention_input

    def rounding_store(*args: Any) -> torch.Tensor:
        q = store(*args)
        k_cache, v_cache, slots = args[8], args[9], args[10]
        slots = slots[slots >= 0]
        blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
        for cache, rnd in ((k_cache, k_round), (v_cache, v_round)):
            cache[blocks, offsets] = rnd(cache[blocks, offsets]).to(cache.dtype)
        return q

    llama.attention_input = rounding_store
    try:
        yield
    finally:
        llama.attention_input = store


def agreement(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement, and top-5 (each side's argmax in the other's top 5), over rows."""
    top_a, top_b = a.topk(5, -1).indices, b.topk(5, -1).indices
    top1 = (top_a[:, 0] == top_b[:, 0]).float()
    in_b = (top_b == top_a[:, :1]).any(-1)
    in_a = (top_a == top_b[:, :1]).any(-1)
    return {"top1": top1.mean().item(), "top5": (in_a & in_b).float().mean().item()}


def variant_logprobs(engines: dict[str, LLM], rounded: dict[str, tuple[Rounding, Rounding]],
                     name: str, prompt: list[int]) -> torch.Tensor:
    """`prefill_logprobs` of one variant: its own engine, or auto's with its rounded store."""
    if name not in rounded:
        return prefill_logprobs(engines[name], prompt)
    with rounded_store(*rounded[name]):
        return prefill_logprobs(engines["auto"], prompt)


def accuracy(args: argparse.Namespace) -> dict[str, Any]:
    """Every variant against auto (and against transformers) over the same prompts."""
    model = args.accuracy_model or args.model
    engines = {name: accuracy_engine(model, args, v) for name, v in ACCURACY_VARIANTS.items()}
    rounded = {**(ERROR_SPLIT if args.error_split else {}),
               **(NOISE_FLOOR if args.noise_floor else {})}
    try:
        prompts = accuracy_prompts(args, engines["auto"])
        mc = engines["auto"].config.model_config
        hf = None if args.no_hf else hf_logprobs(model, mc.dtype, args.device)
        sums: dict[str, dict[str, float]] = {name: {} for name in [*engines, *rounded]}
        flip_margins: dict[str, list[float]] = {name: [] for name in sums}
        positions = decisive = 0
        for prompt in prompts:
            base = prefill_logprobs(engines["auto"], prompt)
            ref = hf(prompt) if hf is not None else None
            positions += len(prompt)
            top2 = base.topk(2, -1).values
            margin = top2[:, 0] - top2[:, 1]
            is_decisive = margin >= args.near_tie_nats
            decisive += int(is_decisive.sum())
            for name in sums:
                lp = base if name == "auto" else variant_logprobs(engines, rounded, name, prompt)
                agree = lp.argmax(-1) == base.argmax(-1)
                flip_margins[name] += margin[~agree].tolist()
                row = {"next_token_agreement": agree.sum().item(),
                       "decisive_agreement": (agree & is_decisive).sum().item(),
                       "kl_sum": (base.exp() * (base - lp)).sum().item()}
                if ref is not None:
                    row |= {f"hf_{k}_sum": v * len(prompt) for k, v in agreement(lp, ref).items()}
                for key, value in row.items():
                    sums[name][key] = sums[name].get(key, 0.0) + value
        result = {name: {"next_token_agreement": s["next_token_agreement"] / positions,
                         "decisive_agreement": s["decisive_agreement"] / max(1, decisive),
                         "disagreement_margin_median": (float(np.median(flip_margins[name]))
                                                        if flip_margins[name] else None),
                         "mean_kl": s["kl_sum"] / positions,
                         **{k.removesuffix("_sum"): v / positions for k, v in s.items()
                            if k.startswith("hf_")},
                         "kv_scales": (engines[name].engine.executor.workers[0].runner
                                       .kv_scales()[:4] if name in engines else None)}
                  for name, s in sums.items()}
    finally:
        for llm in engines.values():
            llm.shutdown()
    return {"model": model, "prompts": len(prompts), "positions": positions,
            "prompts_file": args.prompts_file, "hf": not args.no_hf and hf is not None,
            "near_tie_nats": args.near_tie_nats, "decisive_share": decisive / positions,
            "variants": result}


# -- report --------------------------------------------------------------------------------------


def ratios(runs: list[dict[str, Any]]) -> dict[str, float]:
    """The last run's figures over the first's (fp8 over the model's dtype by default)."""
    first, last = runs[0], runs[-1]
    t0, t1 = first["throughput"], last["throughput"]
    out = {"blocks_ratio": last["num_blocks"] / first["num_blocks"],
           "throughput_ratio": t1["output_tokens_per_s"] / t0["output_tokens_per_s"],
           # The most the cache dtype alone can give this workload: the ratio of the limits.
           "limit_ratio": t1["limit_output_tokens_per_s"] / t0["limit_output_tokens_per_s"]}
    for a in first["decode"]:
        for b in last["decode"]:
            if a["batch"] == b["batch"]:
                out[f"decode_batch{a['batch']}_speedup"] = a["step_ms"] / b["step_ms"]
    return out


def print_tables(result: dict[str, Any]) -> None:
    runs = result.get("engine", [])
    if runs:
        print(f"device: {result['device']}, copy bandwidth {result['copy_bandwidth_gbps']:.0f} "
              f"GB/s, model {runs[0].get('model', '')}")
        print(f"{'cache':<14} {'blocks':>9} {'B/block':>10} {'KV GiB':>7} {'out tok/s':>10} "
              f"{'limit':>10} {'of limit':>8} "
              + " ".join(f"{'dec' + str(d['batch']) + ' ms':>10}" for d in runs[0]["decode"]))
        for r in runs:
            t = r["throughput"]
            print(f"{r['dtype']:<14} {r['num_blocks']:>9,} {r['block_bytes']:>10,} "
                  f"{r['kv_bytes'] / GiB:>7.2f} {t['output_tokens_per_s']:>10,.0f} "
                  f"{t['limit_output_tokens_per_s']:>10,.0f} {t['of_limit']:>8.1%} "
                  + " ".join(f"{d['step_ms']:>10.3f}" for d in r["decode"]))
        print("ratios (last / first):", ", ".join(f"{k} {v:.3f}"
                                                  for k, v in result["ratios"].items()))
    acc = result.get("accuracy")
    if acc:
        print(f"accuracy on {acc['model']}: {acc['prompts']} prompts, {acc['positions']} "
              f"positions, teacher forced; {acc['decisive_share']:.1%} decisive (auto's top-1 "
              f"ahead by >= {acc['near_tie_nats']} nats)")
        for name, v in acc["variants"].items():
            hf = (f", vs transformers top-1 {v['hf_top1']:.4f} top-5 {v['hf_top5']:.4f}"
                  if "hf_top1" in v else "")
            flips = v["disagreement_margin_median"]
            print(f"  {name:<15} next-token agreement {v['next_token_agreement']:.4f} "
                  f"(decisive {v['decisive_agreement']:.4f}), mean KL {v['mean_kl']:.5f} nats"
                  + ("" if flips is None else f", median lead where they differ {flips:.3f}")
                  + hf)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny models gain nothing from threads that spin
    # Measured first, before any engine holds memory; in the model's default dtype (the CPU's
    # figures are held against its own limits, as bench/throughput.py's are).
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    limits = measure_device_limits(device, dtype)
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **limit_keys(limits, dtype),
        "kv_cache_dtypes": args.kv_cache_dtypes, "targets": TARGETS,
    }
    if not args.skip_engine:
        result["engine"] = [{"model": args.model, **engine_run(args, d, limits)}
                            for d in args.kv_cache_dtypes]
        result["ratios"] = ratios(result["engine"])
    if args.accuracy_prompts > 0:
        result["accuracy"] = accuracy(args)
    write_record(args.out, record_of("kv-dtype", result, vars(args)))
    print_tables(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
