"""Deterministic (batch-invariant) mode: what it costs, and whether outputs are bit-identical.

    python3 bench/determinism.py --out determinism.json                      # on the GPU machine
    python3 bench/determinism.py --skip-checks --out cost.json               # the cost alone
    python3 bench/determinism.py --skip-throughput --out checks.json         # the checks alone
    PYTHONPATH=src python3 bench/determinism.py --skip-checks --profile $OUT/det-profile.txt \\
        --out $OUT/det-cost.json                                 # where the cost goes (GPU)
    python3 bench/determinism.py --device cpu --model kvfit-tiny --num-seqs 8 --min-len 8 \\
        --max-len 32 --check-models kvfit-tiny --check-prompts 4 --check-others 8 \\
        --check-max-tokens 4 --out d.json

Cost: `bench/throughput.py`'s offline workload (its `offline_workload`: `--num-seqs` requests,
prompt and output lengths uniform in [`--min-len`, `--max-len`], dummy weights, temperature 1),
timed as there, in the default mode and with `deterministic=True` side by side in this one
process; the cost is 1 - deterministic / default output tokens per second.

`--profile PATH`: after each mode's timed runs, the same workload once more (other token ids)
under torch.profiler (`bench/throughput.py`'s `profile_offline`); PATH gets both modes side by
side: device time per kernel family (GEMM by cuBLAS vs the mode's `_matmul_kernel`, attention
prefill/decode kernels, norms, sampling, ...), the same split by step kind (decode-only vs
mixed steps, with the steps' host time), the top kernels, and the difference; the record gets
the per-family totals (`results.profile`). On an H200 the `--skip-checks --profile` command
above should take about 3 to 5 minutes: an estimate, not a measurement (per mode: start-up,
Triton compiles on a fresh machine, the untimed, timed and profiled runs at the 2026-12-04
pace of ~6 s default and ~11 s deterministic each, and the profiler's processing of a few
hundred thousand kernel events, the least certain part); without `--skip-checks` the checks
come on top.

Checks, for each of `--check-models` (dummy weights), in both modes: `--check-prompts` prompts
(16 to 256 tokens, greedy, `--check-max-tokens` tokens, the top logprob), each alone on a
graphed engine; then all of them in one batch among filler prompts up to 1 + `--check-others`
sequences; the same batch reversed (other positions); these from an empty prefix cache; the
batch again (every prompt's full blocks prefix-cache hits); and the batch on an eager engine
whose small KV cache forces preemptions. Reported: how many prompts give bit-identical token
ids and logprobs to their run alone, per case. Writes a record (kvfit.benchmarks.record) to
--out, prints tables.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

import torch

from kvfit import LLM, SamplingParams
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.profiling import FAMILY_NAMES, KernelProfile, comparison_text
from kvfit.benchmarks.record import write_record
from kvfit.ops.compiles import triton_compiles
from throughput import check_lengths, count, offline_workload, profile_offline

MODES = {"default": False, "deterministic": True}


def offline_throughput(args: argparse.Namespace, deterministic: bool
                       ) -> tuple[dict, KernelProfile | None]:
    """`bench/throughput.py`'s offline workload on one engine in one mode: output tokens per
    second from submission to the last completion, median of `--repeat` timed runs (other
    token ids each) after an untimed run of the same shape (kernel compilation); and with
    `--profile`, the profile of one more run (else None)."""
    llm = LLM(args.model, device=args.device, load_format="dummy",
              max_model_len=2 * args.max_len + 1, enforce_eager=args.enforce_eager,
              deterministic=deterministic)
    vocab = llm.config.model_config.hf_config.vocab_size
    seeds = [args.seed + i for i in range(args.repeat)]
    if args.warmup:
        llm.generate(*offline_workload(args, vocab, seeds[-1] + 1), use_tqdm=False)
    runs = []
    for seed in seeds:
        prompts, params = offline_workload(args, vocab, seed)
        _sync(llm)
        with triton_compiles() as compiled:
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            _sync(llm)
            elapsed = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append({"seed": seed, "elapsed_s": elapsed, "output_tokens": tokens,
                     "output_tokens_per_s": tokens / elapsed, "kernels_compiled": compiled})
    profile = profile_offline(llm, args, vocab, seeds[-1] + 2) if args.profile else None
    llm.shutdown()
    speed = statistics.median_low(r["output_tokens_per_s"] for r in runs)
    median = next(r for r in runs if r["output_tokens_per_s"] == speed)
    return {"mode": "deterministic" if deterministic else "default", "model": args.model,
            "num_seqs": args.num_seqs, **median, "runs": runs}, profile


def profile_summary(profiles: dict[str, KernelProfile]) -> dict:
    """The record's `profile`: per mode its totals, families, step split and top kernels, and
    per family the deterministic - default device ms."""
    modes = {mode: p.as_dict() for mode, p in profiles.items()}
    summary: dict = {"modes": modes}
    if {"default", "deterministic"} <= set(modes):
        a, b = modes["default"]["families_ms"], modes["deterministic"]["families_ms"]
        summary["families_diff_ms"] = {f: b[f] - a[f] for f in FAMILY_NAMES}
        summary["device_diff_ms"] = modes["deterministic"]["device_ms"] - modes["default"][
            "device_ms"]
        summary["wall_diff_s"] = modes["deterministic"]["wall_s"] - modes["default"]["wall_s"]
    return summary


def _sync(llm: LLM) -> None:
    if llm.config.device.type == "cuda":
        torch.cuda.synchronize(llm.config.device)


def fingerprints(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[tuple]:
    """Per prompt: its token ids and (token, logprob, rank) entries, exactly."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [sorted((t, lp.logprob, lp.rank) for t, lp in d.items())
              for d in o.outputs[0].logprobs]) for o in outs]


def check_prompts(args: argparse.Namespace, vocab: int) -> tuple[list, list]:
    """(the checked prompts, the filler prompts), random ids (other seeds than the cost's)."""
    rng = random.Random(args.seed + 1000)

    def prompt(low: int, high: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(rng.randint(low, high))]

    checked = [prompt(16, 256) for _ in range(args.check_prompts)]
    fillers = [prompt(16, 256) for _ in range(max(0, args.check_others + 1 - len(checked)))]
    return checked, fillers


CHECK_MAX_MODEL_LEN = 512  # prompts of at most 256 tokens, at most 256 generated


def engine(args: argparse.Namespace, model: str, deterministic: bool, **kwargs: object) -> LLM:
    kwargs.setdefault("max_model_len", CHECK_MAX_MODEL_LEN)
    return LLM(model, device=args.device, load_format="dummy", max_num_seqs=args.check_others + 1,
               deterministic=deterministic, seed=args.seed, **kwargs)


def invariance(args: argparse.Namespace, model: str, deterministic: bool) -> dict:
    """How many of the checked prompts match their run alone in each case (see module)."""
    params = SamplingParams(temperature=0.0, max_tokens=args.check_max_tokens, ignore_eos=True,
                            logprobs=1)
    llm = engine(args, model, deterministic, enforce_eager=args.enforce_eager)
    checked, fillers = check_prompts(args, llm.config.model_config.hf_config.vocab_size)
    n = len(checked)
    batch = [p for pair in zip(checked, fillers[:n], strict=False) for p in pair]
    batch += fillers[n:] + checked[len(fillers):]  # the checked prompts spread through it
    where = [batch.index(p) for p in checked]
    alone = []
    for p in checked:  # each computed from scratch
        llm.reset_prefix_cache()
        alone.append(fingerprints(llm, [p], params)[0])
    results = {}
    for case, order in (("in a batch", batch), ("reversed batch", batch[::-1]),
                        ("prefix-cache hit", batch)):
        if case != "prefix-cache hit":  # computed from scratch; the hit reuses the last run's
            llm.reset_prefix_cache()
        found = fingerprints(llm, order, params)
        rows = where if order is batch else [len(batch) - 1 - i for i in where]
        results[case] = sum(found[r] == a for r, a in zip(rows, alone, strict=True))
    llm.shutdown()
    gc.collect()
    # An eager engine whose cache holds a quarter of the batch's blocks, or the longest
    # sequence and one block more: the sequences it admits outgrow it, so it preempts.
    longest = max(len(p) for p in batch) + args.check_max_tokens
    blocks = sum(-(-(len(p) + args.check_max_tokens) // 16) for p in batch) // 4
    small = engine(args, model, deterministic, enforce_eager=True, max_model_len=longest,
                   num_gpu_blocks_override=max(blocks, -(-longest // 16) + 1),
                   enable_prefix_caching=False)
    found = fingerprints(small, batch, params)
    results["preempted, eager"] = sum(found[r] == a for r, a in zip(where, alone, strict=True))
    preemptions = small.engine.scheduler.num_preemptions
    small.shutdown()
    gc.collect()
    return {"model": model, "mode": "deterministic" if deterministic else "default",
            "prompts": n, "batch": len(batch), "preemptions": preemptions,
            "identical": results}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON record path")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model", default="qwen3-0.6b-shape", help="the cost's model")
    parser.add_argument("--num-seqs", type=count, default=256)
    parser.add_argument("--min-len", type=count, default=100)
    parser.add_argument("--max-len", type=count, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=count, default=1,
                        help="timed offline runs per mode; the median is reported")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="an untimed run of the offline workload first, in each mode")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--check-models", nargs="*",
                        default=["qwen3-0.6b-shape", "qwen3-8b-shape"])
    parser.add_argument("--check-prompts", type=count, default=48)
    parser.add_argument("--check-others", type=int, default=255,
                        help="sequences beside each checked one in the batch cases")
    parser.add_argument("--check-max-tokens", type=count, default=32,
                        help=f"tokens generated per checked prompt (at most "
                        f"{CHECK_MAX_MODEL_LEN - 256})")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--profile", metavar="PATH",
                        help="profile the offline workload once more in each mode and write "
                             "both kernel tables, grouped by family, side by side to PATH")
    args = parser.parse_args(argv)
    check_lengths(parser, args)
    if args.profile and args.skip_throughput:
        parser.error("--profile profiles the cost's workload: drop --skip-throughput")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"

    result: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda")
                    else "cpu", **in_run_limits(args.device), "throughputs": [], "checks": []}
    if not args.skip_throughput:
        profiles = {}
        for mode, deterministic in MODES.items():
            throughput, profile = offline_throughput(args, deterministic)
            result["throughputs"].append(throughput)
            if profile is not None:
                profiles[mode] = profile
            gc.collect()
        if profiles:
            with open(args.profile, "w") as f:
                f.write(comparison_text(profiles))
            result["profile"] = profile_summary(profiles)
    if not args.skip_checks:
        for model in args.check_models:
            for deterministic in MODES.values():
                result["checks"].append(invariance(args, model, deterministic))
    write_record(args.out, record_of("determinism", result, vars(args)))
    print_tables(result)
    return 0


def print_tables(result: dict) -> None:
    print(f"device: {result['device']}")
    speeds = {t["mode"]: t["output_tokens_per_s"] for t in result["throughputs"]}
    for t in result["throughputs"]:
        ratio = t["output_tokens_per_s"] / speeds["default"] if "default" in speeds else 1.0
        print(f"offline {t['model']} {t['mode']:<13}: {t['num_seqs']} seqs in "
              f"{t['elapsed_s']:.2f} s, {t['output_tokens_per_s']:,.0f} output tok/s "
              f"({ratio:.3f} x default, {len(t['kernels_compiled'])} compiles in the timed run)")
    if "profile" in result:
        print_profile(result["profile"])
    if result["checks"]:
        cases = list(result["checks"][0]["identical"])
        print(f"{'model':<18} {'mode':<13} " + " ".join(f"{c:>17}" for c in cases)
              + "  preemptions")
        for c in result["checks"]:
            cells = " ".join(f"{c['identical'][k]:>11} of {c['prompts']:<3}" for k in cases)
            print(f"{c['model']:<18} {c['mode']:<13} {cells}  {c['preemptions']}")


def print_profile(summary: dict) -> None:
    """Device ms per kernel family in each profiled mode, and the difference."""
    modes = summary["modes"]
    print("profiled run, device ms per kernel family: " + ", ".join(
        f"{m} {p['wall_s']:.2f} s wall, busy {p['busy_mean']:.0%}" for m, p in modes.items()))
    print(f"{'family':<18} " + " ".join(f"{m:>13}" for m in modes)
          + (f" {'diff':>10}" if "families_diff_ms" in summary else ""))
    for family in FAMILY_NAMES:
        cells = " ".join(f"{p['families_ms'][family]:>13.1f}" for p in modes.values())
        diff = summary.get("families_diff_ms", {}).get(family)
        print(f"{family:<18} {cells}" + (f" {diff:>+10.1f}" if diff is not None else ""))


if __name__ == "__main__":
    sys.exit(main())
