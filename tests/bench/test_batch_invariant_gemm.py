"""bench/batch_invariant_gemm.py without a GPU: its arguments, the shapes it reads from the
model configs, the bit check it applies, and the table, picks and record it builds from
timings (fake ones here)."""

from __future__ import annotations

import pytest
import torch

from kvfit.batch_invariant.matmul import row_tiled_linear
from kvfit.benchmarks.figures import record_of
from kvfit.benchmarks.record import validate

from .scripts import load_bench


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 (the bench module)
    return load_bench("batch_invariant_gemm")


def test_configs_parse_from_their_names_and_back(bench) -> None:  # noqa: ANN001
    cfg = bench.parse_config("m128n256k64w8s3")
    assert cfg == dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8,
                       num_stages=3)
    assert bench.config_name(cfg) == "m128n256k64w8s3"
    for bad in ("m128n128k64w8", "m100n128k64w4s3", "m8n128k64w4s3", "current"):
        with pytest.raises(ValueError):
            bench.parse_config(bad)


def test_arguments(bench, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    args = bench.build_parser().parse_args(["--out", "x.json"])
    assert args.m == [1, 64, 256, 2048, 8192] and args.check_m == 8192
    assert args.configs == bench.CANDIDATES and args.models == ["qwen3-0.6b-shape",
                                                                "qwen3-8b-shape"]
    assert all(bench.parse_config(c)["BLOCK_K"] == 64 for c in bench.CANDIDATES)
    args = bench.build_parser().parse_args(["--out", "x.json", "--configs", "m64n64k64w4s2",
                                            "--m", "1", "7"])
    assert args.configs == ["m64n64k64w4s2"] and args.m == [1, 7]
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--out", "x.json", "--configs", "big"])
    assert "m<BLOCK_M>n<BLOCK_N>" in capsys.readouterr().err


def test_without_cuda_it_says_what_it_needs(bench, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--out", "unused.json"])
    assert exit_.value.code == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_shapes_are_the_models_gemms(bench) -> None:  # noqa: ANN001
    small = {s.gemm: (s.n, s.k, s.max_m) for s in bench.gemm_shapes("qwen3-0.6b-shape", 256)}
    # 16 query + 2 x 8 KV heads of 128; hidden 1024, intermediate 3072, vocab 151936.
    assert small == {"qkv_proj": (4096, 1024, None), "o_proj": (1024, 2048, None),
                     "gate_up_proj": (6144, 1024, None), "down_proj": (1024, 3072, None),
                     "lm_head": (151936, 1024, 256)}
    large = {s.gemm: (s.n, s.k) for s in bench.gemm_shapes("qwen3-8b-shape", 256)}
    assert large["qkv_proj"] == (6144, 4096) and large["down_proj"] == (4096, 12288)
    head = next(s for s in bench.gemm_shapes("qwen3-0.6b-shape", 256) if s.gemm == "lm_head")
    assert bench.m_values(head, [1, 64, 256, 2048]) == [1, 64, 256]
    assert bench.m_values(head, [2048]) == [256]


def test_the_bit_check_slices_every_size_at_several_places(bench) -> None:  # noqa: ANN001
    assert bench.check_starts(64, 8192) == [0, 5, 4109, 8128]
    assert bench.check_starts(255, 256) == [0, 1]
    assert bench.check_starts(1, 1) == [0]
    x, w = torch.randn(300, 16), torch.randn(8, 16)

    def rowwise(a: torch.Tensor) -> torch.Tensor:  # the mode's CPU GEMM: fixed 16-row calls
        return row_tiled_linear(a, w)

    def batch_dependent(a: torch.Tensor) -> torch.Tensor:  # a result that follows M
        return a @ w.t() + a.shape[0]

    assert bench.row_mismatches(rowwise(x), rowwise, x) == []
    failures = bench.row_mismatches(batch_dependent(x), batch_dependent, x)
    # every slice but none: each is shorter than the 300 rows
    assert len(failures) == sum(len(bench.check_starts(m, 300)) for m in bench.CHECK_ROWS)
    assert failures[0] == "rows 0:1 of 300"


def fake_run(bench) -> dict:  # noqa: ANN001
    """Two shapes, cuBLAS, the current config and two candidates: `fast` is invariant but
    changes the bits, `same` keeps them and wins at M=1 only."""
    timings, checks = [], []
    for gemm in ("qkv_proj", "o_proj"):
        for m in (1, 8192):
            us = {"cublas": 10.0 * m**0.5, "current": 20.0 * m**0.5,
                  "fast": 11.0 * m**0.5 + (30 if m == 1 else 0), "same": 25.0 * m**0.5}
            if m == 1:
                us["same"] = 5.0
            current = "m64n32k64w4s4" if m == 1 else "m128n128k64w8s3"
            timings.append({"model": "qwen3-0.6b-shape", "gemm": gemm, "n": 1024, "k": 2048,
                            "m": m, "us": us, "current_config": current})
        for kernel in ("cublas", "current", "fast", "same"):
            checks.append({"model": "qwen3-0.6b-shape", "gemm": gemm, "kernel": kernel,
                           "rows": 8192, "failures": [],
                           "config": "per M" if kernel == "current" else None,
                           "invariant": kernel != "cublas",
                           "same_bits_as_current": kernel in ("current", "same")})
    return bench.summarise(timings, checks)


def test_summary_ratios_and_picks(bench) -> None:  # noqa: ANN001
    result = fake_run(bench)
    first = result["timings"][0]
    assert first["over_cublas"] == {"current": 2.0, "fast": 4.1, "same": 0.5}
    pick = result["picks"][0]
    assert pick["same_bits_configs"] == ["current", "same"]
    assert pick["fastest_same_bits_per_m"] == {1: "same", 8192: "current"}
    # Summed over M: fast 41 + 996, current 20 + 1810, same 5 + 2263: fast wins.
    assert pick["fastest_invariant_overall"] == "fast"
    assert pick["overall_us"]["fast"] == pytest.approx(41 + 11 * 8192**0.5)
    assert pick["cublas_overall_us"] == pytest.approx(10 + 10 * 8192**0.5)


def test_table_and_record(bench) -> None:  # noqa: ANN001
    result = fake_run(bench)
    text = bench.table_text(result)
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["model", "gemm", "N", "K", "M", "cuBLAS"]
    assert lines[0].split()[-3:] == ["current", "fast", "same"]
    row = next(ln for ln in lines if ln.startswith("qwen3-0.6b-shape   qkv_proj") and " 1 " in ln)
    assert "10.0" in row and "2.00x" in row and "4.10x" in row and "0.50x" in row
    bits = [ln for ln in lines if ln.split()[:1] == ["bits"]]
    assert len(bits) == 2 and bits[0].split()[1:3] == ["inv", "NO"]  # cuBLAS fails
    assert "inv yes, same no" in bits[0] and "inv yes, same yes" in bits[0]
    assert ("(current m64n32k64w4s4/m128n128k64w8s3) per M: M=1: same, M=8192: current; "
            "one config: fast") in text
    record = record_of("batch-invariant-gemm", {"device": "cpu", **result}, {"out": "x"})
    assert validate(record) == []
    figures = record["figures"]
    assert figures["qwen3-0.6b-shape.qkv_proj.m8192.current_over_cublas"]["value"] == 2.0
    assert figures["qwen3-0.6b-shape.o_proj.current_invariant"]["value"] == 1.0
    assert not any("fast" in name for name in figures)  # candidates are not claims


def test_a_measurement_on_cpu_stand_ins(bench) -> None:  # noqa: ANN001
    """The whole pipeline of one shape with the CPU's batch-invariant GEMM as the current
    config and a scaled copy of it as a candidate (invariant, other bits): the checks tell
    them apart, and plain `F.linear` (MKL, float32) is caught as batch dependent."""
    current = bench.parse_config("m64n32k64w4s4")  # as matmul_config(m, 48, 96, float32) gives
    candidate = bench.parse_config("m128n128k64w8s3")

    def matmul(x: torch.Tensor, w: torch.Tensor, cfg: dict) -> torch.Tensor:
        return row_tiled_linear(x, w if cfg is None else w * (1 + 2**-10))

    calls = []

    def time_us(fn) -> float:  # noqa: ANN001
        calls.append(fn)
        fn()
        return 1.0 + len(calls)

    kernels = bench.Kernels("cpu", time_us, matmul, lambda m, n, k, dtype: current)
    shape = bench.GemmShape("tiny", "qkv_proj", 48, 96)
    timings, checks = bench.measure_shape(shape, {"current": None, "m128n128k64w8s3": candidate},
                                          [1, 8], 300, torch.float32, 0, kernels)
    assert [t["m"] for t in timings] == [1, 8] and len(calls) == 6
    assert list(timings[0]["us"]) == ["cublas", "current", "m128n128k64w8s3"]
    verdicts = {c["kernel"]: (c["invariant"], c["same_bits_as_current"]) for c in checks}
    assert verdicts["current"] == (True, True)
    assert verdicts["m128n128k64w8s3"] == (True, False)
    assert verdicts["cublas"][0] is False
    assert {c["kernel"]: c["config"] for c in checks}["m128n128k64w8s3"] == "m128n128k64w8s3"
    result = bench.summarise(timings, checks)
    assert result["picks"][0]["fastest_same_bits_per_m"] == {1: "current", 8: "current"}
