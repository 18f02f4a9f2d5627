"""bench/skinny_linear.py without a GPU: its arguments, the shapes it reads from the model
configs, and the table and record it builds from timings (fake ones here)."""

from __future__ import annotations

import pytest

from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.record import validate

from .payloads import skinny_linear as payload
from .scripts import load_bench


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 (the bench module)
    return load_bench("skinny_linear")


def test_arguments(bench) -> None:  # noqa: ANN001
    args = bench.build_parser().parse_args(["--out", "x.json"])
    assert args.m == [1, 2, 4, 8, 16] and not args.sweep
    assert args.models == ["qwen3-0.6b-shape", "qwen3-8b-shape"]
    assert args.layers == [s.layer for s in bench.shapes("qwen3-0.6b-shape")]
    picked = bench.build_parser().parse_args(["--out", "x.json", "--layers", "o_proj",
                                              "down_proj"])
    assert picked.layers == ["o_proj", "down_proj"]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--out", "x.json", "--layers", "mlp"])


def test_shapes_are_the_models_linear_layers_with_their_folded_ops(bench) -> None:  # noqa: ANN001
    small = {s.layer: (s.n, s.k, s.prologue) for s in bench.shapes("qwen3-0.6b-shape")}
    assert small == {"qkv_proj": (4096, 1024, "add_rms_norm"), "o_proj": (1024, 2048, "none"),
                     "gate_up_proj": (6144, 1024, "add_rms_norm"),
                     "down_proj": (1024, 3072, "silu_and_mul"), "lm_head": (151936, 1024, "none")}
    large = {s.layer: (s.n, s.k) for s in bench.shapes("qwen3-8b-shape")}
    assert large["qkv_proj"] == (6144, 4096) and large["down_proj"] == (4096, 12288)


def test_the_sweep_configs_keep_the_kernels_constraints(bench) -> None:  # noqa: ANN001
    """BLOCK_N at least 16 (tl.dot's smallest tile), BLOCK_K dividing every model K, and a
    split config's parts a power of two (the bench skips a K its parts do not divide)."""
    for cfg in bench.SWEEP:
        assert cfg["BLOCK_N"] >= 16
        assert all(k % cfg["BLOCK_K"] == 0 for k in (1024, 2048, 3072, 4096, 12288))
        assert cfg["SPLIT_K"] in (1, 2, 4)


def test_table_and_record_from_timings(bench) -> None:  # noqa: ANN001
    # The bench adds `in_run_limits`'s keys to its result: the share of copy bandwidth reads them.
    result = payload() | {"copy_bandwidth_gbps": 4000.0, "gemm_tflops": 700.0}
    text = bench.table_text(result)
    assert "qkv_proj" in text and text.count("\n") == len(result["layers"])
    small, big = text.splitlines()[1:3], text.splitlines()[3]
    assert all(line.split()[7] == "0.70" for line in small)  # 2,800 / 4,000
    record = record_of("skinny-linear", result, {"m": [1, 16, 256]})
    assert validate(record) == []
    figures = record["figures"]
    assert figures["qwen3-0.6b.qkv_proj.m1.fused_over_unfused"]["value"] == 3.5 / 9
    assert figures["qwen3-0.6b.qkv_proj.m1.skinny_pdl_us"]["value"] == 2.5
    # pdl, the MMA tile of the plain and the fused kernel, unsplit
    assert small[0].split()[-7:-2] == ["2.50", "3.00", "4.00", "3.75", "3.25"]
    assert figures["qwen3-0.6b.qkv_proj.m1.skinny_mma_us"]["value"] == 4.0
    assert figures["qwen3-0.6b.qkv_proj.m1.fused_mma_us"]["value"] == 3.75
    assert figures["qwen3-0.6b.qkv_proj.m1.skinny_whole_us"]["value"] == 3.25
    # 256 rows: cuBLAS (and cuBLASLt) against the op's limit, no skinny column or figure.
    assert big.split()[-2:] == ["4.00", "2.00"] and big.split()[4:6] == ["6.00", "nan"]
    assert figures["qwen3-0.6b.qkv_proj.m256.cublaslt_us"]["value"] == 6.0
    assert figures["qwen3-0.6b.qkv_proj.m256.cublas_over_limit"]["value"] == 2.0
    assert not any(name.startswith("qwen3-0.6b.qkv_proj.m256.skinny") for name in figures)


def test_the_limit_is_the_longer_of_bytes_and_flops(bench) -> None:  # noqa: ANN001
    shape = bench.Shape("m", "lm_head", 151936, 1024, "none")
    limits = {"copy_bandwidth_gbps": 4000.0, "gemm_tflops": 800.0}
    weight_us = 2 * 151936 * 1024 / 4e6  # 311 MB at 4,000 GB/s: 77.8 us
    # One row moves the weight (and a row in and out); 256 rows do 2MNK FLOPs at the GEMM rate.
    assert bench.limit_us(shape, 1, limits) == pytest.approx(weight_us, rel=1e-3)
    assert bench.limit_us(shape, 1024, limits) == pytest.approx(
        2 * 1024 * 151936 * 1024 / 800e6)
    assert bench.limit_us(shape, 1, {}) is None
