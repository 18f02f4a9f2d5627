"""The attention kernels compile for sm_90, on a machine without a GPU.

Triton's interpreter (tests/ops/test_triton_interpret.py) runs a kernel's Python, not its
compiler: a kernel the interpreter runs can still fail to compile (a helper with a static `if`
that returns twice did, for every attention kernel). `tools/triton_sass.py` captures the real
launches of one step and compiles them as the JIT would; this runs it over the head dims and
cache dtypes the kernels branch on. Needs Triton with its NVIDIA backend (ptxas ships in the
wheel), e.g. `pip install --target /tmp/tritonpkg triton==3.6.0` and that folder on PYTHONPATH;
skipped without it, as in CI.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.mark.parametrize(("head_dim", "cache_dtype", "query_len", "tile_fp8"), [
    (128, "bf16", 1, False),
    (80, "bf16", 1, False),
    (96, "fp8", 1, False),   # the e4m3 pairs kernel, padded
    (128, "fp8", 1, True),   # the e4m3 tile kernel
    (128, "bf16", 16, False),
    (48, "fp8", 16, False),
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
