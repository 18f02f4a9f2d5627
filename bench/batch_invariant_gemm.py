"""The deterministic mode's GEMM (`kvfit.batch_invariant.triton_matmul`) against cuBLAS at the
models' weight shapes, with candidate tile configs: what each costs, whether each is batch
invariant on the device, and whether each gives the same bits as the current config.

    PYTHONPATH=src python3 bench/batch_invariant_gemm.py --out $OUT/bi-gemm.json

CUDA only (Triton and a GPU). On an H200 this should take about 2 to 3 minutes: an estimate,
not a measurement (10 weight shapes, 46 (shape, M) cases, 6 kernels each timed by
`triton.testing.do_bench` at ~0.15 s, about 8 Triton compiles of a few seconds, and ~600
small launches for the bit checks).

Shapes: for each of `--models` (built-in configs, tensor parallel 1), the GEMMs the model
runs through `kvfit.batch_invariant.functional.linear` in the mode: qkv_proj, o_proj,
gate_up_proj, down_proj and the LM head (whose M is the sampled rows of a step: only the
`--m` values up to `--lm-head-max-m`). bf16 (`--dtype`), no bias, x `[M, K]` random.

Timed: `torch.nn.functional.linear` (cuBLAS), `matmul_triton` with the mode's own config at
each M (`matmul_config(M, N, K, dtype)`, "current") and with each of `--configs` (named
`m<BLOCK_M>n<BLOCK_N>k<BLOCK_K>w<warps>s<stages>`, GROUP_M 8; keep k64: BLOCK_K fixes each
row's K order). Median microseconds, and
the ratio to cuBLAS.

Checked, per shape and kernel, at the shape's largest M (`--check-m`, 8192, or the LM head's
cap): rows of the full product against the same rows computed at M = 1, 3, 64, 255 starting
at row 0, 5, the middle + 13 and the end ("invariant"); and the full product against the
current kernel's ("same bits"). A config that is invariant and gives the same bits as the
current one can replace it at any M without breaking invariance; one that is only invariant
can replace it for every M of that weight (one config per shape). cuBLAS is checked too, as
the control: it is expected to fail. Writes a record (`kvfit.benchmarks.record`) to --out
and prints the table.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record

CANDIDATES = ["m128n128k64w8s3", "m64n128k64w4s4", "m128n64k64w4s4", "m128n256k64w8s3"]
"""Default candidate configs: big tiles for prefill (M in the thousands), and the current
BLOCK_M with wider columns."""
CUBLAS, CURRENT = "cublas", "current"
M_VALUES = [1, 64, 256, 2048, 8192]
CHECK_ROWS = (1, 3, 64, 255)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_CONFIG = re.compile(r"m(\d+)n(\d+)k(\d+)w(\d+)s(\d+)")


def parse_config(name: str) -> dict[str, int]:
    """`m128n128k64w8s3` -> the launch config `matmul_triton` takes (GROUP_M 8)."""
    found = _CONFIG.fullmatch(name)
    if not found:
        raise ValueError(f"config {name!r} is not m<BLOCK_M>n<BLOCK_N>k<BLOCK_K>w<warps>"
                         f"s<stages>, e.g. m128n128k64w8s3")
    bm, bn, bk, warps, stages = map(int, found.groups())
    for what, v in (("BLOCK_M", bm), ("BLOCK_N", bn), ("BLOCK_K", bk)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"config {name!r}: {what} must be a power of two >= 16, got {v}")
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
                num_stages=stages)


def config_name(cfg: dict[str, int]) -> str:
    """The inverse of `parse_config` (GROUP_M aside)."""
    return (f"m{cfg['BLOCK_M']}n{cfg['BLOCK_N']}k{cfg['BLOCK_K']}w{cfg['num_warps']}"
            f"s{cfg['num_stages']}")


@dataclass(frozen=True)
class GemmShape:
    """One weight the model multiplies by: `[n, k]`; `max_m` caps the M it is run at."""

    model: str
    gemm: str
    n: int
    k: int
    max_m: int | None = None

    @property
    def label(self) -> str:
        return f"{self.model} {self.gemm}"


def gemm_shapes(model: str, lm_head_max_m: int) -> list[GemmShape]:
    """The GEMMs of one decoder layer of `model` (a built-in name or a folder) and its LM head,
    at tensor parallel 1, as `kvfit.models.llama` builds them."""
    from kvfit.models.llama import head_dim
    from kvfit.models.loader import load_hf_config

    c = load_hf_config(model)
    heads, dim = c.num_attention_heads, head_dim(c)
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return [
        GemmShape(model, "qkv_proj", (heads + 2 * kv_heads) * dim, c.hidden_size),
        GemmShape(model, "o_proj", c.hidden_size, heads * dim),
        GemmShape(model, "gate_up_proj", 2 * c.intermediate_size, c.hidden_size),
        GemmShape(model, "down_proj", c.hidden_size, c.intermediate_size),
        GemmShape(model, "lm_head", c.vocab_size, c.hidden_size, lm_head_max_m),
    ]


def m_values(shape: GemmShape, ms: list[int]) -> list[int]:
    """The M values of `ms` the shape runs at (its cap itself if none is under it)."""
    return [m for m in ms if shape.max_m is None or m <= shape.max_m] or [shape.max_m]


def check_starts(m: int, rows: int) -> list[int]:
    """Where the `m`-row slices start: row 0, row 5 (off every tile border), the middle + 13
    and the last `m` rows; those that fit in `rows`."""
    return sorted({s for s in (0, 5, rows // 2 + 13, rows - m) if 0 <= s <= rows - m})


def row_mismatches(full: torch.Tensor, op: Any, x: torch.Tensor) -> list[str]:
    """Slices of `x` (see `check_starts`) whose `op` differs from the same rows of `full`
    (= `op(x)`), bit for bit."""
    rows = x.shape[0]
    failures = []
    for m in CHECK_ROWS:
        for start in check_starts(m, rows):
            if not torch.equal(op(x[start:start + m]), full[start:start + m]):
                failures.append(f"rows {start}:{start + m} of {rows}")
    return failures


@dataclass(frozen=True)
class Kernels:
    """What `measure_shape` runs on: the device, a timer (median microseconds of a call), the
    mode's GEMM with a config and its default config. `cuda_kernels()` is the real one; the
    tests pass CPU stand-ins."""

    device: str
    time_us: Callable[[Callable[[], object]], float]
    matmul: Callable[[torch.Tensor, torch.Tensor, dict[str, int]], torch.Tensor]
    default_config: Callable[[int, int, int, torch.dtype], dict[str, int]]


def cuda_kernels() -> Kernels:
    """`triton.testing.do_bench` (median) and `matmul_triton` on the current CUDA device."""
    from triton.testing import do_bench

    from kvfit.batch_invariant.triton_matmul import matmul_config, matmul_triton

    return Kernels("cuda", lambda fn: do_bench(fn, return_mode="median") * 1e3,
                   lambda x, w, cfg: matmul_triton(x, w, config=cfg), matmul_config)


def measure_shape(shape: GemmShape, configs: dict[str, dict[str, int] | None],
                  ms: list[int], check_m: int, dtype: torch.dtype, seed: int,
                  kernels: Kernels) -> tuple[list[dict], list[dict]]:
    """(timing rows, one per M: microseconds per kernel; check rows, one per kernel) of one
    weight shape. `configs` maps a kernel name to its config (None: the default config)."""
    g = torch.Generator(device=kernels.device).manual_seed(seed)
    rows = max(m_values(shape, [*ms, check_m]))  # the checks' M; every timed M fits in it
    x = torch.randn(rows, shape.k, device=kernels.device, dtype=dtype, generator=g)
    w = torch.randn(shape.n, shape.k, device=kernels.device, dtype=dtype, generator=g)
    w *= shape.k**-0.5

    def op(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        if name == CUBLAS:
            return lambda a: F.linear(a, w)
        return lambda a: kernels.matmul(a, w, configs[name])  # None: the mode's, per M

    ops = {k: op(k) for k in [CUBLAS, *configs]}
    timings = []
    for m in m_values(shape, ms):
        us = {k: kernels.time_us(partial(f, x[:m])) for k, f in ops.items()}
        current = config_name(kernels.default_config(m, shape.n, shape.k, dtype))
        timings.append({"model": shape.model, "gemm": shape.gemm, "n": shape.n, "k": shape.k,
                        "m": m, "us": us, "current_config": current})
    reference = ops[CURRENT](x)
    checks = []
    for k, f in ops.items():
        full = f(x)
        failures = row_mismatches(full, f, x)
        checks.append({"model": shape.model, "gemm": shape.gemm, "kernel": k, "rows": rows,
                       "config": (None if k == CUBLAS else config_name(configs[k]) if configs[k]
                                  else "per M"),
                       "invariant": not failures, "failures": failures[:8],
                       "same_bits_as_current": torch.equal(full, reference)})
        del full
    return timings, checks


def summarise(timings: list[dict], checks: list[dict]) -> dict:
    """The payload: the timings with each kernel's ratio to cuBLAS, the checks, and per shape
    the picks a fix would take: the fastest config that gives the current bits at each M
    (replaceable per M), and the one config fastest over all M among the invariant ones
    (replaceable per shape, summed microseconds)."""
    for t in timings:
        t["over_cublas"] = {k: us / t["us"][CUBLAS] for k, us in t["us"].items() if k != CUBLAS}
    picks = []
    shapes = list(dict.fromkeys((t["model"], t["gemm"]) for t in timings))
    for model, gemm in shapes:
        rows = [t for t in timings if (t["model"], t["gemm"]) == (model, gemm)]
        ok = {c["kernel"]: c for c in checks
              if (c["model"], c["gemm"]) == (model, gemm) and c["kernel"] != CUBLAS}
        same = [k for k, c in ok.items() if c["invariant"] and c["same_bits_as_current"]]
        invariant = [k for k, c in ok.items() if c["invariant"]]
        per_m = {t["m"]: min(same, key=lambda k, t=t: t["us"][k]) for t in rows if same}
        total = {k: sum(t["us"][k] for t in rows) for k in invariant}
        best = min(total, key=total.get) if total else None
        picks.append({
            "model": model, "gemm": gemm,
            "current_config": {t["m"]: t["current_config"] for t in rows},
            "same_bits_configs": same,
            "fastest_same_bits_per_m": per_m,
            "fastest_invariant_overall": best,
            "overall_us": total,
            "current_overall_us": sum(t["us"][CURRENT] for t in rows),
            "cublas_overall_us": sum(t["us"][CUBLAS] for t in rows),
        })
    return {"timings": timings, "checks": checks, "picks": picks}


def table_text(result: dict) -> str:
    """The timing table (us and x cuBLAS per kernel), each shape's invariance and same-bits
    line under its rows, then the picks."""
    timings, checks = result["timings"], result["checks"]
    kernels = [k for k in timings[0]["us"] if k != CUBLAS] if timings else []
    w = max([18, *map(len, kernels)])
    lines = [f"{'model':<18} {'gemm':<13} {'N':>6} {'K':>6} {'M':>5} {'cuBLAS us':>10} "
             + " ".join(f"{k:>{w}}" for k in kernels),
             f"{'':<63} " + " ".join(f"{'us    x cuBLAS':>{w}}" for _ in kernels)]
    shapes = list(dict.fromkeys((t["model"], t["gemm"]) for t in timings))
    for model, gemm in shapes:
        for t in (t for t in timings if (t["model"], t["gemm"]) == (model, gemm)):
            cells = " ".join(f"{t['us'][k]:>{w - 8}.1f} {t['over_cublas'][k]:>6.2f}x"
                             for k in kernels)
            lines.append(f"{model:<18} {gemm:<13} {t['n']:>6} {t['k']:>6} {t['m']:>5} "
                         f"{t['us'][CUBLAS]:>10.1f} {cells}")
        shape_checks = {c["kernel"]: c for c in checks
                        if (c["model"], c["gemm"]) == (model, gemm)}
        cublas = shape_checks.get(CUBLAS)
        lines.append(f"{'':<18} {'bits':<13} {'':>6} {'':>6} {'':>5} "
                     f"{'inv ' + ('yes' if cublas and cublas['invariant'] else 'NO'):>10} "
                     + " ".join(f"{_verdict(shape_checks.get(k)):>{w}}" for k in kernels))
    lines.append("")
    lines.append("picks: the fastest config with the current bits at each M (a per-M choice "
                 "keeps invariance); the fastest invariant config summed over M (one per shape)")
    for p in result["picks"]:
        per_m = ", ".join(f"M={m}: {k}" for m, k in p["fastest_same_bits_per_m"].items())
        best = p["fastest_invariant_overall"]
        overall = (f"{best} {p['overall_us'][best]:.1f} us vs current "
                   f"{p['current_overall_us']:.1f}, cuBLAS {p['cublas_overall_us']:.1f}"
                   if best else "none invariant")
        current = "/".join(dict.fromkeys(p["current_config"].values()))
        lines.append(f"{p['model']:<18} {p['gemm']:<13} (current {current}) per M: "
                     f"{per_m or 'none'}; one config: {overall}")
    return "\n".join(lines)


def _verdict(check: dict | None) -> str:
    if check is None:
        return "-"
    return (f"inv {'yes' if check['invariant'] else 'NO'}, same "
            f"{'yes' if check['same_bits_as_current'] else 'no'}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON record path")
    parser.add_argument("--models", nargs="+", default=["qwen3-0.6b-shape", "qwen3-8b-shape"])
    parser.add_argument("--m", type=int, nargs="+", default=M_VALUES, metavar="M",
                        help="rows of x to time at")
    parser.add_argument("--configs", nargs="*", default=CANDIDATES, type=_config_arg,
                        help="candidate configs, m<BLOCK_M>n<BLOCK_N>k<BLOCK_K>w<warps>s<stages>")
    parser.add_argument("--check-m", type=int, default=8192,
                        help="rows of the product the bit checks slice")
    parser.add_argument("--lm-head-max-m", type=int, default=256,
                        help="largest M of the LM head (its rows are the sampled ones)")
    parser.add_argument("--dtype", choices=DTYPES, default="bf16")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _config_arg(name: str) -> str:
    try:
        parse_config(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: it times the Triton GEMM against cuBLAS")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        parser.error(f"needs Triton (pip install 'kvfit[cuda]'): {e}")
    limits = in_run_limits("cuda")
    configs: dict[str, dict[str, int] | None] = {CURRENT: None}
    configs |= {name: parse_config(name) for name in args.configs}
    kernels = cuda_kernels()
    timings, checks = [], []
    for shape in [s for model in args.models for s in gemm_shapes(model, args.lm_head_max_m)]:
        t, c = measure_shape(shape, configs, args.m, args.check_m, DTYPES[args.dtype], args.seed,
                             kernels)
        timings += t
        checks += c
        print(f"{shape.label}: done", flush=True)
        torch.cuda.empty_cache()
    shapes = [s for model in args.models for s in gemm_shapes(model, args.lm_head_max_m)]
    result = {"device": torch.cuda.get_device_name(), "dtype": args.dtype,
              "shapes": [asdict(s) for s in shapes], **summarise(timings, checks), **limits}
    write_record(args.out, record_of("batch-invariant-gemm", result, vars(args)))
    print(f"device: {result['device']}, {args.dtype}")
    print(table_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
