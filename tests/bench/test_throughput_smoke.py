"""bench/throughput.py on the CPU: the steps it records are the steps the engine ran, and every
throughput figure of its record carries its share of the limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfit import LLM, SamplingParams

from .scripts import BENCH_DIR, load_bench


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 (the bench module)
    return load_bench("throughput")


def test_step_recorder_sees_every_token_computed_and_every_row_sampled(bench) -> None:  # noqa: ANN001
    llm = LLM("kvfit-tiny", device="cpu", max_model_len=128, max_num_batched_tokens=32)
    # Distinct first tokens: no prefix-cache hit skips a token.
    prompts = [{"prompt_token_ids": [i] + [7] * (n - 1)} for i, n in ((1, 5), (2, 40), (3, 17))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (3, 1, 6)]
    with bench.StepRecorder(llm) as recorder:
        llm.generate(prompts, params, use_tqdm=False)
    steps = recorder.steps
    # Each sequence computes its prompt and all its outputs but the last; one logits row
    # per output token; the 32-token budget splits the 40-token prompt.
    assert sum(sum(s.num_new) for s in steps) == (5 + 40 + 17) + (2 + 0 + 5)
    assert sum(s.num_logits for s in steps) == 3 + 1 + 6
    assert all(sum(s.num_new) <= 32 for s in steps) and len(steps) >= 7
    assert steps[0].starts == [0, 0] and steps[1].starts[1] == 27  # the chunk after 27 of 40
    assert "launch" not in vars(llm.engine.executor)  # the executor's own method again
    llm.shutdown()


def test_throughput_bench_records_each_figure_against_its_limit(bench, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "t.json"
    bench.main(["--device", "cpu", "--model", "kvfit-tiny", "--num-seqs", "4", "--min-len", "8",
                "--max-len", "32", "--decode-models", "kvfit-tiny", "--decode-batches", "2",
                "--decode-context", "32", "--iters", "3", "--ttft-models", "kvfit-tiny",
                "--ttft-len", "48", "--ttft-repeat", "1", "--no-warmup",
                "--cudagraph-mode", "full_decode_only", "full_and_piecewise", "--out", str(out)])
    record = json.loads(out.read_text())
    result, figures = record["results"], record["figures"]
    offline = result["throughput"]
    assert offline["of_limit"] == pytest.approx(offline["limit"]["limit_s"]
                                                / offline["elapsed_s"])
    assert figures["offline.of_limit"]["value"] == offline["of_limit"]
    assert 0 < offline["of_limit"] < 1  # the CPU runs far from its limit, never above it
    decode = result["decode"][0]
    assert decode["of_limit"] == pytest.approx(1 / decode["ratio"]) and decode["memory_bound"]
    ttft = result["ttft"][0]
    assert figures["ttft.kvfit-tiny.len48.of_limit"]["value"] == ttft["of_limit"] > 0
    assert ttft["limit"]["num_steps"] == 1  # one prefill step
    assert set(record["limits"]) == {"copy_gb_per_s", "gemm_tflops"}
    # Graph modes side by side (on the CPU both run eagerly), each against its own limit.
    modes = [t["cudagraph_mode"] for t in result["throughputs"]]
    assert modes == ["FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
    for t in result["throughputs"]:
        name = f"offline.uni.{t['cudagraph_mode']}"
        assert figures[f"{name}.output_tokens_per_s"]["value"] == t["output_tokens_per_s"]
        assert figures[f"{name}.of_limit"]["value"] == t["of_limit"]


def test_decode_rows_side_by_side_with_and_without_small_batch_kernels(bench,  # noqa: ANN001
                                                                        tmp_path: Path) -> None:
    """`--small-batch-kernels both`: each decode row once per setting, named apart in the
    figures (on the CPU the switch changes nothing: the kernels are CUDA-only)."""
    out = tmp_path / "t.json"
    bench.main(["--device", "cpu", "--skip-throughput", "--decode-models", "kvfit-tiny",
                "--decode-batches", "1", "2", "--decode-context", "32", "--iters", "2",
                "--ttft-models", "--small-batch-kernels", "both", "--out", str(out)])
    record = json.loads(out.read_text())
    rows = [(d["batch"], d["small_batch_kernels"]) for d in record["results"]["decode"]]
    assert rows == [(1, False), (2, False), (1, True), (2, True)]
    figures = record["figures"]
    assert "decode.kvfit-tiny.batch1.step_ms" in figures
    assert "decode.kvfit-tiny.batch1.small_batch.step_ms" in figures


def test_decode_rows_per_pdl_setting_and_their_profile(bench, tmp_path: Path) -> None:  # noqa: ANN001
    """`--pdl both` runs the small-batch rows once per PDL setting (the rows without
    the kernels once), named apart in the figures; `--profile-decode` appends each row's
    decode steps, per step, to one file."""
    out, prof = tmp_path / "t.json", tmp_path / "decode.txt"
    bench.main(["--device", "cpu", "--skip-throughput", "--decode-models", "kvfit-tiny",
                "--decode-batches", "2", "--decode-context", "32", "--iters", "3",
                "--ttft-models", "--small-batch-kernels", "both", "--pdl", "both",
                "--profile-decode", str(prof), "--out", str(out)])
    record = json.loads(out.read_text())
    rows = [(d["small_batch_kernels"], d["pdl"]) for d in record["results"]["decode"]]
    assert rows == [(False, None), (True, False), (True, True)]
    figures = record["figures"]
    for name in ("batch2", "batch2.small_batch.no_pdl", "batch2.small_batch.pdl"):
        assert f"decode.kvfit-tiny.{name}.step_ms" in figures
    text = prof.read_text()
    assert text.count("kvfit-tiny batch 2") == 3
    # Three decode steps each, and the CPU's kernels by name (on the CPU: no device span).
    assert text.count(": 3 decode steps, per step") == 3



def _decode_record(bench, tmp_path: Path, batch: int, *flags: str) -> dict:  # noqa: ANN001
    """The record of one short decode run of kvfit-tiny on the CPU at `batch` with `flags`."""
    out = tmp_path / "t.json"
    bench.main(["--device", "cpu", "--skip-throughput", "--decode-models", "kvfit-tiny",
                "--decode-batches", str(batch), "--decode-context", "32", "--iters", "2",
                "--decode-repeat", "1", "--ttft-models", *flags, "--out", str(out)])
    return json.loads(out.read_text())


def test_decode_rows_per_pdl_trigger(bench, tmp_path: Path) -> None:  # noqa: ANN001
    """`--pdl on --pdl-trigger early late` runs the rows with PDL once per trigger, named apart
    in the record and its figures."""
    record = _decode_record(bench, tmp_path, 1, "--small-batch-kernels", "on", "--pdl", "on",
                            "--pdl-trigger", "early", "late")
    rows = [(d["pdl"], d["pdl_trigger"]) for d in record["results"]["decode"]]
    assert rows == [(True, "early"), (True, "late")]
    for trigger in ("early", "late"):
        assert (f"decode.kvfit-tiny.batch1.small_batch.pdl.{trigger}_trigger.step_ms"
                in record["figures"])


@pytest.mark.parametrize(("flags", "key", "names"), [
    (("--small-batch-kernels", "off", "--fused-decode-input", "both"), "fused_decode_input",
     ("batch2", "batch2.fused_input")),
    # Off the GPU the one-row MMA changes no kernel; the rows and their names are the bench's.
    (("--small-batch-kernels", "on", "--one-row-mma", "both"), "one_row_mma",
     ("batch2.small_batch.no_row_mma", "batch2.small_batch.row_mma")),
])  # fmt: skip
def test_decode_rows_side_by_side_off_then_on(
        bench, tmp_path: Path, flags: tuple[str, ...], key: str,  # noqa: ANN001
        names: tuple[str, str]) -> None:
    """`--fused-decode-input both`, `--one-row-mma both`: each decode row once per setting,
    off first, named apart in the figures."""
    record = _decode_record(bench, tmp_path, 2, *flags)
    assert [d[key] for d in record["results"]["decode"]] == [False, True]
    for name in names:
        assert f"decode.kvfit-tiny.{name}.step_ms" in record["figures"]


def test_decode_rows_side_by_side_with_and_without_the_qkv_epilogue(
        bench, tmp_path: Path) -> None:  # noqa: ANN001
    """`--qkv-epilogue both`: each decode row with the small-batch kernels once per setting,
    named apart in the figures; the module's default is back after."""
    from kvfit.ops import small_batch

    default = small_batch.QKV_EPILOGUE_DEFAULT
    record = _decode_record(bench, tmp_path, 2, "--small-batch-kernels", "both",
                            "--qkv-epilogue", "both")
    rows = [(d["small_batch_kernels"], d["qkv_epilogue"]) for d in record["results"]["decode"]]
    assert rows == [(False, None), (True, False), (True, True)]
    for name in ("batch2", "batch2.small_batch.no_qkv_epilogue",
                 "batch2.small_batch.qkv_epilogue"):
        assert f"decode.kvfit-tiny.{name}.step_ms" in record["figures"]
    assert small_batch.QKV_EPILOGUE_DEFAULT is default



@pytest.mark.parametrize(("flags", "message"), [
    (("--repeat", "0"), "argument --repeat: must be an integer >= 1 (a count), got '0'"),
    (("--ttft-repeat", "0"), "argument --ttft-repeat: must be an integer >= 1"),
    (("--num-seqs", "0"), "argument --num-seqs: must be an integer >= 1"),
    (("--min-len", "0"), "argument --min-len: must be an integer >= 1"),
    (("--iters", "x"), "argument --iters: must be an integer >= 1 (a count), got 'x'"),
    (("--min-len", "5", "--max-len", "2"), "--min-len 5 is more than --max-len 2"),
])  # fmt: skip
def test_counts_that_would_crash_after_the_run_are_refused_first(
        bench, flags: tuple[str, ...], message: str, tmp_path: Path,  # noqa: ANN001
        capsys: pytest.CaptureFixture[str]) -> None:
    """A count of 0 (or lengths drawn from an empty range) failed after the engines had run:
    an IndexError for no runs, a ZeroDivisionError for no requests, a StatisticsError for no
    TTFT runs. Each is a usage error now, before anything is measured."""
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--device", "cpu", "--out", str(tmp_path / "t.json"), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize(("script", "flags", "message"), [
    ("kv_dtype", ("--iters", "0"), "argument --iters: must be an integer >= 1"),
    ("kv_dtype", ("--min-len", "9", "--max-len", "8"), "--min-len 9 is more than --max-len 8"),
    ("determinism", ("--repeat", "0"), "argument --repeat: must be an integer >= 1"),
    ("determinism", ("--min-len", "9", "--max-len", "8"), "--min-len 9 is more than"),
])  # fmt: skip
def test_scripts_sharing_the_workload_refuse_the_same_counts(
        script: str, flags: tuple[str, ...], message: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))  # they import bench/throughput.py
    module = load_bench(script)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--device", "cpu", "--out", str(tmp_path / "t.json"), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
