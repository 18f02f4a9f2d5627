"""bench/vmm.py: its documented CPU command is sized for the host, and a small run writes a
record that validates."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvfit.benchmarks.record import validate

from .scripts import load_bench

bench = load_bench("vmm")
GiB = 1 << 30


def _documented_cpu_argv() -> list[str]:
    line = next(x for x in bench.__doc__.splitlines() if "--device cpu" in x)
    return shlex.split(re.sub(r".*bench/vmm\.py", "", line))


def test_the_documented_cpu_command_commits_no_more_than_its_bulk_size() -> None:
    args = bench.parse_args(_documented_cpu_argv())
    assert args.device == "cpu"
    # The breakdown commits --parts-gib at once; it was 32 GiB whatever --bulk-gib said, and
    # the documented command failed with ENOMEM on a 24 GiB host.
    assert args.parts_gib <= args.bulk_gib
    assert all(c <= args.parts_gib for c in args.parts_chunk_gib)
    gpu = bench.parse_args(["--out", "x.json"])
    assert gpu.parts_gib == 32.0 and gpu.parts_chunk_gib == [1.0, 4.0]


@pytest.mark.parametrize("flags", [["--parts-gib", "1", "--parts-chunk-gib", "4"],
                                   ["--parts-gib", "3", "--parts-chunk-gib", "2"]])
def test_a_chunk_that_does_not_tile_the_breakdown_is_refused(flags: list[str]) -> None:
    # A chunk past the reservation's end would be mapped over whatever lies beyond it.
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--device", "cpu", "--out", "x.json", *flags])
    assert e.value.code == 2


def test_a_small_cpu_run_writes_a_valid_record(tmp_path: Path) -> None:
    out = tmp_path / "vmm.json"
    bench.main(["--device", "cpu", "--growth-gib", "0.0625", "--bulk-gib", "0.125",
                "--copy-gib", "0.03125", "--repeats", "2", "--pause-s", "0",
                "--parts-chunk-gib", "0.0625", "--out", str(out)])
    record = json.loads(out.read_text())
    assert validate(record) == []
    assert record["results"]["parts_gib_0.0625"] == 0.125
    assert set(record["figures"]) == {"growth_us_per_chunk", "release_plus_recommit_s",
                                      "vmm_gbps", "bandwidth_ratio"}
