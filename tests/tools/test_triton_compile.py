"""kvfit's Triton kernels compile for sm_90, on a machine without a GPU.

Triton's interpreter (tests/ops/test_triton_interpret.py) runs a kernel's Python, not its
compiler: a kernel the interpreter runs can still fail to compile (a helper with a static `if`
that returns twice did, for every attention kernel). `tools/triton_sass.py` captures the real
launches of one step and compiles them as the JIT would; this runs it over the head dims and
cache dtypes the kernels branch on. Needs Triton with its NVIDIA backend (ptxas ships in the
wheel; the `dev` extra installs it, or `pip install --target /tmp/tritonpkg triton==3.6.0` and
that folder on PYTHONPATH); skipped without it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")
# Under TRITON_INTERPRET=1 every kernel in this process is interpreted, so none compiles.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles need TRITON_INTERPRET unset")

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize(("head_dim", "cache_dtype", "query_len", "tile_fp8"), [
    (128, "bf16", 1, False),
    (80, "bf16", 1, False),
    (96, "fp8", 1, False),   # the e4m3 pairs kernel, padded
    (128, "fp8", 1, True),   # the e4m3 tile kernel
    (128, "bf16", 16, False),
    (48, "fp8", 16, False),
    (16, "fp8", 1, False),   # pairs would dot over 8 pairs: the tile kernel runs instead
    (8, "bf16", 1, False),   # tiny test models: tl.dot needs K >= 16, so dims pad to 16
    (8, "bf16", 16, False),
    (4, "fp8", 1, False),
    (4, "fp8", 16, False),
])  # fmt: skip
def test_attention_kernels_compile_for_sm90(
    monkeypatch: pytest.MonkeyPatch, head_dim: int, cache_dtype: str, query_len: int,
    tile_fp8: bool,
) -> None:
    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    args = argparse.Namespace(
        cache_dtype=cache_dtype, no_fp8_pairs=tile_fp8, num_heads=16, num_kv_heads=8,
        head_dim=head_dim, batch=2, context=256, query_len=query_len, block_n=64, num_warps=4,
        num_stages=3)
    launches = sass.capture_launches(args)
    assert launches
    for fn, named, options in launches:
        kernel = sass.compile_launch(fn, named, options, arch=90)
        assert kernel.asm["cubin"], fn.__name__


def test_decode_config_register_cap_reaches_the_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    """`maxnreg` in a decode config (a `bench/attention.py --sweep` row: the fp8 pairs kernel at
    BLOCK_N 128, 4 warps) is a compile option of the launch, not a kernel argument: the PTX
    carries the cap."""
    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    args = argparse.Namespace(
        cache_dtype="fp8", no_fp8_pairs=False, num_heads=16, num_kv_heads=8, head_dim=128,
        batch=2, context=256, query_len=1, block_n=128, num_warps=4, num_stages=3, maxnreg=128)
    (fn, named, options), *_ = sass.capture_launches(args)
    assert fn.__name__ == "_decode_fp8_pairs_kernel"
    assert ".maxnreg 128" in sass.compile_launch(fn, named, options, arch=90).asm["ptx"]


def _compile_launches(monkeypatch: pytest.MonkeyPatch, call) -> list[str]:  # noqa: ANN001
    """Names of the kernels `call()` launches, each compiled for sm_90 (launches captured)."""
    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    launches = sass.captured_launches(call)
    for fn, named, options in launches:
        assert sass.compile_launch(fn, named, options, arch=90).asm["cubin"], fn.__name__
    return [fn.__name__ for fn, _, _ in launches]


@pytest.mark.parametrize(("head_dim", "dtype", "cache", "query_len", "batch_invariant"), [
    (128, torch.bfloat16, "same", 1, False),   # split decode and its reduction
    (256, torch.bfloat16, "same", 16, False),  # the head_dim > 128 configs
    (96, torch.float16, "same", 16, False),
    (128, torch.bfloat16, "fp8", 16, False),   # e4m3 widened to the query's bfloat16
    (80, torch.float16, "fp8", 1, False),      # pairs in a float16 model, padded
    (128, torch.bfloat16, "same", 1, True),    # the deterministic mode's one kernel
    (96, torch.bfloat16, "same", 16, True),
    (8, torch.bfloat16, "same", 1, False),     # dims below tl.dot's 16, padded to 16
    (4, torch.float16, "fp8", 1, False),
    (8, torch.bfloat16, "fp8", 16, False),
    (4, torch.bfloat16, "same", 16, True),
])  # fmt: skip
def test_attention_launches_the_sweep_misses_compile_for_sm90(
    monkeypatch: pytest.MonkeyPatch, head_dim: int, dtype: torch.dtype, cache: str,
    query_len: int, batch_invariant: bool,
) -> None:
    """What `paged_attention_triton` launches at a context long enough to split decode (the sweep's
    256 tokens never split), in the deterministic mode, and over e4m3 without float16."""
    from kvfit.ops import triton_attention

    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    batch = sass.make_paged_batch([(2048 - query_len, query_len)] * 2, num_heads=16,
                                  num_kv_heads=4, head_dim=head_dim, dtype=dtype)
    k_cache, v_cache, extra = batch.k_cache, batch.v_cache, {}
    if cache == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        extra = dict(k_scale=torch.ones(1), v_scale=torch.ones(1))
    monkeypatch.setattr(triton_attention, "_has_e4m3x2_cvt", lambda device: True)
    names = _compile_launches(monkeypatch, lambda: triton_attention.paged_attention_triton(
        batch.query, k_cache, v_cache, batch.metadata, head_dim**-0.5,
        torch.empty_like(batch.query), batch_invariant=batch_invariant, **extra))
    assert ("_reduce_splits_kernel" in names) == (not batch_invariant)


def _attention_input_args(head_dim: int, fp8: bool) -> dict:
    from kvfit.ops.layers import RotaryEmbedding

    t, heads, kv_heads, block_size = 5, 4, 2, 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    cache = torch.zeros(4, block_size, kv_heads, head_dim, dtype=cache_dtype)
    return dict(
        positions=torch.arange(t), q=q.view(t, heads, head_dim), k=k.view(t, kv_heads, head_dim),
        v=v.view(t, kv_heads, head_dim), q_norm_weight=torch.ones(head_dim, dtype=torch.bfloat16),
        k_norm_weight=torch.ones(head_dim, dtype=torch.bfloat16), eps=1e-6,
        cos_sin_cache=RotaryEmbedding(head_dim, 64, base=10_000.0).cos_sin_cache,
        k_cache=cache, v_cache=cache.clone(), slot_mapping=torch.arange(t),
        k_scale=torch.ones(1), v_scale=torch.ones(1))


@pytest.mark.parametrize("head_dim", [4, 8, 64, 80, 128])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_attention_input_and_kv_write_compile_for_sm90(
    monkeypatch: pytest.MonkeyPatch, head_dim: int, fp8: bool,
) -> None:
    from kvfit.ops import triton_attention_input, triton_kv_write

    args = _attention_input_args(head_dim, fp8)
    names = _compile_launches(monkeypatch,
                              lambda: triton_attention_input.attention_input_triton(**args))
    names += _compile_launches(monkeypatch, lambda: triton_kv_write.write_kv_triton(
        args["k"], args["v"], args["k_cache"], args["v_cache"], args["slot_mapping"],
        args["k_scale"], args["v_scale"]))
    assert len(names) == 2


@pytest.mark.parametrize("hidden", [896, 1024, 3584])
def test_layer_kernels_compile_for_sm90(monkeypatch: pytest.MonkeyPatch, hidden: int) -> None:
    from kvfit.ops import triton_layers

    x = torch.randn(3, hidden, dtype=torch.bfloat16)
    w = torch.ones(hidden, dtype=torch.bfloat16)
    names = _compile_launches(monkeypatch, lambda: (
        triton_layers.rms_norm_triton(x, w, 1e-6),
        triton_layers.add_rms_norm_triton(x, x.clone(), w, 1e-6),
        triton_layers.silu_and_mul_triton(torch.randn(3, 2 * hidden, dtype=torch.bfloat16))))
    assert len(names) == 3


@pytest.mark.parametrize("vocab", [1000, 151_936])
def test_sampling_and_filter_kernels_compile_for_sm90(
    monkeypatch: pytest.MonkeyPatch, vocab: int,
) -> None:
    from kvfit.ops import triton_argmax, triton_filters, triton_sampling

    logits = torch.randn(4, vocab, dtype=torch.bfloat16)
    temperature = torch.tensor([0.0, 0.7, 1.0, 2.0])
    seeds = torch.arange(4, dtype=torch.int64)
    top_k = torch.tensor([0, 5, 50, vocab], dtype=torch.int32)
    top_p, min_p = torch.tensor([1.0, 0.9, 0.5, 0.1]), torch.tensor([0.0, 0.0, 0.1, 0.0])
    names = _compile_launches(monkeypatch, lambda: triton_filters.filter_thresholds_triton(
        logits, temperature, top_k, top_p, min_p))
    names += _compile_launches(monkeypatch, lambda: triton_sampling.gumbel_sample_triton(
        logits, temperature, seeds, torch.full((4,), -1e30)))
    scratch = triton_argmax.ArgmaxScratch.allocate(4, logits.device)
    names += _compile_launches(monkeypatch, lambda: triton_argmax.argmax_triton(logits, scratch))
    assert "_argmax_kernel" in names


@pytest.mark.parametrize(("rows", "width", "dtype"), [
    (3, 300, torch.bfloat16),      # the narrow tiles (decode)
    (300, 9000, torch.bfloat16),   # a wide weight's big tiles past SMALL_M
    (1029, 300, torch.float16),    # every weight's big tiles from LARGE_M (prefill)
    (1029, 300, torch.float32),    # float32 keeps the narrow tiles, in IEEE float32
])  # fmt: skip
def test_batch_invariant_kernels_compile_for_sm90(
    monkeypatch: pytest.MonkeyPatch, rows: int, width: int, dtype: torch.dtype,
) -> None:
    from kvfit.batch_invariant import triton_logsumexp, triton_matmul

    x = torch.randn(rows, 1000, dtype=dtype)
    names = _compile_launches(monkeypatch, lambda: (
        triton_logsumexp.logsumexp_triton(x.float()),
        triton_matmul.matmul_triton(x, torch.randn(width, 1000, dtype=dtype),
                                    torch.randn(width, dtype=dtype))))
    assert len(names) >= 2


@pytest.mark.parametrize(("n", "k"), [
    (1024, 3072),     # BLOCK_N 16 over a long K: the loops stay loops
    (6144, 1024),     # BLOCK_N 32
    (24576, 4096),    # BLOCK_N 64
    (151_936, 1024),  # an LM head
    (37, 100),        # N and K off the tiles: the masked loop
])  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_linear_kernels_compile_for_sm90(
    monkeypatch: pytest.MonkeyPatch, n: int, k: int, dtype: torch.dtype,
) -> None:
    from kvfit.ops import triton_skinny

    x, w = torch.randn(3, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    norm, bias = torch.ones(k, dtype=dtype), torch.randn(n, dtype=dtype)
    with _split_k_scratch():  # as the engine runs them: (1024, 3072) in 4 parts
        names = _compile_launches(monkeypatch, lambda: (
            triton_skinny.skinny_linear_triton(x, w, bias),
            triton_skinny.rms_norm_linear_triton(x, None, norm, 1e-6, w),
            triton_skinny.rms_norm_linear_triton(x, x.clone(), norm, 1e-6, w, bias),
            triton_skinny.silu_and_mul_linear_triton(torch.randn(3, 2 * k, dtype=dtype), w)))
    assert names == ["_skinny_kernel"] * 4  # plain and the three prologues


@contextmanager
def _split_k_scratch() -> Iterator[None]:
    """The engine's split-K scratch in effect, so launches split where `skinny_config` says."""
    from kvfit.ops import triton_skinny
    from kvfit.ops.small_batch import small_batch_kernels

    with small_batch_kernels(scratch=triton_skinny.allocate_split_k_scratch(
            torch.device("cpu"))):
        yield


@pytest.mark.parametrize("arch", [80, 89])
@pytest.mark.parametrize(("n", "k", "parts"), [
    (24576, 4096, 1),
    (37, 100, 1),
    (1024, 3072, 4),  # the 0.6B's down_proj: K in parts and the last program's sum
])  # fmt: skip
def test_skinny_linear_kernels_compile_before_sm90(monkeypatch: pytest.MonkeyPatch, arch: int,
                                                   n: int, k: int, parts: int) -> None:
    """The small-batch kernels are on by default on every CUDA device, so they must compile
    for Ampere and Ada too (no PDL there: `use_pdl` needs 9.0), at one row (the FMA path and
    the fused prologues) and at several (the MMA tile), off the tiles and in K's parts
    included (the tickets' acq_rel atomic and the `.cg` loads of the partials)."""
    from kvfit.ops import triton_skinny

    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    x1, x3 = torch.randn(1, k, dtype=torch.bfloat16), torch.randn(3, k, dtype=torch.bfloat16)
    w, bias = torch.randn(n, k, dtype=torch.bfloat16), torch.randn(n, dtype=torch.bfloat16)
    norm, gate_up = torch.ones(k, dtype=torch.bfloat16), torch.randn(1, 2 * k,
                                                                     dtype=torch.bfloat16)
    with _split_k_scratch():
        launches = sass.captured_launches(lambda: (
            triton_skinny.skinny_linear_triton(x1, w, bias),
            triton_skinny.skinny_linear_triton(x3, w),
            triton_skinny.rms_norm_linear_triton(x1, x1.clone(), norm, 1e-6, w),
            triton_skinny.silu_and_mul_linear_triton(gate_up, w)))
    assert len(launches) == 4
    assert [named["SPLIT_K"] for _, named, _ in launches] == [parts] * 4
    for fn, named, options in launches:
        kernel = sass.compile_launch(fn, named, options, arch=arch)
        assert kernel.asm["cubin"]
        # `tools/triton_sass.py --arch 80` reports ptxas's figures too (sm_80, not "sm_80a")
        assert sass.ptxas_usage(kernel, arch)[0], fn.__name__


@pytest.mark.parametrize(("n", "k"), [
    (4096, 1024), (6144, 1024), (1024, 3072),  # the 0.6B shape: qkv, gate_up, down
    (1024, 2048),  # the 0.6B's o_proj, in parts as down_proj
    (6144, 4096), (24576, 4096), (4096, 12288),  # the 8B shape
])  # fmt: skip
def test_skinny_linear_kernels_do_not_spill(monkeypatch: pytest.MonkeyPatch, n: int,
                                            k: int) -> None:
    """A spill in the one-row loop costs its whole stream: the rms pass in one block of the
    0.6B's K 1024 spilled 292 bytes and ran 3.4x slower than the unfused pair on the H200.
    The split launches' sum of parts too (a [4, 16, 16] tile at once spilled 8 bytes beside
    the SiLU prologue)."""
    from kvfit.ops import triton_skinny

    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    x, w, norm = torch.randn(1, k), torch.randn(n, k), torch.ones(k)
    x, w, norm = (t.to(torch.bfloat16) for t in (x, w, norm))
    with _split_k_scratch():
        launches = sass.captured_launches(lambda: (
            triton_skinny.skinny_linear_triton(x, w),
            triton_skinny.rms_norm_linear_triton(x, None, norm, 1e-6, w),
            triton_skinny.rms_norm_linear_triton(x, x.clone(), norm, 1e-6, w),
            triton_skinny.silu_and_mul_linear_triton(torch.randn(1, 2 * k, dtype=x.dtype), w)))
    if n == 1024:
        assert all(named["SPLIT_K"] == 4 for _, named, _ in launches)
    for prologue, (fn, named, options) in enumerate(launches):
        regs, spills = sass.ptxas_usage(sass.compile_launch(fn, named, options, arch=90), 90)
        assert spills == 0, f"prologue {prologue}: {regs} registers, {spills} bytes spilled"


@pytest.mark.parametrize("arch", [90, 80])
@pytest.mark.parametrize(("heads", "hidden"), [((16, 8, 128), 1024), ((32, 8, 128), 4096)])
def test_qkv_epilogue_compiles_without_spills(monkeypatch: pytest.MonkeyPatch, arch: int,
                                              heads: tuple[int, int, int], hidden: int) -> None:
    """The QKV projection with the attention input in its kernel (`qkv_attention_input`), at
    one row with the input norm in it and at three rows without, over a 16-bit and an e4m3
    cache (sm_89 and later: Ampere has no e4m3), compiles for sm_90 and sm_80 and spills
    nothing: the epilogue's head tile comes after the product's registers are free."""
    from kvfit.ops import triton_skinny
    from kvfit.ops.attention_input import AttentionInputArgs
    from kvfit.ops.layers import RotaryEmbedding
    from kvfit.ops.small_batch import small_batch_kernels

    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    num_heads, num_kv_heads, head_dim = heads
    w = torch.randn((num_heads + 2 * num_kv_heads) * head_dim, hidden, dtype=torch.bfloat16)
    norm = torch.ones(head_dim, dtype=torch.bfloat16)
    rope = RotaryEmbedding(head_dim, 64, base=10_000.0)
    scratch = triton_skinny.allocate_split_k_scratch(torch.device("cpu"),
                                                     num_heads + 2 * num_kv_heads)

    def launches(rows: int, cache_dtype: torch.dtype) -> None:
        cache = torch.zeros(2, 16, num_kv_heads, head_dim, dtype=cache_dtype)
        args = AttentionInputArgs(torch.zeros(rows, dtype=torch.long), norm, norm, 1e-6,
                                  rope.cos_sin_cache, cache, cache.clone(),
                                  torch.arange(rows), torch.ones(1), torch.ones(1))
        x = torch.randn(rows, hidden, dtype=torch.bfloat16)
        in_norm = (x.clone(), torch.ones(hidden, dtype=torch.bfloat16), 1e-6) if rows == 1 \
            else None
        triton_skinny.qkv_attention_input_triton(x, w, None, args, in_norm)

    with small_batch_kernels(scratch=scratch):
        dtypes = (torch.bfloat16, torch.float8_e4m3fn) if arch >= 89 else (torch.bfloat16,)
        captured = sass.captured_launches(lambda: [launches(rows, dtype) for rows in (1, 3)
                                                   for dtype in dtypes])
    assert len(captured) == 2 * len(dtypes)
    assert all(named["ATTENTION_INPUT"] for _, named, _ in captured)
    for fn, named, options in captured:
        regs, spills = sass.ptxas_usage(sass.compile_launch(fn, named, options, arch=arch), arch)
        assert spills == 0, f"FP8 {named['FP8']}: {regs} registers, {spills} bytes spilled"


SM90_SHARED_BYTES, SM90_REGISTERS = 233_472, 65_536  # per SM; the driver keeps 1 KB a block


@pytest.mark.parametrize(("n", "k"), [
    (4096, 1024), (6144, 1024),  # the 0.6B shape's qkv and gate_up
    (6144, 4096), (24576, 4096),  # the 8B shape's
    (28672, 4096),  # Llama 3 8B's gate_up: 448 programs of 64 columns
])  # fmt: skip
def test_skinny_norm_kernels_run_in_one_wave(monkeypatch: pytest.MonkeyPatch, n: int,
                                             k: int) -> None:
    """Every program of a fused-norm kernel resident at once on 132 SMs: the second, part-empty
    wave of the 8B gate_up (384 programs, two a SM) cost 1.33x its unfused pair on the H200."""
    from kvfit.ops import triton_skinny

    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    x, w, norm = (torch.randn(*s).to(torch.bfloat16) for s in ((1, k), (n, k), (k,)))
    launches = sass.captured_launches(lambda: (
        triton_skinny.rms_norm_linear_triton(x, None, norm, 1e-6, w),
        triton_skinny.rms_norm_linear_triton(x, x.clone(), norm, 1e-6, w)))
    for fn, named, options in launches:
        kernel = sass.compile_launch(fn, named, options, arch=90)
        regs, _ = sass.ptxas_usage(kernel, 90)
        threads = 32 * options["num_warps"]
        per_sm = min(SM90_SHARED_BYTES // (kernel.metadata.shared + 1024),
                     SM90_REGISTERS // (regs * threads))
        grid = -(-n // named["BLOCK_N"])
        assert grid <= per_sm * 132, (f"{grid} programs, {per_sm} a SM "
                                      f"({kernel.metadata.shared} B shared, {regs} registers)")


def _check_trigger(after_wait: str, early: bool, name: str) -> None:
    """The PTX after a PDL kernel's wait lets its successor start: right away (early), or
    after the kernel's loads and before its last stores (late, `ops/pdl.PDL_EARLY` off)."""
    before, trigger, rest = after_wait.partition("griddepcontrol.launch_dependents")
    assert trigger, name
    loads = re.findall(r"\bld\.global|\bcp\.async\.\w+\.shared\.global", before)
    assert (not loads) if early else (loads and re.search(r"\bst\.global", rest)), name


@pytest.mark.parametrize("early", [True, False])
def test_skinny_pdl_launch_reads_and_writes_nothing_before_its_wait(
    monkeypatch: pytest.MonkeyPatch, early: bool,
) -> None:
    """Launched with programmatic dependent launch, a skinny kernel may run beside the kernel
    before it: before `griddepcontrol.wait` its PTX may only prefetch (the weights), never load
    x nor store; and it lets its successor start (`launch_dependents`), early or late."""

    from kvfit.ops import pdl, triton_skinny

    monkeypatch.setattr(triton_skinny, "use_pdl", lambda pdl, device, num_tokens: True)
    monkeypatch.setattr(pdl, "PDL_EARLY", early)
    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    n, k = 4096, 1024
    x, w, norm = (torch.randn(*s).to(torch.bfloat16) for s in ((1, k), (n, k), (k,)))
    launches = sass.captured_launches(lambda: (
        triton_skinny.skinny_linear_triton(x, w),
        triton_skinny.rms_norm_linear_triton(x, x.clone(), norm, 1e-6, w),
        triton_skinny.silu_and_mul_linear_triton(torch.randn(1, 2 * k).to(x.dtype), w)))
    assert len(launches) == 3
    for fn, named, options in launches:
        kernel = sass.compile_launch(fn, named, options, arch=90)
        ptx = kernel.asm["ptx"]
        assert kernel.metadata.launch_pdl
        before, _, after = ptx.partition("griddepcontrol.wait")
        memory_ops = re.findall(r"\b(?:ld|st|cp\.async|atom|red)\.global|\bprefetch\.global",
                                before)
        assert memory_ops and set(memory_ops) == {"prefetch.global"}, named["PROLOGUE"]
        _check_trigger(after, early, f"PROLOGUE {named['PROLOGUE']}")


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("cache", ["same", "fp8"])
def test_decode_step_pdl_kernels_wait_before_any_memory_access(
    monkeypatch: pytest.MonkeyPatch, cache: str, early: bool,
) -> None:
    """With PDL on, a small-batch step's attention input, decode attention and split reduction
    launch with it, and each program's first memory access comes after `griddepcontrol.wait`
    (its inputs are its predecessor's outputs), then lets its successor start, early or late.
    A large step's kernels launch without it."""
    from kvfit.ops import pdl, triton_attention, triton_attention_input
    from kvfit.ops.small_batch import small_batch_kernels

    monkeypatch.setattr(pdl, "use_pdl", lambda requested, device, num_tokens: True)
    monkeypatch.setattr(pdl, "PDL_EARLY", early)
    monkeypatch.setattr(triton_attention, "_has_e4m3x2_cvt", lambda device: True)
    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")

    def step(num_seqs: int) -> None:
        batch = sass.make_paged_batch([(2047, 1)] * num_seqs, num_heads=16, num_kv_heads=4,
                                      head_dim=128, dtype=torch.bfloat16)
        k_cache, v_cache, extra = batch.k_cache, batch.v_cache, {}
        if cache == "fp8":
            k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
            extra = dict(k_scale=torch.ones(1), v_scale=torch.ones(1),
                         fp8_compute_dtype=torch.float16)
        args = _attention_input_args(128, cache == "fp8")
        triton_attention_input.attention_input_triton(**args)
        triton_attention.paged_attention_triton(
            batch.query, k_cache, v_cache, batch.metadata, 128**-0.5,
            torch.empty_like(batch.query), **extra)

    with small_batch_kernels():
        launches = sass.captured_launches(lambda: step(2))
        large = sass.captured_launches(lambda: step(17))
    names = [fn.__name__ for fn, _, _ in launches]
    assert names[0] == "_attention_input_kernel" and names[-1] == "_reduce_splits_kernel"
    assert len(names) == 3
    for fn, named, options in launches:
        assert options.get("launch_pdl") and named["PDL"], fn.__name__
        ptx = sass.compile_launch(fn, named, options, arch=90).asm["ptx"]
        before, _, after = ptx.partition("griddepcontrol.wait")
        assert after, fn.__name__
        assert not re.findall(r"\b(?:ld|st|cp\.async|atom|red|prefetch)\.global", before)
        _check_trigger(after, early, fn.__name__)
    # The attention input there still takes the test's 5 tokens: only the attention is large.
    assert [options.get("launch_pdl", False) for _, _, options in large[1:]] == [False, False]


@pytest.mark.parametrize("head_dim", [4, 8, 64, 80, 128, 256])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("pdl_early", [None, True, False], ids=["no_pdl", "early", "late"])
@pytest.mark.parametrize("tickets", [False, True], ids=["reduction_kernel", "tickets"])
def test_fused_decode_input_compiles_for_sm90(
    monkeypatch: pytest.MonkeyPatch, head_dim: int, qk_norm: bool, pdl_early: bool | None,
    tickets: bool,
) -> None:
    """`decode_attention`'s kernel, and the split reduction after it unless the metadata's
    `split_tickets` let the kernel reduce its own splits (an acq_rel ticket, then the parts
    read past L1), at the head dims the tiles pad (4, 8, 80) and the larger config (256); under
    PDL each program's first memory access comes after `griddepcontrol.wait` (q, k and v are
    the QKV projection's output)."""
    from kvfit.ops import pdl
    from kvfit.ops.small_batch import small_batch_kernels

    monkeypatch.setattr(pdl, "use_pdl",
                        lambda requested, device, num_tokens: pdl_early is not None)
    monkeypatch.setattr(pdl, "PDL_EARLY", bool(pdl_early))
    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    args = argparse.Namespace(num_heads=16, num_kv_heads=4, head_dim=head_dim, batch=2,
                              context=2048, no_tickets=not tickets, no_qk_norm=not qk_norm)
    with small_batch_kernels():
        launches = sass.capture_decode_input_launches(args)
    names = [fn.__name__ for fn, _, _ in launches]
    assert names == ["_decode_input_kernel"] + ([] if tickets else ["_reduce_splits_kernel"])
    for fn, named, options in launches:
        ptx = sass.compile_launch(fn, named, options, arch=90).asm["ptx"]
        if fn.__name__ == "_decode_input_kernel":
            assert bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)) is tickets
            assert bool(re.search(r"ld\.global\.cg", ptx)) is tickets
            if tickets:  # every warp's part stored, then a CTA barrier, then the one ticket
                parts, _, _ = ptx.partition("atom.global.gpu.acq_rel.add")
                assert "bar.sync" in parts.rpartition("st.global")[2]
        if pdl_early is None:
            assert "griddepcontrol" not in ptx, fn.__name__
            continue
        before, _, after = ptx.partition("griddepcontrol.wait")
        assert after and not re.findall(r"\b(?:ld|st|cp\.async|atom|red|prefetch)\.global",
                                        before), fn.__name__
        _check_trigger(after, pdl_early, fn.__name__)


@pytest.mark.parametrize("arch", [90, 80])
def test_one_row_norm_through_the_mma_compiles_to_a_short_stage(monkeypatch: pytest.MonkeyPatch,
                                                                arch: int) -> None:
    """With `ROW_GEMV` off a one-row fused add + RMSNorm feeds the MMA (the 8B's gate_up tile,
    BLOCK_N 64): it compiles without spills, and its weight stage's loop is far shorter than
    the FMA path's (133 against 260 instructions for sm_90 with Triton 3.6), the reason it
    was timed (and on since: `triton_skinny.ROW_MMA_PROLOGUE`)."""
    from kvfit.ops import triton_skinny

    monkeypatch.syspath_prepend(str(TOOLS))
    sass = importlib.import_module("triton_sass")
    n, k = 24576, 4096
    x, w = torch.randn(1, k, dtype=torch.bfloat16), torch.randn(n, k, dtype=torch.bfloat16)
    norm = torch.ones(k, dtype=torch.bfloat16)
    config = triton_skinny.skinny_config(n, k, prologue=triton_skinny.ADD_RMS_NORM)
    assert config["BLOCK_N"] == 64
    with _split_k_scratch():
        launches = sass.captured_launches(lambda: [
            triton_skinny.rms_norm_linear_triton(x, x.clone(), norm, 1e-6, w,
                                                 config={**config, "ROW_GEMV": row_gemv})
            for row_gemv in (True, False)])
    stages = []
    for fn, named, options in launches:
        kernel = sass.compile_launch(fn, named, options, arch=arch)
        regs, spills = sass.ptxas_usage(kernel, arch)
        assert spills == 0, f"ROW_GEMV {named['ROW_GEMV']}: {regs} registers, {spills} spilled"
        stages.append(sass.loop_mixes(sass.sass_text(kernel)))
    # Both kernels hold the 2-16-row MMA loop too (M is a runtime branch); the one-row stage
    # is the FMA path's loop without HMMA, and the other kernel's shorter HMMA loop.
    fma = max(sum(m.values()) for m in stages[0] if not m["HMMA"])
    mma = min(sum(m.values()) for m in stages[1] if m["HMMA"])
    assert sum(1 for m in stages[1] if m["HMMA"]) == 2
    assert mma < 0.6 * fma, (mma, fma)
