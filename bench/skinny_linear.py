"""The small-batch linear kernels (`kvfit.ops.triton_skinny`) against cuBLAS at decode sizes.

    PYTHONPATH=src python3 bench/skinny_linear.py --out $OUT/skinny-linear.json

CUDA only (Triton and a GPU); about a minute on an H200 (an estimate: 10 shapes x 5 M x 2-4
ops, each a CUDA-graph replay of ~0.1 s, and ~10 compiles of a few seconds).

Shapes: the linear layers of `--models` (default the built-in 0.6B: hidden 1024, q 2048, kv
1024 each, intermediate 3072; and 8B: hidden 4096, q 4096, kv 1024 each, intermediate 12288)
and their LM head (vocab 151936), bf16, at M in `--m` (1 2 4 8 16; above the skinny kernels'
16 rows, as at a decode step of 64-256 sequences, cuBLAS and the unfused chain alone). Per
shape and M, each op is timed as a CUDA graph node (`triton.testing.do_bench_cudagraph`), as
a decode graph runs it, over as many copies of the weight as fill `--rotate-mib` (default 512
MiB, several L2s) so that every call reads its weight from DRAM as a decode step does:

- `cublas`: `F.linear`; `cublaslt`: the same under `torch.backends.cuda.preferred_blas_library
  ("cublaslt")`, whose heuristics might split K where few output tiles leave SMs idle (the
  N-1024 layers at 64-256 rows; on an H100 on 2026-12-07 the 0.6B's layers took the same time
  either way); `skinny`: `skinny_linear_triton`;
- where the model folds an op in (qkv and gate_up after the residual add + RMSNorm, down after
  SiLU-and-mul): `unfused` (the op's own kernel, then `F.linear`) and `fused`
  (`rms_norm_linear_triton` / `silu_and_mul_linear_triton`);
- `skinny_mma`: the plain kernel with its 16-row tensor-core tile at every M (`ROW_GEMV` off),
  where `skinny` takes FMAs at one row; `fused_mma` (one row, norm prologues): the fused
  kernel with `ROW_GEMV` off, its one row's prologue broadcast to the MMA tile, where `fused`
  takes FMAs;
- `skinny_whole` and `fused_whole` (with `_pdl` as below), where `skinny_config` splits K
  across programs (`split_k`: the 0.6B's N-1024 layers), the same launch unsplit; the engine's
  split-K scratch is in effect throughout, as in a decode step;
- `skinny_pdl` and `fused_pdl`: the same kernels launched with programmatic dependent launch
  (`pdl=True`: each node prefetches its weights and starts while the node before finishes),
  on compute capability 9.0+. The graph chains the calls, so each has a predecessor to
  overlap, as in a decode step.

Reported: microseconds, the weight's GB/s and that over the in-run copy bandwidth
(`copy_bandwidth_gbps`), skinny/cublas and fused/unfused, and cuBLAS against the op's limit:
max(bytes moved / copy bandwidth, 2MNK / the in-run GEMM rate), the bytes being the weight,
the input and the output (`cublas_over_limit`: how far a decode step's GEMMs sit from what
the device allows at that batch). With `--sweep`, the skinny kernel at each of a few tile
configs too (exploration for `skinny_config`). Writes a record (`kvfit.benchmarks.record`)
to --out and prints the table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.limits import in_run_limits
from kvfit.benchmarks.record import write_record

MiB = 1 << 20


@dataclass(frozen=True)
class Shape:
    model: str
    layer: str
    n: int
    k: int
    prologue: str  # "none", "add_rms_norm" or "silu_and_mul"


LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


def shapes(model: str) -> list[Shape]:
    """The linear layers of one decoder layer of `model` (a built-in name or a folder) and its
    LM head at tensor parallel 1, as `kvfit.models.llama` builds them, with the op the
    small-batch path folds into each."""
    from kvfit.models.llama import head_dim
    from kvfit.models.loader import load_hf_config

    c = load_hf_config(model)
    heads, dim = c.num_attention_heads, head_dim(c)
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    return [Shape(model, "qkv_proj", (heads + 2 * kv_heads) * dim, c.hidden_size, "add_rms_norm"),
            Shape(model, "o_proj", c.hidden_size, heads * dim, "none"),
            Shape(model, "gate_up_proj", 2 * c.intermediate_size, c.hidden_size, "add_rms_norm"),
            Shape(model, "down_proj", c.hidden_size, c.intermediate_size, "silu_and_mul"),
            Shape(model, "lm_head", c.vocab_size, c.hidden_size, "none")]


SWEEP = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=s, SPLIT_K=p)
         for bn, bk, w, s, p in ((16, 256, 2, 4, 1), (16, 512, 4, 3, 1), (32, 256, 4, 4, 1),
                                 (32, 128, 4, 6, 1), (64, 128, 4, 4, 1), (64, 256, 8, 3, 1),
                                 # few tiles: more stages in flight, or K in parts
                                 (16, 256, 2, 6, 1), (16, 256, 2, 8, 1), (16, 128, 2, 8, 1),
                                 (16, 256, 2, 4, 2), (16, 256, 2, 4, 4), (16, 128, 2, 4, 4))]


def _time_us(calls: list[Callable[[], object]]) -> float:
    """Microseconds per call, replaying all of `calls` (one per weight copy) as one graph."""
    import triton.testing

    def run() -> None:
        for call in calls:
            call()

    return triton.testing.do_bench_cudagraph(run, rep=50, return_mode="median") * 1e3 / len(calls)


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` for the block, then put back."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def limit_us(shape: Shape, m: int, limits: dict) -> float | None:
    """The op's time at the in-run limits (None without them): its bf16 weight, input and
    output at copy bandwidth, or its 2MNK FLOPs at the GEMM rate, whichever is longer."""
    if not limits:
        return None
    moved = 2 * (shape.n * shape.k + m * shape.k + m * shape.n)
    flops = 2 * m * shape.n * shape.k
    return max(moved / (limits["copy_bandwidth_gbps"] * 1e3),
               flops / (limits["gemm_tflops"] * 1e6))


def measure(shape: Shape, m: int, rotate_bytes: int, sweep: bool, limits: dict) -> dict:
    from kvfit.ops import triton_skinny as ts
    from kvfit.ops.layers import add_rms_norm, silu_and_mul
    from kvfit.ops.sm_count import num_sms
    from kvfit.ops.small_batch import small_batch_kernels

    dev, dtype = torch.device("cuda"), torch.bfloat16
    weight_bytes = shape.n * shape.k * 2
    copies = max(1, min(64, -(-rotate_bytes // weight_bytes)))
    ws = [torch.randn(shape.n, shape.k, device=dev, dtype=dtype) / shape.k**0.5
          for _ in range(copies)]
    x = torch.randn(m, shape.k, device=dev, dtype=dtype)
    res = torch.randn(m, shape.k, device=dev, dtype=dtype)
    norm = torch.ones(shape.k, device=dev, dtype=dtype)
    gate_up = torch.randn(m, 2 * shape.k, device=dev, dtype=dtype)
    skinny = m <= ts.MAX_ROWS
    pdl_ok = torch.cuda.get_device_capability(dev)[0] >= 9
    pdls = ([False, True] if pdl_ok else [False]) if skinny else []
    us = {"cublas": _time_us([lambda w=w: F.linear(x, w) for w in ws])}
    with blas_library("cublaslt"):
        us["cublaslt"] = _time_us([lambda w=w: F.linear(x, w) for w in ws])
    kinds = {"none": ts.NONE, "add_rms_norm": ts.ADD_RMS_NORM, "silu_and_mul": ts.SILU_AND_MUL}
    config = ts.skinny_config(shape.n, shape.k, num_sms(dev), kinds[shape.prologue])
    # The engine's split-K scratch is in effect, so the kernels split where `skinny_config`
    # says (`skinny`, `fused`); `*_whole` beside them where it does: the same launch unsplit.
    wholes: dict[str, dict | None] = {"": None}
    if config["SPLIT_K"] > 1:
        wholes["_whole"] = {**config, "SPLIT_K": 1}
    with small_batch_kernels(scratch=ts.allocate_split_k_scratch(dev)):
        for pdl in pdls:
            for whole, cfg in wholes.items():
                tag = whole + ("_pdl" if pdl else "")
                us["skinny" + tag] = _time_us([lambda w=w, p=pdl, c=cfg: ts.skinny_linear_triton(
                    x, w, config=c, pdl=p) for w in ws])
                if shape.prologue == "add_rms_norm":
                    us["fused" + tag] = _time_us([lambda w=w, p=pdl, c=cfg:
                                                  ts.rms_norm_linear_triton(
                                                      x, res, norm, 1e-6, w, config=c, pdl=p)
                                                  for w in ws])
                elif shape.prologue == "silu_and_mul":
                    us["fused" + tag] = _time_us([lambda w=w, p=pdl, c=cfg:
                                                  ts.silu_and_mul_linear_triton(
                                                      gate_up, w, config=c, pdl=p) for w in ws])
        # The plain kernel at one row takes FMAs (`ROW_GEMV`); its 16-row MMA tile, as at
        # 2-16 rows, beside it.
        if skinny:
            mma = {**ts.skinny_config(shape.n, shape.k, num_sms(dev)), "ROW_GEMV": False}
            us["skinny_mma"] = _time_us([lambda w=w: ts.skinny_linear_triton(x, w, config=mma)
                                         for w in ws])
        if m == 1 and shape.prologue == "add_rms_norm":
            mma = {**config, "ROW_GEMV": False}
            us["fused_mma"] = _time_us([lambda w=w: ts.rms_norm_linear_triton(
                x, res, norm, 1e-6, w, config=mma) for w in ws])
        if sweep and skinny:
            for cfg in SWEEP:
                name = "n{BLOCK_N}k{BLOCK_K}w{num_warps}s{num_stages}p{SPLIT_K}".format(**cfg)
                if shape.k % (cfg["SPLIT_K"] * cfg["BLOCK_K"]) == 0:
                    us[f"skinny.{name}"] = _time_us([lambda w=w, c=cfg: ts.skinny_linear_triton(
                        x, w, config=c) for w in ws])
    if shape.prologue == "add_rms_norm":
        us["unfused"] = _time_us([lambda w=w: F.linear(add_rms_norm(x, res, norm, 1e-6)[0], w)
                                  for w in ws])
    elif shape.prologue == "silu_and_mul":
        us["unfused"] = _time_us([lambda w=w: F.linear(silu_and_mul(gate_up), w) for w in ws])
    row = {"model": shape.model, "layer": shape.layer, "n": shape.n, "k": shape.k, "m": m,
           "prologue": shape.prologue, "weight_copies": copies, "us": us,
           "weight_gb_per_s": {k: weight_bytes / (v * 1e3) for k, v in us.items()}}
    if skinny:
        row["skinny_over_cublas"] = us["skinny"] / us["cublas"]
    limit = limit_us(shape, m, limits)
    if limit is not None:
        row["limit_us"], row["cublas_over_limit"] = limit, us["cublas"] / limit
    if "fused" in us:
        row["fused_over_unfused"] = us["fused"] / us["unfused"]
    return row


def table_text(result: dict) -> str:
    nan = float("nan")
    copy = result.get("copy_bandwidth_gbps")
    lines = [f"{'model':16} {'layer':13} {'M':>3} {'cublas us':>9} {'lt us':>7} {'skinny us':>9} "
             f"{'GB/s':>7} {'of copy':>7} {'unfused':>8} {'fused':>8} {'skinny pdl':>10} "
             f"{'fused pdl':>9} {'skinny mma':>10} {'fused mma':>9} {'whole us':>8} "
             f"{'limit us':>8} "
             f"{'cublas/limit':>12}"]
    for r in result["layers"]:
        gbps = r["weight_gb_per_s"].get("skinny", nan)
        share = f"{gbps / copy:7.2f}" if copy else f"{'-':>7}"
        us = r["us"]
        lines.append(f"{r['model']:16} {r['layer']:13} {r['m']:3d} {us['cublas']:9.2f} "
                     f"{us.get('cublaslt', nan):7.2f} {us.get('skinny', nan):9.2f} "
                     f"{gbps:7.0f} {share} "
                     f"{us.get('unfused', nan):8.2f} {us.get('fused', nan):8.2f} "
                     f"{us.get('skinny_pdl', nan):10.2f} {us.get('fused_pdl', nan):9.2f} "
                     f"{us.get('skinny_mma', nan):10.2f} {us.get('fused_mma', nan):9.2f} "
                     f"{us.get('skinny_whole', nan):8.2f} "
                     f"{r.get('limit_us', nan):8.2f} "
                     f"{r.get('cublas_over_limit', nan):12.2f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="where to write the record (JSON)")
    p.add_argument("--models", nargs="+", default=["qwen3-0.6b-shape", "qwen3-8b-shape"],
                   help="built-in model names or folders whose layer shapes to time")
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16],
                   help="rows; above 16 (the skinny kernels' most) cuBLAS and the chain alone")
    p.add_argument("--rotate-mib", type=int, default=512,
                   help="weight copies cycled per timing, so each call reads DRAM, not L2")
    p.add_argument("--sweep", action="store_true", help="time the skinny kernel's SWEEP configs")
    p.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS),
                   help="which of each model's layers to time (default all)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: it times the Triton kernels against cuBLAS")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        parser.error(f"needs Triton (pip install 'kvfit[cuda]'): {e}")
    if min(args.m) < 1:
        parser.error("--m values must be at least 1")
    limits = in_run_limits("cuda")
    rows = []
    for shape in [s for model in args.models for s in shapes(model) if s.layer in args.layers]:
        for m in args.m:
            rows.append(measure(shape, m, args.rotate_mib * MiB, args.sweep, limits))
        print(f"{shape.model} {shape.layer}: done", flush=True)
        torch.cuda.empty_cache()
    result = {"device": torch.cuda.get_device_name(), "dtype": "bf16", "layers": rows, **limits}
    write_record(args.out, record_of("skinny-linear", result, vars(args)))
    print(table_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
