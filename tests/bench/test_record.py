"""The benchmark record: what a fresh run records, the validator, and published files adapted."""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest

from kvfit.benchmarks.figures import FIGURES, record_of
from kvfit.benchmarks.record import (
    check,
    git_state,
    jsonable,
    load_record,
    validate,
    write_record,
)

from . import payloads

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"


@pytest.mark.parametrize("bench", sorted(payloads.ALL))
def test_record_of_each_bench_validates_and_keeps_the_payload(bench: str) -> None:
    payload = payloads.ALL[bench]()
    record = record_of(bench, payload, {"device": "cpu", "rate": math.inf})
    assert validate(record) == []
    assert record["bench"] == bench and record["results"] == payload
    assert record["config"] == {"device": "cpu", "rate": "inf"}  # strict JSON in the config
    assert record["figures"], f"{bench} claims no figure"
    assert record["versions"]["python"] and record["versions"]["torch"]
    assert record["machine"]["host"] and record["machine"]["cpu"]


def test_a_run_in_a_checkout_records_its_revision_and_dirty_flag() -> None:
    root = RESULTS.parents[1]
    if not (root / ".git").exists():
        pytest.skip("a copy of the tree without .git (the GPU machine's)")
    git = record_of("elastic", payloads.elastic(), {})["git"]
    assert len(git["revision"]) == 40 and isinstance(git["dirty"], bool)


def test_figures_are_drawn_from_the_payload() -> None:
    f = record_of("capacity", payloads.capacity(gain=0.1, startup_s=2.0), {})["figures"]
    assert f["tiny.blocks_gain"] == {"value": 0.1, "unit": "fraction", "direction": "higher"}
    assert f["tiny.startup_measured_s"]["value"] == 2.0
    assert f["tiny.startup_measured_s"]["direction"] == "lower"
    # Startup stages: those of at least 5% of the total, and the total; a stage of 1% has none.
    assert f["tiny.measured.stage.warm_up_s"] == {"value": 1.0, "unit": "s", "direction": "lower"}
    assert f["tiny.estimate.stage.total_s"]["value"] == 2.8
    assert {k for k in f if ".stage." in k} == {
        f"tiny.{m}.stage.{s}_s" for m in ("measured", "estimate")
        for s in ("load_weights", "warm_up", "total")}
    record = record_of("throughput", payloads.throughput(), {})
    assert record["limits"] == {
        "copy_gb_per_s": {"value": 100.0, "unit": "GB/s", "direction": "higher"},
        "gemm_tflops": {"value": 2.0, "unit": "TFLOP/s", "direction": "higher"}}
    f = record["figures"]
    assert f["offline.of_limit"] == {"value": 0.8, "unit": "fraction", "direction": "higher"}
    assert f["ttft.tiny.len64.ttft_s"]["value"] == 0.02
    assert f["ttft.tiny.len64.of_limit"]["value"] == 0.5


def test_validate_names_every_violation() -> None:
    good = record_of("vmm", {"growth_us_per_chunk": 1.0, "release_plus_recommit_s": 0.1,
                             "vmm_gbps": 10.0, "bandwidth_ratio": 1.0}, {})
    bad = copy.deepcopy(good)
    del bad["machine"]
    bad["extra"] = 1
    bad["figures"]["vmm_gbps"]["direction"] = "up"
    bad["figures"]["bandwidth_ratio"]["value"] = math.nan
    bad["limits"] = {"copy": {"value": "fast", "unit": "GB/s", "direction": "higher"}}
    errors = validate(bad)
    assert "missing key 'machine'" in errors and "unknown key 'extra'" in errors
    bad.pop("extra")
    bad["machine"] = good["machine"]
    errors = validate(bad)
    assert any("vmm_gbps.direction" in e for e in errors)
    assert any("bandwidth_ratio.value" in e for e in errors)
    assert any("limits.copy.value" in e for e in errors)
    assert validate(good) == []


def test_write_record_refuses_an_invalid_record(tmp_path: Path) -> None:
    record = record_of("elastic", payloads.elastic(), {})
    record["schema_version"] = 0
    path = tmp_path / "r.json"
    with pytest.raises(ValueError, match="schema_version"):
        write_record(path, record)
    assert not path.exists()
    record["schema_version"] = 1
    write_record(path, record)
    assert load_record(path) == json.loads(json.dumps(record))


def test_jsonable_makes_strict_json() -> None:
    value = jsonable({"rates": [4.0, math.inf], "path": Path("/x"), 3: len})
    assert json.loads(json.dumps(value, allow_nan=False)) == value
    assert value["rates"] == [4.0, "inf"] and value["path"] == "/x"


def test_a_callable_in_the_config_is_recorded_by_name() -> None:
    # `kvfit bench` keeps its handler in args.func: its repr names a memory address, which
    # differed between any two runs and made compare.py warn of different configs each time.
    from kvfit.commands.bench_offline import run_throughput

    config = record_of("elastic", payloads.elastic(), {"func": run_throughput, "f": len})["config"]
    assert config == {"func": "kvfit.commands.bench_offline.run_throughput",
                      "f": "builtins.len"}


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_published_result_files_adapt_to_valid_records(path: Path) -> None:
    record, published = load_record(path), json.loads(path.read_text())
    check(record)
    # Files published before records existed are their bench's results, wrapped on load;
    # later ones are records already and load unchanged.
    is_record = isinstance(published, dict) and "schema_version" in published
    assert (record if is_record else record["results"]) == published
    assert record["bench"] in FIGURES and record["date"][:10] in path.name
    if not record["bench"].endswith("-sweep"):
        assert record["figures"]


# What docs/results may hold besides records: bench/run_gpu.sh's pytest logs, excerpts of its
# run.log (a bench's printed table where its record did not come back) and torch.profiler
# tables (`--profile PATH`), each dated like the records it stands beside.
LOGS = re.compile(r"(gpu-tests-.+\.log|.+-run-.+\.log|.*profile.*\.txt)")


def test_every_published_result_is_a_record_or_a_log() -> None:
    others = [p.name for p in RESULTS.iterdir() if p.suffix != ".json"]
    for name in others:
        assert LOGS.fullmatch(name), f"docs/results/{name}: neither a record (.json) nor a log"
        assert re.search(r"-\d{4}-\d{2}-\d{2}", name), f"docs/results/{name}: no date"
    assert all(p.is_file() for p in RESULTS.iterdir())


def test_load_record_refuses_an_unknown_file(tmp_path: Path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match="not a record"):
        load_record(path)


def test_git_state_outside_a_checkout_takes_the_revision_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFIT_GIT_REVISION", raising=False)
    assert git_state(tmp_path) == {"revision": None, "dirty": None}
    monkeypatch.setenv("KVFIT_GIT_REVISION", "abc123")
    assert git_state(tmp_path) == {"revision": "abc123", "dirty": None}


def test_git_state_takes_a_named_revision_over_a_checkouts_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFIT_GIT_REVISION", raising=False)
    assert git_state()["revision"] not in (None, "abc123")  # this checkout's HEAD
    monkeypatch.setenv("KVFIT_GIT_REVISION", "abc123")  # a copy whose .git is stale
    assert git_state() == {"revision": "abc123", "dirty": None}


@pytest.mark.gpu
def test_record_on_a_gpu_names_the_device_and_its_stack() -> None:
    import torch

    torch.zeros(1, device="cuda")
    record = record_of("elastic", payloads.elastic(), {})
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    assert record["machine"]["gpu"] == props.name
    assert record["machine"]["gpu_memory_bytes"] == props.total_memory
    assert record["versions"]["cuda"] == torch.version.cuda and record["versions"]["driver"]


@pytest.mark.parametrize("bench", sorted(payloads.ALL))
def test_a_result_file_without_the_record_fields_adapts_to_its_bench(
        bench: str, tmp_path: Path) -> None:
    path = tmp_path / f"{bench}-2026-01-02.json"
    path.write_text(json.dumps(payloads.ALL[bench]()))
    record = load_record(path)
    assert record["bench"] == bench and record["date"] == "2026-01-02"
    assert record["figures"] == record_of(bench, payloads.ALL[bench](), {})["figures"]


def test_an_adversarial_sweep_whose_runs_were_all_skipped_claims_no_zero_counts() -> None:
    # adversarial-8b-4k-h200-2026-12-03.json: its margin-zero sweep ran past the deadline, every
    # run skipped; its summary still reads 0 OOMs, 0 errors, 0 guard events.
    record = load_record(RESULTS / "adversarial-8b-4k-h200-2026-12-03.json")
    assert not [n for n in record["figures"] if n.startswith("qwen3-8b-shape.zero.")]
    assert record["figures"]["qwen3-8b-shape.default.ooms"]["value"] == 0
    payload = copy.deepcopy(payloads.adversarial())
    payload["sweeps"][0]["runs"] = [{"run": "all", "skipped": "deadline"}]
    payload["summaries"][0] |= {"worst_kept_over_peak_need": None, "skipped": 1}
    assert FIGURES["adversarial"](payload) == {}
    payload["sweeps"][0]["runs"].append({"run": "top_p", "oom": "CUDA out of memory"})
    payload["summaries"][0]["ooms"] = 1  # one run ran and failed: that is a claim
    assert FIGURES["adversarial"](payload)["tiny.default.ooms"]["value"] == 1


def test_a_load_that_measured_no_latency_claims_none() -> None:
    # `kvfit bench serve` reports 0.0 ms for a latency with no sample: every request failed,
    # or none produced a second token (no TPOT, no ITL). As "lower is better" figures those
    # zeros read as the fastest run ever, and compare.py calls a total failure an improvement.
    failed = payloads.bench_serve() | {"completed": 0, "failed": 8, "total_output_tokens": 0,
                                       "p50_ttft_ms": 0.0, "p99_itl_ms": 0.0}
    f = FIGURES["bench-serve"](failed)
    assert not [k for k in f if k.endswith("_ms")] and f["failed"]["value"] == 8
    one_token = payloads.bench_serve() | {"completed": 8, "total_output_tokens": 8,
                                          "p50_ttft_ms": 5.0, "p99_itl_ms": 0.0,
                                          "mean_tpot_ms": 0.0}
    f = FIGURES["bench-serve"](one_token)
    assert "p50_ttft_ms" in f and "p99_itl_ms" not in f and "mean_tpot_ms" not in f
    ok = payloads.bench_serve() | {"completed": 8, "total_output_tokens": 64}
    assert {"p50_ttft_ms", "p99_itl_ms"} <= set(FIGURES["bench-serve"](ok))
    rows = payloads.serving()
    rows["serve"]["rows"][0] |= {"completed": 0, "total_output_tokens": 0}
    f = FIGURES["serving"](rows)
    assert "serve.rate4.p50_ttft_ms" not in f and "serve.rate16.p50_ttft_ms" in f


def test_every_served_placement_is_a_figure() -> None:
    # serving-h200-2026-12-04.json: one API process (the target's ratio, 87.2%) and four
    # (99.4%, a claim of docs/benchmarks.md); the four had no figure, so compare.py never saw it.
    path = RESULTS / "serving-h200-2026-12-04.json"
    results = json.loads(path.read_text())["results"]
    f = FIGURES["serving"](results)
    assert f["serve_over_offline"]["value"] == pytest.approx(0.8722, abs=1e-4)
    assert f["process.api4.serve_over_offline"]["value"] == pytest.approx(0.9937, abs=1e-4)
    assert "process.api4.serve.rateinf.conc512.output_throughput" in f
    assert not [n for n in f if n.startswith("process.api1.")]  # the first: its own names
    engines = json.loads((RESULTS / "serving-engines-h200-2026-12-03b.json").read_text())
    f = FIGURES["serving"](engines["results"])  # --engines process thread
    assert f["thread.serve_over_offline"]["value"] == engines["results"][
        "serve_by_engine"][1]["ratio"]
    assert not [n for n in f if n.startswith("process.")]
