"""What Triton makes of kvfit's paged attention for a GPU, on a machine without one.

Runs `paged_attention_triton` on CPU tensors of a batch (decode rows, or prefill rows with
`--query-len`) with Triton's launch replaced by a capture, specialises each captured launch as
Triton's JIT would (ints of 1 become constants, multiples of 16 and pointers are marked
divisible, `do_not_specialize` respected), compiles it for `--arch` and prints, per kernel:
registers, spills and shared memory (ptxas), and the instruction mix of its loops (cuobjdump's
SASS: a backward branch closes each loop).

    pip install --target /tmp/tritonpkg triton==3.6.0   # ships ptxas and cuobjdump
    PYTHONPATH=src:/tmp/tritonpkg python3 tools/triton_sass.py --cache-dtype fp8
    PYTHONPATH=src:/tmp/tritonpkg python3 tools/triton_sass.py --cache-dtype fp8 --no-fp8-pairs

With `--linear N K` it reports the small-batch linear kernels (`ops/triton_skinny.py`) for an
`[N, K]` weight at `--batch` rows instead:

    PYTHONPATH=src:/tmp/tritonpkg python3 tools/triton_sass.py --linear 4096 1024 --batch 1

With `--decode-input`, the fused decode input's kernel (`ops/triton_decode_input.py`):

    PYTHONPATH=src:/tmp/tritonpkg python3 tools/triton_sass.py --decode-input --num-heads 32

Counts say where instructions go, not how long they take: the H200 times them
(`bench/attention.py --sweep --kv-cache-dtype fp8`, `bench/skinny_linear.py`).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction, native_specialize_impl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ops"))
from conftest import make_paged_batch  # noqa: E402  (the tests' paged batch builder)
from kvfit.ops import triton_attention  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BACK_BRANCH = re.compile(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)")


def capture_launches(args: argparse.Namespace) -> list[tuple[JITFunction, dict[str, Any], dict]]:
    """(kernel, its arguments by name, launch options) of each Triton launch of one step."""
    seqs = [(args.context - args.query_len, args.query_len)] * args.batch
    batch = make_paged_batch(seqs, num_heads=args.num_heads,
                             num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
                             dtype=torch.bfloat16)  # fmt: skip
    k_cache, v_cache = batch.k_cache, batch.v_cache
    extra: dict[str, Any] = {}
    if args.cache_dtype == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        pairs = False if args.no_fp8_pairs else None
        extra = dict(k_scale=torch.ones(1), v_scale=torch.ones(1), fp8_compute_dtype=torch.float16,
                     fp8_pairs=pairs)
    decode_config = dict(BLOCK_N=args.block_n, num_warps=args.num_warps,
                         num_stages=args.num_stages)  # fmt: skip
    if getattr(args, "maxnreg", None):
        decode_config["maxnreg"] = args.maxnreg
    if getattr(args, "prefill_config", None):
        extra["prefill_config"] = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"),
                                           args.prefill_config, strict=True))
    with mock.patch.object(triton_attention, "_has_e4m3x2_cvt", lambda device: True):
        return captured_launches(lambda: triton_attention.paged_attention_triton(
            batch.query, k_cache, v_cache, batch.metadata, args.head_dim**-0.5,
            torch.empty_like(batch.query), decode_config=decode_config, **extra))


def capture_decode_input_launches(args: argparse.Namespace
                                  ) -> list[tuple[JITFunction, dict[str, Any], dict]]:
    """The fused decode input's launch (`--decode-input`) for `--batch` decode rows at
    `--context` (q/k norm on unless `--no-qk-norm`), its split reduction through tickets as
    the engine runs it (or the reduction kernel after it with `--no-tickets`)."""
    from kvfit.ops import triton_decode_input
    from kvfit.ops.layers import RotaryEmbedding

    heads, kv_heads, head_dim, rows = args.num_heads, args.num_kv_heads, args.head_dim, args.batch
    batch = make_paged_batch([(args.context - 1, 1)] * rows, num_heads=heads,
                             num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.bfloat16)
    if not args.no_tickets:
        batch.metadata.split_tickets = torch.zeros(rows * kv_heads, dtype=torch.int32)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    norm = None if args.no_qk_norm else torch.ones(head_dim, dtype=torch.bfloat16)
    rope = RotaryEmbedding(head_dim, args.context + 8, base=10_000.0)
    return captured_launches(lambda: triton_decode_input.decode_attention_input_triton(
        torch.full((rows,), args.context - 1), q.view(rows, heads, -1),
        k.view(rows, kv_heads, -1), v.view(rows, kv_heads, -1), norm, norm, 1e-6,
        rope.cos_sin_cache, batch.k_cache, batch.v_cache, batch.metadata.slot_mapping,
        batch.metadata, head_dim**-0.5, torch.empty(rows, heads, head_dim, dtype=torch.bfloat16)))


def capture_linear_launches(args: argparse.Namespace
                            ) -> list[tuple[JITFunction, dict[str, Any], dict]]:
    """The small-batch linear kernels' launches for a `[N, K]` weight at `--batch` rows: plain,
    after RMSNorm, after the residual add and RMSNorm, after SiLU-and-mul (PROLOGUE 0-3), with
    the engine's split-K scratch in effect (K in parts where `skinny_config` says)."""
    from kvfit.ops import triton_skinny as ts
    from kvfit.ops.small_batch import small_batch_kernels

    n, k = args.linear
    x = torch.randn(args.batch, k, dtype=torch.bfloat16)
    gate_up = torch.randn(args.batch, 2 * k, dtype=torch.bfloat16)
    norm, weight = torch.ones(k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)

    def launches() -> None:
        with small_batch_kernels(scratch=ts.allocate_split_k_scratch(torch.device("cpu"))):
            ts.skinny_linear_triton(x, weight)
            ts.rms_norm_linear_triton(x, None, norm, 1e-6, weight)
            ts.rms_norm_linear_triton(x, x.clone(), norm, 1e-6, weight)
            ts.silu_and_mul_linear_triton(gate_up, weight)

    return captured_launches(launches)


def captured_launches(call: Callable[[], object]) -> list[tuple[JITFunction, dict[str, Any], dict]]:
    """(kernel, its arguments by name, launch options) of each Triton launch `call()` makes;
    nothing runs (outputs stay as allocated)."""
    launches = []

    def capture(self: JITFunction, *call_args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        named = dict(zip(self.arg_names, call_args, strict=False))
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "launch_pdl")
                   if k in kwargs}
        launches.append((self, named | kwargs, options))

    with mock.patch.object(JITFunction, "run", capture):
        call()
    return launches


def compile_launch(fn: JITFunction, named: dict[str, Any], options: dict, arch: int):  # noqa: ANN201
    """Triton's compiled kernel for one captured launch, specialised as the JIT would."""
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        value = named.get(param.name, param.default)  # a default the launch did not pass
        if param.is_constexpr:
            signature[param.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False,
                                            not param.do_not_specialize,
                                            not param.do_not_specialize_on_alignment)
        signature[param.name] = kind
        if kind == "constexpr":
            constexprs[(i,)] = spec
        elif spec:
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 128), options=options)


def loop_mixes(sass: str) -> list[collections.Counter]:
    """The opcode counts of each loop body (from a backward branch's target to the branch)."""
    instrs = [(int(m.group(1), 16), m.group(2)) for m in _SASS_LINE.finditer(sass)]
    index = {addr: i for i, (addr, _) in enumerate(instrs)}
    loops = []
    for i, (addr, text) in enumerate(instrs):
        branch = _BACK_BRANCH.search(text)
        target = int(branch.group(1), 16) if branch else None
        if target is not None and target < addr and target in index:
            body = instrs[index[target] : i + 1]
            loops.append(collections.Counter(
                re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in body))
    return loops


def ptxas_usage(kernel: Any, arch: int) -> tuple[int | None, int | None]:
    """(registers, bytes of spill stores) ptxas reports for the kernel; None where it says
    nothing."""
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        arch_flag = f"-arch=sm_{arch}a" if arch >= 90 else f"-arch=sm_{arch}"  # "a": Hopper's own
        ptxas = subprocess.run([BIN / "ptxas", arch_flag, "-v", ptx, "-o", "/dev/null"],
                               capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", ptxas)
    spills = re.search(r"(\d+) bytes spill stores", ptxas)
    return (int(regs.group(1)) if regs else None, int(spills.group(1)) if spills else None)


def sass_text(kernel: Any) -> str:
    """cuobjdump's SASS of a compiled kernel."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout


def report(kernel: Any, arch: int, top: int) -> str:
    regs, spills = ptxas_usage(kernel, arch)
    sass = sass_text(kernel)
    lines = [f"{kernel.name}: {'?' if regs is None else regs} registers, "
             f"{'?' if spills is None else spills} bytes spilled, "
             f"{kernel.metadata.shared} bytes shared"]
    for mix in loop_mixes(sass):
        ops = ", ".join(f"{op} {n}" for op, n in mix.most_common(top))
        lines.append(f"  loop of {sum(mix.values())} instructions: {ops}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--no-fp8-pairs", action="store_true", help="the fp8 tile kernel")
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--query-len", type=int, default=1, help="> 1: the prefill kernel's launch")
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--num-stages", type=int, default=3)
    p.add_argument("--maxnreg", type=int, default=None,
                   help="decode's register cap (ptx .maxnreg), as a decode_config key")
    p.add_argument("--prefill-config", type=int, nargs=4, default=None,
                   metavar=("BLOCK_M", "BLOCK_N", "WARPS", "STAGES"),
                   help="the prefill kernel's tiles (default _prefill_config's)")
    p.add_argument("--linear", type=int, nargs=2, metavar=("N", "K"), default=None,
                   help="report the small-batch linear kernels for an [N, K] weight at --batch "
                   "rows instead of attention")
    p.add_argument("--decode-input", action="store_true",
                   help="the fused decode input's kernel (`--fused-decode-input`) instead")
    p.add_argument("--no-tickets", action="store_true",
                   help="--decode-input: the split reduction as its own kernel")
    p.add_argument("--no-qk-norm", action="store_true",
                   help="--decode-input: a model without q/k RMSNorm (Llama's)")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200)")
    p.add_argument("--top", type=int, default=12, help="opcodes shown per loop")
    args = p.parse_args(argv)
    capture = (capture_linear_launches if args.linear
               else capture_decode_input_launches if args.decode_input else capture_launches)
    launches = capture(args)
    for fn, named, options in launches:
        if args.linear:
            print(f"PROLOGUE {named['PROLOGUE']}, BLOCK_N {named['BLOCK_N']}, BLOCK_K "
                  f"{named['BLOCK_K']}, SPLIT_K {named['SPLIT_K']}, {options}")
        print(report(compile_launch(fn, named, options, args.arch), args.arch, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
